"""The bucket store on gs:// against a Google Cloud Storage emulator on loopback
(``gcp-storage-emulator``, tests/gcs_server.py): an entry through the bucket into another
cache, two writers of one key, a corrupted object, the maintenance commands, and a whole
``jaxaot`` run twice (its second compile served from the bucket, outputs bit-equal)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli_env, extra_reason, missing_extra_modules, read_manifest

# Known from the venv's path, not by importing gcsfs and the emulator (a second of CPU in every
# worker's collection).
for _extra in ("testing", "gcs"):
    if missing_extra_modules(_extra):
        pytest.skip(extra_reason(_extra), allow_module_level=True)

from gcs_server import GcsServer, plain_gcsfs, running_gcs_server  # noqa: E402
from jaxaot.store.bucket import parse_bucket_url  # noqa: E402

# The S3 tests' helpers (importing them needs the s3 extra: without it this module is skipped,
# naming it).
from test_store_bucket import (  # noqa: E402
    COMPAT,
    KEY,
    KEY2,
    cache_only_put,
    jaxaot_args,
    ls_and_stats_of_two_entries,
    store_at,
    store_warnings,
)

pytestmark = [pytest.mark.extra("testing", "gcs"), pytest.mark.xdist_group("gcs_store")]


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsServer]:
    yield from running_gcs_server()


@pytest.fixture
def gcs_env(gcs: GcsServer, monkeypatch: pytest.MonkeyPatch) -> GcsServer:
    plain_gcsfs(monkeypatch, gcs)
    return gcs


def objects(gcs: GcsServer, url: str) -> dict[str, bytes]:
    """Every object under the store's prefix, by its name under the prefix."""
    root = parse_bucket_url(url).root
    fs = gcs.fs
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}  # type: ignore[attr-defined]


def test_an_entry_goes_through_the_bucket_to_another_cache(
    gcs_env: GcsServer, tmp_path: Path
) -> None:
    url = gcs_env.bucket()
    first = store_at(url, tmp_path / "a")
    payload = {"executable.bin": b"\x00\x01" * 5000, "meta.json": b"{}"}
    put = first.put("compile", KEY, payload, meta={"m": 1}, compute_seconds=2.5, compat=COMPAT)
    assert put is not None
    names = objects(gcs_env, url)
    manifest = f"v1/compile/ab/{KEY}/entry.json"
    assert sorted(names) == sorted(
        [manifest, *(f"v1/compile/ab/{KEY}/{put.files[n].sha256}/{n}" for n in payload)]
    )
    assert names[manifest] == (put.dir / "entry.json").read_bytes()
    second = store_at(url, tmp_path / "b")
    hit = second.get("compile", KEY, expect=COMPAT)
    assert hit is not None and hit.dir.is_relative_to(tmp_path / "b")
    assert {n: hit.read_bytes(n) for n in payload} == payload
    assert hit.created == put.created and hit.compute_seconds == 2.5 and hit.meta == {"m": 1}
    moved = second.bucket.bytes_down
    assert moved == len(names[manifest]) + 10000 + 2
    assert second.get("compile", KEY, expect=COMPAT) is not None  # the local cache's hit
    assert second.bucket.bytes_down == moved
    assert second.get("compile", KEY2, expect=COMPAT) is None  # absent: a plain miss


def test_two_writers_of_one_key_leave_one_whole_entry(gcs_env: GcsServer, tmp_path: Path) -> None:
    """The manifest is created with ifGenerationMatch=0. Where the server honours it, the
    second writer loses (FileExistsError: its upload returns False, its payload is deleted, the
    first entry stays); where it does not (the emulator), both manifests go through, the last
    stays, and it names only its own payload: the key was computed twice, never mixed."""
    url = gcs_env.bucket()
    a, b = store_at(url, tmp_path / "a"), store_at(url, tmp_path / "b")
    won = a.put("compile", KEY, {"x": b"first"}, compat=COMPAT)
    assert won is not None
    local = cache_only_put(b, {"x": b"second"})
    manifest = (local.dir / "entry.json").read_bytes()
    uploaded = b.bucket.upload("compile", KEY, manifest, {"x": (local.dir / "x", local.files["x"])})
    base = f"v1/compile/ab/{KEY}"
    names = objects(gcs_env, url)
    hit = store_at(url, tmp_path / "c").get("compile", KEY, expect=COMPAT)
    assert hit is not None
    if gcs_env.honours_preconditions():
        assert not uploaded
        assert sorted(names) == [f"{base}/{won.files['x'].sha256}/x", f"{base}/entry.json"]
        assert hit.read_bytes("x") == b"first"
    else:
        assert uploaded  # the documented duplicate compile: the last manifest stays
        assert names[f"{base}/entry.json"] == manifest
        assert sorted(names) == sorted(
            [
                f"{base}/entry.json",
                f"{base}/{won.files['x'].sha256}/x",  # unreferenced now: gc's, past its grace
                f"{base}/{local.files['x'].sha256}/x",
            ]
        )
        assert hit.read_bytes("x") == b"second"


def test_a_corrupted_object_is_refused_before_it_is_deserialised(
    gcs_env: GcsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = gcs_env.bucket()
    put = store_at(url, tmp_path / "a").put("compile", KEY, {"x": b"good" * 100}, compat=COMPAT)
    assert put is not None
    root = parse_bucket_url(url).root
    gcs_env.fs.pipe_file(f"{root}/v1/compile/ab/{KEY}/{put.files['x'].sha256}/x", b"evil" * 100)  # type: ignore[attr-defined]
    reader = store_at(url, tmp_path / "b")
    caplog.set_level(logging.WARNING, logger="jaxaot.store")
    assert reader.get("compile", KEY, expect=COMPAT) is None
    (line,) = store_warnings(caplog)
    assert f"corrupt entry in {url}" in line and "does not match manifest" in line
    assert "entry removed from the bucket" in line
    assert not objects(gcs_env, url)
    assert not (tmp_path / "b" / "v1" / "compile" / "ab" / KEY).exists()  # nothing unverified kept


def test_store_ls_and_stats_on_a_gs_bucket(
    gcs_env: GcsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ls_and_stats_of_two_entries(gcs_env.bucket(), tmp_path, capsys)


def test_a_run_twice_compiles_once_through_the_bucket_bit_equal(
    gcs: GcsServer, tmp_path: Path
) -> None:
    """Two ``jaxaot`` runs, each with an empty store.cache_dir: the second's compile is served
    from the gs:// bucket and its outputs are the first's, bit for bit."""
    import numpy as np

    url = gcs.bucket()
    for name in ("first", "hit"):
        done = subprocess.run(
            [sys.executable, "-m", "jaxaot", *jaxaot_args(url, tmp_path, name)],
            cwd=tmp_path,
            env=cli_env(**gcs.env),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    statuses = [
        read_manifest(tmp_path / n)["stages"]["compile"]["status"] for n in ("first", "hit")
    ]
    assert statuses == ["ran", "cached"]
    assert sum(k.endswith("/entry.json") for k in objects(gcs, url)) >= 1
    exe = [(tmp_path / n / "compile" / "executable.bin").read_bytes() for n in ("first", "hit")]
    assert exe[0] == exe[1]
    first, hit = (np.load(tmp_path / n / "execute" / "outputs.npz") for n in ("first", "hit"))
    assert first.files and sorted(first.files) == sorted(hit.files)
    for name in first.files:
        assert hit[name].dtype == first[name].dtype and hit[name].tobytes() == first[name].tobytes()
