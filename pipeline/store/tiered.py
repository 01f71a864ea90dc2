"""A bucket store behind a local cache: ``store.dir=s3://bucket/prefix`` (or ``gs://``) with
``store.cache_dir`` (default: the local store) in front.

:class:`BucketStore` is a :class:`~jaxaot.store.cache.Store` whose root is the local cache: a
hit there costs what a local hit costs and touches no network. A miss there asks the bucket
(:class:`~jaxaot.store.bucket.Bucket`): an entry found is downloaded with every object hashed on
the way, put into the cache (atomically, as any local put) and served from it. A put goes to the
cache, then to the bucket (payload, then the manifest with a conditional write). The per-key
lock (:class:`~jaxaot.store.locks.KeyLock`) adds a claim object in the bucket, so that machines
sharing the bucket compute a key once (:meth:`Bucket.claim`).

Trust: an entry in a bucket was written by whoever may write the bucket, which jaxaot cannot
see; a bucket store is used only when the command line says so (``store.trust=true``, or
``JAXAOT_TRUST_STORE=1``), else the run is refused in one line before any work. The cache folder
is checked as every local store is (``store.trust=true`` from the command line covers the
bucket; the cache's permissions are still checked unless ``JAXAOT_TRUST_STORE=1``).

A bucket that fails (unreachable, credentials refused, timeouts) costs one warning; the run goes
on with the local cache alone, which serves what it holds and caches what this process
computes, and nothing more is asked of the bucket by this process.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxaot.errors import StoreError
from jaxaot.store.bucket import Bucket, BucketDown, Claim, is_bucket_url, parse_bucket_url
from jaxaot.store.cache import Store
from jaxaot.store.entries import MANIFEST_NAME, Refused, StoreEntry, entry_label
from jaxaot.util.fsio import TEMP_PREFIX, make_temp_dir, trust_from_env
from jaxaot.util.store_root import ENV_STORE_DIR, default_store_dir

log = logging.getLogger("jaxaot.store")

DEFAULT_LEASE_S = 60.0


class BucketStore(Store):
    """The store at ``bucket`` with the local store at ``cache_root`` in front."""

    def __init__(
        self,
        bucket: Bucket,
        cache_root: str | Path,
        enabled: bool = True,
        trust: bool | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        super().__init__(cache_root, enabled=enabled, trust=None)  # the cache: $JAXAOT_TRUST_STORE
        self.bucket = bucket
        self.bucket_trusted = trust_from_env() if trust is None else trust
        self.lease_s = lease_s
        self._down: str | None = None  # why the bucket is no longer asked (warned once)

    def __repr__(self) -> str:
        return f"BucketStore({self.bucket.url.url!r}, cache={str(self.root)!r})"

    @property
    def location(self) -> str:
        return self.bucket.url.url

    @property
    def bucket_usable(self) -> bool:
        return self.enabled and self._down is None and self.bucket_trusted

    def check_trusted(self) -> None:
        if self.enabled and not self.bucket_trusted:
            raise StoreError(
                f"store at {self.location} is not safe to load executables from unless you say "
                "so: anyone who may write the bucket could hand this process a pickle, and "
                "jaxaot cannot see who may; set store.trust=true on the command line (or "
                "JAXAOT_TRUST_STORE=1) if you trust every principal with write access to it"
            )
        super().check_trusted()

    def _bucket_failed(self, exc: BucketDown) -> None:
        if self._down is None:
            log.warning(
                "store bucket unusable (%s); this process goes on with the local cache at %s "
                "alone (results are not shared through the bucket)",
                exc,
                self.root,
            )
        self._down = str(exc)

    # -- get / put -----------------------------------------------------------------------------

    def get(
        self, stage: str, key: str, expect: Mapping[str, Any] | None = None
    ) -> StoreEntry | None:
        entry = super().get(stage, key, expect)
        if (
            entry is not None
            or not self.bucket_usable
            or self.entry_dir(stage, key) in self._skipped
        ):
            return entry
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = make_temp_dir(self.root, f"{TEMP_PREFIX}get-{stage}-{key[:12]}-")
        except OSError:
            return None  # the cache takes no writes: served neither from it nor through it
        try:
            try:
                fetched = self.bucket.fetch(stage, key, expect, into=tmp / "entry")
            except Refused as bad:
                self._refused(stage, key, bad)
                return None
            except BucketDown as exc:
                self._bucket_failed(exc)
                return None
            if fetched is None:
                log.debug("store miss: %s: not in %s", entry_label(stage, key), self.location)
                return None
            doc = fetched.doc
            placed = super().put(
                stage,
                key,
                files={name: fetched.folder / name for name in fetched.files},
                meta=doc["meta"],
                compute_seconds=float(doc["compute_seconds"]),
                compat=doc["compat"],
                created=float(doc["created"]),
            )
            log.debug(
                "store hit: %s: %d bytes from %s",
                entry_label(stage, key),
                fetched.bytes_read,
                self.location,
            )
            return None if placed is None else super().get(stage, key, expect)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _refused(self, stage: str, key: str, bad: Refused) -> None:
        if bad.incompatible:  # another jax/backend's entry under this key: not ours to remove
            log.warning(
                "store miss: %s: incompatible entry in %s: %s",
                entry_label(stage, key),
                self.location,
                bad.reason,
            )
            return
        try:
            self.bucket.remove(stage, key)
            outcome = "entry removed from the bucket"
        except BucketDown as exc:
            outcome = f"it could not be removed ({exc})"
        log.warning(
            "store miss: %s: corrupt entry in %s: %s; %s",
            entry_label(stage, key),
            self.location,
            bad.reason,
            outcome,
        )

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
        entry = super().put(stage, key, files, meta, compute_seconds, compat, created)
        if entry is None or not self.bucket_usable:
            return entry
        try:
            if self.bucket.has(stage, key):
                return entry
            manifest = (entry.dir / MANIFEST_NAME).read_bytes()
            payload = {name: (entry.dir / name, rec) for name, rec in entry.files.items()}
            if not self.bucket.upload(stage, key, manifest, payload):
                log.debug(
                    "store put: %s: another machine stored it in %s first",
                    entry_label(stage, key),
                    self.location,
                )
        except BucketDown as exc:
            self._bucket_failed(exc)
        except OSError as exc:  # our cache entry vanished meanwhile: the bucket just lacks it
            log.warning(
                "store put %s: not uploaded to %s: %s", entry_label(stage, key), self.location, exc
            )
        return entry

    def discard(self, stage: str, key: str, reason: str) -> str:
        """Remove the entry from the cache and the bucket: it verified, but cannot be used here
        (the same executable would fail on every machine of this kind)."""
        outcome = super().discard(stage, key, reason)
        if self.bucket_usable:
            try:
                self.bucket.remove(stage, key)
                outcome += f", and from {self.location}"
            except BucketDown as exc:
                self._bucket_failed(exc)
        return outcome

    # -- claims (KeyLock) ------------------------------------------------------------------------

    def claim(self, stage: str, key: str, blocking: bool) -> Claim | str | None:
        """The bucket claim :class:`~jaxaot.store.locks.KeyLock` takes beside its local lock:
        a :class:`Claim`, None (no claim needed, or the bucket is not used), or ``"busy"``."""
        if not self.bucket_usable or self.read_only:
            return None
        if self.entry_dir(stage, key).is_dir():
            return None  # in the cache already: a local hit needs no claim
        try:
            return self.bucket.claim(stage, key, blocking=blocking, lease_s=self.lease_s)
        except BucketDown as exc:
            self._bucket_failed(exc)
            return None


def store_location(configured: str | None) -> str | Path:
    """``store.dir`` if set, else ``$JAXAOT_STORE_DIR``, else the default folder: a bucket URL
    as a string, a folder as a Path."""
    if configured is not None and str(configured) != "":
        where = str(configured)
    else:
        where = os.environ.get(ENV_STORE_DIR, "")
        if not where:
            return default_store_dir()
    return where.strip() if is_bucket_url(where) else Path(where).expanduser()


def cache_location(cache_dir: str | None) -> Path:
    """``store.cache_dir`` if set, else the local store (``$JAXAOT_STORE_DIR`` when that is a
    folder, else the default one)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(ENV_STORE_DIR, "")
    return Path(env).expanduser() if env and not is_bucket_url(env) else default_store_dir()


def open_store(
    configured: str | None,
    cache_dir: str | None = None,
    enabled: bool = True,
    trust: bool | None = None,
    lease_s: float = DEFAULT_LEASE_S,
) -> Store:
    """The store ``store.*`` describes: a :class:`Store` on a folder, a :class:`BucketStore`
    on a bucket URL (its library imported now, MissingDependencyError naming the extra)."""
    where = store_location(configured)
    if isinstance(where, Path):
        return Store(where, enabled=enabled, trust=trust)
    url = parse_bucket_url(where, "store.dir" if configured else ENV_STORE_DIR)
    bucket = Bucket(url) if enabled else None
    if bucket is None:
        return Store(cache_location(cache_dir), enabled=False, trust=trust)
    return BucketStore(bucket, cache_location(cache_dir), enabled, trust, lease_s)


__all__ = ["DEFAULT_LEASE_S", "BucketStore", "cache_location", "open_store", "store_location"]
