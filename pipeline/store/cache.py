"""Content-addressed checkpoint store: stage outputs keyed by the sha256 of their inputs.

Layout (``v1`` is :data:`STORE_FORMAT_VERSION`)::

    <root>/v1/<stage>/<key[:2]>/<key>/entry.json   manifest, written last
    <root>/v1/<stage>/<key[:2]>/<key>/<file>...    payload named in the manifest
    <root>/v1/stats.jsonl                          hit/miss log, one JSON object a line
    <root>/.tmp-*                                  puts in progress / interrupted, trash

A put builds the whole entry in a temp folder inside ``root`` (same filesystem), fsyncs every
file, writes ``entry.json`` last and renames the folder into place, so an entry folder is
either complete or absent. A get verifies size and sha256 of every file before it returns an
entry, and :meth:`StoreEntry.read_bytes` verifies again the very bytes it hands out
(:class:`jaxaot.util.verified.VerifiedFiles`): no deserializer (an executable's pickle) ever sees
bytes whose hash was not checked. Anything
that fails verification is a miss, logged once on ``jaxaot.store`` and removed, so the next
put recomputes it; one that cannot be removed is skipped by this process, alone (which store
problems fail a run and which only cost caching: :func:`jaxaot.store.root.check_store_dir`).

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
    MANIFEST_NAME,
    STATS_LOG_NAME,
    STORE_FORMAT_VERSION,
    FileRecord,
    Refused,
    StoreEntry,
    check_file_name,
    check_key,
    check_stage,
    check_store_trusted,
    entry_label,
    fsync_dir,
    is_stage_name,
    load_entry,
    remove_entry,
    touch,
    write_file,
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
from jaxaot.store.root import (
    ENV_STORE_DIR,
    check_store_dir,
    default_store_dir,
    resolve_store_root,
)
from jaxaot.util.fsio import FILE_MODE, TEMP_PREFIX, canonical_json, make_temp_dir, trust_from_env

log = logging.getLogger("jaxaot.store")

# errno values that mean "this file system takes no more writes", wherever they come from.
_FULL_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# ... and these too where the store root itself refuses a write (creating a temp folder in it).
_DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_PUT_ATTEMPTS = 3


def _why_not_removed(entry_dir: Path, err: OSError) -> str:
    return f"moving it out of {entry_dir.parent}: {err.strerror or err}"


class Store:
    """The checkpoint store at ``root``; ``enabled=False`` makes get/put/record no-ops."""

    def __init__(self, root: str | Path, enabled: bool = True, trust: bool | None = None) -> None:
        self.root = Path(root)
        self.enabled = enabled
        # True: load entries whatever their permissions (store.trust, $JAXAOT_TRUST_STORE).
        self.trust = trust_from_env() if trust is None else trust
        self._read_only = False  # set on the first "cannot write here" error, warned once
        self._skipped: set[Path] = set()  # entries this process leaves alone, each warned once
        self._unplaceable: set[Path] = set()  # folders an entry could not be put in, warned once
        self._no_log = False  # the hit/miss log cannot be appended to (warned once)

    def __repr__(self) -> str:
        return f"Store(root={str(self.root)!r}, enabled={self.enabled})"

    def check_trusted(self) -> None:
        """A one-line StoreError when users you do not trust can write the store's folders (its
        root, ``v1``, each stage's folder and the folders above): checked before a run uses it."""
        if not self.enabled or self.trust:
            return
        check_store_trusted(self.root, self.data_dir)
        try:
            stage_dirs = sorted(d for d in self.data_dir.iterdir() if is_stage_name(d.name))
        except OSError:  # no v1 yet (or unreadable: each get reports its own folders)
            return
        for d in stage_dirs:
            check_store_trusted(self.root, d)

    @property
    def read_only(self) -> bool:
        """True once the store as a whole refused a write: its root (EACCES/EPERM creating a
        temp folder in it, or the root gone or no longer a folder), or its file system
        (EROFS/ENOSPC/EDQUOT/EFBIG anywhere). Puts are then skipped; hits are still served.
        One entry or one inner folder that refuses a write never sets it."""
        return self._read_only

    @property
    def data_dir(self) -> Path:
        return self.root / f"v{STORE_FORMAT_VERSION}"

    def entry_dir(self, stage: str, key: str) -> Path:
        check_stage(stage)
        check_key(key)
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
        if entry_dir in self._skipped:
            log.debug("store miss: %s: skipped (warned above)", entry_label(stage, key))
            return None
        try:
            entry = load_entry(entry_dir, stage, key, expect, self.trust)
        except Refused as bad:
            self._discard(entry_dir, stage, key, bad, during="store miss")
            return None
        if entry is None:
            log.debug("store miss: %s: not stored", entry_label(stage, key))
            return None
        touch(entry_dir / MANIFEST_NAME)
        log.debug(
            "store hit: %s: %d file(s), %d bytes verified",
            entry_label(stage, key),
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
        created: float | None = None,
    ) -> StoreEntry | None:
        """Store ``files`` (name -> bytes or a Path to copy) atomically; None if not writable.

        If the entry already exists and verifies (a concurrent writer won), ours is discarded
        and the existing one is returned. ``created``: when the entry was first made (an entry
        copied from a bucket keeps its own); default now.
        """
        entry_dir = self.entry_dir(stage, key)
        for name in files:
            check_file_name(name)
        meta_d = dict(meta or {})
        compat_d = dict(compat or {})
        json.dumps([meta_d, compat_d])  # a non-JSON value is a caller bug: fail before any I/O
        if not self.enabled or self._read_only or entry_dir in self._skipped:
            return None
        tmp: Path | None = None
        try:
            existing = self._existing(entry_dir, stage, key, compat_d)
            if existing is not None or entry_dir in self._skipped:
                return existing
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                tmp = make_temp_dir(self.root, f"{TEMP_PREFIX}put-{stage}-{key[:12]}-")
            except OSError as exc:  # the root itself: gone, not a folder, not writable, full
                self._degrade(exc)
                return None
            records = {name: write_file(tmp / name, src) for name, src in files.items()}
            created = time.time() if created is None else float(created)
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
            write_file(tmp / MANIFEST_NAME, manifest)
            touch(tmp / MANIFEST_NAME)
            fsync_dir(tmp)
            try:
                placed = self._place(tmp, entry_dir, stage, key, compat_d)
            except OSError as exc:
                if exc.errno in _DENIED_ERRNOS:  # a folder inside the store, not its root
                    self._unplaceable_folder(entry_dir, stage, key, exc)
                    return None
                raise
            if isinstance(placed, StoreEntry):  # another writer's
                return placed
            if not placed:
                return None
            tmp = None
        except OSError as exc:
            ours = exc.filename is None or str(exc.filename).startswith(str(tmp))
            if exc.errno in _FULL_ERRNOS or (exc.errno in _DENIED_ERRNOS and ours):
                self._degrade(exc)  # writing into our own temp folder in the root
            else:
                log.warning(
                    "store put %s failed, result not cached: %s", entry_label(stage, key), exc
                )
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        log.debug("store put: %s: %d file(s) stored", entry_label(stage, key), len(records))
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

    def _place(
        self, tmp: Path, entry_dir: Path, stage: str, key: str, compat: Mapping[str, Any]
    ) -> bool | StoreEntry:
        """Rename the finished ``tmp`` to ``entry_dir``: True when placed, the entry another
        writer placed first, or False when an invalid entry is in the way (warned)."""
        entry_dir.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(_PUT_ATTEMPTS):
            try:
                os.rename(tmp, entry_dir)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                existing = self._existing(entry_dir, stage, key, compat)
                if existing is not None:
                    log.debug(
                        "store put: %s: another writer stored it first", entry_label(stage, key)
                    )
                    return existing
                if entry_dir in self._skipped:  # a bad entry that cannot be removed: warned
                    return False
                continue
            with contextlib.suppress(OSError):  # the entry is in place; durability is best-effort
                fsync_dir(entry_dir.parent)
            return True
        log.warning(
            "store put %s: an invalid entry kept reappearing at %s; result not cached",
            entry_label(stage, key),
            entry_dir,
        )
        return False

    def _existing(
        self, entry_dir: Path, stage: str, key: str, compat: Mapping[str, Any]
    ) -> StoreEntry | None:
        """The valid entry already at ``entry_dir``; a bad one is removed and None returned."""
        try:
            return load_entry(entry_dir, stage, key, compat, self.trust)
        except Refused as bad:
            self._discard(entry_dir, stage, key, bad, during="store put replaces")
            return None

    def discard(self, stage: str, key: str, reason: str) -> str:
        """Remove the entry for (stage, key), which verified but cannot be used (its executable
        does not load here, or serves another calling convention), so that the next
        put stores a good one. Returns what happened, for the caller's one warning; an entry
        that cannot be removed is skipped by this process from then on."""
        entry_dir = self.entry_dir(stage, key)
        err = remove_entry(self.root, entry_dir)
        if err is None:
            outcome = "entry removed"
        else:
            outcome = f"could not remove it ({_why_not_removed(entry_dir, err)})"
            self._skipped.add(entry_dir)
        log.debug("store discard: %s: %s; %s", entry_label(stage, key), reason, outcome)
        return outcome

    def _discard(self, entry_dir: Path, stage: str, key: str, bad: Refused, during: str) -> None:
        what = "incompatible" if bad.incompatible else "corrupt"
        err = remove_entry(self.root, entry_dir)
        if err is None:
            log.warning(
                "%s: %s: %s entry: %s; entry removed",
                during,
                entry_label(stage, key),
                what,
                bad.reason,
            )
            return
        self._skipped.add(entry_dir)
        log.warning(
            "%s: %s: %s entry at %s: %s; it cannot be removed (%s), so this process skips it "
            "and does not cache that result; the rest of the store is used as usual (remove it "
            "as a user who may: jaxaot-store verify --remove)",
            during,
            entry_label(stage, key),
            what,
            entry_dir,
            bad.reason,
            _why_not_removed(entry_dir, err),
        )

    def _unplaceable_folder(self, entry_dir: Path, stage: str, key: str, exc: OSError) -> None:
        """A put whose entry cannot go into a folder inside the store (EACCES/EPERM): warned
        once per folder; other entries are still cached."""
        folder = next((p for p in entry_dir.parents if p.is_dir()), entry_dir.parent)
        if folder in self._unplaceable:
            log.debug(
                "store put %s: %s is not writable (warned above)", entry_label(stage, key), folder
            )
            return
        self._unplaceable.add(folder)
        log.warning(
            "store put %s: cannot create entry %s: %s is not writable (%s); results that go "
            "there are not cached by this process, the rest of the store is used as usual",
            entry_label(stage, key),
            entry_dir,
            folder,
            exc.strerror or exc,
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
        check_stage(stage)
        check_key(key)
        if not self.enabled or self._read_only or self._no_log:
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
            if exc.errno in _FULL_ERRNOS or not self.root.is_dir():  # the store, not its log
                self._degrade(exc)
                return
            # The log alone: entries are still read and written.
            self._no_log = True
            log.warning(
                "store: cannot record hits and misses in %s (%s); `jaxaot-store stats` will "
                "not count this process's; stage results are still cached",
                self.data_dir / STATS_LOG_NAME,
                exc.strerror or exc,
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
    "check_store_dir",
    "default_store_dir",
    "parse_size",
    "resolve_store_root",
]
