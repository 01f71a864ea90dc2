"""One store entry on disk: its format version, names, manifest, how its files are written,
and :func:`load_entry`, the only way an entry is read back.

The layout these describe is in :mod:`jaxaot.store.cache`. :func:`load_entry` parses
``entry.json`` (:func:`jaxaot.util.verified.parse_versioned_json`), checks the compat dict and
re-hashes every payload file (:class:`jaxaot.util.verified.VerifiedFiles`), and raises
:class:`~jaxaot.util.verified.Refused` (never returns) for anything that must not be used.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from jaxaot.util.fsio import TEMP_PREFIX, canonical_json, untrusted_path
from jaxaot.util.links import link_into
from jaxaot.util.verified import (
    FileRecord,
    Mismatch,
    Refused,
    VerifiedFiles,
    check_modes,
    parse_versioned_json,
    shown_with_target,
)

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


def is_stage_name(name: str) -> bool:
    """Whether ``name`` can name a stage's folder in the store."""
    return isinstance(name, str) and _STAGE_RE.fullmatch(name) is not None


def is_key(name: str) -> bool:
    """Whether ``name`` is a store key (64 lowercase hex digits)."""
    return isinstance(name, str) and _KEY_RE.fullmatch(name) is not None


def _is_file_name(name: str) -> bool:
    return isinstance(name, str) and _FILE_RE.fullmatch(name) is not None and name != MANIFEST_NAME


def check_stage(stage: str) -> str:
    if not is_stage_name(stage):
        raise ValueError(f"invalid store stage name {stage!r}: expected [A-Za-z0-9_-]{{1,64}}")
    return stage


def check_key(key: str) -> str:
    if not is_key(key):
        raise ValueError(f"invalid store key {key!r}: expected 64 lowercase hex digits (sha256)")
    return key


def check_file_name(name: str) -> str:
    if not _is_file_name(name):
        raise ValueError(
            f"invalid store file name {name!r}: expected a plain file name "
            f"([A-Za-z0-9_.+-], no path separators) other than {MANIFEST_NAME!r}"
        )
    return name


def entry_label(stage: str, key: str) -> str:
    """How logs and messages name an entry: ``<stage>/<key[:12]>``."""
    return f"{stage}/{key[:12]}"


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

    @property
    def verified(self) -> VerifiedFiles:
        """The payload as :class:`VerifiedFiles` (each read re-hashed)."""
        label = entry_label(self.stage, self.key)

        def refuse(m: Mismatch) -> Exception:
            if m.error is not None:
                return StoreError(
                    f"store entry {label}: cannot read {m.name!r} at {m.path}: {m.error}"
                )
            return StoreError(
                f"store entry {label}: file {m.name!r} at {m.path} changed after verification: "
                f"expected {m.expected.size} bytes sha256 {m.expected.sha256[:16]}, found "
                f"{m.size} bytes sha256 {str(m.sha256)[:16]}; run `jaxaot-store verify --remove`"
            )

        return VerifiedFiles(self.dir, self.files, label=f"store entry {label}", refuse=refuse)

    def path(self, name: str) -> Path:
        """Path of payload file ``name``; not re-verified: use :meth:`read_bytes` to deserialize."""
        return self.verified.path(name)

    def read_bytes(self, name: str) -> bytes:
        """The bytes of ``name``, checked against the manifest's size and sha256 first."""
        return self.verified.read(name)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def parse_manifest(raw: bytes, stage: str, key: str) -> dict[str, Any]:
    doc = parse_versioned_json(raw, STORE_FORMAT_VERSION, name=MANIFEST_NAME, kind="entry")
    if doc.get("stage") != stage or doc.get("key") != key:
        raise Refused(
            f"{MANIFEST_NAME} names {doc.get('stage')!r}/{str(doc.get('key'))[:12]}, "
            f"but sits at {stage}/{key[:12]}"
        )
    files = doc.get("files")
    if not isinstance(files, dict):
        raise Refused(f"{MANIFEST_NAME} has no 'files' object")
    for name, rec in files.items():
        if not _is_file_name(name):
            raise Refused(f"{MANIFEST_NAME} lists an invalid file name {name!r}")
        record = FileRecord.from_json(rec)
        if record is None or record.size < 0 or not _SHA256.fullmatch(record.sha256):
            raise Refused(
                f"{MANIFEST_NAME} has a malformed record for {name!r} (expected a size >= 0 "
                "and a sha256 of 64 lowercase hex digits)"
            )
    for name, kind in (("meta", dict), ("compat", dict), ("created", (int, float))):
        if not isinstance(doc.get(name), kind):
            raise Refused(f"{MANIFEST_NAME} has a missing or malformed {name!r}")
    if not isinstance(doc.get("compute_seconds"), int | float):
        raise Refused(f"{MANIFEST_NAME} has a missing or malformed 'compute_seconds'")
    return doc


def compat_diff(found: Mapping[str, Any], expect: Mapping[str, Any]) -> str:
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


def check_store_trusted(root: Path, folder: Path) -> None:
    """Raise :class:`StoreError` (one line) when ``folder`` (one the store's entries sit in), the
    folders from it up to the store root, or those above, can be written by users you do not
    trust: such a store could hand this process a pickle of anyone's making. A store-wide fault
    fails the run instead of missing every entry and recompiling forever."""
    reason = untrusted_path(folder, root)
    if reason:
        raise StoreError(
            f"store at {shown_with_target(root)} is not safe to load executables from: {reason}; "
            f"{TRUST_HINT}"
        )


def load_entry(
    entry_dir: Path,
    stage: str,
    key: str,
    expect: Mapping[str, Any] | None,
    trust: bool = False,
) -> StoreEntry | None:
    """The verified entry at ``entry_dir``; None if absent; raises :class:`Refused` otherwise.

    Unless ``trust``, folders and files that users you do not trust can write are refused: the
    store's own folders with :class:`StoreError`, the entry's with :class:`Refused`.
    """
    try:
        st = entry_dir.lstat()
    except OSError:  # absent (or a folder above it unreadable): a miss
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise Refused("entry is not a directory")
    if not trust:
        check_store_trusted(entry_dir.parents[3], entry_dir.parent)  # <root>/v1/<stage>/<xx>
        check_modes(entry_dir, st)
    try:
        raw = (entry_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            if any(entry_dir.iterdir()):
                raise Refused(f"{MANIFEST_NAME} missing (payload without manifest)") from None
        raise Refused(f"{MANIFEST_NAME} missing (empty entry folder)") from None
    except OSError as exc:
        raise Refused(f"{MANIFEST_NAME} unreadable ({exc})") from None
    doc = parse_manifest(raw, stage, key)
    if expect is not None:
        diff = compat_diff(doc["compat"], expect)
        if diff:
            raise Refused(f"compat mismatch: {diff}", incompatible=True)
    if not trust:
        try:
            check_modes(entry_dir / MANIFEST_NAME, (entry_dir / MANIFEST_NAME).lstat())
        except OSError as exc:
            raise Refused(f"{MANIFEST_NAME} unreadable ({exc})") from None
    entry = StoreEntry(
        stage=stage,
        key=key,
        dir=entry_dir,
        files={n: FileRecord(r["sha256"], r["size"]) for n, r in doc["files"].items()},
        meta=doc["meta"],
        compat=doc["compat"],
        created=float(doc["created"]),
        compute_seconds=float(doc["compute_seconds"]),
        format_version=doc["format_version"],
    )
    entry.verified.check(strict_modes=not trust)
    return entry


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(dest: Path, src: bytes | Path) -> FileRecord:
    """Write ``src`` to ``dest`` (a new file), fsync it, and return its hash and size. A big
    file on this file system is hard-linked instead, read-only (a run directory's payload:
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


def touch(path: Path) -> None:
    """Mark an entry used now: last use is its manifest's mtime."""
    # Set from time_ns() rather than the filesystem clock (which may be coarse) so that LRU
    # order follows the order of calls. A read-only store still serves hits; its LRU order
    # just goes stale.
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


def remove_entry(root: Path, entry_dir: Path) -> OSError | None:
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
    "TRUST_HINT",
    "FileRecord",
    "Refused",
    "StoreEntry",
    "check_file_name",
    "check_key",
    "check_stage",
    "check_store_trusted",
    "compat_diff",
    "entry_label",
    "fsync_dir",
    "is_key",
    "is_stage_name",
    "load_entry",
    "parse_manifest",
    "remove_entry",
    "touch",
    "write_file",
]
