"""``jaxaot server start|stop|status|restart``: the user's handle on the resident server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from jaxaot.cli.server import CHILD_MARK
from jaxaot.cli.server.client import ask
from jaxaot.cli.server.daemon import SERVE
from jaxaot.cli.server.folder import OVERRIDE, check_folder, socket_path
from jaxaot.cli.server.loop import IDLE_SECONDS


def spawn() -> subprocess.Popen[bytes]:
    """Start a server in the background; UnsafeSocketError when its folder is not the user's
    alone (nothing started)."""
    path = socket_path()
    check_folder(path.parent, create=True)
    env = {k: v for k, v in os.environ.items() if k != CHILD_MARK}
    env[OVERRIDE] = str(path)  # absolute: the server runs in /, and finds what clients find
    with path.with_suffix(".log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", SERVE],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd="/",  # no user folder on its sys.path, none kept busy
            start_new_session=True,
        )


def start(wait: float = 120.0) -> int:
    path = socket_path()
    check_folder(path.parent, create=True)  # UnsafeSocketError: one line (command)
    if (info := ask("status")) is not None:
        print(f"jaxaot server: already running (pid {info['pid']}, {path})")
        return 0
    if len(os.fsencode(path.with_name(f".{path.name}.{2**22}"))) > 107:  # sun_path's 108 bytes
        print(
            f"jaxaot: error: server socket path {str(path)!r} is too long for a Unix socket "
            "(at most ~95 bytes); set JAXAOT_SERVER_SOCKET to a shorter path",
            file=sys.stderr,
        )
        return 2
    proc = spawn()
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if (info := ask("status")) is not None:
            print(f"jaxaot server: started (pid {info['pid']}, {path})")
            return 0
        if proc.poll() is not None:
            print(
                f"jaxaot: error: the server exited with status {proc.returncode}; see "
                f"{path.with_suffix('.log')}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
    print(
        f"jaxaot: error: the server did not start within {wait:.0f} s; see "
        f"{path.with_suffix('.log')}",
        file=sys.stderr,
    )
    return 1


def stop() -> int:
    reply = ask("stop")
    if reply is None or "stopping" not in reply:  # none, or one leaving already
        print(f"jaxaot server: not running ({socket_path()})")
        return 0
    pid = int(reply["stopping"])
    for _ in range(400):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.025)
    print(f"jaxaot server: stopped (pid {pid})")
    return 0


def status() -> int:
    info = ask("status")
    if info is None:
        print(f"jaxaot server: not running ({socket_path()})")
        return 3
    up = time.time() - float(info["started"])
    print(
        f"jaxaot server: running (pid {info['pid']}, {socket_path()}, up {up:.0f} s, "
        f"{info['running']} running, {info['declined']} declined, {info['served']} runs served, "
        f"{info['compositions'][1]} compositions reused)"
    )
    return 0


def usage() -> str:
    """``jaxaot server --help``: what each subcommand does, where the socket is, how runs use it."""
    return f"""usage: jaxaot server {{start,stop,status,restart}}

A resident process with Python, JAX, Hydra and jaxaot imported once: while it runs, each
`jaxaot ...` of yours (same Python environment) is run by a fresh child of it, without
those imports. Output, exit status, Ctrl-C and the run's folder are as without it.

  start    start the server (nothing to do when it runs already)
  stop     stop it
  status   pid, socket, uptime and runs served; exit status 3 when it is not running
  restart  stop, then start

socket: {socket_path()}
  one per user and Python environment; JAXAOT_SERVER_SOCKET names another; its log is
  beside it (.log)
A run the server cannot serve exactly (another JAX/XLA environment variable, another
checkout or venv, a run started from a served run) runs in-process, as with no server;
a changed source file restarts it. JAXAOT_SERVER=0: a run does not use it;
JAXAOT_SERVER=1: a run starts one for the runs after it. It exits after
JAXAOT_SERVER_IDLE seconds without a request (default {IDLE_SECONDS // 3600} hours)."""


def command(args: list[str]) -> int:
    """``jaxaot server start|stop|status|restart``; ``--help``/``-h``: :func:`usage`, status 0;
    nothing: the usage and one error line, status 2. A socket folder that is not the user's
    alone, or one that cannot be made, is one line and status 2."""
    if any(a in ("-h", "--help") for a in args):
        from jaxaot.util.console import quiet_broken_pipe

        with quiet_broken_pipe():  # `jaxaot server --help | head`
            print(usage())
        return 0
    if not args:
        print(usage(), file=sys.stderr)
        print(
            "jaxaot: error: jaxaot server: expected start, stop, status or restart",
            file=sys.stderr,
        )
        return 2
    verb = args[0] if len(args) == 1 else " ".join(args)
    verbs = {"start": start, "stop": stop, "status": status}
    if verb in verbs or verb == "restart":
        try:
            with contextlib.suppress(FileNotFoundError):  # no folder: no server
                check_folder(socket_path().parent, create=False)
            if verb == "restart":
                stop()
                return start()
            return verbs[verb]()
        except OSError as exc:  # UnsafeSocketError, or the log or socket cannot be made
            print(f"jaxaot: error: jaxaot server {verb}: {exc}", file=sys.stderr)
            return 2
    print(
        f"jaxaot: error: jaxaot server: expected start, stop, status or restart; found {verb!r}",
        file=sys.stderr,
    )
    return 2


__all__ = ["command", "spawn", "start", "status", "stop", "usage"]
