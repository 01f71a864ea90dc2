"""One store entry on disk: its format version, names, manifest records, how its files are
written, parsing and checks.

The layout these describe is in :mod:`jaxaot.store.cache`. :func:`_load` is the only way an entry
is read back: it parses ``entry.json``, checks the compat dict and re-hashes every payload
file, and raises :class:`_Bad` (never returns) for anything that must not be used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.errors import StoreError
from jaxaot.util.fsio import TEMP_PREFIX, canonical_json, loose_permissions, untrusted_path
from jaxaot.util.links import link_into

# Store format history (bump when entry.json or the layout changes incompatibly; a store
# reader refuses entries of any other version, naming both):
#   1 (2026-11-22): <root>/v1/<stage>/<key[:2]>/<key>/{entry.json, files}; entry.json holds
#     format_version, stage, key, created, files {name: {sha256, size}}, meta, compat,
#     compute_seconds.
STORE_FORMAT_VERSION = 1

MANIFEST_NAME = "entry.json"
STATS_LOG_NAME = "stats.jsonl"

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_STAGE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
_CHUNK = 1 << 20


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


class _Bad(Exception):
    """An entry that must not be used; ``incompatible`` separates version skew from damage."""

    def __init__(self, reason: str, *, incompatible: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.incompatible = incompatible


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


TRUST_HINT = (
    "make it writable by you and your team's group only (chmod -R o-w; a team store: "
    "chgrp -R TEAM, chmod -R g+rwXs), or set store.trust=true (JAXAOT_TRUST_STORE=1) if you "
    "trust every user who can write there"
)


def check_store_trusted(root: Path, entry_dir: Path) -> None:
    """Raise :class:`StoreError` (one line) when the folders every entry sits in, from
    ``entry_dir``'s parent up to the store root and above, can be written by users you do not
    trust: such a store could hand this process a pickle of anyone's making (issue 12, item 9).
    A store-wide fault fails the run instead of missing every entry and recompiling forever."""
    reason = untrusted_path(entry_dir.parent, root)
    if reason:
        raise StoreError(
            f"store at {shown_with_target(root)} is not safe to load executables from: {reason}; "
            f"{TRUST_HINT}"
        )


def shown_with_target(path: Path) -> str:
    """``path``, followed by where it leads when it is (or passes through) a symbolic link."""
    real = os.path.realpath(path)
    return str(path) if real == os.path.abspath(path) else f"{path} (a symbolic link to {real})"


def _check_entry_trusted(path: Path, st: os.stat_result) -> None:
    reason = loose_permissions(path, st)
    if reason:  # one entry: a miss (removed and recomputed, with the umask's modes)
        raise _Bad(f"untrusted: {reason}")


def _verify_file(path: Path, name: str, rec: FileRecord, trust: bool = True) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise _Bad(f"{name!r} is missing (manifest without payload)") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Bad(f"{name!r} is not a regular file")
    if not trust:
        _check_entry_trusted(path, st)
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
    entry_dir: Path,
    stage: str,
    key: str,
    expect: Mapping[str, Any] | None,
    trust: bool = False,
) -> StoreEntry | None:
    """The verified entry at ``entry_dir``; None if absent; raises :class:`_Bad` otherwise.

    Unless ``trust``, folders and files that users you do not trust can write are refused: the
    store's own folders with :class:`StoreError`, the entry's with :class:`_Bad`.
    """
    try:
        st = entry_dir.lstat()
    except OSError:  # absent (or a folder above it unreadable): a miss
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise _Bad("entry is not a directory")
    if not trust:
        check_store_trusted(entry_dir.parents[3], entry_dir)  # <root>/v1/<stage>/<xx>/<key>
        _check_entry_trusted(entry_dir, st)
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
    if not trust:
        try:
            _check_entry_trusted(entry_dir / MANIFEST_NAME, (entry_dir / MANIFEST_NAME).lstat())
        except OSError as exc:
            raise _Bad(f"{MANIFEST_NAME} unreadable ({exc})") from None
    for name, rec in files.items():
        try:
            _verify_file(entry_dir / name, name, rec, trust)
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(dest: Path, src: bytes | Path) -> FileRecord:
    """Write ``src`` to ``dest`` (a new file), fsync it, and return its hash and size. A big
    file on this file system is hard-linked instead, read-only (a run directory's executable:
    one copy on disk, :mod:`jaxaot.util.links`), and hashed through the new name."""
    h = hashlib.sha256()
    size = 0
    if not isinstance(src, bytes | bytearray | memoryview) and link_into(Path(src), dest):
        with open(dest, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return FileRecord(sha256=h.hexdigest(), size=size)
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


def _touch(path: Path) -> None:
    # Last use is the manifest's mtime. Set from time_ns() rather than the filesystem clock
    # (which may be coarse) so that LRU order follows the order of calls.
    # A read-only store still serves hits; its LRU order just goes stale.
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


def _remove_entry(root: Path, entry_dir: Path) -> OSError | None:
    """Move ``entry_dir`` out of the tree (atomic for readers), then delete it."""
    trash = root / f"{TEMP_PREFIX}trash-{uuid.uuid4().hex}"
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


__all__ = [
    "MANIFEST_NAME",
    "STATS_LOG_NAME",
    "STORE_FORMAT_VERSION",
    "FileRecord",
    "StoreEntry",
]
