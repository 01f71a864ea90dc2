"""The resident server (pipeline/server.py): runs through it are the runs without it."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env, run_cli

AXPY = ["program=axpy", "program.args=[3,4]", "execute.repeats=1"]


def _same(text: str) -> str:
    """Output with what differs between any two runs (times, dated run dirs) masked."""
    text = re.sub(r"\d+(\.\d+)? ?(ms|us|s)\b", "<t>", text)
    text = re.sub(r"run dir: .*", "run dir: <dir>", text)
    text = re.sub(r"\[\d{4}-\d\d-\d\d [\d:,]+\]", "[<when>]", text)
    return re.sub(r" +", " ", text)  # columns are as wide as the times in them


def _status(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "server", "status"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _served(env: dict[str, str]) -> int:
    out = _status(env).stdout
    return int(out.rsplit(",", 1)[1].split()[0]) if "runs served" in out else -1


@pytest.fixture(autouse=True)
def _servers_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest turns the server off for every other test; these turn it on, per socket."""
    monkeypatch.delenv("JAXAOT_SERVER", raising=False)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A server on a private socket; yields the environment whose ``jaxaot`` uses it."""
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / "srv" / "server.sock"))
    start = subprocess.run([sys.executable, "-m", "pipeline.cli", "server", "start"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert start.returncode == 0 and "started" in start.stdout, start.stderr
    try:
        yield env
    finally:
        subprocess.run([sys.executable, "-m", "pipeline.cli", "server", "stop"], env=env,
                       capture_output=True, timeout=60)  # fmt: skip


def test_socket_is_owner_only(server: dict[str, str]) -> None:
    sock = Path(server["JAXAOT_SERVER_SOCKET"])
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


def test_runs_through_the_server_match_runs_without_it(server, tmp_path: Path) -> None:
    alone = {**server, "JAXAOT_SERVER": "0"}
    cases = [
        [*AXPY, "--cfg", "job"],  # printed config
        ["--info"],  # Hydra's view of the app: the config dir as `python -m pipeline.cli` has it
        ["program=axpy", "execute.nope=1"],  # a one-line error, exit 1
        ["program=axpy", "program.args=[3]"],  # an error from the run itself
    ]
    for args in cases:
        via = run_cli(args, cwd=tmp_path, env=server)
        direct = run_cli(args, cwd=tmp_path, env=alone)
        assert (via.returncode, _same(via.stdout)) == (direct.returncode, _same(direct.stdout))
        assert _same(via.stderr) == _same(direct.stderr)
    assert _served(server) == len(cases)
    # A whole run: relative run dir under the client's cwd, the client's store, same outputs.
    work = tmp_path / "work"
    work.mkdir()
    env = {**server, "JAXAOT_STORE_DIR": "mystore"}
    via = run_cli([*AXPY, "hydra.run.dir=rel/run"], cwd=work, env=env)
    direct = run_cli(
        [*AXPY, "hydra.run.dir=rel/direct"], cwd=work, env={**env, "JAXAOT_SERVER": "0"}
    )
    assert via.returncode == direct.returncode == 0, via.stderr
    # The served run stored the executable in the client's ./mystore: the direct run loads it.
    assert (work / "mystore").is_dir() and re.search(r"^compile\s+cached", direct.stdout, re.M)
    outs = [
        np.load(work / "rel" / d / "execute" / "outputs.npz")["out0"] for d in ("run", "direct")
    ]
    assert outs[0].tobytes() == outs[1].tobytes() and float(outs[0]) == 10.0
    assert _served(server) == len(cases) + 1


def test_another_jax_environment_runs_in_process(server, tmp_path: Path) -> None:
    env = {**server, "JAX_ENABLE_X64": "1"}  # JAX reads it at import: the server's imports differ
    proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "program:" in proc.stdout
    assert _served(server) == 0


def test_a_changed_module_restarts_the_server(server, tmp_path: Path) -> None:
    assert run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=server).returncode == 0
    assert _served(server) == 1
    import pipeline.errors as mod  # imported by the server (and by every run)

    path = Path(mod.__file__)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    try:
        proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=server)  # declined: in-process
        assert proc.returncode == 0 and "program:" in proc.stdout
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _served(server) != 0:  # re-executed: count reset
            time.sleep(0.1)
        assert _served(server) == 0
        proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=server)
        assert proc.returncode == 0 and _served(server) == 1  # the fresh server serves again
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_ctrl_c_reaches_the_run_and_its_status_comes_back(server, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "program=transformer_train", "store.enabled=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=server, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "run" / "stage_out").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err.splitlines()[-1]
    assert _served(server) == 1


def test_server_command_errors_and_status_without_a_server(tmp_path: Path) -> None:
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / "none" / "server.sock"))
    assert _status(env).returncode == 3 and "not running" in _status(env).stdout
    bad = subprocess.run([sys.executable, "-m", "pipeline.cli", "server", "bogus"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "jaxaot: error: jaxaot server: expected start, stop, status or restart; found 'bogus'"
    )


def test_jaxaot_server_1_starts_one_for_the_next_runs(tmp_path: Path) -> None:
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / "auto" / "server.sock"), JAXAOT_SERVER="1")
    try:
        first = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=env)  # in-process
        assert first.returncode == 0 and "program:" in first.stdout
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _served(env) < 0:
            time.sleep(0.1)
        second = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=env)
        assert (second.returncode, second.stdout) == (0, first.stdout)
        assert _served(env) == 1
    finally:
        subprocess.run([sys.executable, "-m", "pipeline.cli", "server", "stop"], env=env,
                       capture_output=True, timeout=60)  # fmt: skip


_HELP = """
import sys
sys.argv = ["jaxaot", *sys.argv[1:]]
import pipeline.cli as cli
if sys.argv[1] == "--unshared":
    del sys.argv[1]
    cli._share_help_repository = lambda argv: None
try:
    cli.main()
finally:
    print("JAX IMPORTED" if "jax" in sys.modules else "no jax", file=sys.stderr)
"""


def test_help_is_hydras_help_without_its_repository_copies(tmp_path: Path) -> None:
    env = cli_env(JAXAOT_SERVER="0")
    for args in (["--help"], ["program=mlp", "--help"]):
        fast, slow = (
            subprocess.run(
                [sys.executable, "-c", _HELP, *pre, *args],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )
            for pre in ([], ["--unshared"])
        )
        assert fast.returncode == slow.returncode == 0, fast.stderr
        assert fast.stdout == slow.stdout and "== Config groups" in fast.stdout
        assert "what to compile: attention, axpy" in fast.stdout
        assert fast.stderr.splitlines()[-1] == "no jax"
