"""Honest exits: a run that ends early says so, in its manifest and in its exit status.

Three ways a run would end without a trace, and what is done about each:

- user code calls ``sys.exit(0)``: a :class:`SystemExit` goes through every ``except
  Exception``, so uncaught the process would exit 0 with the manifest saying ``running``;
- user code calls ``os._exit(0)``: the process would vanish; while a run is in progress
  :func:`guard_os_exit` makes ``os._exit`` raise :class:`ProgramExit` in this process instead;
- Ctrl-C would print a traceback and SIGTERM kill the process outright. :func:`signals_raise`
  makes SIGTERM raise :class:`Terminated` (a ``KeyboardInterrupt``, so both are handled alike).

The runner turns the first two into a failed stage and records the others as ``interrupted``;
the CLI prints one line and exits ``128 + signal`` (130 for Ctrl-C, 143 for SIGTERM), the
shell's convention for a process ended by a signal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

log = logging.getLogger("jaxaot")


class Terminated(KeyboardInterrupt):
    """SIGTERM raised as an exception in the main thread, so the run can record it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ProgramExit(SystemExit):
    """``os._exit(code)`` called by user code while a run was in progress."""

    how = "os._exit"


def exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's status for a process ended by this interrupt: 128 + signal number."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def describe_interrupt(exc: KeyboardInterrupt) -> str:
    if isinstance(exc, Terminated):
        return f"terminated by {signal.Signals(exc.signum).name}"
    return "interrupted by Ctrl-C (SIGINT)"


def describe_exit(exc: SystemExit) -> str:
    """``the program called sys.exit(0)`` (or ``os._exit``), for a failed stage's message."""
    how = getattr(exc, "how", "sys.exit")
    code = exc.code if not isinstance(exc.code, str) else repr(exc.code)
    args = "" if code is None else code
    return (
        f"the program called {how}({args}); expected it to return its result, not end the process"
    )


# Why the process is being ended on purpose by its job system (set by the SLURM launcher's
# checkpoint hook, which submitit calls from its signal handler before it exits): the
# SystemExit that follows is a preemption, not the program's own exit.
_preempted: str | None = None

# What records a preemption in the manifest of the run in progress (the runner's, for the
# length of a run). submitit's handler (submitit 1.5) calls the checkpoint hook, then runs
# ``scontrol requeue``, then raises SystemExit; SLURM sends SIGTERM (which submitit ignores)
# and SIGKILL ``KillWait`` seconds after the requeue. The runner's own handling of that
# SystemExit may still be waiting for an XLA compile on a worker thread when the SIGKILL
# comes, so the record is written here, synchronously, before the hook returns.
_recorders: list[Callable[[str], None]] = []


def note_preempted(why: str) -> None:
    """Say that the coming SystemExit is the job system preempting this run, and record the
    run in progress as interrupted now (:func:`recording_preemption`), before the job system
    is told to requeue it. A recorder's error is logged, not raised: the requeue matters more.
    """
    global _preempted
    _preempted = why
    for record in list(_recorders):
        try:
            record(why)
        except Exception as exc:  # e.g. a full disk
            log.error("could not record the preemption (%s): %s", why, exc)


@contextlib.contextmanager
def recording_preemption(record: Callable[[str], None]) -> Iterator[None]:
    """Within the block, :func:`note_preempted` calls ``record(why)`` before it returns.

    ``record`` runs in a signal handler: in the main thread, between two bytecodes of whatever
    the run was doing then; it must leave what it interrupted intact (replace containers that
    code may be iterating, do not update them in place) and write atomically.
    """
    _recorders.append(record)
    try:
        yield
    finally:
        _recorders.remove(record)


def preempted() -> str | None:
    """Why the job system is ending this run, or None when it is not."""
    return _preempted


# The interrupt a handler raised that the run has not seen yet. Python drops an exception
# raised where it cannot propagate (a garbage-collection callback such as JAX's, a __del__):
# the run would go on to the end and say ``ok``. The runner calls :func:`raise_pending` between
# stages, so a dropped interrupt still ends the run, a stage later.
_pending: list[KeyboardInterrupt] = []


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    """A signal handler: raise :class:`Terminated` where the main thread is."""
    _pending[:] = [Terminated(signum)]
    raise _pending[0]


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """Python's Ctrl-C handler, remembered until the run sees it (:func:`raise_pending`)."""
    _pending[:] = [KeyboardInterrupt()]
    raise _pending[0]


def raise_pending() -> None:
    """Raise the interrupt a handler raised where Python dropped it, if there is one."""
    if _pending:
        raise _pending.pop()


def clear_pending() -> None:
    """The interrupt reached the run: nothing left to raise."""
    _pending.clear()


@contextlib.contextmanager
def signals_raise(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """Within the block, ``signals`` raise :class:`Terminated` in the main thread, and Ctrl-C
    raises ``KeyboardInterrupt`` through :func:`raise_interrupted` (remembered until seen).

    Only where a signal still has its default action (a caller's own handler is left alone),
    and only in the main thread (Python delivers signals there); restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved: dict[int, Any] = {}
    for s in signals:
        if signal.getsignal(s) is signal.SIG_DFL:
            saved[s] = signal.signal(s, raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        saved[signal.SIGINT] = signal.signal(signal.SIGINT, raise_interrupted)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def guard_os_exit() -> Iterator[None]:
    """Within the block, ``os._exit`` in this process raises :class:`ProgramExit`.

    A child forked meanwhile (multiprocessing's fork start method ends its children with
    ``os._exit``) still exits for real: the guard checks the process id.
    """
    real = os._exit
    pid = os.getpid()

    def guarded(code: int) -> Any:
        if os.getpid() != pid:
            real(code)
        raise ProgramExit(code)

    os._exit = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


__all__ = [
    "ProgramExit",
    "Terminated",
    "describe_exit",
    "describe_interrupt",
    "exit_code",
    "guard_os_exit",
    "note_preempted",
    "preempted",
    "raise_terminated",
    "recording_preemption",
    "signals_raise",
]
