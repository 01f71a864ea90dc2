"""Looking after a store: list, count, re-verify and garbage-collect its entries.

These are what ``jaxaot-store`` runs; :class:`~jaxaot.store.cache.Store` exposes them as its
``ls``/``stats``/``verify``/``gc`` methods. None of them hashes a payload except ``verify``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jaxaot.store.entries import (
    MANIFEST_NAME,
    STATS_LOG_NAME,
    Refused,
    check_stage,
    is_key,
    is_stage_name,
    load_entry,
    remove_entry,
)
from jaxaot.store.locks import LOCKS_DIR, STATS_LOCK, file_lock, remove_idle_locks
from jaxaot.util.fsio import (
    TEMP_PREFIX,
    atomic_write_bytes,
    canonical_json,
    find_temps,
    remove_stale_temps,
)
from jaxaot.util.humanize import parse_size

if TYPE_CHECKING:
    from jaxaot.store.cache import Store


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
    """One entry's verdict. ``kind``: ``corrupt`` (bytes or manifest wrong) or ``unusable``
    (verifies, but ``--deep`` could not load or call it); ``reason`` says why, or for an ok
    entry what was not checked. ``remove_error``: why ``--remove`` could not delete it."""

    stage: str
    key: str
    dir: Path
    ok: bool
    reason: str = ""
    removed: bool = False
    kind: str = "corrupt"
    remove_error: str = ""


@dataclass(frozen=True)
class TempInfo:
    """A ``.tmp-*`` file or folder in the store: a put in progress, or one that was killed."""

    path: Path
    age_s: float


@dataclass(frozen=True)
class VerifyReport:
    results: tuple[VerifyResult, ...]
    temps: tuple[TempInfo, ...] = ()

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def corrupt(self) -> tuple[VerifyResult, ...]:
        """Every entry that failed, corrupt or unusable."""
        return tuple(r for r in self.results if not r.ok)

    @property
    def unusable(self) -> tuple[VerifyResult, ...]:
        return tuple(r for r in self.results if not r.ok and r.kind == "unusable")

    @property
    def not_removed(self) -> tuple[VerifyResult, ...]:
        return tuple(r for r in self.results if r.remove_error)


@dataclass(frozen=True)
class GcReport:
    temps_removed: int
    entries_removed: int
    bytes_freed: int
    bytes_remaining: int
    locks_removed: int = 0
    log_lines_folded: int = 0


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
    temps: tuple[TempInfo, ...] = ()

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


def _iter_entry_dirs(data_dir: Path, stage: str | None = None) -> Iterator[tuple[str, str, Path]]:
    if stage is not None:
        check_stage(stage)
    if not data_dir.is_dir():
        return
    for stage_dir in sorted(data_dir.iterdir()):
        if not stage_dir.is_dir() or not is_stage_name(stage_dir.name):
            continue
        if stage is not None and stage_dir.name != stage:
            continue
        for prefix_dir in sorted(stage_dir.iterdir()):
            if not prefix_dir.is_dir() or prefix_dir.name.startswith(TEMP_PREFIX):
                continue
            for d in sorted(prefix_dir.iterdir()):
                if is_key(d.name) and d.name[:2] == prefix_dir.name:
                    yield stage_dir.name, d.name, d


def ls(store: Store, stage: str | None = None) -> list[EntryInfo]:
    """Every entry (optionally of one stage), without hashing payloads."""
    out = []
    for st, key, d in _iter_entry_dirs(store.data_dir, stage):
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


def _slot(acc: dict[str, dict[str, float]], stage: str) -> dict[str, float]:
    return acc.setdefault(stage, {"entries": 0, "bytes": 0, "hits": 0, "misses": 0, "saved": 0.0})


def _log_totals(
    lines: list[bytes], acc: dict[str, dict[str, float]] | None = None
) -> dict[str, dict[str, float]]:
    """Per-stage hits, misses and seconds saved from hit/miss log lines.

    A line is one hit or miss (``record``) or the totals ``gc`` folded earlier lines into
    (``"folded": true``). A line torn by a crash is skipped, not fatal.
    """
    acc = {} if acc is None else acc
    for raw in lines:
        try:
            rec = json.loads(raw)
            stage = str(rec["stage"])
            if rec.get("folded"):
                hits, misses = int(rec["hits"]), int(rec["misses"])
                saved = float(rec["seconds_saved"])
            elif rec["hit"]:
                hits, misses, saved = 1, 0, float(rec.get("seconds_saved", 0.0))
            else:
                hits, misses, saved = 0, 1, 0.0
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        s = _slot(acc, stage)
        s["hits"] += hits
        s["misses"] += misses
        s["saved"] += saved
    return acc


def _read_log(store: Store) -> list[bytes]:
    try:
        with open(store.data_dir / STATS_LOG_NAME, "rb") as f:
            return f.read().splitlines()
    except OSError:
        return []


def stats(store: Store) -> StoreStats:
    """Entries and bytes per stage, plus hits, misses and time saved from the record() log."""
    acc: dict[str, dict[str, float]] = {}
    for info in store.ls():
        s = _slot(acc, info.stage)
        s["entries"] += 1
        s["bytes"] += info.size_bytes
    _log_totals(_read_log(store), acc)
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
    return StoreStats(root=store.root, stages=stages, temps=temps(store))


def temps(store: Store) -> tuple[TempInfo, ...]:
    """Every ``.tmp-*`` file or folder in the store (not inside another), oldest first."""
    found = (TempInfo(p, age) for p, age in find_temps(store.root))
    return tuple(sorted(found, key=lambda t: -t.age_s))


def fold_log(store: Store) -> int:
    """Rewrite the hit/miss log as one line of totals per stage; return how many hit or miss
    lines were folded (0: nothing to do).

    Appenders hold the log's lock shared, so no line is written while this reads and replaces
    the file (atomically: a reader sees the old log or the folded one, with the same totals).
    Torn lines are dropped. Where the lock cannot be taken or the log cannot be rewritten it is
    left as it is.
    """
    with file_lock(store.root / LOCKS_DIR / STATS_LOCK, exclusive=True) as locked:
        lines = _read_log(store) if locked else []
        records = sum(1 for raw in lines if b'"folded"' not in raw)
        if not records:
            return 0
        folded = "".join(
            canonical_json(
                {
                    "folded": True,
                    "stage": stage,
                    "hits": int(t["hits"]),
                    "misses": int(t["misses"]),
                    "seconds_saved": round(t["saved"], 6),
                }
            )
            + "\n"
            for stage, t in sorted(_log_totals(lines).items())
        )
        try:
            atomic_write_bytes(store.data_dir / STATS_LOG_NAME, folded.encode())
        except OSError:
            return 0
        return records


def _failed(
    store: Store, stage: str, key: str, d: Path, reason: str, kind: str, remove: bool
) -> VerifyResult:
    err = remove_entry(store.root, d) if remove else None
    if remove and err is None and (d.exists() or d.is_symlink()):
        err = OSError("it is still there")  # never claim a removal that did not happen
    return VerifyResult(
        stage,
        key,
        d,
        False,
        reason,
        removed=remove and err is None,
        kind=kind,
        remove_error="" if err is None else str(err),
    )


def _installed(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _made_elsewhere(compat: Mapping[str, object]) -> str:
    """What an entry's jax/jaxlib differ in from the installed ones ('' when they match): such
    an entry verifies but is never served here (a miss), and ``gc`` removes it once unused."""
    other = [
        f"{dist} {compat.get(dist)}"
        for dist in ("jax", "jaxlib")
        if compat.get(dist) is not None and compat.get(dist) != _installed(dist)
    ]
    if not other:
        return ""
    here = ", ".join(f"{dist} {_installed(dist)}" for dist in ("jax", "jaxlib"))
    return f"made by {', '.join(other)}: never served to this {here}"


def verify(store: Store, remove: bool = False, deep: bool = False) -> VerifyReport:
    """Re-hash every entry; corrupt ones are reported and, with ``remove``, deleted.

    ``deep``: also load every verified entry in a fresh process, as a cold run would, and call
    what it holds (:mod:`jaxaot.store.probe`); the ones that cannot be loaded or called are
    ``unusable``. An entry made by another jax or jaxlib verifies, says so in its ``reason``,
    and is not probed (this jax never serves it).
    """
    results = []
    for stage, key, d in _iter_entry_dirs(store.data_dir):
        try:
            entry = load_entry(d, stage, key, None, store.trust)
            note = _made_elsewhere(entry.compat) if entry is not None else ""
            results.append(VerifyResult(stage, key, d, ok=True, reason=note))
        except Refused as bad:
            results.append(_failed(store, stage, key, d, bad.reason, "corrupt", remove))
    if deep:
        from jaxaot.store.probe import probe_entries

        # An entry another jax/jaxlib made is never loaded by this one: probing it here would
        # call it unusable, and --remove would delete what that jax serves.
        to_probe = [r for r in results if r.ok and not r.reason]
        probed = probe_entries([r.dir for r in to_probe], store.trust) if to_probe else []
        verdicts = {p.dir: p for p in probed}
        results = [
            r
            if r.dir not in verdicts
            else VerifyResult(r.stage, r.key, r.dir, True, verdicts[r.dir].reason, kind="")
            if verdicts[r.dir].usable
            else _failed(store, r.stage, r.key, r.dir, verdicts[r.dir].reason, "unusable", remove)
            for r in results
        ]
    return VerifyReport(tuple(results), temps(store))


def gc(
    store: Store,
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    temp_grace_s: float = 3600.0,
) -> GcReport:
    """Remove temp folders and idle key locks older than ``temp_grace_s``, entries unused
    for more than ``older_than_s``, then least recently used entries until the store holds
    at most ``max_bytes``; fold the hit/miss log into per-stage totals (``stats`` is unchanged)."""
    n_temps = remove_stale_temps(store.root, older_than_s=temp_grace_s)
    locks = remove_idle_locks(store.root, older_than_s=temp_grace_s)
    folded = fold_log(store)
    infos = sorted(store.ls(), key=lambda i: i.last_used)
    total = sum(i.size_bytes for i in infos)
    now = time.time()
    removed = freed = 0
    for info in infos:
        stale = older_than_s is not None and now - info.last_used > older_than_s
        too_big = max_bytes is not None and total > max_bytes
        if not (stale or too_big):
            continue
        if remove_entry(store.root, info.dir) is None:
            removed += 1
            freed += info.size_bytes
            total -= info.size_bytes
    return GcReport(n_temps, removed, freed, total, locks, folded)


__all__ = [
    "EntryInfo",
    "GcReport",
    "StageStats",
    "StoreStats",
    "TempInfo",
    "VerifyReport",
    "VerifyResult",
    "fold_log",
    "gc",
    "ls",
    "parse_size",
    "stats",
    "temps",
    "verify",
]
