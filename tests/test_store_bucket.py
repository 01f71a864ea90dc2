"""The bucket store (store.dir=s3://...) against a real S3-compatible server on loopback (moto's
server mode, tests/s3_server.py): round trips through a local cache, verification of every
object, conditional puts and claims, a put killed halfway, a bucket that goes away, the
maintenance commands, and whole runs (two processes on one key, store on/off bit-equal)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, cli_env, extra_reason, missing_extra_modules, read_manifest
from jaxaot.cli import store_cmd
from jaxaot.errors import ConfigError, MissingDependencyError, StoreError
from jaxaot.store.bucket import BUSY, Claim, parse_bucket_url
from jaxaot.store.cache import Store, StoreEntry
from jaxaot.store.root import check_store_dir
from jaxaot.store.tiered import BucketStore, open_store
from s3_server import S3Server, free_port, running_s3_server

# Known from the venv's path, not by importing moto and s3fs (a second of CPU in every worker's
# collection).
for _extra in ("testing", "s3"):
    if missing_extra_modules(_extra):
        pytest.skip(extra_reason(_extra), allow_module_level=True)

pytestmark = pytest.mark.xdist_group("b1_bucket")

KEY, KEY2 = "ab" * 32, "cd" * 32
COMPAT = {"jax": "0.10.2", "backend": "cpu"}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from running_s3_server()


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3


def store_at(url: str, cache: Path, **kw: object) -> BucketStore:
    store = open_store(url, str(cache), trust=True, **kw)  # type: ignore[arg-type]
    assert isinstance(store, BucketStore)
    return store


def objects(s3: S3Server, url: str) -> dict[str, bytes]:
    u = parse_bucket_url(url)
    client = s3.client()
    listed = client.list_objects_v2(Bucket=u.bucket, Prefix=u.prefix)  # type: ignore[attr-defined]
    return {
        o["Key"][len(u.prefix) + 1 :]: client.get_object(Bucket=u.bucket, Key=o["Key"])[  # type: ignore[attr-defined]
            "Body"
        ].read()
        for o in listed.get("Contents", [])
    }


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jaxaot.store" and r.levelno >= logging.WARNING
    ]


def test_an_entry_goes_through_the_bucket_to_another_cache(
    s3_env: S3Server, tmp_path: Path
) -> None:
    url = s3_env.bucket()
    first = store_at(url, tmp_path / "a")
    payload = {"executable.bin": b"\x00\x01" * 5000, "meta.json": b"{}"}
    put = first.put("compile", KEY, payload, meta={"m": 1}, compute_seconds=2.5, compat=COMPAT)
    assert put is not None
    names = objects(s3_env, url)
    assert f"v1/compile/ab/{KEY}/entry.json" in names
    assert names[f"v1/compile/ab/{KEY}/entry.json"] == (put.dir / "entry.json").read_bytes()
    second = store_at(url, tmp_path / "b")
    hit = second.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("executable.bin") == payload["executable.bin"]
    assert hit.dir.is_relative_to(tmp_path / "b") and hit.created == put.created
    assert hit.compute_seconds == 2.5 and hit.meta == {"m": 1}
    moved = second.bucket.bytes_down
    assert moved == len(names[f"v1/compile/ab/{KEY}/entry.json"]) + 10000 + 2
    # The second hit is the local cache's: nothing more crosses the network.
    assert second.get("compile", KEY, expect=COMPAT) is not None
    assert second.bucket.bytes_down == moved
    assert second.get("compile", KEY2, expect=COMPAT) is None  # absent: a plain miss


def test_a_corrupted_object_is_a_miss_warned_once_and_removed(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = s3_env.bucket()
    put = store_at(url, tmp_path / "a").put("compile", KEY, {"x": b"good" * 100}, compat=COMPAT)
    assert put is not None
    u = parse_bucket_url(url)
    obj = f"{u.prefix}/v1/compile/ab/{KEY}/{put.files['x'].sha256}/x"
    s3_env.client().put_object(Bucket=u.bucket, Key=obj, Body=b"evil" * 100)  # type: ignore[attr-defined]
    reader = store_at(url, tmp_path / "b")
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    assert reader.get("compile", KEY, expect=COMPAT) is None
    (line,) = store_warnings(caplog)
    assert f"corrupt entry in {url}" in line and "does not match manifest" in line
    assert "entry removed from the bucket" in line
    assert not objects(s3_env, url)
    assert not (tmp_path / "b" / "v1" / "compile" / "ab" / KEY).exists()  # nothing unverified kept


def test_a_torn_manifest_is_refused(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = s3_env.bucket()
    u = parse_bucket_url(url)
    manifest = f"{u.prefix}/v1/compile/ab/{KEY}/entry.json"
    s3_env.client().put_object(Bucket=u.bucket, Key=manifest, Body=b'{"format_version": 1, "st')  # type: ignore[attr-defined]
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    assert store_at(url, tmp_path / "b").get("compile", KEY, expect=COMPAT) is None
    (line,) = store_warnings(caplog)
    assert "corrupt entry" in line and "entry removed" in line


def test_the_loser_of_a_conditional_put_keeps_the_winner_whole(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """Two machines computed one key with different bytes: the first manifest stays, and the
    second's payload (named by its own sha256) is deleted, never mixed into the first's."""
    url = s3_env.bucket()
    a, b = store_at(url, tmp_path / "a"), store_at(url, tmp_path / "b")
    won = a.put("compile", KEY, {"x": b"first"}, compat=COMPAT)
    assert won is not None
    local = cache_only_put(b, {"x": b"second"})
    manifest = (local.dir / "entry.json").read_bytes()
    assert not b.bucket.upload("compile", KEY, manifest, {"x": (local.dir / "x", local.files["x"])})
    names = objects(s3_env, url)
    assert sorted(names) == sorted(
        [f"v1/compile/ab/{KEY}/entry.json", f"v1/compile/ab/{KEY}/{won.files['x'].sha256}/x"]
    )
    hit = store_at(url, tmp_path / "c").get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"first"


def cache_only_put(store: BucketStore, files: dict[str, bytes]) -> StoreEntry:
    """A put into ``store``'s local cache alone (what a machine holds before its upload)."""
    entry = Store.put(store, "compile", KEY, files, compat=COMPAT)
    assert entry is not None
    return entry


def test_a_claim_makes_other_machines_wait_for_the_entry(s3_env: S3Server, tmp_path: Path) -> None:
    url = s3_env.bucket()
    a, b = store_at(url, tmp_path / "a"), store_at(url, tmp_path / "b")
    claim = a.claim("compile", KEY, blocking=True)
    assert isinstance(claim, Claim)
    assert b.claim("compile", KEY, blocking=False) == BUSY
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(b.claim("compile", KEY, blocking=True)))
    t0 = time.perf_counter()
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()  # waiting for the holder's entry
    a.put("compile", KEY, {"x": b"made once"}, compat=COMPAT)
    claim.release()
    waiter.join(timeout=20)
    assert got == [None] and time.perf_counter() - t0 < 10  # the entry is there: no claim
    hit = b.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"made once"
    assert not any(k.startswith("claims/") for k in objects(s3_env, url))


def test_an_entry_put_between_the_waiters_look_and_its_claim_is_served_not_claimed(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The holder puts its entry and releases its claim right after the waiter looked and
    found nothing: the waiter's claim then succeeds, and it must still serve the entry."""
    url = s3_env.bucket()
    a, b = store_at(url, tmp_path / "a"), store_at(url, tmp_path / "b")
    claim = a.claim("compile", KEY, blocking=True)
    assert isinstance(claim, Claim)
    looked = b.bucket.has
    finished: list[bool] = []

    def look_then_holder_finishes(stage: str, key: str) -> bool:
        found = looked(stage, key)
        if not found and not finished:
            a.put("compile", KEY, {"x": b"made once"}, compat=COMPAT)
            claim.release()
            finished.append(True)
        return found

    b.bucket.has = look_then_holder_finishes  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="jaxaot"):
        assert b.claim("compile", KEY, blocking=True) is None
    assert "was computed on another machine (waited" in caplog.text
    assert not any(k.startswith("claims/") for k in objects(s3_env, url))
    hit = b.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"made once"


PUT_KILLED = textwrap.dedent(
    """
    import os, sys
    from jaxaot.store import bucket
    from jaxaot.store.tiered import open_store

    def die(*args, **kwargs):  # the process is killed once the payload is up, before its manifest
        os._exit(9)

    bucket.Bucket._put_manifest = die
    store = open_store(sys.argv[1], sys.argv[2], trust=True, lease_s=1.0)
    claim = store.claim("compile", sys.argv[3], blocking=True)
    assert claim is not None
    store.put("compile", sys.argv[3], {"x": b"from the killed put"}, compat={"jax": "0.10.2"})
    """
)


def test_a_put_killed_halfway_is_invisible_then_taken_over_and_collected(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = s3_env.bucket()
    proc = subprocess.run(
        [sys.executable, "-c", PUT_KILLED, url, str(tmp_path / "dead"), KEY],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 9, proc.stderr
    left = objects(s3_env, url)
    assert f"claims/compile/{KEY}" in left and not any(k.endswith("entry.json") for k in left)
    store = store_at(url, tmp_path / "b", lease_s=1.0)
    assert store.get("compile", KEY, expect={"jax": "0.10.2"}) is None  # invisible
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    t0 = time.perf_counter()
    claim = store.claim("compile", KEY, blocking=True)  # the dead holder's claim goes stale
    assert isinstance(claim, Claim) and 1.0 <= time.perf_counter() - t0 < 10
    assert any("had no heartbeat for 1 s" in m for m in store_warnings(caplog))
    assert store.put("compile", KEY, {"x": b"recomputed"}, compat={"jax": "0.10.2"})
    claim.release()
    assert store_cmd.main(["--store", url, "gc", "--temp-grace-hours", "0"]) == 0
    after = objects(s3_env, url)
    assert len(after) == 2 and after[f"v1/compile/ab/{KEY}/entry.json"]  # the killed payload: gone
    hit = store_at(url, tmp_path / "c").get("compile", KEY, expect={"jax": "0.10.2"})
    assert hit is not None and hit.read_bytes("x") == b"recomputed"


def test_a_take_over_that_finds_the_slow_holders_entry_serves_it(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder stops beating but puts its entry as the waiter takes its claim over: the
    waiter serves that entry (no claim kept, no "computing it here" warning)."""
    url = s3_env.bucket()
    holder = store_at(url, tmp_path / "a", lease_s=1.0)
    waiter = store_at(url, tmp_path / "b", lease_s=1.0)
    claim = holder.claim("compile", KEY, blocking=True)
    assert isinstance(claim, Claim)
    claim._stop.set()  # the holder hangs: no more heartbeats
    take_over = waiter.bucket._take_over

    def holder_puts_first(*args: object) -> Claim | None:
        holder.put("compile", KEY, {"x": b"made slowly"}, compat=COMPAT)
        return take_over(*args)  # type: ignore[arg-type]

    waiter.bucket._take_over = holder_puts_first  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="jaxaot"):
        assert waiter.claim("compile", KEY, blocking=True) is None
    assert "was computed on another machine (waited" in caplog.text
    assert "computing it here" not in caplog.text
    assert not any(k.startswith("claims/") for k in objects(s3_env, url))
    hit = waiter.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"made slowly"


def test_an_unreachable_bucket_is_one_warning_and_the_cache_goes_on(
    s3_env: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # nobody there
    store = store_at("s3://nowhere-bucket/p", tmp_path / "c")
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    t0 = time.perf_counter()
    assert store.claim("compile", KEY, blocking=True) is None
    assert store.get("compile", KEY, expect=COMPAT) is None
    assert store.put("compile", KEY, {"x": b"1"}, compat=COMPAT) is not None
    assert store.get("compile", KEY, expect=COMPAT) is not None  # the local cache still serves
    assert time.perf_counter() - t0 < 15
    (line,) = store_warnings(caplog)
    assert line.startswith("store bucket unusable (reading s3://nowhere-bucket/p: ")
    assert f"goes on with the local cache at {tmp_path / 'c'} alone" in line


def test_a_bucket_is_trusted_only_when_the_users_side_names_it(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_env.bucket("team/jaxaot/store")
    store_at(url, tmp_path / "w").put("compile", KEY, {"x": b"shared"}, compat=COMPAT)
    bucket_name = parse_bucket_url(url).bucket
    for env in ("", "1", f"s3://{bucket_name}/team/jax", "s3://other-bucket/team"):
        monkeypatch.setenv("JAXAOT_TRUST_STORE", env)
        store = open_store(url, str(tmp_path / "c"))
        with pytest.raises(StoreError, match=rf"^store.dir={url} is not trusted: .* set "):
            store.check_trusted()
        assert store.get("compile", KEY, expect=COMPAT) is None  # the entry is there: not read
    for env in (f"s3://{bucket_name}/team", f"s3://x-bucket/a, s3://{bucket_name}/team/jaxaot/"):
        monkeypatch.setenv("JAXAOT_TRUST_STORE", env)
        store = open_store(url, str(tmp_path / "d"))
        store.check_trusted()
        hit = store.get("compile", KEY, expect=COMPAT)
        assert hit is not None and hit.read_bytes("x") == b"shared"
    monkeypatch.delenv("JAXAOT_TRUST_STORE")
    store_at(url, tmp_path / "e").check_trusted()  # store.trust=true (from the command line)


def test_a_config_may_not_choose_the_bucket_that_store_trust_trusts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import jaxaot
    from jaxaot.api import conf_dir

    monkeypatch.delenv("JAXAOT_TRUST_STORE", raising=False)
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    (conf / "experiment" / "evil.yaml").write_text(
        "# @package _global_\nstore:\n  dir: s3://attacker-bucket/store\n"
    )
    (conf / "experiment" / "evil_env.yaml").write_text(
        "# @package _global_\nhydra:\n  job:\n    env_set:\n"
        "      JAXAOT_STORE_DIR: s3://attacker-bucket/store\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"^store.dir=s3://attacker-bucket/store comes from experiment/evil.yaml .* give "
        r"store.dir=s3://attacker-bucket/store on the command line with store.trust=true, or "
        r"set JAXAOT_TRUST_STORE=s3://attacker-bucket/store$",
    ):
        jaxaot.compose(["program=axpy", "experiment=evil", "store.trust=true"], config_dir=conf)
    jaxaot.compose(["program=axpy", "experiment=evil"], config_dir=conf)  # not trusted: allowed
    (conf / "experiment" / "evil_trust.yaml").write_text(
        "# @package _global_\nstore:\n  dir: s3://attacker-bucket/store\n  trust: true\n"
    )
    with pytest.raises(  # the fix names the bucket: JAXAOT_TRUST_STORE=1 trusts folders only
        ConfigError,
        match=r"^store.trust=true comes from experiment/evil_trust.yaml .* or set "
        r"JAXAOT_TRUST_STORE=s3://attacker-bucket/store$",
    ):
        jaxaot.compose(["program=axpy", "experiment=evil_trust"], config_dir=conf)
    cfg = jaxaot.compose(
        ["program=axpy", "experiment=evil", "store.trust=true", "store.dir=s3://mine-bucket/s"],
        config_dir=conf,
    )
    assert cfg.store.dir == "s3://mine-bucket/s"
    monkeypatch.setenv("JAXAOT_TRUST_STORE", "s3://attacker-bucket")
    jaxaot.compose(["program=axpy", "experiment=evil", "store.trust=true"], config_dir=conf)
    with pytest.raises(
        ConfigError, match=r"^hydra.job.env_set.JAXAOT_STORE_DIR='s3://attacker-bucket/store' "
    ):
        jaxaot.compose(["program=axpy", "experiment=evil_env"], config_dir=conf)


@pytest.mark.parametrize(
    ("where", "found"),
    [
        ("ftp://b/p", "found the scheme ftp://"),
        ("s3://", "with a bucket name of 3-63"),
        ("s3://b/../p", "without '.' or '..' segments"),
    ],
)
def test_a_bad_bucket_url_is_one_line_naming_store_dir(where: str, found: str) -> None:
    with pytest.raises(ConfigError, match=f"^store.dir={where}: expected .*{found}"):
        check_store_dir(where)


def test_a_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a)
    )
    with pytest.raises(MissingDependencyError, match=r"pip install 'jaxaot\[gcs\]'"):
        check_store_dir("gs://team-bucket/store")


def test_the_cache_dir_is_checked_naming_its_key(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^store.cache_dir=.*file: expected a folder"):
        check_store_dir("s3://team-bucket/store", cache_dir=str(tmp_path / "file"))
    with pytest.raises(
        ConfigError, match=r"^store.lease_s: expected seconds from 1 to 600, found 0;"
    ):
        check_store_dir("s3://team-bucket/store", lease_s=0)


def test_the_bucket_can_come_from_jaxaot_store_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$JAXAOT_STORE_DIR may name the bucket; the cache is then the default local store,
    created private as that one is. Nothing is asked of the bucket until a run uses it."""
    monkeypatch.setenv("JAXAOT_STORE_DIR", "s3://team-bucket/store")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = tmp_path / "xdg" / "jaxaot" / "store"
    check_store_dir(None)
    assert cache.is_dir() and cache.stat().st_mode & 0o777 == 0o700
    store = open_store(None, trust=True)
    assert isinstance(store, BucketStore) and store.location == "s3://team-bucket/store"
    assert store.root == cache
    monkeypatch.setenv("JAXAOT_STORE_DIR", "ftp://x/y")
    with pytest.raises(ConfigError, match=r"^JAXAOT_STORE_DIR=ftp://x/y: expected a folder or"):
        check_store_dir(None)


def ls_and_stats_of_two_entries(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two entries put into the bucket at ``url``: `jaxaot-store ls` and `stats` list them."""
    store = store_at(url, tmp_path / "a")
    store.put("compile", KEY, {"x": b"1" * 100}, compat=COMPAT)
    store.put("lower", KEY2, {"y": b"2" * 50}, compat=COMPAT)
    assert store_cmd.main(["--store", url, "ls"]) == 0
    out = capsys.readouterr().out
    assert f"compile  {KEY}" in out and f"lower    {KEY2}" in out and out.endswith("2 entries\n")
    assert store_cmd.main(["--store", url, "stats"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"store {url} (format v1)\n") and "total    2" in out


def test_store_commands_on_a_bucket(
    s3_env: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3_env.bucket()
    ls_and_stats_of_two_entries(url, tmp_path, capsys)
    u = parse_bucket_url(url)
    bad = f"{u.prefix}/v1/lower/cd/{KEY2}/{'0' * 64}/y"  # a killed writer's, too young for gc
    s3_env.client().put_object(Bucket=u.bucket, Key=bad, Body=b"stray")  # type: ignore[attr-defined]
    sha = hashlib.sha256(b"2" * 50).hexdigest()
    s3_env.client().put_object(
        Bucket=u.bucket, Key=f"{u.prefix}/v1/lower/cd/{KEY2}/{sha}/y", Body=b"3" * 50
    )  # type: ignore[attr-defined]
    assert store_cmd.main(["--store", url, "verify"]) == 1
    out = capsys.readouterr().out
    assert f"ok       compile/{KEY}" in out and f"CORRUPT  lower/{KEY2}: 'y' sha256" in out
    assert store_cmd.main(["--store", url, "verify", "--remove"]) == 1
    assert "1 corrupt; 1 removed" in capsys.readouterr().out
    assert store_cmd.main(["--store", url, "gc", "--max-size", "0"]) == 0
    assert "and 1 entry" in capsys.readouterr().out
    assert store_cmd.main(["--store", url, "verify", "--deep"]) == 2
    assert "cannot on a bucket" in capsys.readouterr().err
    assert store_cmd.main(["--store", "s3://b"]) == 2  # no command: usage, one line


# -- whole runs ---------------------------------------------------------------------------------


def jaxaot_args(url: str, tmp: Path, name: str, *extra: str) -> list[str]:
    return [
        "program=axpy",
        f"store.dir={url}",
        f"store.cache_dir={tmp / ('cache-' + name)}",
        "store.trust=true",
        f"hydra.run.dir={tmp / name}",
        *extra,
    ]


def jaxaot_proc(s3: S3Server, url: str, tmp: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxaot", *jaxaot_args(url, tmp, name, *extra)],
        cwd=tmp,
        env=cli_env(**s3.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


STOP = "stop_after=compile"
HOLD_UNTIL_GO = textwrap.dedent(
    """
    import os, runpy, sys, time
    from jaxaot.store import tiered

    put = tiered.BucketStore.put
    go = sys.argv.pop(1)

    def put_when_told(self, *a, **k):  # holds its claim until the other process is waiting
        t0 = time.monotonic()
        while not os.path.exists(go) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        return put(self, *a, **k)

    tiered.BucketStore.put = put_when_told
    sys.argv = ["jaxaot", *sys.argv[1:]]
    runpy.run_module("jaxaot", run_name="__main__")
    """
)


def test_two_processes_compiling_one_key_at_once_compile_it_once(
    s3: S3Server, tmp_path: Path
) -> None:
    """Process a claims the key and holds it (its put waits for a go file); process b starts
    then, finds the claim, says it waits, and is served a's entry once a puts it."""
    url = s3.bucket()
    go = tmp_path / "go"
    a = subprocess.Popen(
        [sys.executable, "-c", HOLD_UNTIL_GO, str(go), *jaxaot_args(url, tmp_path, "a", STOP)],
        cwd=tmp_path,
        env=cli_env(JAXAOT_SERVER="0", **s3.env),  # in this process, where put is wrapped
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not any(k.startswith("claims/") for k in objects(s3, url)):
        assert a.poll() is None and time.monotonic() < deadline, a.communicate()[1][-3000:]
        time.sleep(0.1)
    b = jaxaot_proc(s3, url, tmp_path, "b", STOP)
    log = tmp_path / "b" / "jaxaot.log"
    while not (log.is_file() and "being computed on another machine" in log.read_text()):
        assert b.poll() is None and time.monotonic() < deadline, "".join(b.communicate())[-3000:]
        time.sleep(0.1)
    go.touch()
    for p in (a, b):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    assert "was computed on another machine (waited" in log.read_text()
    statuses = [read_manifest(tmp_path / n)["stages"]["compile"]["status"] for n in "ab"]
    assert statuses == ["ran", "cached"]
    exe = [(tmp_path / n / "compile" / "executable.bin").read_bytes() for n in "ab"]
    assert exe[0] == exe[1]
    names = objects(s3, url)
    assert sum(k.endswith("entry.json") for k in names) == 1
    assert not any(k.startswith("claims/") for k in names)


def test_outputs_are_bit_equal_with_the_bucket_store_on_and_off(
    s3: S3Server, tmp_path: Path
) -> None:
    import numpy as np

    url = s3.bucket()
    off = jaxaot_proc(s3, url, tmp_path, "off", "store.enabled=false")
    first = jaxaot_proc(s3, url, tmp_path, "first")
    for p in (off, first):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    hit = jaxaot_proc(s3, url, tmp_path, "hit")  # a fresh cache: served from the bucket
    _, err = hit.communicate(timeout=300)
    assert hit.returncode == 0, err[-3000:]
    stages = {
        n: read_manifest(tmp_path / n)["stages"]["compile"]["status"] for n in ("first", "hit")
    }
    assert stages == {"first": "ran", "hit": "cached"}
    arrays = [np.load(tmp_path / n / "execute" / "outputs.npz") for n in ("off", "first", "hit")]
    assert sorted(arrays[0].files) == sorted(arrays[1].files) == sorted(arrays[2].files)
    for name in arrays[0].files:
        ref = arrays[0][name]
        for other in arrays[1:]:
            assert other[name].dtype == ref.dtype and other[name].tobytes() == ref.tobytes()


GONE_MID_RUN = textwrap.dedent(
    """
    import runpy, sys
    from s3_server import start_s3_server
    from jaxaot.store import tiered

    server = start_s3_server()  # in this process: stopping it makes the bucket unreachable
    import os

    os.environ.update(server.env)
    url = server.bucket()
    get = tiered.BucketStore.get

    def get_then_stop(self, *a, **k):
        out = get(self, *a, **k)
        server.server.stop()
        return out

    tiered.BucketStore.get = get_then_stop
    sys.argv = ["jaxaot", f"store.dir={url}", *sys.argv[1:]]
    runpy.run_module("jaxaot.cli.main", run_name="__main__")  # in this process, never served
    """
)


def test_a_bucket_gone_mid_run_costs_one_warning_and_the_run_goes_on(tmp_path: Path) -> None:
    """The bucket answers the run's lookup, then goes away before its put."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            GONE_MID_RUN,
            "program=axpy",
            "stop_after=compile",
            f"store.cache_dir={tmp_path / 'cache'}",
            "store.trust=true",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=cli_env(PYTHONPATH=f"{REPO}:{REPO / 'tests'}"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_manifest(tmp_path / "run")["stages"]["compile"]["status"] == "ran"
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "store bucket unusable" in ln]
    assert len(said) == 1 and "Could not connect to the endpoint URL" in said[0], said
    assert any((tmp_path / "cache" / "v1" / "compile").rglob("entry.json"))  # cached locally


# -- bounded requests, claims, gc, faults ----------------------------------------------------------


@pytest.fixture
def silent_endpoint(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An endpoint that accepts connections and never answers; fsspec's user config gives the
    client 1 s timeouts (jaxaot's own: 3 s to connect, 10 s to read), nothing else changed."""
    import socket

    import fsspec

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setitem(
        fsspec.config.conf, "s3", {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{listener.getsockname()[1]}")
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()
    for conn in held:
        conn.close()


def test_a_silent_bucket_costs_one_timeout_and_one_warning(
    silent_endpoint: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run against a bucket that never answers: one request times out (1 s here: one
    attempt, no s3fs or botocore retries), the bucket is marked down, and the claim, the
    lookups, the put and the release ask it nothing more."""
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    store = store_at("s3://silent-bucket/p", tmp_path / "c")
    assert store.bucket.fs.retries == 1
    t0 = time.perf_counter()
    assert store.claim("compile", KEY, blocking=True) is None
    assert store.get("compile", KEY, expect=COMPAT) is None
    assert store.put("compile", KEY, {"x": b"1"}, compat=COMPAT) is not None
    assert store.get("compile", KEY2, expect=COMPAT) is None
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.5, elapsed  # one 1 s read timeout, not attempts x retries of it
    said = store_warnings(caplog)
    assert len(said) == 1 and "ReadTimeoutError" in said[0], said


def test_a_claim_marked_down_neither_beats_nor_releases(s3_env: S3Server, tmp_path: Path) -> None:
    url = s3_env.bucket()
    store = store_at(url, tmp_path / "a", lease_s=1.0)
    claim = store.claim("compile", KEY, blocking=True)
    assert isinstance(claim, Claim)
    store.bucket.down = "the bucket stopped answering"
    version = s3_env.client().head_object(  # type: ignore[attr-defined]
        Bucket=parse_bucket_url(url).bucket, Key=f"{parse_bucket_url(url).prefix}/{claim_key()}"
    )["ETag"]
    time.sleep(0.6)  # two beats' time
    t0 = time.perf_counter()
    claim.release()
    assert time.perf_counter() - t0 < 0.1
    left = s3_env.client().head_object(  # type: ignore[attr-defined]
        Bucket=parse_bucket_url(url).bucket, Key=f"{parse_bucket_url(url).prefix}/{claim_key()}"
    )["ETag"]
    assert left == version  # not renewed, not deleted


def claim_key(key: str = KEY) -> str:
    return f"claims/compile/{key}"


@pytest.mark.slow  # waits out real leases: ~9 s
def test_a_slow_live_holder_is_not_taken_over_by_a_waiter_with_a_short_lease(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """The waiter's lease_s (1 s) does not decide: the holder's (4 s, written in its claim,
    renewed every 1 s) does; then a holder that stops beating is taken over after its own
    lease, by a conditional overwrite, and its late release leaves the new claim alone."""
    url = s3_env.bucket()
    holder = store_at(url, tmp_path / "a", lease_s=4.0)
    waiter = store_at(url, tmp_path / "b", lease_s=1.0)
    claim = holder.claim("compile", KEY, blocking=True)
    assert isinstance(claim, Claim)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(waiter.claim("compile", KEY, True)))
    thread.start()
    thread.join(timeout=3.0)
    assert thread.is_alive() and not got  # 3 s > the waiter's lease: still waiting
    claim._stop.set()  # the holder hangs: no more heartbeats
    thread.join(timeout=15)
    t_taken = time.perf_counter()
    assert len(got) == 1 and isinstance(got[0], Claim), got
    new = got[0]
    claim.release()  # the old holder wakes up late: its conditional delete must fail
    assert claim_key() in objects(s3_env, url)
    assert time.perf_counter() - t_taken < 5
    new.release()
    assert claim_key() not in objects(s3_env, url)


def test_gc_never_deletes_what_a_writer_just_finished(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc lists a killed put's payload (no manifest); a writer then completes that key before
    gc deletes: the writer's entry stays whole, with the grace floor and without it (lowered
    to 0 here: gc still deletes only the objects it listed, after finding no manifest)."""
    from jaxaot.store import bucket_maintenance
    from jaxaot.store.bucket_maintenance import BucketAdmin

    def race(name: str) -> tuple[str, dict[str, bytes]]:
        url = s3_env.bucket()
        u = parse_bucket_url(url)
        killed = f"v1/compile/ab/{KEY}/{'0' * 64}/x"
        s3_env.client().put_object(Bucket=u.bucket, Key=f"{u.prefix}/{killed}", Body=b"killed")  # type: ignore[attr-defined]
        writer = store_at(url, tmp_path / name)
        admin = BucketAdmin(writer.bucket)
        scan = admin._scan

        def scan_then_writer_finishes() -> object:
            out = scan()
            assert writer.put("compile", KEY, {"x": b"fresh"}, compat=COMPAT) is not None
            return out

        monkeypatch.setattr(admin, "_scan", scan_then_writer_finishes)
        admin.gc(temp_grace_s=0)
        hit = store_at(url, tmp_path / f"{name}-reader").get("compile", KEY, expect=COMPAT)
        assert hit is not None and hit.read_bytes("x") == b"fresh"
        return killed, objects(s3_env, url)

    killed, left = race("floor")
    assert killed in left  # younger than MIN_ORPHAN_GRACE_S: kept
    monkeypatch.setattr(bucket_maintenance, "MIN_ORPHAN_GRACE_S", 0.0)
    race("no-floor")
    url = s3_env.bucket()  # and with no writer, the orphan is collected
    u = parse_bucket_url(url)
    s3_env.client().put_object(Bucket=u.bucket, Key=f"{u.prefix}/{killed}", Body=b"killed")  # type: ignore[attr-defined]
    BucketAdmin(store_at(url, tmp_path / "alone").bucket).gc(temp_grace_s=0)
    assert objects(s3_env, url) == {}


def test_remove_deletes_the_manifest_then_only_the_payload_it_named(
    s3_env: S3Server, tmp_path: Path
) -> None:
    url = s3_env.bucket()
    u = parse_bucket_url(url)
    store = store_at(url, tmp_path / "a")
    store.put("compile", KEY, {"x": b"one"}, compat=COMPAT)
    other = f"v1/compile/ab/{KEY}/{'1' * 64}/x"  # another writer's upload under way
    s3_env.client().put_object(Bucket=u.bucket, Key=f"{u.prefix}/{other}", Body=b"two")  # type: ignore[attr-defined]
    store.bucket.remove("compile", KEY)
    assert list(objects(s3_env, url)) == [other]


def test_a_full_cache_costs_the_hit_not_the_bucket(
    s3_env: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import builtins
    import errno

    from jaxaot.store import bucket as bucket_mod

    url = s3_env.bucket()
    store_at(url, tmp_path / "w").put("compile", KEY, {"x": b"data"}, compat=COMPAT)
    reader = store_at(url, tmp_path / "r")
    real_open = builtins.open

    def full(path: object, mode: str = "r", *a: object, **k: object) -> object:
        if "xb" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)  # type: ignore[call-overload]

    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    monkeypatch.setattr(bucket_mod, "open", full, raising=False)
    assert reader.get("compile", KEY, expect=COMPAT) is None
    monkeypatch.delattr(bucket_mod, "open")
    said = store_warnings(caplog)
    assert len(said) == 1 and "No space left on device" in said[0], said
    assert "could not be written into the local cache" in said[0]
    assert reader.bucket_usable  # not marked down: the next hit is served
    hit = reader.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"data"


class ReadOnly:
    """A filesystem whose writes the server refuses (read-only credentials)."""

    def __init__(self, fs: object) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> object:
        return getattr(self._fs, name)

    def pipe_file(self, *a: object, **k: object) -> None:
        raise PermissionError("AccessDenied: read-only credentials")

    put_file = pipe_file


def test_read_only_credentials_stop_claims_and_puts_but_not_hits(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = s3_env.bucket()
    store_at(url, tmp_path / "w").put("compile", KEY, {"x": b"shared"}, compat=COMPAT)
    reader = store_at(url, tmp_path / "r")
    reader.bucket._fs = ReadOnly(reader.bucket.fs)
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    assert reader.claim("compile", KEY2, blocking=True) is None
    assert reader.put("compile", KEY2, {"y": b"mine"}, compat=COMPAT) is not None
    hit = reader.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"shared"
    said = store_warnings(caplog)
    assert len(said) == 1 and "takes no writes from this process" in said[0], said
    assert f"v1/compile/cd/{KEY2}/entry.json" not in objects(s3_env, url)


def test_a_conditional_write_conflict_is_exists_not_down(s3_env: S3Server) -> None:
    from botocore.exceptions import ClientError
    from jaxaot.store.bucket import Bucket

    bucket = Bucket(parse_bucket_url(s3_env.bucket()))
    for code, status in (("ConditionalRequestConflict", 409), ("PreconditionFailed", 412)):
        error = ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

        def conflict(error: ClientError = error) -> None:
            raise OSError("translated") from error

        with pytest.raises(FileExistsError):
            bucket._call("writing to", conflict, write=True, conditional=True)
    assert bucket.down is None


def test_a_bad_read_is_read_again_before_the_entry_is_removed(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxaot.store.bucket import Bucket
    from jaxaot.store.entries import Refused

    url = s3_env.bucket()
    store_at(url, tmp_path / "w").put("compile", KEY, {"x": b"good"}, compat=COMPAT)
    fetch = Bucket.fetch
    calls: list[int] = []

    def bad_once(self: Bucket, *a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise Refused("'x' sha256 0000 does not match manifest 1111")  # a bad transfer
        return fetch(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(Bucket, "fetch", bad_once)
    hit = store_at(url, tmp_path / "r").get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.read_bytes("x") == b"good" and len(calls) == 2
    assert f"v1/compile/ab/{KEY}/entry.json" in objects(s3_env, url)


def test_an_object_larger_than_its_record_is_not_read_whole(
    s3_env: S3Server, tmp_path: Path
) -> None:
    from jaxaot.store.entries import Refused

    url = s3_env.bucket()
    u = parse_bucket_url(url)
    store = store_at(url, tmp_path / "w")
    store.put("compile", KEY, {"x": b"small"}, compat=COMPAT)
    sha = hashlib.sha256(b"small").hexdigest()
    s3_env.client().put_object(  # type: ignore[attr-defined]
        Bucket=u.bucket, Key=f"{u.prefix}/v1/compile/ab/{KEY}/{sha}/x", Body=b"0" * (4 << 20)
    )
    reader = store_at(url, tmp_path / "r")
    with pytest.raises(Refused, match=r"'x' is 6 bytes, manifest says 5"):
        reader.bucket.fetch("compile", KEY, None, into=tmp_path / "into")
    assert reader.bucket.bytes_down < 4096


@pytest.mark.parametrize("sha", ["../../../x", "A" * 64, "0" * 63])
def test_a_manifest_sha256_must_be_64_lowercase_hex_digits(sha: str) -> None:
    import json

    from jaxaot.store.entries import Refused, parse_manifest

    doc = {
        "format_version": 1,
        "stage": "compile",
        "key": KEY,
        "created": 1.0,
        "files": {"x": {"sha256": sha, "size": 1}},
        "meta": {},
        "compat": {},
        "compute_seconds": 0.0,
    }
    with pytest.raises(Refused, match=r"malformed record for 'x' \(expected a size >= 0 and a sha"):
        parse_manifest(json.dumps(doc).encode(), "compile", KEY)


def test_schema_validation_does_not_folder_check_a_bucket_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxaot.util.store_root import check_store_dir as check_folder

    monkeypatch.chdir(tmp_path)
    check_folder("s3://team-bucket/store")
    monkeypatch.setenv("JAXAOT_STORE_DIR", "gs://team-bucket/store")
    check_folder(None)
    assert list(tmp_path.iterdir()) == []  # no folder "s3:" made or checked
