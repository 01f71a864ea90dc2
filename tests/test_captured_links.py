"""One copy of a big executable on disk: run directories hard-link the store's entry.

A program that captures a 256 KiB constant compiles to an executable over
:data:`jaxaot.util.links.LINK_MIN_BYTES`: its run directory's ``compile/executable.bin`` and the
store's are one inode, read-only; outputs equal a store-off run bit for bit; removing the
store's entry (``jaxaot-store gc``) leaves every run directory resumable in another process.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_env, read_manifest, run_cli
from jaxaot.store.cache import Store
from jaxaot.util import links
from jaxaot.util.fsio import sha256_file

# 256 x 256 f32 = 256 KiB, every value distinct (no splat): the executable embeds it.
_W = (np.arange(256 * 256, dtype=np.float32).reshape(256, 256) / 65536).astype(np.float32)


def project(x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ jnp.asarray(_W))


_PROGRAM = (
    "program.target=test_captured_links:project",
    "program.args=[{shape: [2, 256], dtype: f32, init: normal}]",
    "execute.repeats=1",
)


def _exe(run_dir: Path) -> Path:
    return Path(run_dir) / "compile" / "executable.bin"


def _out(run_dir: Path) -> bytes:
    return np.load(Path(run_dir) / "execute" / "outputs.npz")["out0"].tobytes()


def _entry_file(store_root: Path) -> Path:
    (entry,) = Store(store_root).ls("compile")
    return Path(entry.dir) / "executable.bin"


def _writable(path: Path) -> bool:
    return bool(stat.S_IMODE(path.lstat().st_mode) & 0o222)


def test_a_miss_and_a_hit_share_the_store_entry_and_match_a_store_off_run(
    compose_run: Any, isolated_store: Path
) -> None:
    cold = compose_run(*_PROGRAM)
    warm = compose_run(*_PROGRAM)
    off = compose_run(*_PROGRAM, "store.enabled=false")
    assert [r.manifest["stages"]["compile"]["status"] for r in (cold, warm, off)] == [
        "ran",
        "cached",
        "ran",
    ]
    stored = _entry_file(isolated_store)
    assert stored.stat().st_size >= links.LINK_MIN_BYTES
    # One inode for the entry and both run directories, read-only; the store-off run's own.
    for run in (cold, warm):
        assert links.shares_inode(_exe(run.run_dir), stored)
        assert not _writable(_exe(run.run_dir))
    assert stored.stat().st_nlink == 3
    assert (
        not links.shares_inode(_exe(off.run_dir), stored) and _exe(off.run_dir).stat().st_nlink == 1
    )
    # The same bytes the manifests record, and outputs bit for bit equal to the store-off run.
    for run in (cold, warm, off):
        rec = read_manifest(run.run_dir)["stages"]["compile"]["artifacts"]["compile/executable.bin"]
        assert sha256_file(_exe(run.run_dir)) == rec["sha256"]
        assert _out(run.run_dir) == _out(off.run_dir)
    # Small files are copied as before (nothing else of the run is read-only or shared).
    hlo = Path(cold.run_dir) / "compile" / "compiled.json"
    assert _writable(hlo) and hlo.stat().st_nlink == 1


def test_without_hard_links_the_files_are_copied(
    compose_run: Any, isolated_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: object, **kwargs: object) -> None:  # another file system
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(links.os, "link", refused)
    cold = compose_run(*_PROGRAM)
    warm = compose_run(*_PROGRAM)
    assert warm.manifest["stages"]["compile"]["status"] == "cached"
    stored = _entry_file(isolated_store)
    for run in (cold, warm):
        assert not links.shares_inode(_exe(run.run_dir), stored)
        assert _exe(run.run_dir).read_bytes() == stored.read_bytes()
        assert _writable(_exe(run.run_dir))
    assert _out(cold.run_dir) == _out(warm.run_dir)


def test_link_same_refuses_other_bytes_and_leaves_the_file(tmp_path: Path) -> None:
    src, dest = tmp_path / "src.bin", tmp_path / "run" / "dest.bin"
    data = os.urandom(links.LINK_MIN_BYTES)
    src.write_bytes(data)
    dest.parent.mkdir()
    dest.write_bytes(b"old")
    other = bytearray(data)
    other[-1] ^= 1
    assert not links.link_same(src, dest, bytes(other))  # one byte differs: no link
    assert dest.read_bytes() == b"old" and src.stat().st_nlink == 1
    assert not links.link_same(tmp_path / "gone.bin", dest, data)
    assert links.link_same(src, dest, data)
    assert links.shares_inode(src, dest) and not _writable(src)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["dest.bin"]  # no temp left


def test_a_link_has_the_owner_and_group_a_copy_would_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of another group is copied, not linked: in a team store (setgid folder) a run
    directory's file of the user's private group would fail every teammate's trust check."""
    src = tmp_path / "src.bin"
    data = os.urandom(links.LINK_MIN_BYTES)
    src.write_bytes(data)
    (tmp_path / "entry").mkdir()
    gid = src.stat().st_gid
    monkeypatch.setattr(links.os, "getegid", lambda: gid + 1)  # new files here get gid + 1
    assert not links.link_into(src, tmp_path / "entry" / "x.bin")
    assert not links.link_same(src, tmp_path / "run" / "x.bin", data)
    assert src.stat().st_nlink == 1 and _writable(src)
    monkeypatch.setattr(links.os, "getegid", lambda: gid)
    assert links.link_into(src, tmp_path / "entry" / "x.bin")
    assert src.stat().st_nlink == 2 and not _writable(src)


def test_a_run_resumes_from_its_own_directory_after_the_store_is_cleared(
    tmp_path: Path, isolated_store: Path
) -> None:
    env = cli_env(
        JAXAOT_STORE_DIR=str(isolated_store),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), cli_env()["PYTHONPATH"]]),
    )
    first = tmp_path / "first"
    proc = run_cli([*_PROGRAM, f"hydra.run.dir={first}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert links.shares_inode(_exe(first), _entry_file(isolated_store))
    proc = run_cli(
        ["gc", "--max-size", "0", "--store", str(isolated_store)],
        cwd=tmp_path,
        module="jaxaot.cli.store_cmd",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert Store(isolated_store).ls("compile") == []
    assert _exe(first).stat().st_nlink == 1  # the run directory keeps the only copy
    for start_at in ("execute", "compile"):
        again = tmp_path / f"from_{start_at}"
        proc = run_cli(
            [f"resume_from={first}", f"start_at={start_at}", f"hydra.run.dir={again}"],
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        status = read_manifest(again)["stages"]["compile"]["status"]
        assert status == ("resumed" if start_at == "execute" else "ran")
        assert _out(again) == _out(first)
