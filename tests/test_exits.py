"""Honest exits: a run that ends early is recorded, says so in one line, exits non-zero.

``sys.exit(0)`` and ``os._exit(0)`` in a target fail its stage (exit 1), never exit 0 with no
stage run; Ctrl-C and SIGTERM print one line, no traceback, and exit 130 / 143; none leaves the
manifest ``running``.
Every case runs ``jaxaot`` in a subprocess, as a user or a batch system would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jaxaot
import pytest
from conftest import REPO, cli_env, read_manifest, run_cli
from jaxaot.errors import StageError
from jaxaot.util.exits import ProgramExit, Terminated, exit_code, guard_os_exit, signals_raise

pytestmark = pytest.mark.plain_process  # exit statuses and signals of a started `jaxaot`

TARGETS = textwrap.dedent(
    """
    import os
    import sys
    import time

    def calls_sys_exit(x):
        sys.exit(0)

    def calls_os_exit(x):
        os._exit(0)

    def compiles_slowly(x):
        import jax.numpy as jnp

        for i in range(1500):  # ~10 s of XLA:CPU compile, most of it after lowering
            x = jnp.sin(x) * (i % 7) + jnp.cos(x[::-1])
        return x

    def sleeps(x):
        open(os.environ["JAXAOT_TEST_MARKER"], "w").close()  # tracing has begun
        time.sleep(60)
        return x * 2

    class _SignalsWhenCollected:
        def __del__(self):  # Python drops what a __del__ raises (as for JAX's gc callback)
            os.kill(os.getpid(), int(os.environ["JAXAOT_TEST_SIGNAL"]))
            time.sleep(0.5)  # the handler runs here, and its exception is dropped

    def signalled_where_python_drops_it(x):
        _SignalsWhenCollected()
        return x * 2
    """
)


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "exit_targets.py").write_text(TARGETS)
    return cli_env(PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]), JAX_PLATFORMS="cpu")


def _jaxaot_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("jaxaot:")]


@pytest.mark.parametrize("target", ["calls_sys_exit", "calls_os_exit"])
def test_a_target_that_exits_fails_its_stage(
    tmp_path: Path, user_env: dict[str, str], target: str
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            f"program.target=exit_targets:{target}",
            "program.args=[f32[4]]",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=user_env,
    )
    assert proc.returncode == 1, proc.stderr  # the stage fails: never 0 with no stage run
    how = "sys.exit" if target == "calls_sys_exit" else "os._exit"
    message = (
        f"stage 'stage_out' failed: the program called {how}(0); expected it to return "
        "its result, not end the process"
    )
    assert _jaxaot_lines(proc.stderr) == [f"jaxaot: error: {message}"]
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["error"]) == ("failed", message)
    assert manifest["stages"]["stage_out"]["status"] == "failed"


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        (signal.SIGINT, 130, "interrupted by Ctrl-C (SIGINT)"),
        (signal.SIGTERM, 143, "terminated by SIGTERM"),
    ],
)
def test_a_signal_ends_the_run_as_interrupted(
    tmp_path: Path, user_env: dict[str, str], sig: int, code: int, line: str
) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "tracing"
    user_env = {**user_env, "JAXAOT_TEST_MARKER": str(marker)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxaot",
            "program.target=exit_targets:sleeps",
            "program.args=[f32[4]]",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=user_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not marker.exists():  # the run has begun, and is tracing the target (stage_out)
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    assert (run_dir / "manifest.json").exists()
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10  # promptly, not after the target's 60 s
    assert proc.returncode == code
    manifest_path = run_dir / "manifest.json"
    assert _jaxaot_lines(stderr) == [
        f"jaxaot: {line} during stage 'stage_out'; recorded as interrupted in {manifest_path}"
    ]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "interrupted"
    assert manifest["error"] == f"{line} during stage 'stage_out'"
    assert manifest["stages"]["stage_out"]["status"] == "interrupted"


def test_ctrl_c_during_a_compile_exits_without_waiting_for_xla(
    tmp_path: Path, user_env: dict[str, str]
) -> None:
    import json

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxaot",
            "program.target=exit_targets:compiles_slowly",
            "program.args=[f32[64]]",
            "stop_after=compile",
            "store.enabled=false",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=user_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while True:  # until lowering is recorded: the compile (started during lowering) runs on
        try:
            if "lower" in json.loads((run_dir / "manifest.json").read_text())["stages"]:
                break
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.5)  # into the compile stage, waiting for XLA
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    waited = time.monotonic() - t0
    assert proc.returncode == 130
    assert _jaxaot_lines(stderr)[0].startswith(
        "jaxaot: interrupted by Ctrl-C (SIGINT) during stage 'compile'; recorded"
    )
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "interrupted"
    assert manifest["stages"]["compile"]["status"] == "interrupted"  # it had not finished
    assert waited < 1.0  # the compile was left behind, not waited for


def test_a_sweep_jobs_exit_is_that_jobs_failure_row(
    tmp_path: Path, user_env: dict[str, str]
) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "program.target=exit_targets:calls_sys_exit,jax.numpy:sin",
            "program.args=[f32[4]]",
            "stop_after=lower",
            "hydra.callbacks.sweep.plots=false",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=user_env,
    )
    assert proc.returncode == 1  # one job failed; the sweep went on to the next
    assert read_manifest(sweep / "0")["status"] == "failed"
    assert "called sys.exit(0)" in read_manifest(sweep / "0")["error"]
    assert read_manifest(sweep / "1")["status"] == "ok"
    assert "sweep: 2 jobs, 1 ok, 1 failed" in proc.stdout


# --- in-process: the guards, and jaxaot.run from Python ------------------------------------


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        (signal.SIGINT, 130, "interrupted by Ctrl-C (SIGINT)"),
        (signal.SIGTERM, 143, "terminated by SIGTERM"),
    ],
)
def test_an_interrupt_python_drops_still_ends_the_run(
    tmp_path: Path, user_env: dict[str, str], sig: int, code: int, line: str
) -> None:
    """A signal whose exception is raised where Python drops it (a __del__, JAX's gc callback)
    ends the run after the stage as ``interrupted``, never as ``ok`` with exit 0."""
    proc = run_cli(
        [
            "program.target=exit_targets:signalled_where_python_drops_it",
            "program.args=[f32[4]]",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        env={**user_env, "JAXAOT_TEST_SIGNAL": str(int(sig))},
    )
    assert proc.returncode == code, proc.stderr
    assert "Exception ignored in" in proc.stderr  # Python did drop it
    manifest = read_manifest(tmp_path / "run")
    assert manifest["status"] == "interrupted"
    assert manifest["error"] == f"{line} during stage 'stage_out'"
    # The stage finished (the signal's exception was dropped inside it); no later one ran.
    assert manifest["stages"]["stage_out"]["status"] == "ran"
    assert "lower" not in manifest["stages"]


def test_os_exit_is_guarded_only_inside_the_block() -> None:
    real = os._exit
    with guard_os_exit(), pytest.raises(ProgramExit) as info:
        os._exit(3)
    assert info.value.code == 3 and os._exit is real


def test_sigterm_raises_only_inside_the_block_and_keeps_a_callers_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with signals_raise(), pytest.raises(Terminated) as info:
        signal.raise_signal(signal.SIGTERM)
    assert exit_code(info.value) == 143 and signal.getsignal(signal.SIGTERM) is before
    caught: list[int] = []

    def callers(signum: int, frame: object) -> None:
        caught.append(signum)

    old = signal.signal(signal.SIGTERM, callers)
    try:
        with signals_raise():
            assert signal.getsignal(signal.SIGTERM) is callers  # a caller's handler is kept
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert caught == [signal.SIGTERM]
    assert exit_code(KeyboardInterrupt()) == 130


def test_python_run_turns_sys_exit_into_a_stage_error(
    tmp_path: Path, user_env: dict[str, str]
) -> None:
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = jaxaot.compose(
            ["program.target=exit_targets:calls_sys_exit", "program.args=[f32[4]]"]
        )
        with pytest.raises(StageError, match=r"called sys\.exit\(0\)"):
            jaxaot.run(cfg, run_dir=tmp_path / "r")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("exit_targets", None)
    assert read_manifest(tmp_path / "r")["status"] == "failed"


def test_a_job_systems_preemption_is_interrupted_not_the_programs_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SLURM launcher says a preemption is coming; submitit's SystemExit then ends the run
    as interrupted (and still exits), not as a stage failure of the program's."""
    from jaxaot.util import exits

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # aot_programs
    monkeypatch.setattr(exits, "_preempted", None)
    run_dir = tmp_path / "pre"
    with pytest.raises(SystemExit) as info:
        jaxaot.run(
            jaxaot.compose(["program.target=aot_programs:preempted", "program.args=[f32[2]]"]),
            run_dir=run_dir,
        )
    assert info.value.code == -1 and not isinstance(info.value, ProgramExit)
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "interrupted"
    assert manifest["error"] == "preempted by a test during stage 'stage_out'"
    assert manifest["stages"]["stage_out"]["status"] == "interrupted"
