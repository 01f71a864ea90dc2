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

A claim holds its holder's lease (``lease_s``, 1-600 s) and a heartbeat count; its holder
rewrites it every ``lease_s / 4`` seconds, and a waiter takes it over only after it went the
holder's own lease without a change. On S3 the heartbeat, the release and the takeover are
conditional on the claim's ETag (``If-Match``): a holder that was taken over neither renews nor
deletes the new holder's claim, and of two waiters taking over one claim one wins. gcsfs offers
no such condition for an overwrite: there a release deletes the claim only when it still names
its holder (read, then delete), and a takeover deletes the stale claim and creates a new one;
two machines may then compute one key, never store a wrong or torn entry.

Every request is bounded: botocore connects within 3 s and reads within 10 s, without retries
(s3fs's own retries off too), and each manifest, claim or listing request has a 30 s wall-clock
deadline. A bucket that stops answering therefore costs one timeout (at most ~10 s) before it
is marked down; a process asks nothing more of a bucket it marked down (no heartbeats, no
releases). Credentials that may read but not write (``AccessDenied`` on a put) stop this
process's claims and uploads; its reads go on.

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
# A claim's lease (seconds): what store.lease_s may be, and what a waiter reads in a claim.
MIN_LEASE_S, MAX_LEASE_S = 1.0, 600.0
# botocore's own limits for jaxaot's client, so that an unreachable or silent endpoint fails in
# seconds (its defaults: 60 s to connect, 60 s to read, 5 attempts in all; s3fs retries 5 times
# more). total_max_attempts counts the first attempt (max_attempts would count retries);
# a user's fsspec settings (FSSPEC_S3_CONFIG_KWARGS, ~/.config/fsspec) win key by key.
_S3_CLIENT: dict[str, Any] = {
    "connect_timeout": 3,
    "read_timeout": 10,
    "retries": {"total_max_attempts": 1, "mode": "standard"},
}
# The wall-clock deadline of one small request (a manifest, a claim, an object's info, a
# listing page's worth), whatever the client's own timeouts: fsspec's sync(timeout=...).
OP_TIMEOUT_S = 30.0


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
        if protocol == "s3":
            user = fsspec.config.conf.get("s3", {}).get("config_kwargs") or {}
            options["config_kwargs"] = {**_S3_CLIENT, **user}
        fs = _FILESYSTEMS[key] = fsspec.filesystem(protocol, **options)
        if protocol == "s3":
            fs.retries = 1  # s3fs retries a timed-out request 5 times by default
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


class WritesDenied(BucketDown):
    """The bucket refused a write (``AccessDenied``): reads may still be served."""


class CacheFault(Exception):
    """Writing a downloaded object into the local cache failed (a full disk, a quota): the
    cache's fault, not the bucket's."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(f"{exc.strerror or exc}")
        self.exc = exc


_CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict")


def _is_conflict(exc: BaseException) -> bool:
    """A conditional write that lost (S3 412 PreconditionFailed, 409 ConditionalRequestConflict;
    GCS 412): the object exists or changed."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, FileExistsError):
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if err.get("Code") in _CONFLICT_CODES or status in (409, 412):
                return True
        if getattr(seen, "code", None) in (409, 412) or any(
            c in str(seen) for c in _CONFLICT_CODES
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
    thread rewrites it every ``lease_s / 4`` seconds so that waiters see it is alive. ``etag``
    is the claim object's version as this process last wrote it (None: not known)."""

    def __init__(self, bucket: Bucket, path: str, lease_s: float, etag: str | None) -> None:
        self.bucket, self.path, self.lease_s = bucket, path, lease_s
        self.etag = etag
        self.lost = False  # another machine took the claim over
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(lease_s / 4,), name="jaxaot-claim", daemon=True
        )
        self._thread.start()

    def _beat(self, every: float) -> None:
        n = 0
        while not self._stop.wait(every) and self.bucket.down is None:
            n += 1
            try:
                self.etag = self.bucket.renew(self.path, n, self.lease_s, self.etag)
            except FileExistsError:  # the claim is another machine's now
                self.lost = True
                log.warning(
                    "the claim %s was taken over by another machine (this one was too slow to "
                    "renew it); both may compute it",
                    self.path,
                )
                return
            except Exception:  # a missed beat: a waiter may take over later
                continue

    def release(self) -> None:
        self._stop.set()
        if self.bucket.down is None:  # a beat under way ends within its request's timeouts
            self._thread.join(timeout=5)
        if self.lost or self.bucket.down is not None:
            return
        with contextlib.suppress(Exception):
            self.bucket.unclaim(self.path, self.etag)


BUSY = "busy"  # claim(): another machine holds it and the caller would not wait


class Bucket:
    """The entries under one bucket prefix. Methods raise :class:`BucketDown` for a bucket that
    cannot be used and :class:`Refused` for an entry that must not be."""

    def __init__(self, url: BucketUrl, fs: Any | None = None) -> None:
        self.url = url
        self._fs = fs
        self.down: str | None = None  # why this process asks the bucket nothing more
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

    @property
    def _s3(self) -> bool:
        return self.url.scheme == "s3"

    def _call(
        self, what: str, fn: Callable[[], Any], *, write: bool = False, conditional: bool = False
    ) -> Any:
        """``fn()``; FileNotFoundError passes, and FileExistsError (for a ``conditional`` write
        also a 409/412 conflict); a refused ``write`` is :class:`WritesDenied`; anything else
        is :class:`BucketDown` and marks the bucket down for this process."""
        if self.down is not None:
            raise BucketDown(self.down)
        try:
            return fn()
        except (FileNotFoundError, FileExistsError, MissingDependencyError, CacheFault):
            raise
        except Exception as exc:  # botocore, aiohttp, google-auth, OSError, timeouts
            if conditional and _is_conflict(exc):
                raise FileExistsError(str(exc)) from exc
            why = f"{what} {self.url.url}: {type(exc).__name__}: {exc}"
            if write and isinstance(exc, PermissionError):
                raise WritesDenied(why) from exc
            if not isinstance(exc, PermissionError):
                self.down = why
            raise BucketDown(why) from exc

    # -- read --------------------------------------------------------------------------------

    def read_manifest(self, stage: str, key: str) -> bytes | None:
        ahead = self._read_ahead.pop((stage, key), None)
        if ahead is not None:  # claim() read it a moment ago, to find the key stored
            return ahead
        path = f"{self.entry_path(stage, key)}/{MANIFEST_NAME}"
        try:
            raw: bytes = self._call(
                "reading", lambda: self.fs.cat_file(path, timeout=OP_TIMEOUT_S, **self._whole)
            )
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
        try:
            into.mkdir()
        except OSError as exc:
            raise CacheFault(exc) from exc
        total = len(raw)
        small = {
            self.payload_path(stage, key, n, r): n for n, r in records.items() if r.size <= _SMALL
        }
        if small:  # fetched concurrently: one round trip for all of them
            paths = list(small)
            # Each read stops one byte past the recorded size: an object larger than its
            # record is refused without reading it whole.
            ends = [records[small[p]].size + 1 for p in paths]
            got = self._call(
                "downloading from",
                lambda: self.fs.cat_ranges(
                    paths, [0] * len(paths), ends, on_error="return", **self._whole
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
                try:
                    with open(into / name, "xb") as out:
                        out.write(data)
                except OSError as exc:
                    raise CacheFault(exc) from exc
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
            try:
                out = open(dest, "xb")  # noqa: SIM115 - closed below
            except OSError as exc:
                raise CacheFault(exc) from exc
            with out, self.fs.open(src, "rb", block_size=_CHUNK) as f:
                while size <= rec.size and (chunk := f.read(_CHUNK)):
                    try:
                        out.write(chunk)
                    except OSError as exc:
                        raise CacheFault(exc) from exc
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
        try:
            self._call("checking", lambda: self.fs.info(path, timeout=OP_TIMEOUT_S))
        except FileNotFoundError:
            return False
        return True

    def upload(
        self, stage: str, key: str, manifest: bytes, files: Mapping[str, tuple[Path, FileRecord]]
    ) -> bool:
        """Put an entry: every payload object, then ``manifest`` with a conditional write.
        True when ours is the entry now, False when another writer's manifest was there first
        (then our payload objects it does not name are deleted)."""
        try:
            for name, (local, rec) in files.items():
                dest = self.payload_path(stage, key, name, rec)
                self._call(
                    "uploading to",
                    functools.partial(self.fs.put_file, str(local), dest),
                    write=True,
                )
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
        self._call(
            "writing to",
            lambda: self.fs.pipe_file(path, manifest, mode="create", timeout=OP_TIMEOUT_S),
            write=True,
            conditional=True,
        )

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
                    self.fs.rm_file(self.payload_path(stage, key, name, rec), timeout=OP_TIMEOUT_S)

    def remove(self, stage: str, key: str) -> None:
        """Delete an entry: its manifest first (it is then invisible), then the payload objects
        that manifest named, each by name (objects it did not name, e.g. another writer's
        upload under way, stay; gc collects leftovers). A manifest that cannot be parsed is
        deleted alone: its payload is left for gc."""
        base = self.entry_path(stage, key)
        raw = self.read_manifest(stage, key)
        named: list[str] = []
        if raw is not None:
            with contextlib.suppress(Refused):
                doc = parse_manifest(raw, stage, key)
                named = [f"{base}/{r['sha256']}/{n}" for n, r in doc["files"].items()]
        for path in [f"{base}/{MANIFEST_NAME}", *named]:
            with contextlib.suppress(FileNotFoundError):
                self._call(
                    "deleting from",
                    functools.partial(self.fs.rm_file, path, timeout=OP_TIMEOUT_S),
                    write=True,
                )

    # -- claims: one computation per key across machines ---------------------------------------

    def claim_body(self, beat: int = 0, lease_s: float = MAX_LEASE_S) -> bytes:
        return json.dumps(
            {"owner": self.owner, "beat": beat, "t": time.time(), "lease_s": lease_s}
        ).encode()

    def _etag(self, response: Any) -> str | None:
        """The version a put returned (s3fs's put_object response), when it says."""
        if isinstance(response, dict):
            tag = response.get("ETag") or response.get("etag") or response.get("generation")
            return str(tag) if tag else None
        return None

    def _put_claim(self, path: str, body: bytes, *, if_match: str | None) -> str | None:
        """Write the claim object: created only when absent (``if_match`` None), else
        overwritten only while its version is still ``if_match`` (S3; other backends
        overwrite). FileExistsError when the condition fails; the new version when known."""
        if if_match is None:
            out = self._call(
                "claiming in",
                lambda: self.fs.pipe_file(path, body, mode="create", timeout=OP_TIMEOUT_S),
                write=True,
                conditional=True,
            )
        elif self._s3:
            bucket, _, key = path.partition("/")
            out = self._call(
                "claiming in",
                lambda: self.fs.call_s3(
                    "put_object",
                    Bucket=bucket,
                    Key=key,
                    Body=body,
                    IfMatch=if_match,
                    timeout=OP_TIMEOUT_S,
                ),
                write=True,
                conditional=True,
            )
        else:
            out = self._call(
                "claiming in",
                lambda: self.fs.pipe_file(path, body, timeout=OP_TIMEOUT_S),
                write=True,
            )
        return self._etag(out)

    def renew(self, path: str, beat: int, lease_s: float, etag: str | None) -> str | None:
        """Rewrite the claim at ``path`` as its holder (a heartbeat); FileExistsError when it
        is no longer the version this holder wrote (taken over)."""
        if etag is None and self._s3:
            etag = self._claim_version(path)
        return self._put_claim(path, self.claim_body(beat, lease_s), if_match=etag or "*")

    def unclaim(self, path: str, etag: str | None) -> None:
        """Delete the claim at ``path`` if it is still the version this holder wrote (S3:
        a conditional delete; elsewhere: when its body still names this process)."""
        if self._s3 and etag is not None:
            bucket, _, key = path.partition("/")
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                self._call(
                    "releasing a claim in",
                    lambda: self.fs.call_s3(
                        "delete_object",
                        Bucket=bucket,
                        Key=key,
                        IfMatch=etag,
                        timeout=OP_TIMEOUT_S,
                    ),
                    write=True,
                    conditional=True,
                )
            return
        try:
            raw = self._call("reading", lambda: self.fs.cat_file(path, timeout=OP_TIMEOUT_S))
        except FileNotFoundError:
            return
        if _claim_doc(raw).get("owner") == self.owner:
            with contextlib.suppress(FileNotFoundError):
                self._call(
                    "releasing a claim in",
                    lambda: self.fs.rm_file(path, timeout=OP_TIMEOUT_S),
                    write=True,
                )

    def _claim_version(self, path: str) -> str | None:
        info = self._call("checking", lambda: self.fs.info(path, timeout=OP_TIMEOUT_S))
        tag = info.get("ETag") or info.get("etag") or info.get("generation")
        return str(tag) if tag else None

    def claim(self, stage: str, key: str, *, blocking: bool, lease_s: float) -> Claim | str | None:
        """Claim (stage, key) for this process: a :class:`Claim` to release after the put;
        None when the entry is in the bucket already (the caller will hit it); :data:`BUSY`
        when another machine holds the claim and ``blocking`` is False. Blocking, it waits until
        the holder's entry appears, the holder releases, or the claim goes the holder's lease
        (the ``lease_s`` written in it, at most :data:`MAX_LEASE_S`) without a heartbeat (a
        holder that died: the claim is then taken over by a conditional overwrite)."""
        lease_s = min(max(float(lease_s), MIN_LEASE_S), MAX_LEASE_S)
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
                self._served_after_wait(stage, key, waited_from)
                return None
            try:
                etag = self._put_claim(path, self.claim_body(0, lease_s), if_match=None)
            except FileExistsError:
                pass
            except FileNotFoundError as exc:  # a write finds no bucket
                raise BucketDown(f"claiming in {self.url.url}: {exc}") from exc
            else:
                return self._won(Claim(self, path, lease_s, etag), stage, key, waited_from)
            if not blocking:
                return BUSY
            try:
                version = self._claim_version(path) or ""
                body = self._call("reading", lambda: self.fs.cat_file(path, timeout=OP_TIMEOUT_S))
            except FileNotFoundError:
                continue  # released just now
            now = time.perf_counter()
            if seen is None or seen[0] != version:
                seen = (version, now)
            elif now - seen[1] > (held := _holder_lease(body)):
                taken = self._take_over(path, version, lease_s)
                if taken is not None:
                    won = self._won(taken, stage, key, waited_from)
                    if won is not None:
                        log.warning(
                            "[%s] the claim on %s in %s had no heartbeat for %.0f s, its "
                            "holder's lease (its holder died?); computing it here",
                            stage,
                            key[:12],
                            self.url.url,
                            held,
                        )
                    return won
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

    def _won(self, claim: Claim, stage: str, key: str, waited_from: float | None) -> Claim | None:
        """``claim``, just won; None (the claim released) when this process waited for another
        holder and its entry is there now: the holder puts its entry, then releases, and both
        may fall between our last look and our claim (or a slow holder's put, our take-over)."""
        if waited_from is None:
            return claim
        try:
            served = self.has(stage, key)
        except BaseException:
            claim.release()
            raise
        if not served:
            return claim
        claim.release()
        self._served_after_wait(stage, key, waited_from)
        return None

    def _served_after_wait(self, stage: str, key: str, waited_from: float) -> None:
        log.info(
            "[%s] %s was computed on another machine (waited %.2f s)",
            stage,
            key[:12],
            time.perf_counter() - waited_from,
        )

    def _take_over(self, path: str, version: str, lease_s: float) -> Claim | None:
        """Replace the stale claim of version ``version`` with ours; None when another
        machine changed it first."""
        body = self.claim_body(0, lease_s)
        try:
            if self._s3 and version:
                etag = self._put_claim(path, body, if_match=version)
            else:  # no conditional overwrite: delete, then create (two may both win)
                with contextlib.suppress(FileNotFoundError):
                    self._call(
                        "deleting from",
                        lambda: self.fs.rm_file(path, timeout=OP_TIMEOUT_S),
                        write=True,
                    )
                etag = self._put_claim(path, body, if_match=None)
        except (FileExistsError, FileNotFoundError):
            return None
        # On S3 a renewal is conditional on this version (read again if the reply had none).
        return Claim(self, path, lease_s, etag if self._s3 else None)


def _claim_doc(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _holder_lease(raw: bytes) -> float:
    """The lease a claim's holder wrote in it, within [MIN_LEASE_S, MAX_LEASE_S]; the maximum
    when it says none (a waiter's own lease never decides whether a holder is alive)."""
    value = _claim_doc(raw).get("lease_s")
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return MAX_LEASE_S
    return min(max(float(value), MIN_LEASE_S), MAX_LEASE_S)


__all__ = [
    "BUSY",
    "CLAIMS_DIR",
    "MAX_LEASE_S",
    "MIN_LEASE_S",
    "OP_TIMEOUT_S",
    "SCHEMES",
    "Bucket",
    "BucketDown",
    "BucketUrl",
    "CacheFault",
    "Claim",
    "Fetched",
    "WritesDenied",
    "filesystem",
    "is_bucket_url",
    "parse_bucket_url",
]
