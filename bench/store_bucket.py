"""A store hit from a bucket vs from the bucket store's local cache vs from a local store.

Side by side in one run, against an S3-compatible server on loopback (moto's server mode, the
``testing`` extra; a real bucket adds its network round trips and bandwidth to the "bucket"
column, and each request of the count below costs one round trip):

- per hit, in this process, what the runner does for a cached stage (the per-key lock, which
  for a bucket store may claim the key in the bucket, then ``get``): median latency, bytes
  downloaded from the bucket and HTTP requests made, for a hit in a local store, a hit in the
  bucket store's local cache, and a hit that downloads the entry from the bucket into an empty
  cache (every store here checks its folders' permissions, as a run without
  ``JAXAOT_TRUST_STORE=1`` does; the bucket is trusted through ``store.trust=true``);
- the whole ``jaxaot`` process (``stop_after=compile``): a warm local store, a warm cache in
  front of the bucket, and an empty cache that the bucket fills.

    python bench/store_bucket.py [--program mlp] [--reps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class _Requests(logging.Handler):
    """Counts the requests moto's server logs (one line each)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1


def _server() -> tuple[object, dict[str, str], _Requests]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counter = _Requests()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    werkzeug.addHandler(counter)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update(env)
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"]).create_bucket(Bucket="bench")
    return server, env, counter


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "jaxaot", *args],
        cwd=cwd,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "JAXAOT_SERVER": "0"},
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def _hits(store_of, stage: str, key: str, compat: dict, reps: int, counter: _Requests) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Median seconds of lock + get over ``reps`` stores made by ``store_of(i)``, and per hit the
    bytes downloaded from the bucket and the requests made."""
    from jaxaot.store.locks import KeyLock

    times, moved, requests = [], [], []
    for i in range(reps):
        store = store_of(i)
        bucket = getattr(store, "bucket", None)
        if bucket is not None:  # the client is made once per process, not per hit
            bucket.fs.exists(bucket.url.root)
        down0, req0 = (bucket.bytes_down if bucket else 0), counter.n
        t0 = time.perf_counter()
        with KeyLock(store, stage, key):
            entry = store.get(stage, key, expect=compat)
        times.append(time.perf_counter() - t0)
        assert entry is not None, "not a hit"
        moved.append((bucket.bytes_down if bucket else 0) - down0)
        requests.append(counter.n - req0)
    return {
        "median_ms": 1000 * statistics.median(times),
        "bytes": statistics.median(moved),
        "requests": statistics.median(requests),
        "entry_bytes": entry.size_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", default="mlp")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    server, env, counter = _server()
    url = "s3://bench/team/store"
    tmp = Path(tempfile.mkdtemp(prefix="jaxaot-bench-bucket-"))
    try:
        base = [f"program={opts.program}", "stop_after=compile", "store.trust=true"]
        local, cache = tmp / "local-store", tmp / "cache"
        _run([*base, f"store.dir={local}", f"hydra.run.dir={tmp / 'r-local'}"], tmp, env)
        _run(
            [*base, f"store.dir={url}", f"store.cache_dir={cache}", f"hydra.run.dir={tmp / 'r0'}"],
            tmp,
            env,
        )
        manifest = json.loads((tmp / "r0" / "manifest.json").read_text())
        key = manifest["stages"]["compile"]["key"]
        entry_json = next(cache.glob(f"v1/compile/*/{key}/entry.json"))
        compat = json.loads(entry_json.read_text())["compat"]

        from jaxaot.store.cache import Store
        from jaxaot.store.tiered import open_store

        per_hit = {
            "local store": _hits(
                lambda i: Store(local), "compile", key, compat, opts.reps, counter
            ),
            "bucket store, local cache": _hits(
                lambda i: open_store(url, str(cache), trust=True),
                "compile",
                key,
                compat,
                opts.reps,
                counter,
            ),
            "bucket store, from the bucket": _hits(
                lambda i: open_store(url, str(tmp / f"empty-{i}"), trust=True),
                "compile",
                key,
                compat,
                opts.reps,
                counter,
            ),
        }
        print(
            f"program={opts.program}, compile entry {key[:12]}, {opts.reps} hits each (loopback moto)"
        )
        print(f"{'hit from':32} {'lock+get ms':>12} {'bytes moved':>12} {'requests':>9}")
        for name, r in per_hit.items():
            print(f"{name:32} {r['median_ms']:12.2f} {r['bytes']:12.0f} {r['requests']:9.0f}")
        print(f"(the entry holds {per_hit['local store']['entry_bytes']} payload bytes)")

        walls: dict[str, list[float]] = {"local store": [], "local cache": [], "bucket": []}
        for r in range(opts.rounds):
            walls["local store"].append(
                _run([*base, f"store.dir={local}", f"hydra.run.dir={tmp / f'l{r}'}"], tmp, env)
            )
            walls["local cache"].append(
                _run(
                    [
                        *base,
                        f"store.dir={url}",
                        f"store.cache_dir={cache}",
                        f"hydra.run.dir={tmp / f'c{r}'}",
                    ],
                    tmp,
                    env,
                )
            )
            empty = tmp / f"cold-cache-{r}"
            walls["bucket"].append(
                _run(
                    [
                        *base,
                        f"store.dir={url}",
                        f"store.cache_dir={empty}",
                        f"hydra.run.dir={tmp / f'b{r}'}",
                    ],
                    tmp,
                    env,
                )
            )
        print(f"\nwhole process, stop_after=compile, median of {opts.rounds} rounds (s):")
        for name, ws in walls.items():
            print(f"{name:32} {statistics.median(ws):8.2f}   ({', '.join(f'{w:.2f}' for w in ws)})")
    finally:
        server.stop()  # type: ignore[attr-defined]
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
