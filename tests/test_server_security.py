"""The server client trusts only its own server (jaxaot.cli.server.folder, .protocol, .client).

The two-user tests run an attacker as uid 65534 (nobody) in a forked child of the test
process (the venv's Python lives under /root here, which nobody cannot open, so the attacker
is forked rather than exec'd): it takes the victim's socket folder name first and listens
there, recording every byte and descriptor it receives and answering as the real hijack did
(attacker text on the victim's stdout, exit 0). The victim is the test's own uid; TMPDIR is a
private sticky folder, so the real /tmp/jaxaot-* folders are never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env
from jaxaot.cli.server import client, protocol
from jaxaot.cli.server import folder as ss
from jaxaot.errors import UnsafeSocketError

ATTACKER = 65534  # nobody
SERVER = [sys.executable, "-m", "jaxaot", "server"]
SECRET = "victim-token-7f3a"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="runs an attacker as another uid: needs root (tests run as root)"
)


# ------------------------------------------------------------------------------ unit tests


def test_the_peer_judge_trusts_the_same_uid_only() -> None:
    me = os.geteuid()
    assert protocol.peer_problem(1234, me, 0) is None
    assert protocol.peer_problem(1234, me, me + 77) is None  # gid is not judged
    problem = protocol.peer_problem(1234, me + 1, 0)
    assert problem == f"runs as uid {me + 1} (pid 1234), not as you (uid {me})"
    assert protocol.peer_problem(1, 2**32 - 1, 0) is not None  # an unmapped uid (another namespace)


def test_peer_credentials_of_a_real_connection(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        listener.bind(str(tmp_path / "s.sock"))
        listener.listen(1)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(tmp_path / "s.sock"))
        conn, _ = listener.accept()
        with client, conn:
            assert protocol.peer_credentials(client) == (os.getpid(), os.geteuid(), os.getegid())
            assert protocol.peer_credentials(conn) == (os.getpid(), os.geteuid(), os.getegid())


def test_a_folder_made_here_is_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)
    try:
        ss.check_folder(tmp_path / "a" / "b", create=True)
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(made.lstat().st_mode) == 0o700
    ss.check_folder(tmp_path / "a" / "b", create=False)  # and it passes as it is
    with pytest.raises(FileNotFoundError):
        ss.check_folder(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_unsafe_folders_are_one_line_naming_the_folder(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(UnsafeSocketError) as info:
        ss.check_folder(loose, create=True)
    assert str(info.value) == (
        f"server socket folder {loose} has mode 0755, not 0700: others have access; "
        f"chmod 700 {loose}, or set JAXAOT_SERVER_SOCKET to a path in a folder of your own "
        "(e.g. ~/.jaxaot/server.sock)"
    )
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeSocketError, match=r"folder .*/link is a symbolic link; set"):
        ss.check_folder(tmp_path / "link", create=True)
    with pytest.raises(UnsafeSocketError, match=r"is unsafe: .*/link is a symbolic link"):
        ss.check_folder(tmp_path / "link" / "inner", create=True)
    assert not (real / "inner").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeSocketError, match=r"/file is not a folder"):
        ss.check_folder(tmp_path / "file", create=True)
    # A folder on the way that others can write to (not sticky): they could swap ours out.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeSocketError, match=r"/shared is writable by others and not sticky"):
        ss.check_folder(shared / "mine", create=True)
    assert not (shared / "mine").exists()
    shared.chmod(0o1777)  # like /tmp: others cannot rename what is ours
    ss.check_folder(shared / "mine", create=True)


def test_where_the_socket_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAXAOT_SERVER_SOCKET")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    name = ss.socket_path().name
    assert name.startswith("server-") and name.endswith(".sock")  # one per Python environment
    assert ss.socket_path() == runtime / "jaxaot" / name
    # Not what systemd makes (0700, the user's, a real folder): the temp dir's per-user folder.
    fallback = tmp_path / f"jaxaot-{os.geteuid()}" / name
    runtime.chmod(0o755)
    assert ss.socket_path() == fallback
    runtime.chmod(0o700)
    (tmp_path / "run-link").symlink_to(runtime)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run-link"))
    assert ss.socket_path() == fallback
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")
    assert ss.socket_path() == fallback
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert ss.socket_path() == fallback
    monkeypatch.setenv("TMPDIR", str(tmp_path / "not-there"))
    assert ss.socket_path() == Path("/tmp") / f"jaxaot-{os.geteuid()}" / name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAXAOT_SERVER_SOCKET", "sub/s.sock")  # absolute: the server runs in /
    assert ss.socket_path() == tmp_path / "sub" / "s.sock"


def test_connect_to_ones_own_listener(tmp_path: Path) -> None:
    folder = tmp_path / "srv"
    folder.mkdir(mode=0o700)
    assert client.connect(folder / "s.sock") is None  # no server: nothing, quietly
    assert client.connect(tmp_path / "absent" / "s.sock") is None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        listener.bind(str(folder / "s.sock"))
        listener.listen(1)
        sock = client.connect(folder / "s.sock")
        assert sock is not None
        sock.close()
    (folder / "s.sock").unlink()
    (folder / "s.sock").write_text("")
    with pytest.raises(UnsafeSocketError, match=r"s\.sock is not a socket of yours"):
        client.connect(folder / "s.sock")


# ------------------------------------------------------------------------ the two-user tests


class Attacker:
    """A process running as uid 65534 that listens on ``sock`` (in ``folder``, which it makes
    with ``mode`` if missing), forked from this one; :meth:`stop` gives what it received."""

    def __init__(self, folder: Path, mode: int, sock: str = "evil.sock") -> None:
        self.sock = folder / sock
        results_r, results_w = os.pipe()
        self.stop_r, self.stop_w = os.pipe()
        with warnings.catch_warnings():
            # JAX's at-fork hook warns once the suite has started a backend; the child only
            # listens on a socket, never touching JAX.
            warnings.simplefilter("ignore", RuntimeWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the attacker: only what is imported already (nobody cannot read
            os.close(results_r)  # the interpreter's own folder here)
            code = 1
            try:
                _attack(folder, mode, self.sock, results_w, self.stop_r)
                code = 0
            except BaseException as exc:
                with contextlib.suppress(BaseException):
                    os.write(results_w, f"error {exc!r}\n".encode())
            finally:
                os._exit(code)
        os.close(results_w)
        os.close(self.stop_r)
        self.results = os.fdopen(results_r, "rb")
        ready = self.results.readline().decode()
        if ready != "ready\n":
            self.stop()
            raise AssertionError(f"the attacker did not start: {ready!r}")

    def stop(self) -> list[dict[str, Any]]:
        with contextlib.suppress(OSError):
            os.write(self.stop_w, b"x")
            os.close(self.stop_w)
        rest = self.results.read().decode()
        self.results.close()
        os.waitpid(self.pid, 0)
        return json.loads(rest) if rest.startswith("[") else [{"error": rest}]


def _attack(folder: Path, mode: int, path: Path, results: int, stop: int) -> None:
    os.setgroups([])
    os.setgid(ATTACKER)
    os.setuid(ATTACKER)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder)
    os.chmod(folder, mode)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o777)
    listener.listen(8)
    os.write(results, b"ready\n")
    got: list[dict[str, Any]] = []
    while True:
        readable, _, _ = select.select([listener.fileno(), stop], [], [])
        if stop in readable:  # the connections made before the stop are counted too
            listener.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    got.append(_take(listener.accept()[0]))
            break
        got.append(_take(listener.accept()[0]))
    os.write(results, json.dumps(got).encode())


def _take(conn: socket.socket) -> dict[str, Any]:
    """Read one request (whatever of it comes) and answer as the real hijack did: the
    attacker's text on the victim's stdout, exit status 0."""
    conn.setblocking(True)
    conn.settimeout(30)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 255)
    received = bytearray(data)
    while len(received) >= 4 and len(received) < 4 + struct.unpack("!I", received[:4])[0]:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        received += chunk
    if len(fds) > 1:
        os.write(fds[1], b"attacker text\n")
        for reply in ({"pid": os.getpid()}, {"exit": 0}):
            body = json.dumps(reply).encode()
            conn.sendall(struct.pack("!I", len(body)) + body)
    for fd in fds:
        os.close(fd)
    conn.close()
    return {"bytes": len(received), "fds": len(fds), "secret": SECRET.encode() in received}


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky, world-writable TMPDIR of the test's own (as /tmp is), which uid 65534 can
    reach; removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="jaxaot-two-users-"))
    where.chmod(0o1777)
    try:
        yield where
    finally:
        shutil.rmtree(where)


def _victim_env(shared_tmp: Path, **extra: str) -> dict[str, str]:
    """The victim's environment: default socket folder (in ``shared_tmp``), a token."""
    env = cli_env(TMPDIR=str(shared_tmp), VICTIM_TOKEN=SECRET)
    for key in ("XDG_RUNTIME_DIR", "JAXAOT_SERVER", "JAXAOT_SERVER_SOCKET"):
        env.pop(key, None)
    return {**env, **extra}


def _jaxaot(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jaxaot", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """``jaxaot --version`` in the victim's environment with no server (``JAXAOT_SERVER=0``:
    no socket looked at): what a client that runs in-process prints, besides its warning."""
    where = tmp_path_factory.mktemp("alone")
    return _jaxaot(["--version"], _victim_env(where, JAXAOT_SERVER="0"), where)


def _default_socket(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    with monkeypatch.context() as m:
        m.setenv("TMPDIR", str(shared_tmp))
        m.delenv("XDG_RUNTIME_DIR", raising=False)
        m.delenv("JAXAOT_SERVER_SOCKET", raising=False)
        return ss.socket_path()


@needs_root
def test_a_folder_taken_by_another_user_is_refused(
    shared_tmp: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    alone: subprocess.CompletedProcess[str],
) -> None:
    """Another user makes the victim's default folder first and listens there. The victim's
    socket there is made to look the victim's (chown, as root: what a symbolic link swapped
    between a client's stat and its connect would give the attacker); the client still sends
    nothing, runs in-process, and `server start` is one line."""
    path = _default_socket(shared_tmp, monkeypatch)
    folder = path.parent
    assert folder == shared_tmp / f"jaxaot-{os.geteuid()}"
    attacker = Attacker(folder, 0o777, path.name)
    try:
        os.chown(path, os.geteuid(), os.getegid())
        env = _victim_env(shared_tmp)
        via = _jaxaot(["--version"], env, tmp_path)
        start = subprocess.run(
            [*SERVER, "start"], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        got = attacker.stop()
    assert got == [], got  # not even a connection: the folder was refused first
    assert (via.returncode, via.stdout) == (0, alone.stdout)
    assert "attacker text" not in via.stdout and via.stdout.startswith("jaxaot ")
    warning = (
        f"jaxaot: warning: jaxaot server not used, running in this process: server socket "
        f"folder {folder} is owned by uid {ATTACKER}, not by you (uid {os.geteuid()}): "
        "someone else made it; set JAXAOT_SERVER_SOCKET to a path in a folder of your own "
        "(e.g. ~/.jaxaot/server.sock)"
    )
    assert via.stderr.splitlines() == [warning, *alone.stderr.splitlines()]
    assert start.returncode == 2 and start.stdout == ""
    assert start.stderr.splitlines() == [
        f"jaxaot: error: jaxaot server start: server socket folder {folder} is owned by uid "
        f"{ATTACKER}, not by you (uid {os.geteuid()}): someone else made it; set "
        "JAXAOT_SERVER_SOCKET to a path in a folder of your own (e.g. ~/.jaxaot/server.sock)"
    ]
    # The server still starts with a folder of the user's own, and serves.
    own = _victim_env(shared_tmp, JAXAOT_SERVER_SOCKET=str(tmp_path / "own" / "server.sock"))
    started = subprocess.run(
        [*SERVER, "start"], env=own, capture_output=True, text=True, timeout=120
    )
    try:
        assert started.returncode == 0 and "started" in started.stdout, started.stderr
        served = _jaxaot(["--version"], own, tmp_path)
        status = subprocess.run([*SERVER, "status"], env=own, capture_output=True, text=True)
        assert (served.returncode, served.stdout) == (0, alone.stdout)
        assert " 1 runs served" in status.stdout, status.stdout
    finally:
        subprocess.run([*SERVER, "stop"], env=own, capture_output=True, timeout=60)


@needs_root
def test_a_server_of_another_user_gets_nothing(
    shared_tmp: Path, tmp_path: Path, alone: subprocess.CompletedProcess[str]
) -> None:
    """The peer check alone: the victim's own folder (0700) holds a socket owned by the victim
    whose listener runs as another user (put there as root). The client connects, reads the
    listener's uid (SO_PEERCRED), sends not one byte and runs in-process."""
    attacker = Attacker(shared_tmp / "attacker", 0o700)
    mine = tmp_path / "srv"
    mine.mkdir(mode=0o700)
    target = mine / "server.sock"
    try:
        os.rename(attacker.sock, target)
        os.chown(target, os.geteuid(), os.getegid())
        env = _victim_env(shared_tmp, JAXAOT_SERVER_SOCKET=str(target))
        via = _jaxaot(["--version"], env, tmp_path)
        status = subprocess.run([*SERVER, "status"], env=env, capture_output=True, text=True)
    finally:
        got = attacker.stop()
    assert got == [{"bytes": 0, "fds": 0, "secret": False}] * 2, got  # connected, sent nothing
    assert (via.returncode, via.stdout) == (0, alone.stdout)
    assert via.stderr.splitlines()[0] == (
        f"jaxaot: warning: jaxaot server not used, running in this process: the process "
        f"listening on {target} runs as uid {ATTACKER} (pid {attacker.pid}), not as you "
        f"(uid {os.geteuid()}); set JAXAOT_SERVER_SOCKET to a path in a folder of your own "
        "(e.g. ~/.jaxaot/server.sock)"
    )
    assert via.stderr.splitlines()[1:] == alone.stderr.splitlines()
    assert status.returncode == 3 and "not running" in status.stdout


@needs_root
def test_a_symlinked_folder_is_refused(
    shared_tmp: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    alone: subprocess.CompletedProcess[str],
) -> None:
    """The default folder name is a symbolic link another user made: first to a folder the
    victim owns (0700), where `server start` would put its socket, lock and log; then swapped
    to the attacker's folder, whose socket looks the victim's (chown, as root). Refused both
    times: nothing made through the link, nothing sent through it."""
    path = _default_socket(shared_tmp, monkeypatch)
    link = path.parent
    victims = tmp_path / "victims-own"
    victims.mkdir(mode=0o700)
    attacker = Attacker(shared_tmp / "attacker", 0o755, path.name)
    try:
        os.chown(attacker.sock, os.geteuid(), os.getegid())
        # The link is the attacker's (made by it, in the sticky folder): lchown as root.
        link.symlink_to(victims)
        os.lchown(link, ATTACKER, ATTACKER)
        env = _victim_env(shared_tmp)
        start = subprocess.run(
            [*SERVER, "start"], env=env, capture_output=True, text=True, timeout=120
        )
        swapped = shared_tmp / "swap"
        swapped.symlink_to(shared_tmp / "attacker")
        os.lchown(swapped, ATTACKER, ATTACKER)
        os.replace(swapped, link)
        assert link.resolve() / path.name == attacker.sock  # the link leads to its socket now
        via = _jaxaot(["--version"], env, tmp_path)
    finally:
        got = attacker.stop()
    assert start.returncode == 2
    assert start.stderr.splitlines() == [
        f"jaxaot: error: jaxaot server start: server socket folder {link} is a symbolic "
        "link; set JAXAOT_SERVER_SOCKET to a path in a folder of your own "
        "(e.g. ~/.jaxaot/server.sock)"
    ]
    assert list(victims.iterdir()) == []  # no socket, lock or log put through the link
    assert got == []  # not even a connection
    assert (via.returncode, via.stdout) == (0, alone.stdout)
    assert via.stderr.splitlines() == [
        f"jaxaot: warning: jaxaot server not used, running in this process: server socket "
        f"folder {link} is a symbolic link; set JAXAOT_SERVER_SOCKET to a path in a folder "
        "of your own (e.g. ~/.jaxaot/server.sock)",
        *alone.stderr.splitlines(),
    ]
