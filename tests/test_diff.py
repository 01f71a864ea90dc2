"""``jaxaot-diff`` (pipeline/snapshots/diff.py): two runs or snapshots, stage by stage, in a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env

AXPY = ("program=axpy", "execute.warmup=0", "execute.repeats=2")


def _diff(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jaxaot.cli.diff_cmd", *map(str, args)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three runs, shared by this module's tests (which only read them): f32[8], the same
    config again, and f32[16], the last also written as a snapshot."""

    root = tmp_path_factory.mktemp("diff")

    def run(name: str, *overrides: str) -> Path:
        cfg = jaxaot.compose([*AXPY, f"store.dir={root / 'store'}", *overrides])
        return jaxaot.run(cfg, run_dir=root / name).run_dir

    return {
        "a": run("a", "program.args=[f32[8],f32[8]]"),
        "again": run("again", "program.args=[f32[8],f32[8]]"),
        "b": run("b", "program.args=[f32[16],f32[16]]", f"snapshot.write={root / 'snap16'}"),
        "snap16": root / "snap16",
    }


def test_diff_of_two_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    proc = _diff(runs["a"], runs["b"], "--diff-lines", "8", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert f"A: {runs['a']} (run: axpy, jax " in out
    assert "versions: same" in out
    assert 'program.args: ["f32[8]", "f32[8]"] -> ["f32[16]", "f32[16]"]' in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()}
    assert "differs (+" in lines["jaxpr.txt"] and "differs (+" in lines["optimized.hlo.txt"]
    assert "bytes differ" in lines["exported.bin"]
    assert "16 -> 32  (x2.00)" in out  # cost: flops of 2 * x + y
    assert "memory: output" in out and "64 B -> 128 B  (x2.00)" in out
    assert "differs (out0: float32[8] vs float32[16])" in lines["outputs.npz"]
    assert "(B/A = " in out.split("median time", 1)[1]
    assert "first difference: stage_out (jaxpr)" in out
    diff = out.split("first difference: stage_out (jaxpr)\n", 1)[1].splitlines()
    assert diff[:2] == ["--- A/stage_out/jaxpr.txt", "+++ B/stage_out/jaxpr.txt"]
    assert len(diff) == 9 and diff[-1].startswith("... ") and "more diff lines" in diff[-1]


def test_diff_same_config_and_snapshots(runs: dict[str, Path], tmp_path: Path) -> None:
    same = _diff(runs["a"], runs["again"], cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "no difference in the canonical artifacts" in same.stdout
    assert "outputs.npz                same" in same.stdout  # same seed, same values

    vs_snapshot = _diff(runs["snap16"], runs["b"], "--json", cwd=tmp_path)
    assert vs_snapshot.returncode == 0, vs_snapshot.stdout + vs_snapshot.stderr
    report = json.loads(vs_snapshot.stdout)
    assert report["differs"] is False and report["first_difference"] is None
    assert report["stages"]["compile"]["artifacts"]["compile/optimized.hlo.txt"]["status"] == "same"
    assert "binaries" not in report["stages"]["lower"]  # a snapshot has none to compare

    mixed = _diff(runs["snap16"], runs["a"], "--json", cwd=tmp_path)
    assert json.loads(mixed.stdout)["first_difference"] == "stage_out/jaxpr.txt"

    bad = _diff(runs["a"], tmp_path / "nowhere", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr == (
        f"jaxaot-diff: error: {tmp_path / 'nowhere'}: no such file or directory; expected a run "
        "directory or a snapshot folder\n"
    )


def test_diff_refuses_an_artifact_changed_after_the_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "again"
    shutil.copytree(runs["again"], copy)
    hlo = copy / "lower" / "module.hlo.txt"
    hlo.write_text(hlo.read_text() + "\n")
    proc = _diff(runs["a"], copy, cwd=tmp_path)
    assert proc.returncode == 2
    assert "module.hlo.txt: sha256" in proc.stderr and "does not match its manifest" in proc.stderr
