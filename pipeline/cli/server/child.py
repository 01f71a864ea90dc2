"""The child: what a process forked by the server does to become its client's ``jaxaot``.

:func:`run_child` closes what belongs to the server, takes on the client's process
(:func:`become_client`: descriptors at their numbers, cwd, umask, affinity, environment, time
zone, ``sys.path``, ``sys.argv``, stdio, signal dispositions), runs a job (the served run:
:func:`run_jaxaot`) and ends as the interpreter would end after it, with ``os._exit``, never
returning into the server's accept loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NoReturn

from jaxaot.cli.server import CHILD_MARK, facts

# The real os._exit, taken at import, before anything can wrap it (a run guards os._exit while
# user code runs, jaxaot.util.exits): a forked child must end here, whatever happened. The
# server imports this module before it forks its first child.
exit_now = os._exit


def become_client(req: dict[str, Any], fds: list[int], added: dict[str, str]) -> None:
    """Take on the client's process as ``req`` describes it: ``fds`` (received with the
    request) at the numbers the client has them, its cwd, umask, CPU affinity, environment
    (with ``added``, what the server's imports set, on top, and :data:`CHILD_MARK`), time zone,
    ``sys.path``, ``sys.argv``, stdio, and the signals it ignores."""
    # Its own process group (the server sets it too, before telling the client: no race),
    # so a client's signals reach the run and whatever the run started, nothing else.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    targets = [0, 1, 2, *req["process"]["inherited_fds"]]
    high = max(targets) + 1  # first out of every target's way, then into place
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, moved, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    facts.stop_recording()  # the server's import recorder: an in-process run has none
    os.chdir(req["cwd"])
    os.umask(req["process"]["umask"])
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, req["process"]["affinity"])
    os.environ.clear()
    os.environ.update({**req["env"], **added, CHILD_MARK: str(os.getppid())})
    time.tzset()  # TZ as the client has it (${now:...}, run dir names, manifests)
    sys.path[:] = req["path"]
    sys.argv = [req.get("argv0") or "jaxaot", *req["argv"]]
    tty = req.get("isatty", [False] * 3)
    errors = req["process"]["stdio"]  # strict, or surrogateescape in a C locale
    sys.stdin = open(0, errors=errors[0], closefd=False)  # noqa: SIM115
    sys.stdout = open(  # noqa: SIM115
        1, "w", buffering=1 if tty[1] else -1, errors=errors[1], closefd=False
    )
    sys.stderr = open(2, "w", buffering=1, errors=errors[2], closefd=False)  # noqa: SIM115
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in req["process"]["ignored"]:  # `nohup jaxaot ...`: ignored as the client did
        signal.signal(sig, signal.SIG_IGN)


def finish_like_python(code: Any) -> int:
    """What the interpreter does after ``main`` returns or raises SystemExit, short of tearing
    down the (forked) interpreter: print a non-integer exit message, join non-daemon threads,
    run atexit handlers, flush; the exit status."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    import atexit
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def run_child(
    req: dict[str, Any],
    fds: list[int],
    *,
    close: Callable[[], None],
    added: dict[str, str],
    warned: list[Any],
    job: Callable[[], None],
) -> NoReturn:
    """In the forked child: ``close()`` the server's descriptors, :func:`become_client`, show
    the warnings the server's imports raised (``warned``: an in-process run prints them too),
    run ``job`` as ``python`` runs a main function, and exit with its status; 1 on anything
    uncaught (its traceback on the client's stderr). Never returns."""
    code: Any = 1
    try:
        close()
        become_client(req, fds, added)
        import warnings

        for w in warned:  # e.g. Hydra's "Error importing plugin ...", as in-process
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        try:
            job()
            code = 0
        except SystemExit as exc:
            code = exc.code
        code = finish_like_python(code)
    except BaseException:
        import traceback

        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        code = 1  # as Python exits on an uncaught exception
    finally:
        exit_now(code if isinstance(code, int) else 1)


def run_jaxaot(composed: OrderedDict[str, bytes], report: int) -> None:
    """The served run: ``jaxaot.cli.main.main`` with Hydra's compositions taken from
    ``composed`` (the server's, as forked) and reported on the pipe ``report``
    (jaxaot.cli.server.compositions)."""
    from jaxaot.cli.main import main
    from jaxaot.cli.server.compositions import install

    install(composed, report)
    main()


__all__ = ["become_client", "exit_now", "finish_like_python", "run_child", "run_jaxaot"]
