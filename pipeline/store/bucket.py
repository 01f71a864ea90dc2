"""A store kept in an object-storage bucket (``s3://bucket/prefix``, ``gs://bucket/prefix``),
read and written through fsspec (s3fs, gcsfs: the extras ``jaxaot[s3]``, ``jaxaot[gcs]``).

Layout under the prefix (``v1`` is :data:`~jaxaot.store.entries.STORE_FORMAT_VERSION`)::

    v1/<stage>/<key[:2]>/<key>/entry.json          manifest: the local store's, written last
    v1/<stage>/<key[:2]>/<key>/<sha256>/<file>     payload, named by its content
    claims/<stage>/<key>                           a machine computing that key now

An entry is visible once its ``entry.json`` exists, and that object is written last, after
every payload object, with a conditional put (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``
through fsspec's ``mode="create"``): of two machines that put one key, one manifest wins and the
other's payload is deleted. Payload objects are named by their sha256, so two writers never
overwrite each other's bytes, and a manifest only ever names payload that was uploaded before
it. A put killed halfway leaves payload without a manifest: invisible, and removed by
``jaxaot-store gc`` once older than its grace period.

A backend that ignores the condition (some S3-compatible servers) lets both manifests through,
the last one staying; each names its own payload, so the entry is still whole, only computed
twice. The same holds for claims: without a conditional write two machines may both compute a
key; never is an entry wrong or torn.

Every read is verified as the local store's are: the manifest is parsed and checked for its
format version, stage, key and compat, and each payload object is hashed while it is
downloaded, before anything is written into the local cache (:mod:`jaxaot.store.tiered`), which
verifies it again on every read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.errors import ConfigError, MissingDependencyError
from jaxaot.store.entries import (
    MANIFEST_NAME,
    STORE_FORMAT_VERSION,
    FileRecord,
    Refused,
    check_key,
    check_stage,
    compat_diff,
    parse_manifest,
)

log = logging.getLogger("jaxaot.store")

# scheme -> (fsspec protocol, the module that implements it, the jaxaot extra that installs it)
SCHEMES: dict[str, tuple[str, str, str]] = {
    "s3": ("s3", "s3fs", "s3"),
    "gs": ("gcs", "gcsfs", "gcs"),
    "gcs": ("gcs", "gcsfs", "gcs"),
}
CLAIMS_DIR = "claims"
_URL_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)")
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,221}[A-Za-z0-9]")
_CHUNK = 8 << 20
# Payload objects up to this size are downloaded together (concurrently) into memory; larger
# ones are streamed to disk one at a time.
_SMALL = 64 << 20
# Waiting for a claim's holder: poll the manifest this often (seconds), growing to the max.
_POLL_S, _POLL_MAX_S = 0.2, 2.0
# botocore's own limits for jaxaot's client, so that an unreachable endpoint fails in seconds
# (its defaults: 60 s to connect, 60 s to read, retried); a user's FSSPEC_S3_* settings win.
_S3_CLIENT = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}


def is_bucket_url(location: object) -> bool:
    """Whether ``location`` (store.dir) names a bucket rather than a folder: ``<scheme>://...``."""
    return isinstance(location, str) and _URL_RE.fullmatch(location.strip()) is not None


@dataclass(frozen=True)
class BucketUrl:
    """``<scheme>://<bucket>/<prefix>``, checked."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.root}"

    @property
    def root(self) -> str:
        """The prefix as fsspec names it: ``bucket/prefix`` (no scheme)."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    @property
    def extra(self) -> str:
        return SCHEMES[self.scheme][2]

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])


def parse_bucket_url(location: str, key: str = "store.dir") -> BucketUrl:
    """The bucket ``location`` names; a one-line :class:`ConfigError` naming ``key`` otherwise."""
    m = _URL_RE.fullmatch(location.strip())
    if m is None:
        raise ConfigError(f"{key}={location}: expected s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{key}={location}: expected a folder or a bucket URL (s3://, gs://), found the "
            f"scheme {scheme}://; use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    bucket, _, prefix = rest.partition("/")
    parts = [p for p in prefix.split("/") if p]
    if not _BUCKET_RE.fullmatch(bucket) or any(p in (".", "..") for p in parts):
        raise ConfigError(
            f"{key}={location}: expected {scheme}://BUCKET/PREFIX with a bucket name of 3-63 "
            "letters, digits, '.', '-', '_' and a prefix without '.' or '..' segments; fix the URL"
        )
    return BucketUrl(scheme, bucket, "/".join(parts))


def filesystem(url: BucketUrl) -> Any:
    """The fsspec filesystem for ``url``; MissingDependencyError naming the extra when its
    library is not installed. Credentials, endpoint and region come from the library's usual
    places (``AWS_*`` variables, ``~/.aws``, ``AWS_ENDPOINT_URL_S3``; Google's application default
    credentials) and fsspec's configuration (``FSSPEC_S3_ENDPOINT_URL=...``)."""
    protocol, module, extra = SCHEMES[url.scheme]
    try:
        importlib.import_module(module)
        import fsspec
    except ImportError:
        raise MissingDependencyError(
            f"store.dir={url.url} needs {module}, which is not installed; install it with: "
            f"pip install 'jaxaot[{extra}]'"
        ) from None
    # One per process and environment: a client takes a few hundred ms to make (botocore loads
    # its service model), and its credentials and endpoint come from the variables.
    key = (protocol, os.getpid(), tuple(sorted(_client_env().items())))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
        if protocol == "s3" and "config_kwargs" not in fsspec.config.conf.get("s3", {}):
            options["config_kwargs"] = dict(_S3_CLIENT)
        fs = _FILESYSTEMS[key] = fsspec.filesystem(protocol, **options)
    return fs


_FILESYSTEMS: dict[tuple[str, int, tuple[tuple[str, str], ...]], Any] = {}
_CLIENT_ENV = ("AWS_", "FSSPEC_", "GOOGLE_", "GCLOUD_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST")


def _client_env() -> dict[str, str]:
    """The variables a bucket client reads (credentials, endpoint, region, fsspec's options)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_CLIENT_ENV)}


def _check(name: str, size: int, sha256: str, rec: FileRecord) -> None:
    """Refused unless ``size`` and ``sha256`` are what ``rec`` says."""
    if size != rec.size:
        raise Refused(f"{name!r} is {size} bytes, manifest says {rec.size}")
    if sha256 != rec.sha256:
        raise Refused(f"{name!r} sha256 {sha256[:16]} does not match manifest {rec.sha256[:16]}")


class BucketDown(Exception):
    """The bucket could not be reached or refused the request (not: an object is absent)."""


@dataclass(frozen=True)
class Fetched:
    """A verified entry downloaded into ``folder``: its manifest bytes and payload records."""

    doc: Mapping[str, Any]
    manifest: bytes
    folder: Path
    files: Mapping[str, FileRecord]
    bytes_read: int


class Claim:
    """This process computes (stage, key) for every machine: the claim object exists, and a
    thread rewrites it every ``lease_s / 4`` seconds so that waiters see it is alive."""

    def __init__(self, bucket: Bucket, path: str, lease_s: float) -> None:
        self.bucket, self.path = bucket, path
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(lease_s / 4,), name="jaxaot-claim", daemon=True
        )
        self._thread.start()

    def _beat(self, every: float) -> None:
        n = 0
        while not self._stop.wait(every):
            n += 1
            with contextlib.suppress(Exception):  # a missed beat: a waiter may take over later
                self.bucket.fs.pipe_file(self.path, self.bucket.claim_body(n))

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.bucket.fs.rm_file(self.path)


BUSY = "busy"  # claim(): another machine holds it and the caller would not wait


class Bucket:
    """The entries under one bucket prefix. Methods raise :class:`BucketDown` for a bucket that
    cannot be used and :class:`Refused` for an entry that must not be."""

    def __init__(self, url: BucketUrl, fs: Any | None = None) -> None:
        self.url = url
        self._fs = fs
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.bytes_down = 0  # payload and manifests downloaded by this process
        self._read_ahead: dict[tuple[str, str], bytes] = {}  # claim() -> the next fetch()
        # s3fs asks an object's size (a request) before it reads one whole, unless told to read
        # it in one piece.
        self._whole: dict[str, Any] = {"max_concurrency": 1} if url.scheme == "s3" else {}
        self.bytes_up = 0

    def __repr__(self) -> str:
        return f"Bucket({self.url.url!r})"

    @property
    def fs(self) -> Any:
        """The filesystem, made on first use: a run whose hits are all in the local cache never
        imports the bucket's library (s3fs and botocore take most of a second)."""
        if self._fs is None:
            self._fs = filesystem(self.url)
        return self._fs

    def entry_path(self, stage: str, key: str) -> str:
        check_stage(stage)
        check_key(key)
        return self.url.path(f"v{STORE_FORMAT_VERSION}", stage, key[:2], key)

    def claim_path(self, stage: str, key: str) -> str:
        return self.url.path(CLAIMS_DIR, check_stage(stage), check_key(key))

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; FileNotFoundError and FileExistsError pass, anything else is BucketDown."""
        try:
            return fn()
        except (FileNotFoundError, FileExistsError, MissingDependencyError):
            raise
        except Exception as exc:  # botocore, aiohttp, google-auth, OSError: all mean "down"
            raise BucketDown(f"{what} {self.url.url}: {type(exc).__name__}: {exc}") from exc

    # -- read --------------------------------------------------------------------------------

    def read_manifest(self, stage: str, key: str) -> bytes | None:
        ahead = self._read_ahead.pop((stage, key), None)
        if ahead is not None:  # claim() read it a moment ago, to find the key stored
            return ahead
        path = f"{self.entry_path(stage, key)}/{MANIFEST_NAME}"
        try:
            raw: bytes = self._call("reading", lambda: self.fs.cat_file(path, **self._whole))
        except FileNotFoundError:
            return None
        self.bytes_down += len(raw)
        return raw

    def fetch(
        self, stage: str, key: str, expect: Mapping[str, Any] | None, into: Path
    ) -> Fetched | None:
        """Download the entry for (stage, key) into the new folder ``into``, verifying every
        payload object's size and sha256 as it arrives; None when the bucket has no such entry.
        Refused: corrupt (a bad manifest, a missing or altered payload object) or, with
        ``incompatible``, written under another compat dict."""
        raw = self.read_manifest(stage, key)
        if raw is None:
            return None
        doc = parse_manifest(raw, stage, key)
        if expect is not None:
            diff = compat_diff(doc["compat"], expect)
            if diff:
                raise Refused(f"compat mismatch: {diff}", incompatible=True)
        records = {n: FileRecord(r["sha256"], r["size"]) for n, r in doc["files"].items()}
        into.mkdir()
        total = len(raw)
        small = {
            self.payload_path(stage, key, n, r): n for n, r in records.items() if r.size <= _SMALL
        }
        if small:  # fetched concurrently: one round trip for all of them
            paths = list(small)
            got = self._call(
                "downloading from",
                lambda: self.fs.cat_ranges(
                    paths,
                    [None] * len(paths),
                    [None] * len(paths),
                    on_error="return",
                    **self._whole,
                ),
            )
            for path, data in zip(paths, got, strict=True):
                name = small[path]
                if isinstance(data, FileNotFoundError) or data is None:
                    raise Refused(f"{name!r} is missing (manifest without payload)")
                if isinstance(data, BaseException):
                    raise BucketDown(f"downloading from {self.url.url}: {data!r}")
                self.bytes_down += len(data)
                _check(name, len(data), hashlib.sha256(data).hexdigest(), records[name])
                with open(into / name, "xb") as out:
                    out.write(data)
                total += len(data)
        for name, rec in records.items():
            if rec.size > _SMALL:
                total += self._download(self.payload_path(stage, key, name, rec), into / name, rec)
        return Fetched(doc, raw, into, records, total)

    def payload_path(self, stage: str, key: str, name: str, rec: FileRecord) -> str:
        return f"{self.entry_path(stage, key)}/{rec.sha256}/{name}"

    def _download(self, src: str, dest: Path, rec: FileRecord) -> int:
        """Stream ``src`` into ``dest`` hashing it; Refused unless it is ``rec`` exactly."""
        name = dest.name
        h = hashlib.sha256()
        size = 0

        def copy() -> None:
            nonlocal size
            with self.fs.open(src, "rb", block_size=_CHUNK) as f, open(dest, "xb") as out:
                while size <= rec.size and (chunk := f.read(_CHUNK)):
                    out.write(chunk)
                    h.update(chunk)
                    size += len(chunk)

        try:
            self._call("downloading from", copy)
        except FileNotFoundError:
            raise Refused(f"{name!r} is missing (manifest without payload)") from None
        self.bytes_down += size
        _check(name, size, h.hexdigest(), rec)
        return size

    # -- write -------------------------------------------------------------------------------

    def has(self, stage: str, key: str) -> bool:
        path = f"{self.entry_path(stage, key)}/{MANIFEST_NAME}"
        return bool(self._call("checking", lambda: self.fs.exists(path)))

    def upload(
        self, stage: str, key: str, manifest: bytes, files: Mapping[str, tuple[Path, FileRecord]]
    ) -> bool:
        """Put an entry: every payload object, then ``manifest`` with a conditional write.
        True when ours is the entry now, False when another writer's manifest was there first
        (then our payload objects it does not name are deleted)."""
        try:
            for name, (local, rec) in files.items():
                dest = self.payload_path(stage, key, name, rec)
                self._call("uploading to", functools.partial(self.fs.put_file, str(local), dest))
                self.bytes_up += rec.size
            self._put_manifest(stage, key, manifest)
        except FileNotFoundError as exc:  # a write finds no bucket
            raise BucketDown(f"uploading to {self.url.url}: {exc}") from exc
        except FileExistsError:
            self._drop_loser_payload(stage, key, files)
            return False
        self.bytes_up += len(manifest)
        return True

    def _put_manifest(self, stage: str, key: str, manifest: bytes) -> None:
        path = f"{self.entry_path(stage, key)}/{MANIFEST_NAME}"
        self._call("writing to", lambda: self.fs.pipe_file(path, manifest, mode="create"))

    def _drop_loser_payload(
        self, stage: str, key: str, files: Mapping[str, tuple[Path, FileRecord]]
    ) -> None:
        try:
            raw = self.read_manifest(stage, key)
            theirs = (
                set() if raw is None else {r["sha256"] for r in json.loads(raw)["files"].values()}
            )
        except (BucketDown, ValueError, KeyError, TypeError, AttributeError):
            return  # left for gc: unreferenced payload past its grace period
        for name, (_, rec) in files.items():
            if rec.sha256 not in theirs:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(self.payload_path(stage, key, name, rec))

    def remove(self, stage: str, key: str) -> None:
        """Delete an entry: its manifest first (it is then invisible), then its payload."""
        base = self.entry_path(stage, key)
        with contextlib.suppress(FileNotFoundError):
            self._call("deleting from", lambda: self.fs.rm_file(f"{base}/{MANIFEST_NAME}"))
        with contextlib.suppress(FileNotFoundError):
            self._call("deleting from", lambda: self.fs.rm(base, recursive=True))

    # -- claims: one computation per key across machines ---------------------------------------

    def claim_body(self, beat: int = 0) -> bytes:
        return json.dumps({"owner": self.owner, "beat": beat, "t": time.time()}).encode()

    def claim(self, stage: str, key: str, *, blocking: bool, lease_s: float) -> Claim | str | None:
        """Claim (stage, key) for this process: a :class:`Claim` to release after the put;
        None when the entry is in the bucket already (the caller will hit it); :data:`BUSY`
        when another machine holds the claim and ``blocking`` is False. Blocking, it waits until
        the holder's entry appears, the holder releases, or the claim goes ``lease_s`` without a
        heartbeat (a holder that died: the claim is then taken over)."""
        path = self.claim_path(stage, key)
        seen: tuple[str, float] | None = None  # (the claim's version, when we first saw it)
        waited_from: float | None = None
        poll = _POLL_S
        while True:
            if waited_from is None:  # the entry, likely wanted next: read it, not just look
                raw = self.read_manifest(stage, key)
                if raw is not None:
                    self._read_ahead[(stage, key)] = raw
                    return None
            elif self.has(stage, key):
                if waited_from is not None:
                    log.info(
                        "[%s] %s was computed on another machine (waited %.2f s)",
                        stage,
                        key[:12],
                        time.perf_counter() - waited_from,
                    )
                return None
            try:
                self._call(
                    "claiming in", lambda: self.fs.pipe_file(path, self.claim_body(), mode="create")
                )
                return Claim(self, path, lease_s)
            except FileExistsError:
                pass
            except FileNotFoundError as exc:  # a write finds no bucket
                raise BucketDown(f"claiming in {self.url.url}: {exc}") from exc
            if not blocking:
                return BUSY
            try:
                info = self._call("checking", lambda: self.fs.info(path))
            except FileNotFoundError:
                continue  # released just now
            version = str(info.get("ETag") or info.get("etag") or info.get("generation") or info)
            now = time.perf_counter()
            if seen is None or seen[0] != version:
                seen = (version, now)
            elif now - seen[1] > lease_s:
                log.warning(
                    "[%s] the claim on %s in %s had no heartbeat for %.0f s (its holder died?); "
                    "computing it here",
                    stage,
                    key[:12],
                    self.url.url,
                    lease_s,
                )
                with contextlib.suppress(FileNotFoundError):
                    self._call("deleting from", lambda: self.fs.rm_file(path))
                seen = None
                continue
            if waited_from is None:
                waited_from = now
                log.info(
                    "[%s] %s is being computed on another machine (%s); waiting for it",
                    stage,
                    key[:12],
                    self.url.url,
                )
            time.sleep(poll)
            poll = min(poll * 1.5, _POLL_MAX_S)


__all__ = [
    "BUSY",
    "CLAIMS_DIR",
    "SCHEMES",
    "Bucket",
    "BucketDown",
    "BucketUrl",
    "Claim",
    "Fetched",
    "filesystem",
    "is_bucket_url",
    "parse_bucket_url",
]
