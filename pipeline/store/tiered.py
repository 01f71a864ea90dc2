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
see; a bucket is used only when the user's side names it, never a config (configs travel):
``JAXAOT_TRUST_STORE`` holds the bucket's URL or a prefix of it (``s3://team-bucket/jaxaot``;
several separated by commas), or ``store.dir=<the URL>`` and ``store.trust=true`` are both given
on the command line (:func:`jaxaot.config.trust.composed.check_store_bucket` refuses
``store.trust=true`` with a ``store.dir`` bucket from a config). Else the run is refused in one
line before any work. ``JAXAOT_TRUST_STORE=1`` is about folders and trusts no bucket. The cache
folder is checked as every local store is (its permissions, unless ``JAXAOT_TRUST_STORE=1``).

A bucket that fails (unreachable, silent, credentials refused) costs one warning; the run goes
on with the local cache alone, which serves what it holds and caches what this process
computes, and nothing more is asked of the bucket by this process. Credentials that may read
but not write cost one warning too: hits are still served from the bucket, and what this
process computes stays in its cache. A cache that cannot take a downloaded entry (a full disk)
costs one warning and that entry's hit.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxaot.errors import StoreError
from jaxaot.store.bucket import (
    Bucket,
    BucketDown,
    CacheFault,
    Claim,
    Fetched,
    WritesDenied,
    is_bucket_url,
    parse_bucket_url,
)
from jaxaot.store.cache import Store
from jaxaot.store.entries import MANIFEST_NAME, Refused, StoreEntry, entry_label
from jaxaot.util.fsio import ENV_TRUST as ENV_STORE
from jaxaot.util.fsio import TEMP_PREFIX, make_temp_dir
from jaxaot.util.store_root import ENV_STORE_DIR, bucket_trusted_by_env, default_store_dir

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
        self.bucket_trusted = bool(trust) or bucket_trusted_by_env(bucket.url.url)
        self.lease_s = lease_s
        self._down: str | None = None  # why the bucket is no longer asked (warned once)
        self._no_writes: str | None = None  # why nothing is written to it (warned once)
        self._cache_fault: str | None = None  # why a download found no room (warned once)

    def __repr__(self) -> str:
        return f"BucketStore({self.bucket.url.url!r}, cache={str(self.root)!r})"

    @property
    def location(self) -> str:
        return self.bucket.url.url

    @property
    def bucket_usable(self) -> bool:
        return (
            self.enabled and self._down is None and self.bucket.down is None and self.bucket_trusted
        )

    @property
    def bucket_writable(self) -> bool:
        return self.bucket_usable and self._no_writes is None and not self.read_only

    def check_trusted(self) -> None:
        if self.enabled and not self.bucket_trusted:
            raise StoreError(
                f"store.dir={self.location} is not trusted: anyone who may write the bucket "
                "could hand this process a pickle, and jaxaot cannot see who may; if you trust "
                f"every principal with write access to it, set {ENV_STORE}={self.location} "
                f"(or a prefix of it), or give store.dir={self.location} store.trust=true on "
                "the command line"
            )
        super().check_trusted()

    def _bucket_failed(self, exc: BucketDown) -> None:
        if isinstance(exc, WritesDenied):
            if self._no_writes is None:
                log.warning(
                    "store bucket %s takes no writes from this process (%s); hits are still "
                    "read from it, and what this process computes stays in the local cache %s",
                    self.location,
                    exc,
                    self.root,
                )
            self._no_writes = str(exc)
            return
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
                fetched = self._fetch(stage, key, expect, tmp)
            except BucketDown as exc:
                self._bucket_failed(exc)
                return None
            except CacheFault as exc:
                self._cache_failed(stage, key, exc)
                return None
            if fetched is None:
                return None
            doc = fetched.doc
            try:
                placed = super().put(
                    stage,
                    key,
                    files={name: fetched.folder / name for name in fetched.files},
                    meta=doc["meta"],
                    compute_seconds=float(doc["compute_seconds"]),
                    compat=doc["compat"],
                    created=float(doc["created"]),
                )
            except OSError as exc:
                self._cache_failed(stage, key, CacheFault(exc))
                return None
            log.debug(
                "store hit: %s: %d bytes from %s",
                entry_label(stage, key),
                fetched.bytes_read,
                self.location,
            )
            return None if placed is None else super().get(stage, key, expect)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _fetch(
        self, stage: str, key: str, expect: Mapping[str, Any] | None, tmp: Path
    ) -> Fetched | None:
        """The bucket's entry, verified, downloaded under ``tmp``; None on a miss. An entry
        refused as corrupt is read again from the bucket before anything is removed: a payload
        deleted or replaced while it was read (gc, another machine's repair) or a bad transfer
        is not corruption; the same refusal twice over the same manifest is."""
        try:
            return self._fetched(stage, key, expect, tmp / "entry")
        except Refused as bad:
            if bad.incompatible:  # another jax/backend's entry under this key: not ours
                log.warning(
                    "store miss: %s: incompatible entry in %s: %s",
                    entry_label(stage, key),
                    self.location,
                    bad.reason,
                )
                return None
            first = bad
        try:
            return self._fetched(stage, key, expect, tmp / "again")
        except Refused as bad:
            if not bad.incompatible and bad.reason == first.reason:
                self._refused(stage, key, bad)
            else:
                log.warning(
                    "store miss: %s: the entry in %s changed while it was read (%s); left as is",
                    entry_label(stage, key),
                    self.location,
                    bad.reason,
                )
            return None

    def _fetched(
        self, stage: str, key: str, expect: Mapping[str, Any] | None, into: Path
    ) -> Fetched | None:
        fetched = self.bucket.fetch(stage, key, expect, into=into)
        if fetched is None:
            log.debug("store miss: %s: not in %s", entry_label(stage, key), self.location)
        return fetched

    def _cache_failed(self, stage: str, key: str, exc: CacheFault) -> None:
        if self._cache_fault is None:
            log.warning(
                "store: %s from %s could not be written into the local cache %s (%s); it is "
                "computed here, and the bucket is still used",
                entry_label(stage, key),
                self.location,
                self.root,
                exc,
            )
        self._cache_fault = str(exc)

    def _refused(self, stage: str, key: str, bad: Refused) -> None:
        if not self.bucket_writable:
            outcome = "left in the bucket (this process does not write to it)"
        else:
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
        if entry is None or not self.bucket_writable:
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
        if self.bucket_writable:
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
        if not self.bucket_writable:
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


__all__ = [
    "DEFAULT_LEASE_S",
    "BucketStore",
    "cache_location",
    "open_store",
    "store_location",
]
