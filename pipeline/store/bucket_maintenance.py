"""``jaxaot-store ls/stats/verify/gc`` on a bucket store (``--store s3://bucket/prefix``).

The same reports as a folder store's (:mod:`jaxaot.store.maintenance`), with what a bucket
cannot tell said so: an object has no last-use time (hits are served by each machine's local
cache and never reach the bucket), so "last used" and gc's age are the entry's upload time;
hits and misses are counted in each machine's cache (``jaxaot-store stats --store CACHE_DIR``).
What killed puts leave (payload without a manifest, payload no manifest names) and claims
nobody renews are reported as temps, and removed by ``gc`` once older than the grace period.

gc never deletes a folder by prefix: payload without a manifest is deleted object by object,
each by the name the listing gave, after checking again that no manifest has appeared and that
the object is still older than the grace period, which is at least :data:`MIN_ORPHAN_GRACE_S`
there (a writer uploading that key now finishes its manifest after its payload); a claim is
deleted once unchanged for at least the longest lease (:data:`~jaxaot.store.bucket.MAX_LEASE_S`).
verify downloads one entry at a time into a temporary folder it empties after each.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jaxaot.store.bucket import CLAIMS_DIR, MAX_LEASE_S, OP_TIMEOUT_S, Bucket, BucketDown
from jaxaot.store.entries import (
    MANIFEST_NAME,
    STORE_FORMAT_VERSION,
    Refused,
    is_key,
    is_stage_name,
    parse_manifest,
)
from jaxaot.store.maintenance import (
    EntryInfo,
    GcReport,
    StageStats,
    StoreStats,
    TempInfo,
    VerifyReport,
    VerifyResult,
)

# The least age (seconds) at which gc deletes payload of a key that has no manifest, whatever
# --temp-grace-hours says: a writer's upload of that key may be under way.
MIN_ORPHAN_GRACE_S = 600.0


def _mtime(info: dict[str, Any]) -> float:
    """An object's modification time from fsspec's info (s3fs: LastModified, gcsfs: updated)."""
    for name in ("LastModified", "mtime", "updated", "last_modified"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


@dataclass
class _Scan:
    """One entry folder in the bucket: its manifest's mtime and every payload object."""

    stage: str
    key: str
    path: str
    manifest: float | None = None
    objects: dict[str, tuple[int, float]] = field(default_factory=dict)  # rel -> (size, mtime)

    @property
    def size(self) -> int:
        return sum(s for s, _ in self.objects.values())

    @property
    def newest(self) -> float:
        return max([t for _, t in self.objects.values()] + [self.manifest or 0.0])


class BucketAdmin:
    """ls/stats/verify/gc over ``bucket``; ``root`` is its prefix, shown as the store's name."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.root = Path(bucket.url.root)
        self.location = bucket.url.url
        self._orphans: dict[str, _Scan] = {}  # entry folders without a manifest, by path

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return self.bucket._call(what, fn)
        except BucketDown as exc:
            raise OSError(str(exc)) from None

    def _scan(self) -> tuple[list[_Scan], list[TempInfo]]:
        top = self.bucket.url.path(f"v{STORE_FORMAT_VERSION}")
        try:
            found = self._call("listing", lambda: self.bucket.fs.find(top, detail=True))
        except FileNotFoundError:
            found = {}
        scans: dict[str, _Scan] = {}
        for path, info in sorted(found.items()):
            rel = path[len(top) + 1 :].split("/")
            if len(rel) < 4 or not is_stage_name(rel[0]) or not is_key(rel[2]):
                continue
            if rel[1] != rel[2][:2]:
                continue
            base = "/".join([top, *rel[:3]])
            scan = scans.setdefault(base, _Scan(rel[0], rel[2], base))
            if rel[3:] == [MANIFEST_NAME]:
                scan.manifest = _mtime(info)
            scan.objects["/".join(rel[3:])] = (int(info.get("size") or 0), _mtime(info))
        now = time.time()
        temps = [
            TempInfo(Path(s.path), max(now - s.newest, 0.0))
            for s in scans.values()
            if s.manifest is None
        ]
        claims = self.bucket.url.path(CLAIMS_DIR)
        try:
            held = self._call("listing", lambda: self.bucket.fs.find(claims, detail=True))
        except FileNotFoundError:
            held = {}
        temps += [TempInfo(Path(p), max(now - _mtime(i), 0.0)) for p, i in sorted(held.items())]
        entries = [s for s in scans.values() if s.manifest is not None]
        self._orphans = {s.path: s for s in scans.values() if s.manifest is None}
        return entries, sorted(temps, key=lambda t: -t.age_s)

    def ls(self, stage: str | None = None) -> list[EntryInfo]:
        entries, _ = self._scan()
        return [
            EntryInfo(
                s.stage,
                s.key,
                Path(s.path),
                s.size,
                len(s.objects) - 1,
                s.manifest,
                s.manifest or 0.0,
            )
            for s in entries
            if stage is None or s.stage == stage
        ]

    def stats(self) -> StoreStats:
        entries, temps = self._scan()
        acc: dict[str, list[int]] = {}
        for s in entries:
            slot = acc.setdefault(s.stage, [0, 0])
            slot[0] += 1
            slot[1] += s.size
        stages = {n: StageStats(entries=e, bytes=b) for n, (e, b) in sorted(acc.items())}
        return StoreStats(root=self.root, stages=stages, temps=tuple(temps))

    def _unreferenced(self, s: _Scan) -> list[str]:
        """Payload objects of ``s`` its manifest does not name (a losing or killed writer's)."""
        raw = self._call("reading", lambda: self.bucket.fs.cat_file(f"{s.path}/{MANIFEST_NAME}"))
        try:
            doc = parse_manifest(raw, s.stage, s.key)
        except Refused:
            return []  # verify reports it
        named = {f"{r['sha256']}/{n}" for n, r in doc["files"].items()}
        return [rel for rel in s.objects if rel != MANIFEST_NAME and rel not in named]

    def _drop_orphan(self, s: _Scan, grace_s: float) -> bool:
        """Delete the listed payload objects of a key without a manifest, one by one, unless a
        manifest has appeared since the listing or an object was rewritten within ``grace_s``
        (a writer's upload under way); True when any was deleted."""
        fs = self.bucket.fs
        dropped = False
        for rel in sorted(s.objects):
            if self._call("checking", lambda: fs.exists(f"{s.path}/{MANIFEST_NAME}")):
                return dropped
            obj = f"{s.path}/{rel}"
            try:
                info = self._call("checking", lambda obj=obj: fs.info(obj, timeout=OP_TIMEOUT_S))
            except FileNotFoundError:
                continue
            if time.time() - _mtime(info) < grace_s:
                continue
            with contextlib.suppress(FileNotFoundError):
                self._call("deleting from", lambda obj=obj: fs.rm_file(obj, timeout=OP_TIMEOUT_S))
                dropped = True
        return dropped

    def verify(self, remove: bool = False, deep: bool = False) -> VerifyReport:
        if deep:
            raise ValueError(
                "verify --deep loads executables and cannot on a bucket; run it on a machine's "
                "local cache (--store CACHE_DIR), which holds what that machine loaded"
            )
        entries, temps = self._scan()
        results = []
        with tempfile.TemporaryDirectory(prefix="jaxaot-verify-") as tmp:
            for i, s in enumerate(entries):
                into = Path(tmp) / str(i)
                try:
                    self.bucket.fetch(s.stage, s.key, None, into=into)
                    results.append(VerifyResult(s.stage, s.key, Path(s.path), ok=True))
                except Refused as bad:
                    err = ""
                    if remove:
                        try:
                            self.bucket.remove(s.stage, s.key)
                        except BucketDown as exc:
                            err = str(exc)
                    results.append(
                        VerifyResult(
                            s.stage,
                            s.key,
                            Path(s.path),
                            False,
                            bad.reason,
                            removed=remove and not err,
                            remove_error=err,
                        )
                    )
                except BucketDown as exc:
                    raise OSError(str(exc)) from None
                finally:  # one entry on disk at a time
                    shutil.rmtree(into, ignore_errors=True)
        return VerifyReport(tuple(results), tuple(temps))

    def gc(
        self,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        temp_grace_s: float = 3600.0,
    ) -> GcReport:
        entries, temps = self._scan()
        fs = self.bucket.fs
        n_temps = n_claims = 0
        claims = self.bucket.url.path(CLAIMS_DIR)
        for t in temps:
            path = str(t.path)
            if path.startswith(claims + "/"):
                if t.age_s < max(temp_grace_s, MAX_LEASE_S):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    self._call("deleting from", lambda path=path: fs.rm_file(path))
                    n_claims += 1
            elif t.age_s >= max(temp_grace_s, MIN_ORPHAN_GRACE_S):
                n_temps += self._drop_orphan(
                    self._orphans[path], max(temp_grace_s, MIN_ORPHAN_GRACE_S)
                )
        now = time.time()
        for s in entries:
            stray = [
                rel for rel in self._unreferenced(s) if now - s.objects[rel][1] >= temp_grace_s
            ]
            for rel in stray:
                with contextlib.suppress(FileNotFoundError):
                    obj = f"{s.path}/{rel}"
                    self._call("deleting from", lambda obj=obj: fs.rm_file(obj))
                s.objects.pop(rel)
            n_temps += bool(stray)
        infos = sorted(entries, key=lambda s: s.manifest or 0.0)
        total = sum(s.size for s in infos)
        removed = freed = 0
        for s in infos:
            stale = older_than_s is not None and now - (s.manifest or 0.0) > older_than_s
            too_big = max_bytes is not None and total > max_bytes
            if not (stale or too_big):
                continue
            try:
                self.bucket.remove(s.stage, s.key)
            except BucketDown as exc:
                raise OSError(str(exc)) from None
            removed += 1
            freed += s.size
            total -= s.size
        return GcReport(n_temps, removed, freed, total, n_claims, 0)


__all__ = ["BucketAdmin"]
