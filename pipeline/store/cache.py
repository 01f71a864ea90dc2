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

A put hard-links a big payload file (a run directory's executable) instead of copying it when
both sit on one file system, read-only; a hit is linked into the run directory the same way
(:mod:`jaxaot.util.links`). Removing an entry only drops the store's name: the disk is freed
once no run directory links the file, and ``gc --max-size`` counts entries at their full size.

The on-disk form of one entry (format version, manifest records, verification) lives in
:mod:`jaxaot.store.entries`, and ls/stats/verify/gc in :mod:`jaxaot.store.maintenance`;
every public name of both is importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxaot.store import maintenance as _maintenance
from jaxaot.store.entries import (
    _CHUNK,
    MANIFEST_NAME,
    STATS_LOG_NAME,
    STORE_FORMAT_VERSION,
    FileRecord,
    StoreEntry,
    _Bad,
    _check_file_name,
    _check_key,
    _check_stage,
    _label,
    _load,
    _remove_entry,
    check_store_trusted,
)
from jaxaot.store.locks import LOCKS_DIR, STATS_LOCK, file_lock
from jaxaot.store.maintenance import (
    EntryInfo,
    GcReport,
    StageStats,
    StoreStats,
    VerifyReport,
    VerifyResult,
    parse_size,
)
from jaxaot.util.fsio import FILE_MODE, TEMP_PREFIX, canonical_json, make_temp_dir, trust_from_env
from jaxaot.util.links import link_into

ENV_STORE_DIR = "JAXAOT_STORE_DIR"
DEFAULT_STORE_DIR = Path("outputs/store")

log = logging.getLogger("jaxaot.store")

# errno values that mean "this store cannot take writes", as opposed to a one-off failure.
_DEGRADE_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
)
_PUT_ATTEMPTS = 3


def resolve_store_root(configured: str | Path | None = None) -> Path:
    """The store root: ``configured`` if set, else ``$JAXAOT_STORE_DIR``, else ``outputs/store``."""
    if configured is not None and str(configured) != "":
        return Path(configured).expanduser()
    env = os.environ.get(ENV_STORE_DIR, "")
    return Path(env).expanduser() if env else DEFAULT_STORE_DIR


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


class Store:
    """The checkpoint store at ``root``; ``enabled=False`` makes get/put/record no-ops."""

    def __init__(self, root: str | Path, enabled: bool = True, trust: bool | None = None) -> None:
        self.root = Path(root)
        self.enabled = enabled
        # True: load entries whatever their permissions (store.trust, $JAXAOT_TRUST_STORE).
        self.trust = trust_from_env() if trust is None else trust
        self._read_only = False  # set on the first "cannot write here" error, warned once

    def __repr__(self) -> str:
        return f"Store(root={str(self.root)!r}, enabled={self.enabled})"

    def check_trusted(self) -> None:
        """A one-line StoreError when users you do not trust can write the store's folders (its
        root, ``v1``, ``v1/compile`` and the folders above): checked before a run uses it."""
        if self.enabled and not self.trust:
            check_store_trusted(self.root, self.data_dir / "compile" / "00" / ("0" * 64))

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
            entry = _load(entry_dir, stage, key, expect, self.trust)
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
            tmp = make_temp_dir(self.root, f"{TEMP_PREFIX}put-{stage}-{key[:12]}-")
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
            return _load(entry_dir, stage, key, compat, self.trust)
        except _Bad as bad:
            self._discard(entry_dir, stage, key, bad, during="store put replaces")
            return None

    def discard(self, stage: str, key: str, reason: str) -> str:
        """Remove the entry for (stage, key), which verified but cannot be used (its executable
        does not load here, or serves another calling convention: issue 12), so that the next
        put stores a good one. Returns what happened, for the caller's one warning."""
        entry_dir = self.entry_dir(stage, key)
        outcome = self._remove(entry_dir)
        log.debug("store discard: %s: %s; %s", _label(stage, key), reason, outcome)
        return outcome

    def _remove(self, entry_dir: Path) -> str:
        err = _remove_entry(self.root, entry_dir)
        return "entry removed" if err is None else f"could not remove it ({err})"

    def _discard(self, entry_dir: Path, stage: str, key: str, bad: _Bad, during: str) -> None:
        what = "incompatible" if bad.incompatible else "corrupt"
        outcome = self._remove(entry_dir)
        log.warning(
            "%s: %s: %s entry: %s; %s", during, _label(stage, key), what, bad.reason, outcome
        )

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
            # Shared with other appenders; `gc` takes it alone while it folds the log.
            with file_lock(self.root / LOCKS_DIR / STATS_LOCK, exclusive=False):
                fd = os.open(
                    self.data_dir / STATS_LOG_NAME,
                    os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                    FILE_MODE,
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

    # -- maintenance (jaxaot.store.maintenance) ------------------------------------------------

    def ls(self, stage: str | None = None) -> list[EntryInfo]:
        """Every entry (optionally of one stage), without hashing payloads."""
        return _maintenance.ls(self, stage)

    def stats(self) -> StoreStats:
        """Entries and bytes per stage, plus hits, misses and time saved from the record() log."""
        return _maintenance.stats(self)

    def verify(self, remove: bool = False, deep: bool = False) -> VerifyReport:
        """Re-hash every entry (``deep``: and load each executable in a fresh process); bad
        ones are reported and, with ``remove``, deleted."""
        return _maintenance.verify(self, remove, deep)

    def gc(
        self,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        temp_grace_s: float = 3600.0,
    ) -> GcReport:
        """Remove temp folders and idle key locks older than ``temp_grace_s``, entries unused
        for more than ``older_than_s``, then least recently used entries until the store holds
        at most ``max_bytes``; fold the hit/miss log into per-stage totals."""
        return _maintenance.gc(self, max_bytes, older_than_s, temp_grace_s)


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
