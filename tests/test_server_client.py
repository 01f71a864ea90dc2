"""The server client (jaxaot.cli.server.client), alone: against a fake server, a thread that
listens on a socket in a private folder and answers as a script says. No server process, no
JAX."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jaxaot.cli.server import client, facts, protocol
from jaxaot.errors import UnsafeSocketError

NO_GROUP = 4_194_304  # above the kernel's largest pid: signals to this group reach no one

Answer = Callable[[socket.socket, dict[str, Any] | None, list[int]], None]


class FakeServer:
    """Accepts connections on ``path`` in a thread; each request (and its descriptors) is
    recorded in :attr:`got`, then ``answer(conn, request, fds)`` replies."""

    def __init__(self, path: Path, answer: Answer) -> None:
        self.got: list[tuple[dict[str, Any] | None, int]] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.listener.settimeout(0.05)
        self.answer = answer
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
                break
            except TimeoutError:
                if self.stopped:
                    return
            except OSError:
                return
        conn.settimeout(10)
        with conn:
            try:
                req, fds = protocol.recv(conn, maxfds=3 + protocol.MAX_FDS)
            except (OSError, ValueError):
                req, fds = None, []
            self.got.append((req, len(fds)))
            try:
                if req is not None:  # a client that sent nothing is not answered
                    self.answer(conn, req, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def close(self) -> None:
        self.stopped = True
        self.thread.join(10)
        self.listener.close()


@pytest.fixture
def fake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[Answer], FakeServer]]:
    folder = tmp_path / "srv"
    folder.mkdir(mode=0o700)
    path = folder / "s.sock"
    monkeypatch.setenv("JAXAOT_SERVER_SOCKET", str(path))
    # This process imported JAX and jaxaot (the suite): its client stands for a bare `jaxaot`.
    monkeypatch.setattr(facts, "own_setup", lambda: None)
    made: list[FakeServer] = []

    def start(answer: Answer) -> FakeServer:
        made.append(FakeServer(path, answer))
        return made[-1]

    yield start
    for server in made:
        server.close()


def _replies(*messages: dict[str, Any]) -> Answer:
    def answer(conn: socket.socket, req: Any, fds: list[int]) -> None:
        for message in messages:
            protocol.send(conn, message)

    return answer


def test_a_served_run_gives_its_exit_status(fake: Callable[[Answer], FakeServer]) -> None:
    server = fake(_replies({"pid": NO_GROUP}, {"exit": 7}))
    assert client.run_via_server(["program=axpy", "-v"]) == 7
    server.close()
    [(req, nfds)] = server.got
    assert req is not None and req["v"] == protocol.PROTOCOL
    assert req["argv"] == ["program=axpy", "-v"] and req["cwd"] == os.getcwd()
    assert req["env"]["JAXAOT_SERVER_SOCKET"] == os.environ["JAXAOT_SERVER_SOCKET"]
    assert nfds == 3 + len(req["process"]["inherited_fds"])  # stdin, stdout, stderr first


def test_a_declined_request_runs_in_process(fake: Callable[[Answer], FakeServer]) -> None:
    fake(_replies({"declined": "protocol"}))
    assert client.run_via_server(["program=axpy"]) is None


def test_a_server_that_goes_away_before_replying_is_an_error(
    fake: Callable[[Answer], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a silent in-process rerun: the server may have started the run already."""
    fake(_replies())
    assert client.run_via_server(["program=axpy"]) == 1
    assert "went away before the run started" in capsys.readouterr().err


def test_a_server_that_goes_away_during_the_run_is_an_error(
    fake: Callable[[Answer], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    fake(_replies({"pid": NO_GROUP}))
    assert client.run_via_server(["program=axpy"]) == 1
    assert "went away during the run" in capsys.readouterr().err


def test_no_server_is_none_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JAXAOT_SERVER_SOCKET", str(tmp_path / "absent" / "s.sock"))
    assert client.run_via_server(["program=axpy"]) is None
    assert client.ask("status") is None
    assert capsys.readouterr().err == ""


def test_ask_sends_an_operation(fake: Callable[[Answer], FakeServer]) -> None:
    server = fake(_replies({"pid": 12, "served": 0}))
    assert client.ask("status") == {"pid": 12, "served": 0}
    server.close()
    assert server.got == [({"v": protocol.PROTOCOL, "op": "status"}, 0)]


def test_a_listener_of_another_user_gets_nothing(
    fake: Callable[[Answer], FakeServer],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The peer's credentials are checked after connect and before the first byte: a
    listener that runs as another uid (SO_PEERCRED, faked here) receives nothing."""
    server = fake(_replies({"pid": NO_GROUP}, {"exit": 0}))
    other = (4321, os.geteuid() + 1, 0)
    monkeypatch.setattr(client, "peer_credentials", lambda sock: other)
    assert client.run_via_server(["program=axpy"]) is None
    err = capsys.readouterr().err
    assert err.startswith("jaxaot: warning: jaxaot server not used, running in this process: ")
    assert f"runs as uid {other[1]} (pid 4321)" in err and err.count("\n") == 1
    with pytest.raises(UnsafeSocketError, match="not as you"):
        client.connect(Path(os.environ["JAXAOT_SERVER_SOCKET"]))
    server.close()
    assert server.got == [(None, 0)]  # connected, and closed without a byte


def test_a_folder_others_can_reach_gets_nothing(
    fake: Callable[[Answer], FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake(_replies({"pid": NO_GROUP}, {"exit": 0}))
    Path(os.environ["JAXAOT_SERVER_SOCKET"]).parent.chmod(0o755)
    assert client.run_via_server(["program=axpy"]) is None
    assert "has mode 0755, not 0700" in capsys.readouterr().err
    server.close()
    assert server.got == []  # not even connected
