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
    ``sys.path``, ``sys.argv`` and ``sys.orig_argv``, stdio, and the signals it ignores;
    NumPy's global random state drawn afresh, as a process of its own draws it."""
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
    sys.orig_argv = list(req.get("orig_argv") or sys.argv)  # what re-executing itself runs
    sys.stdin, sys.stdout, sys.stderr = _stdio(req["process"]["stdio"])
    # What a process draws from the OS as it starts, and a fork would share with every other
    # child: NumPy's global random state (Python's random reseeds itself in a forked child).
    if (numpy_random := sys.modules.get("numpy.random")) is not None:
        numpy_random.seed()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in req["process"]["ignored"]:  # `nohup jaxaot ...`: ignored as the client did
        signal.signal(sig, signal.SIG_IGN)


def _stdio(streams: list[list[Any]]) -> list[Any]:
    """stdin, stdout and stderr on descriptors 0-2, each opened as the client's interpreter
    opened its own (``facts.process``: encoding and error handler, line buffering,
    write-through; unbuffered under ``python -u``)."""
    import io

    out: list[Any] = []
    for fd, (name, (encoding, errors, lines, through)) in enumerate(
        zip(("<stdin>", "<stdout>", "<stderr>"), streams, strict=True)
    ):
        # As CPython opens them: a buffer sized by the file's block size (stdin's also under
        # `python -u`), or the raw file written through; "\n" lines, none translated.
        unbuffered = bool(through and fd)
        mode = "wb" if fd else "rb"
        buffer: Any = open(fd, mode, 0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        (buffer if unbuffered else buffer.raw).name = name
        text = io.TextIOWrapper(
            buffer,
            encoding=encoding,
            errors=errors,
            newline="\n",
            line_buffering=lines,
            write_through=through,
        )
        text.mode = "w" if fd else "r"  # type: ignore[misc]
        out.append(text)
    return out


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
