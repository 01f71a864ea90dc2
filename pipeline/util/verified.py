"""Files recorded by name with their size and sha256, and read back only after checking both.

Store entries, checkpoints (a finished run's stage folders) and golden snapshots each keep such
records next to their files: ``entry.json``, the run's ``manifest.json``, ``snapshot.json``.
:class:`VerifiedFiles` is the one reader of them all. :meth:`VerifiedFiles.read` hashes the very
bytes it returns, so nothing is deserialised (an executable's pickle, an export) that was not
checked at the moment it was read; :meth:`VerifiedFiles.check` stats and hashes every file ahead
(a store hit is verified whole before it is used); a trust check, when one is given, runs once,
before the first file it guards is read. Each owner says in its own words what a mismatch means
(``refuse``), so its messages stay its own.

:func:`read_versioned_json` is the one reader of those JSON records: a JSON object with an
integer ``format_version``, refused (naming both versions) when it is not the one this jaxaot
writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.errors import StoreError
from jaxaot.util.fsio import loose_permissions, untrusted_path

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """One file as its record says it is."""

    sha256: str
    size: int

    @classmethod
    def from_json(cls, rec: Any) -> FileRecord | None:
        """The record ``{"sha256": str, "size": int}``; None when it is not one."""
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("sha256"), str)
            or not isinstance(rec.get("size"), int)
            or isinstance(rec.get("size"), bool)
        ):
            return None
        return cls(sha256=rec["sha256"], size=rec["size"])

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}


def record_of(data: bytes | bytearray | memoryview) -> FileRecord:
    """The record of ``data``."""
    return FileRecord(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


@dataclass(frozen=True)
class Mismatch:
    """A file that is not what its record says: missing or unreadable (``error``), or other
    bytes (``size`` and ``sha256`` found)."""

    name: str
    path: Path
    expected: FileRecord
    size: int | None = None
    sha256: str | None = None
    error: OSError | None = None

    @property
    def missing(self) -> bool:
        return isinstance(self.error, FileNotFoundError)


class Refused(Exception):
    """Files (or their JSON record) that must not be used. ``reason`` says why in one line;
    ``incompatible`` tells version skew (a format version, a compat field) from damage."""

    def __init__(self, reason: str, *, incompatible: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.incompatible = incompatible


def _refused(m: Mismatch) -> Exception:
    if m.error is not None:
        return Refused(f"{m.name!r} at {m.path}: {m.error.strerror or m.error}")
    return Refused(
        f"{m.name!r} at {m.path}: expected {m.expected.size} bytes sha256 "
        f"{m.expected.sha256[:16]}, found {m.size} bytes sha256 {str(m.sha256)[:16]}"
    )


class VerifiedFiles:
    """The files ``records`` names in ``folder``, read only as the bytes the records describe.

    ``refuse`` turns a :class:`Mismatch` into the exception :meth:`read` raises (the owner's
    words). ``trust`` (optional) runs once, before the first read of a name in ``guarded``
    (every name when ``guarded`` is None): it raises when the files could have been written by
    someone not trusted.
    """

    def __init__(
        self,
        folder: Path,
        records: Mapping[str, FileRecord],
        *,
        label: str,
        refuse: Callable[[Mismatch], Exception] = _refused,
        trust: Callable[[], None] | None = None,
        guarded: Collection[str] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.files: Mapping[str, FileRecord] = dict(records)
        self.label = label
        self._refuse = refuse
        self._trust = trust
        self._guarded = guarded

    def __repr__(self) -> str:
        return f"VerifiedFiles({self.label}, {len(self.files)} file(s))"

    @property
    def size_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def path(self, name: str) -> Path:
        """Where ``name`` is; not verified (use :meth:`read` for bytes to deserialise)."""
        if name not in self.files:
            raise KeyError(f"{self.label} has no file {name!r} (it has {sorted(self.files)})")
        return self.folder / name

    def read(self, name: str) -> bytes:
        """The bytes of ``name``, checked against its record's size and sha256 first; KeyError
        for a name without a record."""
        path = self.path(name)
        rec = self.files[name]
        if self._trust is not None and (self._guarded is None or name in self._guarded):
            self._trust()  # raises while the files are not trusted: every read asks again
            self._trust = None  # trusted once: the later reads of this entry skip the check
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise self._refuse(Mismatch(name, path, rec, error=exc)) from exc
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != rec.size or digest != rec.sha256:
            raise self._refuse(Mismatch(name, path, rec, size=len(data), sha256=digest))
        return data

    def check(self, *, strict_modes: bool = False) -> None:
        """Stat and hash every file without keeping its bytes; :class:`Refused` for the first
        that is missing, not a regular file, of another size or hash, or (``strict_modes``)
        writable by users you do not trust."""
        for name, rec in self.files.items():
            path = self.folder / name
            try:
                _check_file(path, name, rec, strict_modes)
            except OSError as exc:
                raise Refused(f"{name!r} unreadable ({exc})") from None


def _check_file(path: Path, name: str, rec: FileRecord, strict_modes: bool) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise Refused(f"{name!r} is missing (manifest without payload)") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{name!r} is not a regular file")
    if strict_modes:
        check_modes(path, st)
    if st.st_size != rec.size:
        raise Refused(f"{name!r} is {st.st_size} bytes, manifest says {rec.size} (truncated?)")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != rec.sha256:
        raise Refused(
            f"{name!r} sha256 {h.hexdigest()[:16]} does not match manifest {rec.sha256[:16]}"
        )


def check_modes(path: Path, st: os.stat_result) -> None:
    """:class:`Refused` ("untrusted: ...") when users you do not trust can write ``path``."""
    reason = loose_permissions(path, st)
    if reason:
        raise Refused(f"untrusted: {reason}")


def shown_with_target(path: Path) -> str:
    """``path``, followed by where it leads when it is (or passes through) a symbolic link."""
    real = os.path.realpath(path)
    return str(path) if real == os.path.abspath(path) else f"{path} (a symbolic link to {real})"


# -- versioned JSON records -----------------------------------------------------------------------


def parse_versioned_json(raw: bytes, version: int, *, name: str, kind: str) -> dict[str, Any]:
    """The JSON object in ``raw`` (the file ``name``), whose integer ``format_version`` must be
    ``version``. :class:`Refused` otherwise; a version mismatch is ``incompatible`` and named
    as ``"<kind> format version <found>, this jaxaot reads version <version>"``."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise Refused(f"{name} is not a JSON object")
    found = doc.get("format_version")
    if not isinstance(found, int) or isinstance(found, bool):
        raise Refused(f"{name} has no integer format_version (found {found!r})")
    if found != version:
        raise Refused(
            f"{kind} format version {found}, this jaxaot reads version {version}",
            incompatible=True,
        )
    return doc


def read_versioned_json(path: Path, version: int, *, kind: str) -> dict[str, Any]:
    """:func:`parse_versioned_json` of the file at ``path``; OSError when it cannot be read."""
    return parse_versioned_json(Path(path).read_bytes(), version, name=Path(path).name, kind=kind)


# -- checkpoints ------------------------------------------------------------------------------------


def checkpoint_files(
    run_dir: Path,
    stage: str,
    artifacts: Mapping[str, Mapping[str, Any]],
    *,
    trusted: bool,
    guarded: Collection[str],
) -> VerifiedFiles:
    """One stage's files in a finished run directory, as its manifest records them
    (``artifacts``: ``"<stage>/<name>" -> {"sha256", "size"}``, every stage's).

    A recorded file that is missing or altered is a StoreError naming it. Unless ``trusted``,
    the first read of a ``guarded`` file (one that is unpickled) is refused, with a StoreError,
    when users you do not trust could have written it or the folders above it.
    """
    run_dir = Path(run_dir)
    folder = run_dir / stage
    prefix = f"{stage}/"
    records: dict[str, FileRecord] = {}
    for rel, raw in artifacts.items():
        rec = FileRecord.from_json(dict(raw)) if isinstance(raw, Mapping) else None
        if rel.startswith(prefix) and rec is not None:
            records[rel[len(prefix) :]] = rec

    def refuse(m: Mismatch) -> Exception:
        if m.error is not None:
            if m.missing:
                return StoreError(f"resume_from: checkpoint file {m.path} is missing")
            return StoreError(
                f"resume_from: checkpoint file {m.path} is unreadable "
                f"({m.error.strerror or m.error})"
            )
        return StoreError(
            f"resume_from: checkpoint file {m.path} is corrupt ({m.size} bytes, sha256 "
            f"{str(m.sha256)[:12]}; the manifest says {m.expected.size} bytes, "
            f"{m.expected.sha256[:12]}); re-run the stage that wrote it"
        )

    def trust() -> None:
        for name in sorted(set(guarded) & set(records)):
            path = folder / name
            try:
                reason = untrusted_path(path, run_dir)
            except FileNotFoundError:
                continue  # reported as missing by the read
            if reason:
                via = shown_with_target(run_dir)[len(str(run_dir)) :]
                raise StoreError(
                    f"resume_from={str(run_dir)!r}{via}: refusing to unpickle {name}: {reason}; "
                    "make the run directory writable by you (and your team's group) only "
                    "(chmod -R o-w), or set store.trust=true (JAXAOT_TRUST_STORE=1) if you "
                    "trust every user who can write there"
                )

    return VerifiedFiles(
        folder,
        records,
        label=f"resume_from={run_dir}",
        refuse=refuse,
        trust=None if trusted else trust,
        guarded=guarded,
    )


__all__ = [
    "FileRecord",
    "Mismatch",
    "Refused",
    "VerifiedFiles",
    "check_modes",
    "checkpoint_files",
    "parse_versioned_json",
    "read_versioned_json",
    "record_of",
    "shown_with_target",
]
