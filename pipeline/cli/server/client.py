"""The client: hand one ``jaxaot`` run to this user's server, and be that run's process.

It connects only to a socket in a folder that is the user's alone
(:func:`jaxaot.cli.server.folder.check_folder`), owned by the user, with a listening process
that runs as the user (``SO_PEERCRED``), and checks all of that before it sends a byte. It then
sends its request with its stdin/stdout/stderr, and waits: the run's output goes straight to
those descriptors, Ctrl-C and SIGTERM are forwarded to the run's process group, and the client
exits with the run's status (or is killed by the same signal). A server that declines leaves
nothing done: the caller runs in-process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import sys
from pathlib import Path
from typing import Any

from jaxaot.cli.server import facts
from jaxaot.cli.server.folder import FIX, check_folder, socket_path
from jaxaot.cli.server.protocol import (
    PROTOCOL,
    operation,
    peer_credentials,
    peer_problem,
    recv,
    send,
)
from jaxaot.errors import UnsafeSocketError


def connect(path: Path) -> socket.socket | None:
    """A connection to this user's own server at ``path``, nothing sent yet; None when there
    is no server there. Raises UnsafeSocketError when the folder or the listening process is
    someone else's (the connection closed, nothing sent)."""
    try:
        check_folder(path.parent, create=False)
        st = os.lstat(path)
    except UnsafeSocketError:
        raise
    except OSError:  # no folder, no socket: no server
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafeSocketError(
            f"server socket {path} is not a socket of yours (owner uid {st.st_uid}); {FIX}"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        problem = peer_problem(*peer_credentials(sock))
    except OSError:
        sock.close()
        return None
    if problem:
        sock.close()
        raise UnsafeSocketError(f"the process listening on {path} {problem}; {FIX}")
    return sock


def _connect(quiet: bool = False) -> socket.socket | None:
    """A connection to this user's own server (:func:`connect`); None when there is none, or
    when it is someone else's: then one warning line (unless ``quiet``), nothing sent."""
    try:
        return connect(socket_path())
    except UnsafeSocketError as exc:
        if not quiet:
            print(
                f"jaxaot: warning: jaxaot server not used, running in this process: {exc}",
                file=sys.stderr,
            )
        return None


def ask(op: str, quiet: bool = False) -> dict[str, Any] | None:
    """The server's reply to an operation (``status``, ``stop``); None when no server of this
    user's answers."""
    sock = _connect(quiet)
    if sock is None:
        return None
    with sock:
        try:
            send(sock, operation(op))
            return recv(sock)[0]
        except (OSError, ValueError):
            return None


def request(argv: list[str]) -> tuple[dict[str, Any], list[int]]:
    """The request that runs ``jaxaot argv`` as this process would, and the descriptors that
    go with it (stdin, stdout, stderr, then every other inheritable one)."""
    process = facts.process()
    req = {
        "v": PROTOCOL,
        "argv": argv,
        "argv0": sys.argv[0],
        "orig_argv": sys.orig_argv,  # the command line as the client's interpreter got it
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "path": sys.path,
        "origins": facts.origins(),
        "process": process,
    }
    return req, [0, 1, 2, *process["inherited_fds"]]


def run_via_server(argv: list[str]) -> int | None:
    """Run ``jaxaot argv`` in a child of the server; its exit status, or None when there is
    no server or it declined (then the caller runs in-process, nothing having happened), or
    when this process set up more than a ``jaxaot`` process has (:func:`facts.own_setup`)."""
    if facts.own_setup():
        return None
    sock = _connect()
    if sock is None:
        return None
    group: int | None = None  # the child leads its own process group
    pending: list[int] = []  # signals that came before the child existed

    def forward(signum: int, _frame: Any) -> None:
        # As a terminal's Ctrl-C reaches every process of an in-process run.
        if group is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)

    # Installed before asking, so that no Ctrl-C falls between the fork and the handler; not
    # for a signal this process ignores (`nohup`, `cmd &`): the run ignores it too.
    previous = {
        sig: signal.signal(sig, forward)
        for sig in facts.FORWARDED
        if signal.getsignal(sig) != signal.SIG_IGN
    }
    try:
        with sock:
            try:
                send(sock, *request(argv))
            except OSError:
                reply: dict[str, Any] | None = {"declined": "not sent"}  # nothing can have run
            else:
                try:
                    reply, _ = recv(sock)
                except (OSError, ValueError):
                    reply = None
            if reply is None:  # the server went away: it may have started the run, so not again
                print(
                    "jaxaot: error: the jaxaot server went away before the run started or while "
                    "it started (it may have run); run again (JAXAOT_SERVER=0 runs in this process)",
                    file=sys.stderr,
                )
                return 1
            if "pid" not in reply:  # declined (stale code, another environment)
                if pending:  # interrupted before anything ran
                    print("jaxaot: interrupted before the run started", file=sys.stderr)
                    return 128 + pending[0]
                return None  # the caller runs in-process, nothing having happened
            group = int(reply["pid"])
            for signum in pending:
                forward(signum, None)
            try:
                done, _ = recv(sock)
            except (OSError, ValueError):
                done = None
            if done is None or "exit" not in done:
                forward(signal.SIGTERM, None)  # no run goes on writing to a terminal given back
                print("jaxaot: error: the jaxaot server went away during the run", file=sys.stderr)
                return 1
            if done.get("signal"):  # killed by a signal: this process ends the same way
                sig = signal.Signals(int(done["signal"]))
                sys.stdout.flush()
                previous[sig] = signal.SIG_DFL
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            return int(done["exit"])
    finally:  # this process's own handlers back (run_via_server is also called in tests)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["ask", "connect", "request", "run_via_server"]
