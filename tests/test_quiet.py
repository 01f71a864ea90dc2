"""Quiet runs: the summary (a sweep: its progress and report lines) is the screen output.

jaxaot's INFO lines (``[lower] ran in 0.11 s``, cache hits and misses) go to the run's
``jaxaot.log``; Hydra's launch lines to the sweep's ``multirun.log``; ``-v`` / ``--verbose`` /
``verbose=true`` shows them on the screen too; warnings and errors always reach stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import SuiteServer, cli_env, run_cli, served_env
from jaxaot.rundir.logs import (
    end_launch_lines,
    hold_stage_warnings,
    log_launch_lines,
    release_stage_warnings,
    show_info,
    verbose_argv,
)

pytestmark = pytest.mark.plain_process  # what a started `jaxaot` prints

AXPY = ["program=axpy", "program.args=[3,4]"]
INFO = "[jaxaot][INFO]"
# log of a random normal input: NaN for the negative ones, a stage warning (execute's)
LOG = ["program.target=jax.numpy:log", "program.args=[f32[16]]"]


def _run_once(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None, *args: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot <args>``, started as this module's tests start it, in a folder of its own (its
    own store and config folders): the finished process and its run dir."""
    home = tmp_path_factory.mktemp("run")
    own = {"JAXAOT_STORE_DIR": str(home / "store"), "XDG_CONFIG_HOME": str(home / "config")}
    # a plain process, as a plain_process test's own runs; through the suite's server only under
    # JAXAOT_TEST_SERVER=1 (make test-server), which sends those through it too
    every_run_served = os.environ.get("JAXAOT_TEST_SERVER") == "1"
    env = served_env(suite_server, **own) if every_run_served else cli_env(**own)
    run_dir = home / "run"
    return run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=home, env=env), run_dir


@pytest.fixture(scope="module")
def quiet_run(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot`` of :data:`LOG`, every stage: a run whose execute stage warns."""
    return _run_once(tmp_path_factory, suite_server, *LOG)


@pytest.fixture(scope="module")
def verbose_run(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot -v`` of :data:`LOG`, every stage."""
    return _run_once(tmp_path_factory, suite_server, "-v", *LOG)


def test_a_run_prints_its_summary_and_logs_its_stage_lines(
    quiet_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = quiet_run
    assert proc.returncode == 0, proc.stderr
    screen = proc.stdout + proc.stderr
    assert INFO not in screen and "ran in" not in screen
    assert proc.stdout.startswith("jaxaot · log") and proc.stderr == ""
    log = (run_dir / "jaxaot.log").read_text()
    assert f"{INFO} - [stage_out] ran in" in log and f"{INFO} - [lower] ran in" in log


def test_verbose_shows_the_stage_lines_on_stderr(
    verbose_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = verbose_run
    assert proc.returncode == 0, proc.stderr
    shown = [ln for ln in proc.stderr.splitlines() if INFO in ln]
    assert any("[lower] ran in" in ln for ln in shown), proc.stderr
    assert INFO not in proc.stdout  # the summary stays alone on stdout
    assert "[lower] ran in" in (run_dir / "jaxaot.log").read_text()


def test_a_stage_warning_shows_once_in_the_summary(
    quiet_run: tuple[subprocess.CompletedProcess[str], Path],
    verbose_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, run_dir = quiet_run
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not also as a log line
    [shown] = [ln for ln in proc.stdout.splitlines() if "non-finite" in ln]
    assert shown.startswith("warning: execute: non-finite values")
    [logged] = [ln for ln in (run_dir / "jaxaot.log").read_text().splitlines() if "[WARNING]" in ln]
    assert "[execute] non-finite values" in logged
    verbose, _ = verbose_run
    assert verbose.returncode == 0, verbose.stderr
    [line] = [ln for ln in verbose.stderr.splitlines() if "[WARNING]" in ln]
    assert "[execute] non-finite values" in line


def _console(run_dir: Path) -> tuple[logging.Handler, list[str]]:
    """A screen handler named as Hydra's job logging names it, its lines, and the held
    stage warnings for a job in ``run_dir``."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.set_name("console")
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    return handler, lines


def _manifest(run_dir: Path, status: str, warnings: list[str]) -> None:
    run_dir.mkdir(exist_ok=True)
    stages = {"execute": {"status": "ran", "warnings": warnings}}
    (run_dir / "manifest.json").write_text(json.dumps({"status": status, "stages": stages}))


@pytest.mark.parametrize(
    ("status", "recorded", "printed", "shown"),
    [
        ("ok", ["non-finite values"], None, []),  # the summary showed it
        ("running", [], None, ["[execute] non-finite values"]),  # ended before its summary
        ("failed", ["another"], None, ["[execute] non-finite values"]),  # not recorded
        ("ok", ["non-finite values"], False, ["[execute] non-finite values"]),  # nothing printed
    ],
)
def test_held_stage_warnings_show_unless_the_summary_showed_them(
    tmp_path: Path, status: str, recorded: list[str], printed: bool | None, shown: list[str]
) -> None:
    handler, lines = _console(tmp_path)
    log = logging.getLogger("jaxaot")
    try:
        hold_stage_warnings(tmp_path, summary=True)
        log.warning("[%s] %s", "execute", "non-finite values")
        log.warning("store: not shared")  # no stage's warning: on the screen at once
        assert lines == ["store: not shared"]
        _manifest(tmp_path, status, recorded)
        release_stage_warnings(printed=printed)
        assert lines == ["store: not shared", *shown]
        release_stage_warnings()  # idempotent; the filter is gone
        log.warning("[%s] %s", "execute", "after the run")
        assert lines[-1] == "[execute] after the run"
    finally:
        logging.getLogger().removeHandler(handler)


def test_a_two_job_sweep_prints_its_progress_lines_and_report_only(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(
        ["-m", *AXPY, "stop_after=lower", "execute.repeats=1,2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert re.match(r"\[1/2\] repeats=1 \| ok \|", lines[0]), lines[0]
    assert re.match(r"\[2/2\] repeats=2 \| ok \|", lines[1]), lines[1]
    assert lines[2] == f"sweep: 2 jobs, 2 ok, 0 failed; report: {sweep / 'sweep.md'}"
    assert "[HYDRA]" not in proc.stdout + proc.stderr and INFO not in proc.stdout + proc.stderr
    launched = (sweep / "multirun.log").read_text()
    assert "[HYDRA] Launching 2 jobs locally" in launched and "\t#1 : " in launched
    for job in ("0", "1"):
        assert f"{INFO} - [lower] ran in" in (sweep / job / "jaxaot.log").read_text()


def test_a_verbose_sweep_shows_the_launch_and_stage_lines(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "-v",
            *AXPY,
            "stop_after=stage_out",
            "execute.repeats=1,2",
            "hydra.callbacks.sweep.plots=false",  # the launch and stage lines are what is shown
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    screen = proc.stdout + proc.stderr
    assert "[HYDRA] Launching 2 jobs locally" in screen and "[stage_out] ran in" in screen
    assert "Launching 2 jobs locally" in (sweep / "multirun.log").read_text()


def test_the_flags_become_one_override() -> None:
    assert verbose_argv(["-v", "program=mlp", "--verbose", "-m"]) == [
        "verbose=true",
        "program=mlp",
        "verbose=true",
        "-m",
    ]
    assert verbose_argv(["program.name=-v"]) == ["program.name=-v"]  # a value, not a flag


def test_show_info_lowers_only_the_console_handler() -> None:
    root = logging.getLogger()
    console, other = logging.StreamHandler(), logging.StreamHandler()
    console.set_name("console")
    console.setLevel(logging.WARNING)
    other.setLevel(logging.WARNING)
    root.addHandler(console)
    root.addHandler(other)
    try:
        show_info(False)
        assert console.level == logging.WARNING
        show_info(True)
        assert console.level == logging.INFO and other.level == logging.WARNING
    finally:
        root.removeHandler(console)
        root.removeHandler(other)


def test_launch_lines_go_to_the_sweep_log_and_the_screen_only_when_verbose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = logging.getLogger("hydra._internal.core_plugins.basic_launcher")
    for verbose in (False, True):
        sweep = tmp_path / str(verbose)
        sweep.mkdir()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            log_launch_lines(sweep, verbose)
            try:
                launcher.info("Launching 1 jobs locally")
            finally:
                end_launch_lines(sweep)
            launcher.info("after the sweep")
        written = (sweep / "multirun.log").read_text().splitlines()
        assert len(written) == 1 and written[0].endswith("[HYDRA] Launching 1 jobs locally")
        shown = [r.getMessage() for r in caplog.records]
        assert ("Launching 1 jobs locally" in shown) == verbose
        assert "after the sweep" in shown and launcher.propagate


def test_a_launchers_warning_still_reaches_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher = logging.getLogger("hydra._internal.core_plugins.basic_launcher")
    log_launch_lines(tmp_path, False)
    try:
        launcher.warning("a job could not be launched")
    finally:
        end_launch_lines(tmp_path)
    assert capsys.readouterr().err.endswith("[HYDRA] a job could not be launched\n")
    assert "a job could not be launched" in (tmp_path / "multirun.log").read_text()
