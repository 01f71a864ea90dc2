"""Content-addressed checkpoint store: stage outputs keyed by the sha256 of their inputs.

Layout (``v1`` is :data:`STORE_FORMAT_VERSION`)::

    <root>/v1/<stage>/<key[:2]>/<key>/entry.json   manifest, written last
    <root>/v1/<stage>/<key[:2]>/<key>/<file>...    payload named in the manifest
    <root>/v1/stats.jsonl                          hit/miss log, one JSON object a line
    <root>/.tmp-*                                  puts in progress / interrupted, trash

A put builds the whole entry in a temp folder inside ``root`` (same filesystem), fsyncs every
file, writes ``entry.json`` last and renames the folder into place, so an entry folder is
either complete or absent. A get verifies size and sha256 of every file before it returns an
entry, and :meth:`StoreEntry.read_bytes` verifies again the very bytes it hands out: the
pickle-based executable deserializer never sees bytes whose hash was not checked. Anything
that fails verification is a miss, logged once on ``jaxaot.store`` and removed, so the next
put recomputes it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, StoreError
from pipeline.fsutil import TEMP_PREFIX, canonical_json, remove_stale_temps

# Store format history (bump when entry.json or the layout changes incompatibly; a store
# reader refuses entries of any other version, naming both):
#   1 (2026-11-22): <root>/v1/<stage>/<key[:2]>/<key>/{entry.json, files}; entry.json holds
#     format_version, stage, key, created, files {name: {sha256, size}}, meta, compat,
#     compute_seconds.
STORE_FORMAT_VERSION = 1

ENV_STORE_DIR = "JAXAOT_STORE_DIR"
DEFAULT_STORE_DIR = Path("outputs/store")
MANIFEST_NAME = "entry.json"
STATS_LOG_NAME = "stats.jsonl"

log = logging.getLogger("jaxaot.store")

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_STAGE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
# errno values that mean "this store cannot take writes", as opposed to a one-off failure.
_DEGRADE_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
)
_CHUNK = 1 << 20
_PUT_ATTEMPTS = 3


def parse_size(text: str | int) -> int:
    """``"2GB"`` -> 2_000_000_000; units B, KB, MB, GB, TB (1000) and KiB, MiB, GiB, TiB (1024)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"invalid size {text!r}: expected a number with an optional unit "
            "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, e.g. '2GB' or '512MiB'"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def resolve_store_root(configured: str | Path | None = None) -> Path:
    """The store root: ``configured`` if set, else ``$JAXAOT_STORE_DIR``, else ``outputs/store``."""
    if configured is not None and str(configured) != "":
        return Path(configured).expanduser()
    env = os.environ.get(ENV_STORE_DIR, "")
    return Path(env).expanduser() if env else DEFAULT_STORE_DIR


def _check_stage(stage: str) -> str:
    if not isinstance(stage, str) or not _STAGE_RE.fullmatch(stage):
        raise ValueError(f"invalid store stage name {stage!r}: expected [A-Za-z0-9_-]{{1,64}}")
    return stage


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"invalid store key {key!r}: expected 64 lowercase hex digits (sha256)")
    return key


def _check_file_name(name: str) -> str:
    if not isinstance(name, str) or not _FILE_RE.fullmatch(name) or name == MANIFEST_NAME:
        raise ValueError(
            f"invalid store file name {name!r}: expected a plain file name "
            f"([A-Za-z0-9_.+-], no path separators) other than {MANIFEST_NAME!r}"
        )
    return name


def _label(stage: str, key: str) -> str:
    return f"{stage}/{key[:12]}"


@dataclass(frozen=True)
class FileRecord:
    """One payload file as recorded in ``entry.json``."""

    sha256: str
    size: int


@dataclass(frozen=True)
class StoreEntry:
    """A verified store entry. Read payload through :meth:`read_bytes`, which re-verifies."""

    stage: str
    key: str
    dir: Path
    files: Mapping[str, FileRecord]
    meta: Mapping[str, Any]
    compat: Mapping[str, Any]
    created: float
    compute_seconds: float
    format_version: int = STORE_FORMAT_VERSION

    @property
    def size_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def path(self, name: str) -> Path:
        """Path of payload file ``name``; not re-verified: use :meth:`read_bytes` to deserialize."""
        if name not in self.files:
            raise KeyError(
                f"store entry {_label(self.stage, self.key)} has no file {name!r} "
                f"(it has {sorted(self.files)})"
            )
        return self.dir / name

    def read_bytes(self, name: str) -> bytes:
        """The bytes of ``name``, checked against the manifest's size and sha256 first."""
        path = self.path(name)
        rec = self.files[name]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StoreError(
                f"store entry {_label(self.stage, self.key)}: cannot read {name!r} at {path}: {exc}"
            ) from exc
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != rec.size or digest != rec.sha256:
            raise StoreError(
                f"store entry {_label(self.stage, self.key)}: file {name!r} at {path} changed "
                f"after verification: expected {rec.size} bytes sha256 {rec.sha256[:16]}, found "
                f"{len(data)} bytes sha256 {digest[:16]}; run `jaxaot-store verify --remove`"
            )
        return data


@dataclass(frozen=True)
class EntryInfo:
    """What ``ls`` shows: an entry's identity, size and age, without hashing its payload."""

    stage: str
    key: str
    dir: Path
    size_bytes: int
    files: int
    created: float | None
    last_used: float


@dataclass(frozen=True)
class VerifyResult:
    stage: str
    key: str
    dir: Path
    ok: bool
    reason: str = ""
    removed: bool = False


@dataclass(frozen=True)
class VerifyReport:
    results: tuple[VerifyResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def corrupt(self) -> tuple[VerifyResult, ...]:
        return tuple(r for r in self.results if not r.ok)


@dataclass(frozen=True)
class GcReport:
    temps_removed: int
    entries_removed: int
    bytes_freed: int
    bytes_remaining: int


@dataclass(frozen=True)
class StageStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    seconds_saved: float = 0.0


@dataclass(frozen=True)
class StoreStats:
    root: Path
    stages: Mapping[str, StageStats] = field(default_factory=dict)

    @property
    def total(self) -> StageStats:
        s = list(self.stages.values())
        return StageStats(
            entries=sum(x.entries for x in s),
            bytes=sum(x.bytes for x in s),
            hits=sum(x.hits for x in s),
            misses=sum(x.misses for x in s),
            seconds_saved=sum(x.seconds_saved for x in s),
        )


class _Bad(Exception):
    """An entry that must not be used; ``incompatible`` separates version skew from damage."""

    def __init__(self, reason: str, *, incompatible: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.incompatible = incompatible


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(dest: Path, src: bytes | Path) -> FileRecord:
    """Write ``src`` to ``dest`` (a new file), fsync it, and return its hash and size."""
    h = hashlib.sha256()
    size = 0
    with open(dest, "xb") as out:
        if isinstance(src, bytes | bytearray | memoryview):
            data = bytes(src)
            out.write(data)
            h.update(data)
            size = len(data)
        else:
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return FileRecord(sha256=h.hexdigest(), size=size)


def _parse_manifest(raw: bytes, stage: str, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Bad(f"{MANIFEST_NAME} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _Bad(f"{MANIFEST_NAME} is not a JSON object")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise _Bad(f"{MANIFEST_NAME} has no integer format_version (found {version!r})")
    if version != STORE_FORMAT_VERSION:
        raise _Bad(
            f"entry format version {version}, this jaxaot reads version {STORE_FORMAT_VERSION}",
            incompatible=True,
        )
    if doc.get("stage") != stage or doc.get("key") != key:
        raise _Bad(
            f"{MANIFEST_NAME} names {doc.get('stage')!r}/{str(doc.get('key'))[:12]}, "
            f"but sits at {stage}/{key[:12]}"
        )
    files = doc.get("files")
    if not isinstance(files, dict):
        raise _Bad(f"{MANIFEST_NAME} has no 'files' object")
    for name, rec in files.items():
        if not isinstance(name, str) or not _FILE_RE.fullmatch(name) or name == MANIFEST_NAME:
            raise _Bad(f"{MANIFEST_NAME} lists an invalid file name {name!r}")
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("sha256"), str)
            or not isinstance(rec.get("size"), int)
        ):
            raise _Bad(f"{MANIFEST_NAME} has a malformed record for {name!r}")
    for name, kind in (("meta", dict), ("compat", dict), ("created", (int, float))):
        if not isinstance(doc.get(name), kind):
            raise _Bad(f"{MANIFEST_NAME} has a missing or malformed {name!r}")
    if not isinstance(doc.get("compute_seconds"), int | float):
        raise _Bad(f"{MANIFEST_NAME} has a missing or malformed 'compute_seconds'")
    return doc


def _compat_diff(found: Mapping[str, Any], expect: Mapping[str, Any]) -> str:
    names = sorted(set(found) | set(expect))
    diffs = [
        f"{n}: entry has {found.get(n)!r}, expected {expect.get(n)!r}"
        for n in names
        if canonical_json(found.get(n)) != canonical_json(expect.get(n))
    ]
    return "; ".join(diffs)


def _verify_file(path: Path, name: str, rec: FileRecord) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise _Bad(f"{name!r} is missing (manifest without payload)") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Bad(f"{name!r} is not a regular file")
    if st.st_size != rec.size:
        raise _Bad(f"{name!r} is {st.st_size} bytes, manifest says {rec.size} (truncated?)")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != rec.sha256:
        raise _Bad(
            f"{name!r} sha256 {h.hexdigest()[:16]} does not match manifest {rec.sha256[:16]}"
        )


def _load(
    entry_dir: Path, stage: str, key: str, expect: Mapping[str, Any] | None
) -> StoreEntry | None:
    """The verified entry at ``entry_dir``; None if absent; raises :class:`_Bad` otherwise."""
    if not entry_dir.exists() and not entry_dir.is_symlink():
        return None
    if entry_dir.is_symlink() or not entry_dir.is_dir():
        raise _Bad("entry is not a directory")
    try:
        raw = (entry_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            if any(entry_dir.iterdir()):
                raise _Bad(f"{MANIFEST_NAME} missing (payload without manifest)") from None
        raise _Bad(f"{MANIFEST_NAME} missing (empty entry folder)") from None
    except OSError as exc:
        raise _Bad(f"{MANIFEST_NAME} unreadable ({exc})") from None
    doc = _parse_manifest(raw, stage, key)
    if expect is not None:
        diff = _compat_diff(doc["compat"], expect)
        if diff:
            raise _Bad(f"compat mismatch: {diff}", incompatible=True)
    files = {n: FileRecord(sha256=r["sha256"], size=r["size"]) for n, r in doc["files"].items()}
    for name, rec in files.items():
        try:
            _verify_file(entry_dir / name, name, rec)
        except OSError as exc:
            raise _Bad(f"{name!r} unreadable ({exc})") from None
    return StoreEntry(
        stage=stage,
        key=key,
        dir=entry_dir,
        files=files,
        meta=doc["meta"],
        compat=doc["compat"],
        created=float(doc["created"]),
        compute_seconds=float(doc["compute_seconds"]),
        format_version=doc["format_version"],
    )


def _touch(path: Path) -> None:
    # Last use is the manifest's mtime. Set from time_ns() rather than the filesystem clock
    # (which may be coarse) so that LRU order follows the order of calls.
    # A read-only store still serves hits; its LRU order just goes stale.
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


class Store:
    """The checkpoint store at ``root``; ``enabled=False`` makes get/put/record no-ops."""

    def __init__(self, root: str | Path, enabled: bool = True) -> None:
        self.root = Path(root)
        self.enabled = enabled
        self._read_only = False  # set on the first "cannot write here" error, warned once

    def __repr__(self) -> str:
        return f"Store(root={str(self.root)!r}, enabled={self.enabled})"

    @property
    def read_only(self) -> bool:
        """True once a write failed with EACCES/EROFS/ENOSPC/...: puts are then skipped."""
        return self._read_only

    @property
    def data_dir(self) -> Path:
        return self.root / f"v{STORE_FORMAT_VERSION}"

    def entry_dir(self, stage: str, key: str) -> Path:
        _check_stage(stage)
        _check_key(key)
        return self.data_dir / stage / key[:2] / key

    # -- get / put -------------------------------------------------------------------------

    def get(
        self, stage: str, key: str, expect: Mapping[str, Any] | None = None
    ) -> StoreEntry | None:
        """The verified entry for (stage, key), or None on a miss.

        ``expect`` is the compat dict the caller runs under (jaxlib, backend...); an entry
        written under a different one is a miss. None skips the compat check.
        """
        entry_dir = self.entry_dir(stage, key)
        if not self.enabled:
            return None
        try:
            entry = _load(entry_dir, stage, key, expect)
        except _Bad as bad:
            self._discard(entry_dir, stage, key, bad, during="store miss")
            return None
        if entry is None:
            log.debug("store miss: %s: not stored", _label(stage, key))
            return None
        _touch(entry_dir / MANIFEST_NAME)
        log.debug(
            "store hit: %s: %d file(s), %d bytes verified",
            _label(stage, key),
            len(entry.files),
            entry.size_bytes,
        )
        return entry

    def put(
        self,
        stage: str,
        key: str,
        files: Mapping[str, bytes | Path],
        meta: Mapping[str, Any] | None = None,
        compute_seconds: float = 0.0,
        compat: Mapping[str, Any] | None = None,
    ) -> StoreEntry | None:
        """Store ``files`` (name -> bytes or a Path to copy) atomically; None if not writable.

        If the entry already exists and verifies (a concurrent writer won), ours is discarded
        and the existing one is returned.
        """
        entry_dir = self.entry_dir(stage, key)
        for name in files:
            _check_file_name(name)
        meta_d = dict(meta or {})
        compat_d = dict(compat or {})
        json.dumps([meta_d, compat_d])  # a non-JSON value is a caller bug: fail before any I/O
        if not self.enabled or self._read_only:
            return None
        tmp: Path | None = None
        try:
            existing = self._existing(entry_dir, stage, key, compat_d)
            if existing is not None:
                return existing
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(
                tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}put-{stage}-{key[:12]}-", dir=self.root)
            )
            records = {name: _write_file(tmp / name, src) for name, src in files.items()}
            created = time.time()
            doc = {
                "format_version": STORE_FORMAT_VERSION,
                "stage": stage,
                "key": key,
                "created": created,
                "files": {n: {"sha256": r.sha256, "size": r.size} for n, r in records.items()},
                "meta": meta_d,
                "compat": compat_d,
                "compute_seconds": float(compute_seconds),
            }
            manifest = json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"
            _write_file(tmp / MANIFEST_NAME, manifest)
            _touch(tmp / MANIFEST_NAME)
            _fsync_dir(tmp)
            entry_dir.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(_PUT_ATTEMPTS):
                try:
                    os.rename(tmp, entry_dir)
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    existing = self._existing(entry_dir, stage, key, compat_d)
                    if existing is not None:
                        log.debug(
                            "store put: %s: another writer stored it first", _label(stage, key)
                        )
                        return existing
                    continue
                tmp = None
                with contextlib.suppress(
                    OSError
                ):  # the entry is in place; durability is best-effort
                    _fsync_dir(entry_dir.parent)
                break
            else:
                log.warning(
                    "store put %s: an invalid entry kept reappearing at %s; result not cached",
                    _label(stage, key),
                    entry_dir,
                )
                return None
        except OSError as exc:
            if exc.errno in _DEGRADE_ERRNOS:
                self._degrade(exc)
            else:
                log.warning("store put %s failed, result not cached: %s", _label(stage, key), exc)
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        log.debug("store put: %s: %d file(s) stored", _label(stage, key), len(records))
        return StoreEntry(
            stage=stage,
            key=key,
            dir=entry_dir,
            files=records,
            meta=meta_d,
            compat=compat_d,
            created=created,
            compute_seconds=float(compute_seconds),
        )

    def _existing(
        self, entry_dir: Path, stage: str, key: str, compat: Mapping[str, Any]
    ) -> StoreEntry | None:
        """The valid entry already at ``entry_dir``; a bad one is removed and None returned."""
        try:
            return _load(entry_dir, stage, key, compat)
        except _Bad as bad:
            self._discard(entry_dir, stage, key, bad, during="store put replaces")
            return None

    def _discard(self, entry_dir: Path, stage: str, key: str, bad: _Bad, during: str) -> None:
        what = "incompatible" if bad.incompatible else "corrupt"
        err = self._remove(entry_dir)
        outcome = "entry removed" if err is None else f"could not remove it ({err})"
        log.warning(
            "%s: %s: %s entry: %s; %s", during, _label(stage, key), what, bad.reason, outcome
        )

    def _remove(self, entry_dir: Path) -> OSError | None:
        """Move ``entry_dir`` out of the tree (atomic for readers), then delete it."""
        trash = self.root / f"{TEMP_PREFIX}trash-{uuid.uuid4().hex}"
        try:
            os.rename(entry_dir, trash)
        except FileNotFoundError:
            return None  # someone else removed it first
        except OSError as exc:
            return exc
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)
        return None

    def _degrade(self, exc: OSError) -> None:
        if not self._read_only:
            log.warning(
                "store at %s is not writable (%s); stage results will not be cached by this "
                "process (hits are still served)",
                self.root,
                exc,
            )
        self._read_only = True

    # -- hit/miss log ------------------------------------------------------------------------

    def record(self, stage: str, key: str, hit: bool, seconds_saved: float = 0.0) -> None:
        """Append one hit/miss line to ``v1/stats.jsonl`` (one O_APPEND write: safe across processes)."""
        _check_stage(stage)
        _check_key(key)
        if not self.enabled or self._read_only:
            return
        line = canonical_json(
            {
                "t": round(time.time(), 3),
                "stage": stage,
                "key": key,
                "hit": bool(hit),
                "seconds_saved": float(seconds_saved),
            }
        )
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(
                self.data_dir / STATS_LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in _DEGRADE_ERRNOS:
                self._degrade(exc)
            else:
                log.warning(
                    "store: could not record %s for %s: %s",
                    "hit" if hit else "miss",
                    _label(stage, key),
                    exc,
                )

    # -- maintenance ---------------------------------------------------------------------------

    def _iter_entry_dirs(self, stage: str | None = None) -> Iterator[tuple[str, str, Path]]:
        if stage is not None:
            _check_stage(stage)
        if not self.data_dir.is_dir():
            return
        for stage_dir in sorted(self.data_dir.iterdir()):
            if not stage_dir.is_dir() or not _STAGE_RE.fullmatch(stage_dir.name):
                continue
            if stage is not None and stage_dir.name != stage:
                continue
            for prefix_dir in sorted(stage_dir.iterdir()):
                if not prefix_dir.is_dir() or prefix_dir.name.startswith(TEMP_PREFIX):
                    continue
                for d in sorted(prefix_dir.iterdir()):
                    if _KEY_RE.fullmatch(d.name) and d.name[:2] == prefix_dir.name:
                        yield stage_dir.name, d.name, d

    def ls(self, stage: str | None = None) -> list[EntryInfo]:
        """Every entry (optionally of one stage), without hashing payloads."""
        out = []
        for st, key, d in self._iter_entry_dirs(stage):
            size, files, last_used = 0, 0, 0.0
            created: float | None = None
            try:
                for p in d.iterdir():
                    s = p.lstat()
                    size += s.st_size
                    if p.name == MANIFEST_NAME:
                        last_used = s.st_mtime
                    else:
                        files += 1
                doc = json.loads((d / MANIFEST_NAME).read_bytes())
                created = float(doc["created"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # listed anyway; verify() says what is wrong with it
            if not last_used:
                try:
                    last_used = d.stat().st_mtime
                except OSError:
                    continue
            out.append(EntryInfo(st, key, d, size, files, created, last_used))
        return out

    def stats(self) -> StoreStats:
        """Entries and bytes per stage, plus hits, misses and time saved from the record() log."""
        acc: dict[str, dict[str, float]] = {}

        def slot(stage: str) -> dict[str, float]:
            return acc.setdefault(
                stage, {"entries": 0, "bytes": 0, "hits": 0, "misses": 0, "saved": 0.0}
            )

        for info in self.ls():
            s = slot(info.stage)
            s["entries"] += 1
            s["bytes"] += info.size_bytes
        try:
            with open(self.data_dir / STATS_LOG_NAME, "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        for raw in lines:
            try:
                rec = json.loads(raw)
                s = slot(str(rec["stage"]))
                if rec["hit"]:
                    s["hits"] += 1
                    s["saved"] += float(rec.get("seconds_saved", 0.0))
                else:
                    s["misses"] += 1
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash is skipped, not fatal
        stages = {
            name: StageStats(
                entries=int(s["entries"]),
                bytes=int(s["bytes"]),
                hits=int(s["hits"]),
                misses=int(s["misses"]),
                seconds_saved=s["saved"],
            )
            for name, s in sorted(acc.items())
        }
        return StoreStats(root=self.root, stages=stages)

    def verify(self, remove: bool = False) -> VerifyReport:
        """Re-hash every entry; corrupt ones are reported and, with ``remove``, deleted."""
        results = []
        for stage, key, d in self._iter_entry_dirs():
            try:
                _load(d, stage, key, None)
                results.append(VerifyResult(stage, key, d, ok=True))
            except _Bad as bad:
                removed = remove and self._remove(d) is None
                results.append(VerifyResult(stage, key, d, False, bad.reason, removed))
        return VerifyReport(tuple(results))

    def gc(
        self,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        temp_grace_s: float = 3600.0,
    ) -> GcReport:
        """Remove temp folders older than ``temp_grace_s`` (interrupted puts, trash), entries
        unused for more than ``older_than_s``, then least recently used entries until the
        store holds at most ``max_bytes``."""
        temps = remove_stale_temps(self.root, older_than_s=temp_grace_s)
        infos = sorted(self.ls(), key=lambda i: i.last_used)
        total = sum(i.size_bytes for i in infos)
        now = time.time()
        removed = freed = 0
        for info in infos:
            stale = older_than_s is not None and now - info.last_used > older_than_s
            too_big = max_bytes is not None and total > max_bytes
            if not (stale or too_big):
                continue
            if self._remove(info.dir) is None:
                removed += 1
                freed += info.size_bytes
                total -= info.size_bytes
        return GcReport(temps, removed, freed, total)


__all__ = [
    "DEFAULT_STORE_DIR",
    "ENV_STORE_DIR",
    "STORE_FORMAT_VERSION",
    "EntryInfo",
    "FileRecord",
    "GcReport",
    "StageStats",
    "Store",
    "StoreEntry",
    "StoreStats",
    "VerifyReport",
    "VerifyResult",
    "parse_size",
    "resolve_store_root",
]
