"""Runs refused before they start leave nothing in ``outputs/``; ``resume_from=latest``.

A run refused before it writes its manifest (a config error, a refused import) removes the
folder jaxaot made for it; ``resume_from=latest`` takes the newest run under ``outputs/``
(by its manifest's start time, single runs and sweep jobs alike) that finished the stages
``start_at`` loads, and the summary names it. ``latest`` in jaxaot-diff and jaxaot-graph is
the newest run that finished stage_out; in jaxaot-report the sweep started last.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from conftest import cli_env, read_manifest, run_cli
from jaxaot.cli.latest import sweep_dir
from jaxaot.engine import resume
from jaxaot.engine.resume import Checkpoint, latest_run, resolve_latest_argv, resolve_resume_from
from jaxaot.errors import ConfigError
from jaxaot.rundir import dirs
from jaxaot.rundir.dirs import remove_unstarted, unique_dir
from jaxaot.rundir.manifest import MANIFEST_FORMAT_VERSION
from jaxaot.schema import JaxaotConfig, to_container, validate

AXPY = ["program=axpy", "program.args=[3,4]"]


def _runs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("2*/*/manifest.json"))


def _manifest(
    run_dir: Path, started: float, config: dict[str, Any] | None = None, **stages: str
) -> Path:
    run_dir.mkdir(parents=True)
    data = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "started": started,
        "stages": {s: {"status": v} for s, v in stages.items()},
        "config": config or {},
    }
    (run_dir / "manifest.json").write_text(json.dumps(data))
    return run_dir


@functools.cache
def _typed(*overrides: str) -> JaxaotConfig:
    return validate(jaxaot.compose(list(overrides)))


def _config(*overrides: str) -> dict[str, Any]:
    """The config a run of ``jaxaot <overrides>`` records in its manifest."""
    return to_container(_typed(*overrides))


def _when(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))


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
    started = read_manifest(first)["started"]
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
    # A sweep resolves latest once, before its first job: the second job loads the same run,
    # not the first job's (which finished lower too, and started later), in the folder the
    # command started in (each job works in its own: hydra.job.chdir=true).
    proc = run_cli(
        [
            "-m",
            *AXPY,
            "resume_from=latest",
            "start_at=compile",
            "execute.warmup=0,1",
            "hydra.job.chdir=true",
            "hydra.callbacks.sweep.plots=false",  # the report's plots: not what is checked
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    chosen = [ln for ln in proc.stderr.splitlines() if ln.startswith("resume_from=latest:")]
    assert chosen == [f"resume_from=latest: {first} (program axpy, started {_when(started)})"]
    jobs = sorted(p.parent for p in (tmp_path / "outputs" / "multirun").glob("*/*/*/manifest.json"))
    assert len(jobs) == 2
    for job in jobs:
        manifest = read_manifest(job)
        assert manifest["resumed_from"] == str(first.resolve())
        assert manifest["config"]["resume_from"] == str(first)  # the folder, not "latest"
        assert manifest["stages"]["lower"]["status"] == "resumed"
        assert f"- resume_from={first}\n" in (job / ".hydra" / "overrides.yaml").read_text()
    # An override of a loaded section that no finished run agrees with: one line, no run.
    proc = run_cli(["program=mlp", "resume_from=latest", "start_at=compile"], cwd=tmp_path)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line == (
        f"jaxaot: error: resume_from=latest: none of the 3 runs under {tmp_path / 'outputs'} "
        f"that finished stage_out and lower agrees with the command line's program; the "
        f"newest, {jobs[-1]}, has program.name = 'axpy', not 'mlp'; run one with these "
        "options first (jaxaot ... stop_after=lower) or name its folder: resume_from=<run dir>"
    )


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


def test_a_resumed_run_says_what_it_resumed_from(tmp_path: Path) -> None:
    assert run_cli([*AXPY, "stop_after=lower"], cwd=tmp_path).returncode == 0
    [first] = _runs(tmp_path)
    proc = run_cli([*AXPY, "resume_from=latest", "start_at=compile"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("run dir: ")
    assert lines[2] == f"resumed from: {first.resolve()}"
    fresh = run_cli(AXPY, cwd=tmp_path)
    assert "resumed from" not in fresh.stdout


def _tool(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"jaxaot.cli.{module}", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_latest_in_diff_and_graph_is_the_newest_run_that_traced(tmp_path: Path) -> None:
    none = _tool("graph_cmd", "latest", cwd=tmp_path)
    assert (none.returncode, none.stderr) == (
        2,
        f"jaxaot-graph: error: latest: expected a run under {tmp_path / 'outputs'} that "
        "finished stage_out, found none; run one first (jaxaot) or name its folder instead of "
        "latest\n",
    )
    assert run_cli(AXPY, cwd=tmp_path).returncode == 0
    [run] = _runs(tmp_path)
    # newer, but it finished nothing: passed over
    assert run_cli(["program=axpy", "program.args=[f32[4]]"], cwd=tmp_path).returncode == 1
    rel = os.path.relpath(run, tmp_path)
    diff = _tool("diff_cmd", "latest", rel, cwd=tmp_path)
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout.startswith(f"A: {rel} (run: axpy")
    graph = _tool("graph_cmd", "latest", cwd=tmp_path)
    assert graph.returncode == 0, graph.stderr
    assert graph.stdout.splitlines()[0] == f"run: {rel}"
    assert (run / "graph" / "optimized.hlo.dot").is_file()


@pytest.mark.parametrize(
    ("module", "prog", "expected"),
    [
        ("diff_cmd", "jaxaot-diff", "a run directory or a snapshot folder"),
        ("graph_cmd", "jaxaot-graph", "a run directory, a snapshot folder or an HLO text file"),
        ("report_cmd", "jaxaot-report", "a sweep folder (hydra.sweep.dir)"),
    ],
)
def test_a_missing_path_is_one_line_naming_it(
    tmp_path: Path, module: str, prog: str, expected: str
) -> None:
    args = ["no/such", "no/such"] if module == "diff_cmd" else ["no/such"]
    proc = _tool(module, *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr == f"{prog}: error: no/such: no such file or directory; expected {expected}\n"
    )


def test_latest_sweep_is_the_one_started_last(tmp_path: Path) -> None:
    root = tmp_path / "outputs" / "multirun"
    with pytest.raises(ConfigError, match=r"^latest: expected a sweep folder under .*found none"):
        sweep_dir("latest", root)
    made = {}
    for name, when in (("2026-01-01/10-00-00", 300), ("2026-01-02/09-00-00", 200)):
        (root / name).mkdir(parents=True)
        (root / name / "multirun.yaml").write_text("")
        os.utime(root / name / "multirun.yaml", (when, when))
        made[when] = root / name
    (root / "2026-01-03" / "08-00-00").mkdir(parents=True)  # no multirun.yaml: not a sweep
    assert sweep_dir("latest", root) == made[300]  # by start, not by folder name
    assert sweep_dir(str(made[200]), root) == made[200]


def test_latest_run_passes_over_runs_the_overrides_contradict(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    mine = _manifest(out / "d" / "1", 100.0, _config(*AXPY), stage_out="ran", lower="ran")
    _manifest(out / "d" / "2", 200.0, _config(*AXPY[:1], "program.args=[5,6]"), stage_out="ran")
    newest = _manifest(
        out / "d" / "3", 300.0, _config("program=axpy", "program.args=[5,6]"), stage_out="ran"
    )
    typed = _typed(*AXPY, "start_at=lower", "resume_from=latest")
    assert latest_run("lower", out, cfg=typed, overrides=AXPY) == mine
    # The overrides say what the command line asked for: none, any run (the newest).
    assert latest_run("lower", out, cfg=typed, overrides=[]) == newest
    # A key of a section this run computes is no reason to pass a run over.
    assert latest_run("lower", out, cfg=typed, overrides=["lower.platforms=[cpu]"]) == newest
    mlp = _typed("program=mlp", "start_at=lower", "resume_from=latest")
    with pytest.raises(ConfigError) as err:
        latest_run("lower", out, cfg=mlp, overrides=["program=mlp"])
    assert str(err.value) == (
        f"resume_from=latest: none of the 3 runs under {out} that finished stage_out agrees "
        f"with the command line's program; the newest, {newest}, has program.name = 'axpy', "
        "not 'mlp'; run one with these options first (jaxaot ... stop_after=stage_out) or "
        "name its folder: resume_from=<run dir>"
    )
    other = _typed(*AXPY[:1], "program.args=[1,2]", "start_at=compile", "resume_from=latest")
    with pytest.raises(ConfigError) as err:
        latest_run("compile", out, cfg=other, overrides=["program.args=[1,2]"])
    assert str(err.value).startswith(
        f"resume_from=latest: the only run under {out} that finished stage_out and lower, "
        f"{mine}, has program.args = [3, 4], not [1, 2] (the command line's program.args); "
    )


def test_a_contradicted_group_choice_is_named_by_its_first_difference(tmp_path: Path) -> None:
    run = _manifest(tmp_path / "run", 1.0, _config(*AXPY), stage_out="ran", lower="ran")
    with pytest.raises(ConfigError) as err:
        Checkpoint(run).apply(
            _typed("program=mlp", "start_at=compile", "resume_from=x"), ["program=mlp"]
        )
    assert str(err.value) == (
        "program: overridden so that program.name = 'mlp', but start_at=compile resumes "
        f"stages whose options come from the checkpoint (program.name = 'axpy' in {run}); "
        "drop the override or start at an earlier stage"
    )


def test_resume_from_without_a_later_start_at_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_resume_from(_typed(*AXPY, "resume_from=latest"), [])
    assert str(err.value) == (
        "resume_from=latest: set, but start_at=stage_out runs every stage and loads nothing "
        "from it; expected a later start_at (lower, compile, execute), e.g. "
        "resume_from=latest start_at=compile, or no resume_from"
    )
    assert resolve_resume_from(_typed(*AXPY), []) == _typed(*AXPY)  # nothing to resolve


def test_latest_is_resolved_once_per_sweep_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "outputs"
    lowered = {"stage_out": "ran", "lower": "ran"}
    first = _manifest(out / "d" / "1", 100.0, _config(*AXPY), **lowered)
    monkeypatch.setattr(resume, "_launch_outputs", lambda: out)
    monkeypatch.setattr(resume, "_RESOLVED", {})
    monkeypatch.setattr(resume, "_sweep", lambda: "multirun/d/t")
    typed = _typed(*AXPY, "start_at=compile", "resume_from=latest")
    assert resolve_resume_from(typed, AXPY).resume_from == str(first)
    # A later job of the same sweep, after a newer run finished: the same run, announced once.
    newer = _manifest(out / "d" / "2", 200.0, _config(*AXPY), **lowered)
    assert resolve_resume_from(typed, AXPY).resume_from == str(first)
    assert capsys.readouterr().err == (
        f"resume_from=latest: {first} (program axpy, started {_when(100.0)})\n"
    )
    # Outside a sweep (a run from Python), each run takes the newest.
    monkeypatch.setattr(resume, "_sweep", lambda: None)
    assert resolve_resume_from(typed, AXPY).resume_from == str(newer)
    assert capsys.readouterr().err == (
        f"resume_from=latest: {newer} (program axpy, started {_when(200.0)})\n"
    )


def test_the_command_line_is_resolved_before_hydra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out,s"  # a comma: the folder is given quoted (else a sweep)
    run = _manifest(
        out / "outputs" / "d" / "1", 100.0, _config(*AXPY), stage_out="ran", lower="ran"
    )
    args = ["-m", *AXPY, "resume_from=latest", "start_at=compile", "execute.warmup=0,1"]
    assert resolve_latest_argv(args, jaxaot.compose, cwd=out) == [
        *args[:3],
        f"resume_from='{run}'",
        *args[4:],
    ]
    assert capsys.readouterr().err == (
        f"resume_from=latest: {run} (program axpy, started {_when(100.0)})\n"
    )
    # Left for the run to resolve: a config dir, a sweep over a loaded section or over
    # start_at, start_at=stage_out (refused by the run), no latest at all.
    for kept in (
        [*args, "--config-dir=conf2"],
        [*AXPY[:1], "program.args=[3,4],[5,6]", "resume_from=latest", "start_at=compile"],
        [*AXPY, "resume_from=latest", "start_at=lower,compile"],
        [*AXPY, "resume_from=latest"],
        [*AXPY, "start_at=compile", f"resume_from={run}"],
    ):
        assert resolve_latest_argv(kept, jaxaot.compose, cwd=out) == kept
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"has program.args = \[3, 4\], not \[5, 6\]"):
        resolve_latest_argv(
            [*AXPY[:1], "program.args=[5,6]", "resume_from=latest", "start_at=compile"],
            jaxaot.compose,
            cwd=out,
        )


def test_latest_run_does_not_search_the_store_or_below_sweep_jobs(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    job = _manifest(out / "multirun" / "d" / "t" / "0", 100.0, stage_out="ran")
    _manifest(out / "store" / "ab", 200.0, stage_out="ran")  # the store's old default place
    _manifest(out / "multirun" / "d" / "t" / "0x" / "deeper", 300.0, stage_out="ran")
    assert latest_run("lower", out) == job
    _manifest(out / "d" / "store", 400.0, stage_out="ran")  # a run may be named store below
    assert latest_run("lower", out) == out / "d" / "store"
