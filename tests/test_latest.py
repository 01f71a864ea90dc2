"""Runs refused before they start leave nothing in ``outputs/``; ``resume_from=latest``.

A run refused before it writes its manifest (a config error, a refused import) removes the
folder jaxaot made for it; ``resume_from=latest`` takes the newest run under ``outputs/``
(by its manifest's start time, single runs and sweep jobs alike) that finished the stages
``start_at`` loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import read_manifest, run_cli
from jaxaot.engine.resume import latest_run
from jaxaot.errors import ConfigError
from jaxaot.rundir import dirs
from jaxaot.rundir.dirs import remove_unstarted, unique_dir

AXPY = ["program=axpy", "program.args=[3,4]"]


def _runs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("2*/*/manifest.json"))


def _manifest(run_dir: Path, started: float, **stages: str) -> Path:
    run_dir.mkdir(parents=True)
    data = {"started": started, "stages": {s: {"status": v} for s, v in stages.items()}}
    (run_dir / "manifest.json").write_text(json.dumps(data))
    return run_dir


def test_a_run_refused_before_it_starts_leaves_no_folder(tmp_path: Path) -> None:
    proc = run_cli([*AXPY, "stop_after=nope"], cwd=tmp_path)  # refused by the config check
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("jaxaot: error: stop_after: expected one of stage_out, lower")
    assert not (tmp_path / "outputs").exists()


def test_named_run_dirs_are_removed_only_when_this_run_made_them(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    kept = run_cli([*AXPY, "stop_after=nope", f"hydra.run.dir={mine}"], cwd=tmp_path)
    fresh = run_cli(
        [*AXPY, "stop_after=nope", f"hydra.run.dir={tmp_path / 'new' / 'run'}"], cwd=tmp_path
    )
    assert kept.returncode == fresh.returncode == 1
    assert (mine / "notes").is_dir() and (mine / "jaxaot.log").is_file()  # the user's folder
    assert not (tmp_path / "new").exists()


def test_resume_from_latest_takes_the_newest_run_that_finished_the_stages(tmp_path: Path) -> None:
    lowered = run_cli([*AXPY, "stop_after=lower"], cwd=tmp_path)
    assert lowered.returncode == 0, lowered.stderr
    [first] = _runs(tmp_path)
    # Newer runs that finished nothing keep their record and are passed over: a stage that
    # failed (axpy's y is missing), and a backend that did not start (before any stage).
    for bad in (["program=axpy", "program.args=[f32[4]]"], [*AXPY, "compile.backend=cuda"]):
        assert run_cli(bad, cwd=tmp_path).returncode == 1
    failed = [r for r in _runs(tmp_path) if r != first]
    assert sorted(
        read_manifest(r)["stages"].get("stage_out", {}).get("status", "-") for r in failed
    ) == [
        "-",
        "failed",
    ]
    proc = run_cli([*AXPY, "resume_from=latest", "start_at=compile"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [resumed] = [r for r in _runs(tmp_path) if r != first and r not in failed]
    manifest = read_manifest(resumed)
    assert manifest["resumed_from"] == str(first.resolve())
    assert manifest["config"]["resume_from"] == os.path.relpath(first, tmp_path)
    assert manifest["stages"]["lower"]["status"] == "resumed"


def test_resume_from_latest_without_a_finished_run_is_one_line(tmp_path: Path) -> None:
    proc = run_cli([*AXPY, "resume_from=latest", "start_at=execute"], cwd=tmp_path)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line == (
        f"jaxaot: error: resume_from=latest: expected a run under {tmp_path / 'outputs'} that "
        "finished stage_out and lower and compile (start_at=execute loads them), found none; "
        "run one first (jaxaot stop_after=compile) or name its folder: resume_from=<run dir>"
    )
    assert not (tmp_path / "outputs").exists()


def test_latest_run_orders_runs_and_sweep_jobs_by_start_time(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    single = _manifest(out / "2026-01-02" / "10-00-00", 200.0, stage_out="ran", lower="ran")
    # a sweep job started later; its folder name sorts first
    job = _manifest(out / "multirun" / "2026-01-01" / "09-00-00" / "3", 300.0, stage_out="cached")
    # newer still, but nothing finished (failed at stage_out) or only a hidden requeued attempt
    _manifest(out / "2026-01-03" / "08-00-00", 400.0, stage_out="failed")
    _manifest(
        out / "multirun" / "2026-01-01" / "09-00-00" / ".jaxaot" / "a", 500.0, stage_out="ran"
    )
    assert latest_run("lower", out) == job
    assert latest_run("compile", out) == single  # the job has no finished lower
    _manifest(out / "2026-01-04" / "07-00-00", 600.0, stage_out="resumed", lower="does_not_fit")
    assert latest_run("compile", out) == single  # a verdict without an executable
    with pytest.raises(ConfigError, match="that finished stage_out and lower and compile"):
        latest_run("execute", out)


def test_remove_unstarted_keeps_what_is_not_a_refused_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    made = Path(unique_dir("outputs/day/time"))
    (made / ".hydra").mkdir()
    (made / "jaxaot.log").write_text("")
    for extra in ("manifest.json", "notes.txt"):  # a run that began; someone else's file
        (made / extra).write_text("{}")
        assert not remove_unstarted(made)
        (made / extra).unlink()
    assert remove_unstarted(made)
    assert not (tmp_path / "outputs").exists()  # its parents too, made for it
    other = tmp_path / "other"
    other.mkdir()
    assert str(other) not in dirs._created and not remove_unstarted(other)  # not made here
    assert other.is_dir()
