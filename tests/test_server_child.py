"""The child (jaxaot.cli.server.child), alone: a small Python process forks and runs
``run_child`` with a fake request and a fake job, as the serve loop would; no server, no JAX.
(Forked from its own process: a child ends with ``os._exit`` after running atexit handlers,
which this test process's must never see.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env

SCRIPT = """
import json, os, signal, sys, warnings
from jaxaot.cli.server import facts
from jaxaot.cli.server.child import run_child

case, work = sys.argv[1], sys.argv[2]
out_r, out_w = os.pipe()
err_r, err_w = os.pipe()
passed = os.open(os.path.join(work, "passed.txt"), os.O_RDONLY)
process = {**facts.process(), "umask": 0o027, "inherited_fds": [9], "ignored": [1]}
req = {
    "argv": ["program=axpy", case], "argv0": "/bin/jaxaot", "cwd": work,
    "env": {"PATH": os.environ["PATH"], "TZ": "UTC", "FROM_CLIENT": "yes"},
    "path": sys.path, "process": process,
}
fds = [os.dup(0), out_w, err_w, passed]
closed = []
warned = []
with warnings.catch_warnings(record=True) as warned:
    warnings.warn("a warning of the server's imports", UserWarning)

def job():
    import atexit
    atexit.register(lambda: print("atexit ran"))
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "umask": os.umask(0),
        "env": {k: os.environ.get(k) for k in ("FROM_CLIENT", "ADDED", "JAXAOT_SERVED_BY")},
        "fd9": os.pread(9, 6, 0).decode(), "closed": closed,
        "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
    }))
    if case == "exit-message":
        sys.exit("bye")
    if case == "raises":
        raise ValueError("job failed")
    if case == "exit-4":
        sys.exit(4)

pid = os.fork()
if pid == 0:
    run_child(req, fds, close=lambda: closed.append(1), added={"ADDED": "1"},
              warned=warned, job=job)
for fd in (out_w, err_w, passed, fds[0]):
    os.close(fd)
with os.fdopen(out_r) as out, os.fdopen(err_r) as err:
    stdout, stderr = out.read(), err.read()
_, status = os.waitpid(pid, 0)
print(json.dumps({"status": os.waitstatus_to_exitcode(status), "stdout": stdout,
                  "stderr": stderr, "parent": os.getpid()}))
"""


def _child(case: str, tmp_path: Path) -> dict:
    (tmp_path / "passed.txt").write_text("passed")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, case, str(tmp_path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_child_becomes_its_client_and_runs_the_job(tmp_path: Path) -> None:
    got = _child("ok", tmp_path)
    assert got["status"] == 0
    report, after = got["stdout"].split("\n", 1)
    seen = json.loads(report)
    assert seen["argv"] == ["/bin/jaxaot", "program=axpy", "ok"]
    assert seen["cwd"] == str(tmp_path) and seen["umask"] == 0o027
    assert seen["env"] == {
        "FROM_CLIENT": "yes",
        "ADDED": "1",
        "JAXAOT_SERVED_BY": str(got["parent"]),
    }
    assert seen["fd9"] == "passed"  # the client's descriptor, at the client's number
    assert seen["closed"] == [1]  # the server's descriptors closed first
    assert seen["sighup_ignored"] and seen["pgid_is_pid"]
    assert after == "atexit ran\n"  # ended as the interpreter ends: atexit handlers, flushed
    assert "UserWarning: a warning of the server's imports" in got["stderr"]


def test_the_child_exits_as_python_would(tmp_path: Path) -> None:
    assert _child("exit-4", tmp_path)["status"] == 4
    message = _child("exit-message", tmp_path)
    assert message["status"] == 1 and message["stderr"].endswith("bye\n")
    raised = _child("raises", tmp_path)
    assert raised["status"] == 1
    assert "Traceback" in raised["stderr"] and "ValueError: job failed" in raised["stderr"]


STDIO = """
import os, sys
if sys.argv[1] == "child":
    from jaxaot.cli.server import facts
    from jaxaot.cli.server.child import _stdio

    sys.stdin, sys.stdout, sys.stderr = _stdio(facts.process()["stdio"])
sys.stdout.write("a" * 6000)  # past the block size of a pipe's buffer: written out
sys.stdout.write("b" * 3000)  # held
os.write(2, b"|ERR|")
sys.stdout.write(repr(sys.stdin.read()) + "\\n")
print("\\u00b7", file=sys.stderr)
"""


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "python -u"])
@pytest.mark.parametrize("encoding", [None, "latin-1"], ids=["locale", "PYTHONIOENCODING"])
def test_the_childs_stdio_is_opened_as_the_interpreter_opens_its_own(
    unbuffered: bool, encoding: str | None
) -> None:
    """stdin, stdout and stderr of a served run are what the client's interpreter made of the
    same descriptors: what comes out of stdout and stderr, in what order and encoding (buffer
    sizes, line buffering, write-through), and what is read from stdin (no newline
    translation)."""
    env = cli_env()
    env.pop("PYTHONUNBUFFERED", None)
    env.pop("PYTHONIOENCODING", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    if encoding:
        env["PYTHONIOENCODING"] = encoding
    got = {}
    for who in ("interpreter", "child"):
        proc = subprocess.run(
            [sys.executable, "-c", STDIO, who],
            input=b"x\r\ny",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout[-2000:]
        got[who] = proc.stdout
    assert got["child"] == got["interpreter"]
    assert b"'x\\r\\ny'" in got["child"]
