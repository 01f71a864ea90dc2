"""The serve loop (jaxaot.cli.server.loop), alone: started and stopped in a thread of the test
(status, declines, stop, idle exit, a changed file), and a served run with a fake job in a
small Python process of its own (the loop forks; this test process must not). No JAX."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env
from jaxaot.cli.server import client, loop, protocol


class Running:
    """A :class:`loop.Server` on ``path``, its loop in a thread; :attr:`restart` is what
    ``loop()`` returned."""

    def __init__(self, path: Path) -> None:
        self.server = loop.Server(path, dict(os.environ), [], lock=None)
        self.server.open()
        self.restart: bool | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        self.restart = self.server.loop()

    def send(self, message: dict[str, Any]) -> dict[str, Any] | None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.server.path))
            protocol.send(sock, message)
            return protocol.recv(sock)[0]


@pytest.fixture
def running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    folder = tmp_path / "srv"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("JAXAOT_SERVER_SOCKET", str(folder / "s.sock"))
    run = Running(folder / "s.sock")
    try:
        yield run
    finally:
        if run.thread.is_alive():
            client.ask("stop")
        run.thread.join(10)


def test_status_then_stop(running: Running) -> None:
    path = running.server.path
    assert path.is_socket() and oct(path.stat().st_mode & 0o777) == "0o600"
    assert path.with_suffix(".pid").read_text() == f"{os.getpid()}\n"
    info = client.ask("status")
    assert info is not None and info["pid"] == os.getpid()
    assert (info["served"], info["declined"], info["running"]) == (0, 0, 0)
    assert client.ask("stop") == {"stopping": os.getpid()}
    running.thread.join(10)
    assert running.restart is False and not running.thread.is_alive()
    assert not path.exists() and not path.with_suffix(".pid").exists()
    assert client.ask("status") is None


def test_requests_it_cannot_serve_are_declined(running: Running) -> None:
    running.server.files = {}  # no watched file: a file edited meanwhile declines nothing
    req, _ = client.request(["program=axpy"])
    assert running.send({**req, "v": protocol.PROTOCOL - 1}) == {"declined": "protocol"}
    # A request that passes every check but came without its descriptors: nothing forked.
    assert running.send(req) == {"declined": "descriptors not received"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(running.server.path))
        sock.sendall(b"\x00\x00")  # half a header, then nothing
        sock.shutdown(socket.SHUT_WR)
        assert protocol.recv(sock)[0] == {"declined": "incomplete request"}
    info = client.ask("status")
    assert info is not None and (info["declined"], info["served"]) == (2, 0)


def test_a_changed_file_declines_and_asks_for_a_restart(running: Running, tmp_path: Path) -> None:
    watched = tmp_path / "module.py"
    watched.write_text("x = 1\n")
    running.server.files = {str(watched): loop._signature(str(watched))}
    watched.write_text("x = 22\n")
    req, _ = client.request(["program=axpy"])
    assert running.send(req) == {"declined": f"changed: {watched}"}
    running.thread.join(10)
    assert running.restart is True  # the caller re-executes the server


def _backlog(tmp_path: Path, *messages: dict[str, Any]) -> tuple[loop.Server, list[socket.socket]]:
    """A server whose loop is not running, and clients connected to it (in the listen
    backlog), each having sent its message."""
    folder = tmp_path / "srv"
    folder.mkdir(mode=0o700)
    server = loop.Server(folder / "s.sock", dict(os.environ), [], lock=None)
    server.open()
    waiting = []
    for message in messages:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(server.path))
        protocol.send(sock, message)
        waiting.append(sock)
    return server, waiting


def _replies(waiting: list[socket.socket]) -> list[dict[str, Any] | None]:
    replies = []
    for sock in waiting:
        with sock:
            sock.settimeout(10)
            replies.append(protocol.recv(sock)[0])
    return replies


@pytest.mark.parametrize("ending", ["restart", "idle"])
def test_clients_waiting_to_be_accepted_when_the_loop_ends_are_answered(
    tmp_path: Path, ending: str
) -> None:
    """Connected while the server was leaving (restarting for changed code, idle): closing the
    listener would drop them with no word whether their run started. A run's request is
    declined (its client runs in-process); a status is answered only by a server that comes
    back (a restart re-executes the same process)."""
    req, _ = client.request(["program=axpy"])
    server, waiting = _backlog(tmp_path, req, {"op": "status"})
    if ending == "restart":
        server.restart_requested = True  # as a changed file asks: the loop ends at once
    else:
        server.idle, server.last_request = 0.0, 0.0
    path = server.path
    assert server.loop() is (ending == "restart")
    replies = _replies(waiting)
    assert replies[0] == {"declined": "stopping"}
    if ending == "restart":
        assert replies[1] is not None and replies[1]["pid"] == os.getpid()
    else:
        assert replies[1] is None
    assert server.declined == 1 and not path.exists()


def test_the_drain_refuses_connections_that_come_after_it(tmp_path: Path) -> None:
    """Between the drain's last accept and the listener's close, a client that found the
    socket before it was removed is refused (it then runs in-process), not queued and reset."""
    req, _ = client.request(["program=axpy"])
    server, waiting = _backlog(tmp_path, req)
    other_name = tmp_path / "srv" / "other.sock"
    os.link(server.path, other_name)  # the listener, still reachable once its path is gone
    assert server.listener is not None
    server._decline_waiting(server.listener)
    late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with late, pytest.raises(ConnectionRefusedError):
        late.connect(str(other_name))
    server.listener.close()
    assert _replies(waiting) == [{"declined": "stopping"}]


def test_a_stop_waiting_when_a_restart_begins_stops_the_server(tmp_path: Path) -> None:
    """The status asked before the stop is not told the server runs: it will not come back."""
    req, _ = client.request(["program=axpy"])
    server, waiting = _backlog(tmp_path, {"op": "status"}, {"op": "stop"}, req)
    server.restart_requested = True
    assert server.loop() is False  # not re-executed: the stop was answered
    assert _replies(waiting) == [None, {"stopping": os.getpid()}, {"declined": "stopping"}]


def test_a_watched_folder_changes_by_its_entries_not_its_pycache(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    plugins = tmp_path / "hydra_plugins"
    absent = tmp_path / "elsewhere" / "hydra_plugins"
    for folder in (site, plugins, site / "pkg"):
        folder.mkdir()
    (site / "a.pth").write_text("/somewhere\n")
    server = loop.Server(tmp_path / "s.sock", dict(os.environ), [], lock=None)

    def watch() -> None:
        server.files = {str(f): loop._signature(str(f)) for f in (site, plugins, absent)}

    watch()
    # A first import elsewhere writes __pycache__ into the folder: its mtime moves, no code did.
    for folder in (site, plugins):
        mtime = folder.stat().st_mtime_ns
        (folder / "__pycache__").mkdir()
        os.utime(folder, ns=(mtime + 10**9, mtime + 10**9))  # whatever the clock's granularity
    assert server.stale() is None
    (plugins / "my_sweeper").mkdir()  # a plugin added
    assert server.stale() == str(plugins)
    watch()
    (site / "new.pth").write_text("import x\n")  # a new .pth file
    assert server.stale() == str(site)
    watch()
    (site / "a.pth").write_text("/elsewhere/too\n")  # an edited one
    assert server.stale() == str(site)
    watch()
    (site / "pkg").rmdir()  # a package removed
    assert server.stale() == str(site)
    watch()
    absent.mkdir(parents=True)  # a hydra_plugins folder that was not there at start
    assert server.stale() == str(absent)


def test_an_idle_loop_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXAOT_SERVER_IDLE", "0")
    run = Running(tmp_path / "s.sock")
    run.thread.join(10)
    assert run.restart is False and not (tmp_path / "s.sock").exists()


FAKE_JOB = """
import os, sys, threading
from pathlib import Path
from jaxaot.cli.server import client, loop

def job(composed, report):
    # A served run: it has its client's argv, cwd and descriptors, and reports a composition.
    print("job", sys.argv[1:], os.getcwd(), os.environ["JAXAOT_SERVED_BY"] == str(os.getppid()))
    key, payload = b"k" * 64, b"composition"
    os.write(report, len(key).to_bytes(4, "big") + len(payload).to_bytes(4, "big") + key + payload)
    sys.exit(int(sys.argv[-1]))

path = Path(os.environ["JAXAOT_SERVER_SOCKET"])
server = loop.Server(path, dict(os.environ), [], lock=None, job=job)
server.open()
thread = threading.Thread(target=server.loop)
thread.start()
# This process is the server too: what serving imports here is no script's set-up.
client.facts.own_setup = lambda: None
codes = [client.run_via_server(["run", str(n)]) for n in (0, 3)]
status = client.ask("status")
client.ask("stop")
thread.join(10)
print("codes", codes, "served", status["served"], "compositions", status["compositions"])
"""


def test_a_served_run_with_a_fake_job(tmp_path: Path) -> None:
    folder = tmp_path / "srv"
    folder.mkdir(mode=0o700)
    env = cli_env(JAXAOT_SERVER_SOCKET=str(folder / "s.sock"))
    proc = subprocess.run(
        [sys.executable, "-c", FAKE_JOB],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"job ['run', '0'] {tmp_path} True",
        f"job ['run', '3'] {tmp_path} True",
        "codes [0, 3] served 2 compositions [1, 0]",
    ]
