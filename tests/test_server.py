"""The resident server (jaxaot.cli.server), whole: runs through it are the runs without it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, cli_env, read_manifest, run_cli

AXPY = ["program=axpy", "program.args=[3,4]", "execute.repeats=1"]
SERVER = [sys.executable, "-m", "jaxaot", "server"]


def _same(text: str) -> str:
    """Output with what differs between any two runs (times, dated run dirs) masked."""
    text = re.sub(r"\d+(\.\d+)? ?(ms|us|s)\b", "<t>", text)
    text = re.sub(r"run dir: .*", "run dir: <dir>", text)
    text = re.sub(r"\[\d{4}-\d\d-\d\d [\d:,]+\]", "[<when>]", text)
    return re.sub(r" +", " ", text)  # columns are as wide as the times in them


def _status(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVER, "status"], env=env, capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def _socket_of(env: dict[str, str]) -> Iterator[None]:
    """This process's JAXAOT_SERVER_SOCKET set to ``env``'s while in the block, and a server
    that does not answer within 60 s (the command's process limit) taken as none."""
    before = os.environ.get("JAXAOT_SERVER_SOCKET")
    timeout = socket.getdefaulttimeout()
    os.environ["JAXAOT_SERVER_SOCKET"] = env["JAXAOT_SERVER_SOCKET"]
    socket.setdefaulttimeout(60)
    try:
        yield
    finally:
        socket.setdefaulttimeout(timeout)
        if before is None:
            del os.environ["JAXAOT_SERVER_SOCKET"]
        else:
            os.environ["JAXAOT_SERVER_SOCKET"] = before


def _status_text(env: dict[str, str]) -> str:
    """What ``jaxaot server status`` prints for the server at ``env``'s socket: the command's
    own code (jaxaot.cli.server.commands), run in this process, asks the server over its socket
    as the command's process does. (:func:`_status` starts that process.)"""
    from jaxaot.cli.server.commands import command

    out = io.StringIO()
    with (
        _socket_of(env),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        command(["status"])
    return out.getvalue()


def _figures(out: str, *what: str) -> tuple[int, ...]:
    """The figures a status line ``out`` prints before each of ``what``; -1 for one it does
    not print (no server)."""
    return tuple(int(m[1]) if (m := re.search(rf"(\d+) {w}", out)) else -1 for w in what)


def _counts(env: dict[str, str], *what: str) -> tuple[int, ...]:
    """The figures ``jaxaot server status`` prints before each of ``what`` ("runs served",
    "declined", ...), from one status; -1 for one it does not print (no server)."""
    return _figures(_status_text(env), *what)


def _count(env: dict[str, str], what: str = "runs served") -> int:
    return _counts(env, what)[0]


def _stop(env: dict[str, str]) -> None:
    subprocess.run([*SERVER, "stop"], env=env, capture_output=True, timeout=60)


def _serve(folder: Path) -> dict[str, str]:
    """Start a server on a private socket under ``folder``; the environment whose ``jaxaot``
    uses it. ``folder`` is on PYTHONPATH (read at start-up, so the server's too): the user
    programs a test writes there import in the runs."""
    env = cli_env(JAXAOT_SERVER_SOCKET=str(folder / "srv" / "server.sock"))
    env["PYTHONPATH"] = f"{folder}{os.pathsep}{env['PYTHONPATH']}"
    env.pop("JAXAOT_SERVER", None)
    start = subprocess.run([*SERVER, "start"], env=env, capture_output=True, text=True, timeout=120)
    assert start.returncode == 0 and "started" in start.stdout, start.stderr
    return env


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A server of the test's own, ``tmp_path`` on its PYTHONPATH: for a test that restarts it
    (its counts start again from 0)."""
    env = _serve(tmp_path)
    try:
        yield env
    finally:
        _stop(env)


def _code_stamp() -> tuple[int, int]:
    """How many of the checkout's modules there are and when the newest changed: a server
    restarts (its counts from 0) at its first request after one of the modules it imported
    changed."""
    times = [
        max(st.st_mtime_ns, st.st_ctime_ns)
        for folder in ("pipeline", "stages", "jaxaot_examples", "hydra_plugins", "conf")
        for st in (p.stat() for p in (REPO / folder).rglob("*.py"))
    ]
    return len(times), max(times)


@pytest.fixture(scope="module")
def _module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    served = {"code": _code_stamp()}
    served["env"] = _serve(tmp_path_factory.mktemp("served"))
    try:
        yield served
    finally:
        _stop(served["env"])


@pytest.fixture
def shared(_module_server: dict[str, Any]) -> dict[str, str]:
    """The module's server, for the tests that read only what it did for their own runs (its
    counts before and after them): the environment whose ``jaxaot`` uses it, with this test's
    own store and config folders. The user programs a test writes go in :func:`_programs`.
    After an edit of the checkout's code it is restarted first, as a server of the test's own
    would start on the edited code."""
    served = _module_server["env"]
    if _code_stamp() != _module_server["code"]:
        _module_server["code"] = _code_stamp()
        restart = subprocess.run(
            [*SERVER, "restart"], env=served, capture_output=True, text=True, timeout=120
        )
        assert restart.returncode == 0 and "started" in restart.stdout, restart.stderr
    env = cli_env(
        JAXAOT_SERVER_SOCKET=served["JAXAOT_SERVER_SOCKET"], PYTHONPATH=served["PYTHONPATH"]
    )
    env.pop("JAXAOT_SERVER", None)
    return env


def _programs(env: dict[str, str]) -> Path:
    """The folder on the server's PYTHONPATH that the runs import user programs from."""
    return Path(env["PYTHONPATH"].split(os.pathsep)[0])


def test_socket_is_owner_only(shared: dict[str, str]) -> None:
    sock = Path(shared["JAXAOT_SERVER_SOCKET"])
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


def test_runs_through_the_server_match_runs_without_it(shared, tmp_path: Path) -> None:
    server = shared
    served = _count(server)
    alone = {**server, "JAXAOT_SERVER": "0"}
    cases = [
        [*AXPY, "--cfg", "job"],  # printed config
        ["--info"],  # Hydra's view of the app
        ["program=axpy", "execute.nope=1"],  # a one-line error, exit 1
        ["program=axpy", "program.args=[3]"],  # an error from the run itself
        ["--version"],
    ]
    for args in cases:
        via = run_cli(args, cwd=tmp_path, env=server)
        direct = run_cli(args, cwd=tmp_path, env=alone)
        assert (via.returncode, _same(via.stdout)) == (direct.returncode, _same(direct.stdout))
        assert _same(via.stderr) == _same(direct.stderr)
    assert _count(server) - served == len(cases)
    # A whole run: relative run dir under the client's cwd, the client's store, same outputs,
    # whichever way jaxaot is called.
    work = tmp_path / "work"
    work.mkdir()
    env = {**server, "JAXAOT_STORE_DIR": "mystore"}
    jaxaot_script = str(Path(sys.executable).with_name("jaxaot"))
    ways = {
        "script": [jaxaot_script],
        "module": [sys.executable, "-m", "jaxaot"],
        "in-process": [sys.executable, "-m", "jaxaot.cli.main"],  # the module itself: never served
    }
    for name, cmd in ways.items():
        via = subprocess.run(
            [*cmd, *AXPY, f"hydra.run.dir=rel/{name}"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert via.returncode == 0, via.stderr
    direct = run_cli(
        [*AXPY, "hydra.run.dir=rel/direct"], cwd=work, env={**env, "JAXAOT_SERVER": "0"}
    )
    assert direct.returncode == 0, direct.stderr
    # The served runs stored the executable in the client's ./mystore: the direct run loads it.
    assert (work / "mystore").is_dir() and re.search(r"^compile\s+cached", direct.stdout, re.M)
    outs = [
        np.load(work / "rel" / d / "execute" / "outputs.npz")["out0"] for d in (*ways, "direct")
    ]
    assert all(o.tobytes() == outs[-1].tobytes() for o in outs) and float(outs[0]) == 10.0
    # the count as the `jaxaot server status` process prints it
    assert _figures(_status(server).stdout, "runs served")[0] - served == len(cases) + 2


def test_another_jax_environment_runs_in_process(shared, tmp_path: Path) -> None:
    before = _counts(shared, "runs served", "declined")
    env = {**shared, "JAX_ENABLE_X64": "1"}  # JAX reads it at import: the server's imports differ
    proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "program:" in proc.stdout
    after = _counts(shared, "runs served", "declined")
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)


def test_a_client_started_by_a_process_that_ran_jax_is_served(shared, tmp_path: Path) -> None:
    """A process that ran JAX (a notebook, a script, a pytest worker) has the variables JAX's
    start set in its environment; a `jaxaot` it starts is served all the same."""
    import jax
    from conftest import JAX_START_VALUES, START_ENV

    if "TF_CPP_MIN_LOG_LEVEL" in START_ENV:
        pytest.skip("TF_CPP_MIN_LOG_LEVEL is set where the suite started: JAX's import keeps it")
    jax.devices()  # JAX's start, in this process: TF_CPP_MIN_LOG_LEVEL and, with libtpu, more
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    before = _counts(shared, "runs served", "declined")
    started_by_jax = {**shared, "TF_CPP_MIN_LOG_LEVEL": "1"}
    proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=started_by_jax)
    assert proc.returncode == 0 and "program:" in proc.stdout
    after = _counts(shared, "runs served", "declined")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    # The suite's environment for the runs it starts leaves out the rest of what JAX's start
    # set in this worker (libtpu's TPU_LIBRARY_PATH, TPU_SKIP_MDS_QUERY): the runs set them.
    env = cli_env()
    for key, value in JAX_START_VALUES.items():
        assert env.get(key) != value or START_ENV.get(key) == value, key


def test_a_client_that_compiled_for_a_gpu_is_served_and_its_run_reads_its_own_value(
    shared, tmp_path: Path
) -> None:
    """A process that compiled for a GPU in-process (jaxaot.targets.cuda.prepare) has the CUDA
    plugin's check skipped; a `jaxaot` it starts is served, and its run sees the variable as
    the client has it (the plugin reads it as the run starts JAX's backends)."""
    (_programs(shared) / "cuda_check_prog.py").write_text(CUDA_CHECK)
    out = tmp_path / "seen.txt"
    before = _counts(shared, "runs served", "declined")
    env = {**shared, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "SEEN_OUT": str(out)}
    proc = run_cli(
        ["program.target=cuda_check_prog:f", "program.args=[f32[2]]", "stop_after=stage_out"],
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    after = _counts(shared, "runs served", "declined")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    assert out.read_text() == "1"


USER_PROGRAM = """
import jax.numpy as jnp

def f(x):
    return jnp.sin(x) * 3 + jnp.cumsum(x)
"""

STARTUP_HOOK = """
import builtins
builtins.SEEN_BY_SITECUSTOMIZE = "hook ran"
"""

HOOKED_PROGRAM = """
import builtins, os

def f(x):
    with open(os.environ["SEEN_OUT"], "w") as fh:
        fh.write(getattr(builtins, "SEEN_BY_SITECUSTOMIZE", "no hook"))
    return x * 2
"""


def test_a_client_with_its_own_pythonpath_is_served_with_the_same_outputs(
    shared, tmp_path: Path
) -> None:
    """`PYTHONPATH=src jaxaot program.target=...`: the user's folder on the client's path is
    the run's too; outputs equal the in-process run's bit for bit. A folder with a start-up
    hook (sitecustomize.py, which the client's interpreter ran) is not served: its run shows
    what the hook did, as in-process."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "user_prog.py").write_text(USER_PROGRAM)
    env = {**shared, "PYTHONPATH": f"{src}{os.pathsep}{shared['PYTHONPATH']}"}
    args = ["program.target=user_prog:f", "program.args=[f32[64]]", "execute.seed=3"]
    before = _counts(shared, "runs served", "declined")
    via = run_cli([*args, "hydra.run.dir=via"], cwd=tmp_path, env=env)
    after = _counts(shared, "runs served", "declined")
    direct = run_cli(
        [*args, "hydra.run.dir=direct"], cwd=tmp_path, env={**env, "JAXAOT_SERVER": "0"}
    )
    assert via.returncode == direct.returncode == 0, via.stderr + direct.stderr
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    outs = [np.load(tmp_path / d / "execute" / "outputs.npz")["out0"] for d in ("via", "direct")]
    assert outs[0].tobytes() == outs[1].tobytes() and outs[0].shape == (64,)

    hooked = tmp_path / "hooked"
    hooked.mkdir()
    (hooked / "sitecustomize.py").write_text(STARTUP_HOOK)
    (hooked / "hooked_prog.py").write_text(HOOKED_PROGRAM)
    seen = tmp_path / "seen.txt"
    env = {
        **shared,
        "PYTHONPATH": f"{hooked}{os.pathsep}{shared['PYTHONPATH']}",
        "SEEN_OUT": str(seen),
    }
    args = ["program.target=hooked_prog:f", "program.args=[f32[2]]", "stop_after=stage_out"]
    before = _counts(shared, "runs served", "declined")
    proc = run_cli(args, cwd=tmp_path, env=env)
    after = _counts(shared, "runs served", "declined")
    assert proc.returncode == 0, proc.stderr
    assert (after[0] - before[0], after[1] - before[1]) == (0, 1)
    assert seen.read_text() == "hook ran"


def test_the_warm_up_starts_no_backend_and_discovers_no_plugin() -> None:
    """The server's warm-up leaves JAX's backends and PJRT plugins to each child, which starts
    them with its client's environment; the warm-up refuses to serve otherwise."""
    probe = (
        "from jaxaot.cli.server.daemon import preimport; preimport(); "
        "from jaxaot.compat import jax as c; import jax; "
        "print(c.backends_started(), c.plugins_discovered()); jax.devices(); "
        "print(c.backends_started(), c.plugins_discovered())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False False", "True True"]


PATCHED_THEN_ENTRY = """
import runpy, sys
import jaxaot.engine.runner as runner

run = runner.run

def announced(*a, **k):
    print("PATCHED RUN", flush=True)
    return run(*a, **k)

runner.run = announced
sys.argv = ["jaxaot", *sys.argv[1:]]
runpy.run_module("jaxaot", run_name="__main__")
"""


def test_a_script_that_set_jaxaot_up_first_runs_its_jaxaot_itself(shared, tmp_path: Path) -> None:
    """A script that patched (or configured) jaxaot, JAX or Hydra and then called the `jaxaot`
    entry gets its run in its own process, as it set it up: a server's child has copies of
    its own. The server is not even asked."""
    before = _counts(shared, "runs served", "declined")
    proc = subprocess.run(
        [sys.executable, "-c", PATCHED_THEN_ENTRY, *AXPY, "stop_after=stage_out"],
        cwd=tmp_path,
        env=shared,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PATCHED RUN" in proc.stdout
    assert _counts(shared, "runs served", "declined") == before


CUDA_CHECK = """
import os

def f(x):
    with open(os.environ["SEEN_OUT"], "w") as fh:
        fh.write(os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "unset"))
    return x * 2
"""


NESTED = """
import os, subprocess, sys

def f(x):
    # `jaxaot` called from inside a run: it must run in this process's child, never through
    # the server that forked this run (a served run waiting on another could multiply runs).
    out = subprocess.run([sys.executable, "-m", "jaxaot", "program=axpy", "--cfg",
                          "job"], capture_output=True, text=True)
    with open(os.environ["NESTED_OUT"], "w") as fh:
        fh.write(f"{out.returncode} {os.environ.get('JAXAOT_SERVED_BY', '')}\\n{out.stdout}")
    return x * 2
"""


def test_jaxaot_called_from_a_served_run_runs_in_process(shared, tmp_path: Path) -> None:
    server = shared
    (_programs(server) / "nested_prog.py").write_text(NESTED)
    out = tmp_path / "nested.txt"
    before = _counts(server, "runs served", "declined")
    proc = run_cli(
        ["program.target=nested_prog:f", "program.args=[f32[2]]", "stop_after=stage_out"],
        cwd=tmp_path,
        env={**server, "NESTED_OUT": str(out)},
    )
    assert proc.returncode == 0, proc.stderr
    code, marked = out.read_text().splitlines()[0].split(" ")
    assert code == "0" and int(marked) > 0  # it ran, in a child the server forked
    assert "program:" in out.read_text()
    after = _counts(server, "runs served", "declined")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


def test_a_changed_import_path_restarts_the_server(server, tmp_path: Path) -> None:
    """A watched path changing restarts the server, which serves again with fresh imports. The
    path is the server's own (a hydra_plugins folder appearing on its PYTHONPATH): a module of
    the checkout would restart every other server of the suite, whose counts other tests read.
    tests/test_server_loop.py changes a module file under a server's watch."""
    assert run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=server).returncode == 0
    assert _count(server) == 1
    (tmp_path / "hydra_plugins").mkdir()  # a project's Hydra plugins, added
    proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=server)  # declined: in-process
    assert proc.returncode == 0 and "program:" in proc.stdout
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _count(server) != 0:  # re-executed: count reset
        time.sleep(0.1)
    assert _count(server) == 0
    log = Path(server["JAXAOT_SERVER_SOCKET"]).with_suffix(".log").read_text()
    assert f"jaxaot server: {tmp_path / 'hydra_plugins'} changed; restarting" in log
    proc = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=server)
    assert proc.returncode == 0 and _count(server) == 1  # the fresh server serves again


def _wait_for(path: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.05)
    assert path.exists(), path


def _long_run(server: dict[str, str], tmp_path: Path, out: int) -> subprocess.Popen[str]:
    """A served run of the train step, once it is inside its first stage."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxaot",
            "program=transformer_train",
            "store.enabled=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=server,
        stdout=out,
        stderr=out,
        text=True,
    )
    _wait_for(tmp_path / "run" / "stage_out")
    return proc


def test_ctrl_c_reaches_the_run_and_its_status_comes_back(shared, tmp_path: Path) -> None:
    server = shared
    served = _count(server)
    proc = _long_run(server, tmp_path, subprocess.PIPE)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err.splitlines()[-1]
    assert read_manifest(tmp_path / "run")["status"] == "interrupted"
    assert _count(server) - served == 1


SLEEPER = """
import time

def f(x):
    time.sleep(60)  # while tracing: the run is busy until a signal ends it
    return x
"""


def test_a_client_that_dies_takes_its_run_with_it(shared, tmp_path: Path) -> None:
    server = shared
    (_programs(server) / "sleeper.py").write_text(SLEEPER)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxaot",
            "program.target=sleeper:f",
            "program.args=[f32[2]]",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        env=server,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(tmp_path / "run" / "stage_out")
    proc.kill()  # SIGKILL: the client cannot forward anything
    proc.wait(timeout=60)
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline and _count(server, "running") != 0:
        time.sleep(0.1)
    log = Path(server["JAXAOT_SERVER_SOCKET"]).with_suffix(".log").read_text()[-2000:]
    assert _count(server, "running") == 0, log  # the server ended the orphaned run (SIGTERM)
    assert read_manifest(tmp_path / "run")["status"] == "interrupted", log


def test_server_command_errors_and_status_without_a_server(tmp_path: Path) -> None:
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / "none" / "server.sock"))
    status = _status(env)
    assert status.returncode == 3 and "not running" in status.stdout
    bad = subprocess.run([*SERVER, "bogus"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "jaxaot: error: jaxaot server: expected start, stop, status or restart; found 'bogus'"
    )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_server_help_says_what_each_subcommand_does(tmp_path: Path, flag: str) -> None:
    sock = tmp_path / "h" / "server.sock"
    env = cli_env(JAXAOT_SERVER_SOCKET=str(sock))
    proc = subprocess.run([*SERVER, flag], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")
    lines = proc.stdout.splitlines()
    assert lines[0] == "usage: jaxaot server {start,stop,status,restart}"
    for verb in ("start", "stop", "status", "restart"):
        assert any(ln.startswith(f"  {verb} ") for ln in lines), verb
    assert f"socket: {sock}" in lines
    assert "JAXAOT_SERVER=0" in proc.stdout and "JAXAOT_SERVER_IDLE" in proc.stdout
    assert not sock.parent.exists()  # help starts and makes nothing
    bare = subprocess.run(SERVER, env=env, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and bare.stdout == ""
    *usage, error = bare.stderr.splitlines()
    assert usage == lines
    assert error == "jaxaot: error: jaxaot server: expected start, stop, status or restart"


def test_a_socket_path_too_long_is_one_line(tmp_path: Path) -> None:
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / ("d" * 100) / "server.sock"))
    proc = subprocess.run([*SERVER, "start"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("jaxaot: error: server socket path ")
    assert proc.stderr.rstrip().endswith("set JAXAOT_SERVER_SOCKET to a shorter path")
    assert len(proc.stderr.splitlines()) == 1


def test_jaxaot_server_1_starts_one_for_the_next_runs(tmp_path: Path) -> None:
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / "auto" / "server.sock"), JAXAOT_SERVER="1")
    try:
        first = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=env)  # in-process
        assert first.returncode == 0 and "program:" in first.stdout
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _count(env) < 0:
            time.sleep(0.1)
        second = run_cli([*AXPY, "--cfg", "job"], cwd=tmp_path, env=env)
        assert (second.returncode, second.stdout) == (0, first.stdout)
        assert _count(env) == 1
    finally:
        _stop(env)


def test_an_idle_server_exits(tmp_path: Path) -> None:
    env = cli_env(
        JAXAOT_SERVER_SOCKET=str(tmp_path / "idle" / "server.sock"), JAXAOT_SERVER_IDLE="1"
    )
    assert subprocess.run([*SERVER, "start"], env=env, capture_output=True).returncode == 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _count(env) >= 0:  # a status ask keeps no server busy
        time.sleep(0.05)
    assert _status(env).returncode == 3
    assert not Path(env["JAXAOT_SERVER_SOCKET"]).exists()


def test_what_the_server_declines(tmp_path: Path) -> None:
    from jaxaot.cli.server import CHILD_MARK, facts, loop, protocol

    s = loop.Server(tmp_path / "s.sock", dict(os.environ), [], lock=None)
    req = {
        "v": protocol.PROTOCOL,
        "env": dict(os.environ),
        "origins": facts.origins(),
        "process": facts.process(),
        "path": sys.path,
        "cwd": os.getcwd(),
    }
    assert s.declines(req) is None
    assert s.declines({**req, "v": 1}) == "protocol"
    marked = {**req, "env": {**req["env"], CHILD_MARK: "1"}}
    assert s.declines(marked) == "a run of this server"
    other = {**req, "env": {**req["env"], "XLA_FLAGS": "--xla_dump_to=/x"}}
    assert s.declines(other) == "environment (XLA_FLAGS)"
    moved = {**req, "origins": {**req["origins"], "jax": "/elsewhere/jax/__init__.py"}}
    assert s.declines(moved) == "import path (jax)"
    proc = req["process"]
    assert s.declines({**req, "process": {**proc, "nice": proc["nice"] + 1}}) == "priority"
    limits = {**proc["limits"], "RLIMIT_AS": [2**30, proc["limits"]["RLIMIT_AS"][1]]}
    assert s.declines({**req, "process": {**proc, "limits": limits}}) == "resource limits"
    flags = [*proc["python"][:-1], {"importtime": True}]
    assert s.declines({**req, "process": {**proc, "python": flags}}) == "interpreter or its options"
    s.runs = dict.fromkeys(range(loop.MAX_RUNS))  # type: ignore[arg-type]
    assert s.declines(req) == f"{loop.MAX_RUNS} runs in flight"


PROCESS_FACTS = """
import os

def f(x):
    passed = os.pread(int(os.environ["FACTS_FD"]), 5, 0).decode()  # `3<file`, say
    with open(os.environ["FACTS_OUT"], "w") as fh:
        fh.write(f"{sorted(os.sched_getaffinity(0))} {os.getcwd()} {passed}")
    return x + 1
"""


def test_the_run_has_the_clients_umask_affinity_and_cwd(shared, tmp_path: Path) -> None:
    server = shared
    (_programs(server) / "facts_prog.py").write_text(PROCESS_FACTS)
    before = _counts(server, "runs served", "declined")

    # What `umask 027; taskset -c 0 jaxaot ...` gives the client (no preexec_fn: forking this
    # JAX-using test process would warn).
    client = (
        "import os, sys; os.umask(0o027); os.sched_setaffinity(0, {0}); "
        "os.execv(sys.executable, [sys.executable, '-m', 'jaxaot', *sys.argv[1:]])"
    )

    (tmp_path / "passed.txt").write_text("hello")
    fd = os.open(tmp_path / "passed.txt", os.O_RDONLY)
    os.set_inheritable(fd, True)
    env = {**server, "FACTS_FD": str(fd)}
    try:
        facts = {}
        for name, run_env in (("via", env), ("direct", {**env, "JAXAOT_SERVER": "0"})):
            out = tmp_path / f"{name}.txt"
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    client,
                    "program.target=facts_prog:f",
                    "program.args=[f32[2]]",
                    "stop_after=stage_out",
                    f"hydra.run.dir={name}",
                ],
                cwd=tmp_path,
                env={**run_env, "FACTS_OUT": str(out)},
                pass_fds=(fd,),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr
            mode = stat.S_IMODE((tmp_path / name / "manifest.json").stat().st_mode)
            facts[name] = (out.read_text(), mode)
        assert facts["via"] == facts["direct"]
        assert facts["via"] == (f"[0] {tmp_path} hello", 0o640)
        after = _counts(env, "runs served", "declined")
        assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    finally:
        os.close(fd)


MEMO_CHECK = """
import os, pickle, sys
from collections import OrderedDict
from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from jaxaot.api import CONF_DIR
from jaxaot.cli.server import compositions as served_compose
from jaxaot.schema import register_configs

register_configs()

def compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)

cases = [
    ["program=transformer_train"],
    ["program=mlp", "execute.seed=3", "hydra.run.dir=x", "+extra=1"],
    ["program=axpy", "execute.repeats=2", "hydra.job.name=foo"],
]
def look(cfg):
    flags = (OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg.hydra))
    return OmegaConf.to_yaml(cfg), flags
hydras = [look(compose(c)) for c in cases]
memo = OrderedDict()
fd = os.open("reports", os.O_RDWR | os.O_CREAT | os.O_APPEND)
served_compose.install(memo, fd)
for _ in range(2):  # the first round composes and reports, the second reuses
    for case, expected in zip(cases, hydras):
        assert look(compose(case)) == expected, case
    with open("reports", "rb") as fh:
        reports = served_compose.read_reports(fh.read())
    os.ftruncate(fd, 0)
    print(sum(1 for _, p in reports if p), sum(1 for _, p in reports if not p))
    memo.update((k, p) for k, p in reports if p)
"""


def test_a_remembered_composition_is_hydras_own(tmp_path: Path) -> None:
    """jaxaot.cli.server.compositions: compositions reused from the server's memo (base config plus
    value overrides applied as Hydra does) equal Hydra's own, flags included."""
    proc = subprocess.run(
        [sys.executable, "-c", MEMO_CHECK],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "0", "0", "3"]  # 3 reported, then 3 reused


EXPERIMENT = "# @package _global_\nexecute:\n  seed: {}\n"


def _edited_conf(root: Path) -> Path:
    """A config folder whose ``experiment/mine.yaml`` sets the seed to 5."""
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text(EXPERIMENT.format(5))
    return root


def _followed_confs(root: Path) -> Path:
    """Config folders read three ways: a primary config (``cd/myconf.yaml``) whose own
    hydra.searchpath adds ``sp``, a group folder that is a symlink (``cd2/experiment`` to
    ``real``), and a defaults list that reads the environment (``cd3/envconf.yaml``)."""
    (root / "sp" / "experiment").mkdir(parents=True)
    (root / "sp" / "experiment" / "demo.yaml").write_text(EXPERIMENT.format(5))
    (root / "cd").mkdir()
    (root / "cd" / "myconf.yaml").write_text(
        f"defaults:\n  - config\n  - _self_\nhydra:\n  searchpath:\n"
        f"    - file://{root / 'sp'}\n    - pkg://jaxaot.conf\n"
    )
    (root / "real").mkdir()
    (root / "real" / "demo2.yaml").write_text(EXPERIMENT.format(5))
    (root / "cd2").mkdir()
    (root / "cd2" / "experiment").symlink_to(root / "real")
    (root / "cd3" / "experiment").mkdir(parents=True)
    for name, seed in (("a", 1), ("b", 2)):
        (root / "cd3" / "experiment" / f"{name}.yaml").write_text(EXPERIMENT.format(seed))
    (root / "cd3" / "envconf.yaml").write_text(
        "defaults:\n  - config\n  - override experiment: ${oc.env:PICK}\n  - _self_\n"
        "hydra:\n  searchpath:\n    - pkg://jaxaot.conf\n"
    )
    return root


@pytest.fixture(scope="module", autouse=True)
def early_confs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The config folders of the composition tests, written as the module starts: a server
    remembers no composition read from files changed in the last 2 s, and the module's server
    start and the tests before them make the files that old (:func:`_old_enough` waits for
    what is left)."""
    root = tmp_path_factory.mktemp("confs")
    return {"edited": _edited_conf(root / "edited"), "followed": _followed_confs(root / "followed")}


def _old_enough(root: Path) -> None:
    """Wait until nothing under ``root`` (symlinks followed) changed in the last 2 s
    (jaxaot.sweeps.config_sources.RACY_NS, the server's own limit): a composition read from
    younger files is not remembered."""
    from jaxaot.sweeps.config_sources import RACY_NS

    newest = max(
        max(st.st_mtime_ns, st.st_ctime_ns)
        for folder, _, files in os.walk(root, followlinks=True)
        for st in (os.stat(os.path.join(folder, name)) for name in [".", *files])
    )
    while time.time_ns() - newest <= RACY_NS:
        time.sleep(0.05)


def test_an_edited_config_file_is_read_again(
    shared, tmp_path: Path, early_confs: dict[str, Path]
) -> None:
    server = shared
    reused = _count(server, "compositions reused")
    conf = early_confs["edited"]
    mine = conf / "experiment" / "mine.yaml"
    args = ["--config-dir", str(conf), "experiment=mine", "program=axpy"]
    _old_enough(conf)  # seed 5, written as the module started
    seen = []
    for seed in (5, 5, 6):
        if f"seed: {seed}" not in mine.read_text():
            mine.write_text(EXPERIMENT.format(seed))
        proc = run_cli([*args, "--cfg", "job"], cwd=tmp_path, env=server)
        assert proc.returncode == 0, proc.stderr
        seen.append(re.search(r"^  seed: (\d+)", proc.stdout, re.M)[1])  # type: ignore[index]
    assert seen == ["5", "5", "6"]
    assert _count(server, "compositions reused") - reused == 1  # the second; the edit a miss


def test_a_reused_composition_gives_the_run_hydras_files(shared, tmp_path: Path) -> None:
    server = shared
    # a composition is remembered with its cwd: none of another test's is reused here
    reused = _count(server, "compositions reused")
    outs = {}
    for name, env in (
        ("first", server),
        ("again", server),
        ("alone", {**server, "JAXAOT_SERVER": "0"}),
    ):
        proc = run_cli([*AXPY, "stop_after=lower", f"hydra.run.dir={name}"], cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        hydra_dir = tmp_path / name / ".hydra"
        outs[name] = [
            (hydra_dir / f).read_text().replace(name, "<dir>")
            for f in ("config.yaml", "hydra.yaml", "overrides.yaml")
        ]
    assert _count(server, "compositions reused") - reused == 1
    assert outs["again"] == outs["alone"] == outs["first"]


def _seed(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return re.search(r"^  seed: (\d+)", proc.stdout, re.M)[1]  # type: ignore[index]


def test_compositions_follow_what_they_read(
    shared, tmp_path: Path, early_confs: dict[str, Path]
) -> None:
    """A primary config's own hydra.searchpath, a symlinked group folder and an environment
    variable in a defaults list are all read again when they change."""
    server = shared
    reused = _count(server, "compositions reused")
    root = early_confs["followed"]  # every seed 5, a: 1, b: 2 (_followed_confs)
    _old_enough(root)  # old enough to be remembered
    cases = {
        "searchpath": (
            ["-cd", str(root / "cd"), "-cn", "myconf", "experiment=demo"],
            root / "sp" / "experiment" / "demo.yaml",
        ),
        "symlink": (
            ["-cd", str(root / "cd2"), "experiment=demo2"],
            root / "real" / "demo2.yaml",
        ),
    }
    for name, (args, edited) in cases.items():
        seen = [_seed(run_cli([*args, "--cfg", "job"], cwd=tmp_path, env=server)) for _ in range(2)]
        edited.write_text(EXPERIMENT.format(7))
        seen.append(_seed(run_cli([*args, "--cfg", "job"], cwd=tmp_path, env=server)))
        assert seen == ["5", "5", "7"], name
    env_args = ["-cd", str(root / "cd3"), "-cn", "envconf", "--cfg", "job"]
    picks = [_seed(run_cli(env_args, cwd=tmp_path, env={**server, "PICK": pick})) for pick in "aab"]
    assert picks == ["1", "1", "2"]
    # the second run of the first two cases
    assert _count(server, "compositions reused") - reused == 2


def test_the_run_has_the_clients_time_zone(shared, tmp_path: Path) -> None:
    server = shared
    served = _count(server)
    args = ["program=axpy", "--cfg", "hydra", "--resolve", "-p", "hydra.run.dir"]
    env = {**server, "TZ": "Asia/Tokyo"}
    via = run_cli(args, cwd=tmp_path, env=env)
    direct = run_cli(args, cwd=tmp_path, env={**env, "JAXAOT_SERVER": "0"})
    assert via.returncode == direct.returncode == 0, via.stderr
    assert via.stdout[:21] == direct.stdout[:21]  # the date and hour of the run dir
    assert _count(server) - served == 1


def test_a_run_ignores_the_signals_its_client_ignores(shared, tmp_path: Path) -> None:
    """`nohup jaxaot ...`: SIGHUP to the client neither reaches nor stops the run."""
    nohup = (  # as `nohup` starts it, without forking this JAX-using test process
        "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, '-m', 'jaxaot', *sys.argv[1:]])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", nohup, *AXPY, "stop_after=compile", "hydra.run.dir=run"],
        cwd=tmp_path,
        env=shared,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(tmp_path / "run" / ".hydra")
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert read_manifest(tmp_path / "run")["status"] == "ok"


STARTUP_FACTS = """
import json, logging, os, sys, warnings

import jax
import numpy as np


def _filter(entry):
    action, message, category, module, lineno = entry
    text = [getattr(m, "pattern", m) for m in (message, module)]  # a regex, or exact text
    return [action, text[0], category.__name__, text[1], lineno]


def f(x):
    print("OUT-1 \\u00b7")  # a middle dot: one byte in latin-1
    print("ERR-2", file=sys.stderr)
    print("OUT-3")
    streams = [
        [s.encoding, s.errors, s.line_buffering, s.write_through]
        for s in (sys.stdin, sys.stdout, sys.stderr)
    ]
    jax_logging = [
        jax.config.jax_logging_level,
        sorted(type(h).__name__ for h in logging.getLogger("jax").handlers),
    ]
    command = sys.orig_argv[:-1]  # the last argument names each run's own folder
    facts = [streams, [_filter(e) for e in warnings.filters], jax_logging, command]
    with open(os.environ["FACTS_OUT"], "a") as out:
        out.write(json.dumps([facts, float(np.random.rand())]) + "\\n")
    return x
"""


def test_a_served_run_starts_as_a_process_of_its_own_would(tmp_path: Path) -> None:
    """What a Python process sets up as it starts, a served run has as the same command run
    without the server: the command line (``sys.orig_argv``, what re-executing itself runs),
    stdio's encoding (``PYTHONIOENCODING``) and buffering (``PYTHONUNBUFFERED``: stdout and
    stderr interleave as written), the warning filters its imports install (NumPy's), JAX's
    logging level from the run's logging config (its ``jax`` logger: JAX's handler and C++ log
    level), and a random state of its own (NumPy's global one: two served runs draw different
    numbers)."""
    (tmp_path / "startup_facts.py").write_text(STARTUP_FACTS)
    env = cli_env(JAXAOT_SERVER_SOCKET=str(tmp_path / "srv" / "server.sock"))
    env.update(PYTHONIOENCODING="latin-1", PYTHONUNBUFFERED="1")  # the server's and the clients'
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    env.pop("JAXAOT_SERVER", None)
    start = subprocess.run([*SERVER, "start"], env=env, capture_output=True, text=True, timeout=120)
    assert start.returncode == 0 and "started" in start.stdout, start.stderr
    try:
        runs = {}
        for name, run_env in (
            ("served", env),
            ("again", env),
            ("plain", {**env, "JAXAOT_SERVER": "0"}),
        ):
            facts = tmp_path / f"{name}.json"
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "jaxaot",
                    "program.target=startup_facts:f",
                    "program.args=[f32[2]]",
                    "stop_after=stage_out",
                    f"hydra.run.dir={name}",
                ],
                cwd=tmp_path,
                env={**run_env, "FACTS_OUT": str(facts)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stdout.decode("latin-1")
            printed = [ln for ln in proc.stdout.splitlines() if ln.startswith((b"OUT-", b"ERR-"))]
            [line] = facts.read_text().splitlines()
            runs[name] = (printed, *json.loads(line))
        assert _count(env) == 2  # both served, none declined
    finally:
        _stop(env)
    assert runs["plain"][0] == [b"OUT-1 \xb7", b"ERR-2", b"OUT-3"]
    for name in ("served", "again"):
        assert runs[name][:2] == runs["plain"][:2]
    streams, filters, *_ = runs["plain"][1]
    assert streams[1] == ["iso8859-1", "strict", False, True]  # latin-1, as Python names it
    assert ["always", None, "RankWarning", None, 0] in filters  # NumPy's, at its import
    assert runs["served"][2] != runs["again"][2]
