"""Compile caching through the store: hits proven by counting compiles, every key input misses,
corrupt entries are never loaded, concurrent writers and read-only stores are safe."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from conftest import cli_env, read_manifest, run_cli
from jaxaot.stages import compile as compile_stage
from jaxaot.store.cache import Store


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts real XLA compiles made by the compile stage in this process."""
    seen: list[str] = []
    real = compile_stage.compile_lowered

    def counting(target: Any, backend: str, options: dict[str, Any]) -> Any:
        seen.append(target.module_sha256)
        return real(target, backend, options)

    monkeypatch.setattr(compile_stage, "compile_lowered", counting)
    return seen


def _status(result: jaxaot.RunResult, stage: str = "compile") -> str:
    return str(result.manifest["stages"][stage]["status"])


def _entries(store: Path) -> list[Path]:
    return sorted(p.parent for p in (store / "v1" / "compile").glob("*/*/entry.json"))


def test_warm_run_loads_the_executable_and_gives_the_same_outputs(
    compose_run, compiles, isolated_store
):
    cold = compose_run("program=mlp", "execute.repeats=1")
    warm = compose_run("program=mlp", "execute.repeats=1")
    assert (_status(cold), _status(warm)) == ("ran", "cached")
    assert len(compiles) == 1
    assert cold.manifest["stages"]["compile"]["key"] == warm.manifest["stages"]["compile"]["key"]
    for name in (
        "executable.bin",
        "optimized.hlo.txt",
        "cost_analysis.json",
        "memory_analysis.json",
    ):
        a = cold.manifest["stages"]["compile"]["artifacts"][f"compile/{name}"]
        b = warm.manifest["stages"]["compile"]["artifacts"][f"compile/{name}"]
        assert a == b, name
    import numpy as np

    assert np.array_equal(cold["execute"].outputs, warm["execute"].outputs)
    stats = Store(isolated_store).stats().stages["compile"]
    assert (stats.hits, stats.misses, stats.entries) == (1, 1, 1)


def test_execute_only_changes_never_recompile(compose_run, compiles):
    results = [
        compose_run("program=axpy", f"execute.seed={s}", "execute.repeats=2") for s in range(4)
    ]
    results.append(compose_run("program=axpy", "execute.check=reference", "execute.warmup=0"))
    assert [_status(r) for r in results] == ["ran"] + ["cached"] * 4
    assert len(compiles) == 1


BASE = ("program=axpy", "program.args=[f32[4],f32[4]]", "stop_after=compile")


@pytest.mark.parametrize(
    "change",
    [
        ["compile.compiler_options={xla_cpu_enable_fast_math:true}"],
        ["program.args=[f32[8],f32[8]]"],
        ["program.args=[bf16[4],bf16[4]]"],
        ["lower.donate_argnums=[0]"],
    ],
    ids=["compiler-option", "shape", "dtype", "donation"],
)
def test_each_key_input_misses(compose_run, compiles, change: list[str]):
    # The host's device count is not among them: a one-device executable is keyed by the device
    # it runs on (tests/test_aot_records.py shows the hit across host device counts).
    assert _status(compose_run(*BASE)) == "ran"
    assert _status(compose_run(*BASE, *change)) == "ran"
    assert len(compiles) == 2
    assert _status(compose_run(*BASE, *change)) == "cached"  # and the changed point is now stored


def test_a_jaxlib_or_backend_change_misses(compose_run, compiles, monkeypatch):
    compose_run("program=axpy", "stop_after=compile")
    from jaxaot.stages import jaxenv

    real = jaxenv.backend_info
    monkeypatch.setattr(jaxenv, "backend_info", lambda b: {**real(b), "jaxlib": "99.0.0"})
    again = compose_run("program=axpy", "stop_after=compile")
    assert _status(again) == "ran"
    assert len(compiles) == 2


def test_moving_code_or_renaming_locals_does_not_miss(tmp_path, compose_run, compiles, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_a.py").write_text(
        "import jax.numpy as jnp\n\ndef f(x, y):\n    s = jnp.sin(x)\n    return s * y\n"
    )
    (tmp_path / "user_b.py").write_text(  # other file, other lines, other local names
        "import jax.numpy as jnp\n\n\n# moved\n\n\ndef f(a, b):\n    t = jnp.sin(a)\n    return t * b\n"
    )
    args = ("program.args=[f32[8],f32[8]]", "stop_after=compile")
    assert _status(compose_run("program.target=user_a:f", *args)) == "ran"
    assert _status(compose_run("program.target=user_b:f", *args)) == "cached"
    assert len(compiles) == 1


@pytest.mark.parametrize(
    "damage", ["empty", "one-byte", "half", "flip", "no-entry-json", "no-payload"]
)
def test_a_corrupt_store_entry_is_reported_removed_and_recompiled(
    compose_run, compiles, isolated_store, caplog, damage
):
    compose_run("program=axpy", "stop_after=compile")
    (entry,) = _entries(isolated_store)
    exe = entry / "executable.bin"
    data = exe.read_bytes()
    if damage == "empty":
        exe.write_bytes(b"")
    elif damage == "one-byte":
        exe.write_bytes(data[:1])
    elif damage == "half":
        exe.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        exe.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "no-entry-json":
        (entry / "entry.json").unlink()
    else:
        exe.unlink()
    with caplog.at_level(logging.WARNING, logger="jaxaot.store"):
        again = compose_run("program=axpy", "stop_after=compile")
    assert _status(again) == "ran"
    assert len(compiles) == 2
    assert any(
        "store miss" in r.getMessage() and entry.name[:12] in r.getMessage() for r in caplog.records
    )
    assert Store(isolated_store).verify().ok
    assert _status(compose_run("program=axpy", "stop_after=compile")) == "cached"


def test_read_only_store_runs_uncached_with_one_warning(compose_run, compiles, monkeypatch, caplog):
    real = os.rename

    def fail(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        if "store" in str(dst):
            raise OSError(errno.EROFS, "Read-only file system", str(dst))
        real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", fail)
    with caplog.at_level(logging.WARNING, logger="jaxaot.store"):
        a = compose_run("program=axpy", "stop_after=compile")
    assert a.ok and _status(a) == "ran"
    warnings = [r for r in caplog.records if "not writable" in r.getMessage()]
    assert len(warnings) == 1


def test_store_disabled_compiles_every_time(compose_run, compiles, isolated_store):
    for _ in range(2):
        assert (
            _status(compose_run("program=axpy", "stop_after=compile", "store.enabled=false"))
            == "ran"
        )
    assert len(compiles) == 2
    assert not _entries(isolated_store)


def test_eight_processes_on_one_key_all_succeed_and_leave_one_entry(tmp_path, isolated_store):
    env = cli_env()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxaot",
                "program=mlp",
                "stop_after=compile",
                f"hydra.run.dir={tmp_path / f'p{i}'}",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, outs
    assert len(_entries(isolated_store)) == 1
    assert Store(isolated_store).verify().ok
    keys = {read_manifest(tmp_path / f"p{i}")["stages"]["compile"]["key"] for i in range(8)}
    assert len(keys) == 1


KILL_DURING_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    import jaxaot.util.fsio as fsutil
    import jaxaot.stages.contract as context

    real = fsutil.atomic_write_bytes

    def dying(path, data):
        if path.name == "executable.bin":
            import tempfile
            fd, tmp = tempfile.mkstemp(prefix=fsutil.TEMP_PREFIX + path.name + ".", dir=path.parent)
            os.write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, data)

    context.atomic_write_bytes = dying
    import jaxaot
    jaxaot.run(jaxaot.compose(sys.argv[2:]), run_dir=sys.argv[1])
    """
)


def test_kill_9_during_an_artifact_write_then_rerun(tmp_path, isolated_store):
    script = tmp_path / "die.py"
    script.write_text(KILL_DURING_WRITE)
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, str(script), str(killed), "program=axpy"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9
    assert not (killed / "compile" / "executable.bin").exists()
    assert list((killed / "compile").glob(".tmp-executable.bin.*"))
    manifest = read_manifest(killed)  # the manifest is whole: written atomically after each stage
    assert manifest["status"] == "running" and "compile" not in manifest["stages"]
    assert not _entries(isolated_store)
    rerun = tmp_path / "rerun"  # as the killed one ran: jaxaot.run, here in this process
    assert jaxaot.run(jaxaot.compose(["program=axpy"]), run_dir=rerun).ok
    assert read_manifest(rerun)["status"] == "ok"
    assert len(_entries(isolated_store)) == 1 and Store(isolated_store).verify().ok


def test_store_cli_reports_hits_and_misses(compose_run, isolated_store, tmp_path):
    compose_run("program=axpy", "stop_after=compile")
    compose_run("program=axpy", "stop_after=compile")
    log = [json.loads(x) for x in (isolated_store / "v1" / "stats.jsonl").read_text().splitlines()]
    assert [(e["stage"], e["hit"]) for e in log] == [("compile", False), ("compile", True)]
    stats = Store(isolated_store).stats().stages["compile"]
    assert (stats.entries, stats.hits, stats.misses) == (1, 1, 1)
    proc = run_cli(
        ["stats", "--store", str(isolated_store)], cwd=tmp_path, module="jaxaot.cli.store_cmd"
    )
    assert proc.returncode == 0, proc.stderr
    # columns: stage, entries, size (number and unit), hits, misses, ...
    row = re.search(r"^compile\s+(\d+)\s+\S+ \S+\s+(\d+)\s+(\d+)", proc.stdout, re.MULTILINE)
    assert row is not None and row.groups() == ("1", "1", "1"), proc.stdout
