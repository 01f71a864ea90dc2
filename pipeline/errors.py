"""One error root for everything jaxaot reports to a user.

Each message is one line: what failed, where (config key, stage, argument path), what was
expected, what was found and, where there is one, how to fix it. The CLI prints the message
alone; ``debug=true`` (or ``JAXAOT_DEBUG=1``) shows the traceback as well.
"""

from __future__ import annotations

from typing import Any, ClassVar


class JaxaotError(Exception):
    """Root of every error jaxaot raises on purpose."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: jaxaot's own message, or ``Type: message`` for any other."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, JaxaotError) else f"{type(exc).__name__}: {text}"


class ConfigError(JaxaotError, ValueError):
    """A config key has a value of the wrong kind, shape or range."""


class ArgSpecError(ConfigError):
    """An argument spec in ``program.args``/``program.kwargs`` cannot be parsed or used."""


class TargetError(JaxaotError, ImportError):
    """``program.target`` does not name an importable callable."""


class BackendError(JaxaotError, RuntimeError):
    """A backend or device count that this machine cannot provide."""


class StageError(JaxaotError, RuntimeError):
    """A stage failed; the message names the stage and the cause."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"stage {stage!r} failed: {message}")
        self.stage = stage
        self.reason = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickling calls the class with ``args`` (the one formatted message).
        return (type(self), (self.stage, self.reason), self.__dict__)


class DoesNotFit(JaxaotError, RuntimeError):
    """``compile.topology``: the program needs more memory per device than the target has
    (HBM less the reserve, or host memory), by XLA's memory analysis or XLA's own refusal.

    A result, not a crash: the manifest's status is ``does_not_fit``, the CLI exits with
    :data:`EXIT_DOES_NOT_FIT`, and ``fit`` holds the verdict (bytes needed, available:
    ``jaxaot.stages.fit_verdict.verdict``, the one place fits is decided). It pickles with its
    message, ``fit``, ``metrics`` and ``breakdown`` (a probe's task in a process of its own
    raises it back to the fit search).
    """

    run_status: ClassVar[str] = "does_not_fit"  # the manifest's status and the stage's
    exit_code: ClassVar[int] = 3  # the CLI's exit status

    def __init__(
        self, message: str, fit: dict[str, object], metrics: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.fit = fit
        self.metrics = metrics or {}  # the stage's report columns of the verdict
        # What was live at the peak of a program XLA refused (memory_breakdown.json's content),
        # where its dump had it; its metrics are in ``metrics``.
        self.breakdown: dict[str, object] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickling calls the class with ``args`` (the message alone); the state
        # (``breakdown`` and any other attribute) follows in ``__dict__``.
        return (type(self), (str(self), self.fit, self.metrics), self.__dict__)


EXIT_DOES_NOT_FIT = DoesNotFit.exit_code


class CheckError(JaxaotError, AssertionError):
    """The execute stage's reference check exceeded its tolerance."""


class StoreError(JaxaotError, OSError):
    """A checkpoint or store entry is missing, corrupt or from an incompatible version. Raised
    while a store hit loads, the runner drops the entry and computes the stage; raised while a
    checkpoint loads, it ends the run (only :class:`EntryUnusable` computes the stage)."""


class EntryUnusable(StoreError):
    """Verified files (a store entry or a checkpoint) that cannot serve this run: the stage's
    ``load`` raises it, the runner drops a store entry (a checkpoint is left alone) and computes
    the stage instead (on a resume, where the stage's live inputs are computed this run). The
    message is the reason, shown in the warning."""


class UnusableExecutable(EntryUnusable):
    """A stored executable that verified but cannot serve this run: it does not unpickle or
    load here, or its calling convention is not the one this run's lowering has."""


class NotLoadableHere(JaxaotError, RuntimeError):
    """The entry is fine; this process cannot load it: the stage's ``load`` raises it, the
    runner keeps the entry and computes the stage here (on a resume, where the stage's live
    inputs are computed this run)."""


class ColdLoadError(NotLoadableHere):
    """An executable calls a custom call this process cannot vouch for (neither jaxlib's nor a
    target registered here): compile it instead."""


class Unkeyable(JaxaotError):
    """What the executable depends on cannot be told: compile without the store."""


class InputTypeError(JaxaotError, TypeError):
    """The inputs do not match the types the executable was compiled for."""


class MissingDependencyError(JaxaotError, ImportError):
    """An optional dependency of a feature is not installed (the message names the extra)."""


class VersionError(JaxaotError, RuntimeError):
    """The installed JAX (or jaxlib) is too old, or laid out otherwise, for a feature: the
    message names the feature, the version it needs, the installed one and the pip command."""


class UnsafeSocketError(JaxaotError, PermissionError):
    """The server socket's folder, or the process listening on the socket, is not this
    user's own: nothing is sent through it."""


class RunDirError(JaxaotError, OSError):
    """The run directory cannot take the run's manifest (a full disk, a read-only file system)."""


class SnapshotError(JaxaotError, OSError):
    """A golden snapshot is missing, hand-edited, from another format, or would be overwritten."""


class SnapshotMismatch(JaxaotError, AssertionError):
    """``snapshot.verify``: the run's lowering differs from the golden snapshot.

    The message is the one-line summary; ``diff`` holds the bounded diff of the first differing
    stage and ``diff_path`` the file with the full diff.
    """

    def __init__(self, message: str, *, diff: str = "", diff_path: str | None = None) -> None:
        super().__init__(message)
        self.diff = diff
        self.diff_path = diff_path


__all__ = [
    "EXIT_DOES_NOT_FIT",
    "ArgSpecError",
    "BackendError",
    "CheckError",
    "ColdLoadError",
    "ConfigError",
    "DoesNotFit",
    "EntryUnusable",
    "InputTypeError",
    "JaxaotError",
    "MissingDependencyError",
    "NotLoadableHere",
    "RunDirError",
    "SnapshotError",
    "SnapshotMismatch",
    "StageError",
    "StoreError",
    "TargetError",
    "Unkeyable",
    "UnsafeSocketError",
    "UnusableExecutable",
    "VersionError",
]
