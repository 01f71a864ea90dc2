"""What a run shows on the screen, and what only its log files get.

Quiet by default: ``conf/config.yaml`` gives Hydra's job logging a console handler at WARNING on
stderr, so a run's screen output is its summary (a sweep's: one progress line per job and the
report line), with warnings and errors; jaxaot's INFO lines (``[compile] ran in 0.14 s``, cache
hits and misses) go to the run's ``jaxaot.log`` only. ``verbose=true`` (``-v``, ``--verbose``)
shows them on the screen too (:func:`show_info`).

A stage's warning (``[execute] non-finite values ...``, ``StageContext.warn``) is recorded in the
manifest, and the run's summary (a sweep job's progress line) shows it: while a job runs, the
screen's handler holds those back (:func:`hold_stage_warnings`), and when the job has printed
its summary or progress line, :func:`release_stage_warnings` drops the ones its manifest records
and shows the rest, so that a run ending before its summary still shows every warning once.

Hydra's launchers log each sweep's ``Launching 2 jobs locally`` and ``#0 : key=value ...``
lines in the launching process; :func:`log_launch_lines` sends them to ``multirun.log`` in the
sweep dir, and to the screen only with ``verbose=true``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxaot.rundir.manifest import MANIFEST_NAME

VERBOSE_FLAGS = ("-v", "--verbose")  # the command line's spelling of verbose=true
CONSOLE = "console"  # the screen's handler in hydra.job_logging (conf/config.yaml)
SWEEP_LOG = "multirun.log"  # in hydra.sweep.dir, beside Hydra's multirun.yaml
# The loggers of Hydra's launchers: "Launching N jobs ...", "#3 : key=value ..." per job.
LAUNCH_LOGGERS = (
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
    "jaxaot.sweeps.slurm_launcher",
)


def verbose_argv(args: Sequence[str]) -> list[str]:
    """``-v`` / ``--verbose`` as the override ``verbose=true``, before Hydra parses argv."""
    return ["verbose=true" if a in VERBOSE_FLAGS else a for a in args]


def show_info(verbose: bool) -> None:
    """With ``verbose``: the screen handlers Hydra's job logging set up show INFO lines too.

    Called at the start of every job, in the process that runs it (a launcher's worker
    included), after Hydra configured its logging; quiet leaves the configured level as it is.
    """
    if not verbose:
        return
    for handler in logging.getLogger().handlers:
        if handler.get_name() == CONSOLE and handler.level > logging.INFO:
            handler.setLevel(logging.INFO)


class _AppendLines(logging.Handler):
    """Each record as one line appended to ``path``; the file is opened per record, so Hydra
    re-applying its logging config (which closes every handler) never silences it. ``screen``:
    warnings and errors also go to stderr (the logger does not propagate to the root's console)."""

    def __init__(self, path: Path, *, screen: bool) -> None:
        super().__init__(logging.INFO)
        self.path, self.screen = path, screen
        self.setFormatter(logging.Formatter("[%(asctime)s][HYDRA] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            with self.path.open("a", encoding="utf-8", errors="replace") as f:
                f.write(line + "\n")
            if self.screen and record.levelno >= logging.WARNING:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


# StageContext.warn's format (stages/contract.py): "[stage] message", recorded in the manifest too.
STAGE_WARNING = "[%s] %s"


class _HeldWarnings(logging.Filter):
    """On the screen's handler: keeps back the stages' warnings of the job in ``run_dir``.

    ``summary``: the job prints its summary (a single run; a sweep job with a snapshot), which
    it renders from the manifest it has just written."""

    def __init__(self, run_dir: Path, *, summary: bool) -> None:
        super().__init__()
        self.run_dir, self.summary = Path(run_dir), summary
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            record.name == "jaxaot"
            and record.levelno == logging.WARNING
            and record.msg == STAGE_WARNING
            and isinstance(args, tuple)
            and len(args) == 2
        ):
            self.held.append(record)
            return False
        return True


_held: list[tuple[logging.Handler, _HeldWarnings]] = []


def hold_stage_warnings(run_dir: Path, *, summary: bool) -> None:
    """Until :func:`release_stage_warnings`: the stages' warnings do not reach the screen.

    Called as a job starts, after Hydra configured its logging, in the process that runs it,
    for a quiet job whose summary or progress line will show its warnings; the run's log file
    gets them as they happen."""
    release_stage_warnings(printed=False)  # an earlier job's, if it never released them
    for handler in logging.getLogger().handlers:
        if handler.get_name() == CONSOLE:
            held = _HeldWarnings(run_dir, summary=summary)
            handler.addFilter(held)
            _held.append((handler, held))


def recorded_warnings(run_dir: Path) -> set[tuple[str, str]]:
    """``(stage, message)`` of every warning a finished run's manifest records (none while it
    runs, or without a readable manifest)."""
    try:
        manifest = json.loads((Path(run_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(manifest, dict) or manifest.get("status") in (None, "running"):
        return set()
    return {
        (str(stage), str(w))
        for stage, rec in (manifest.get("stages") or {}).items()
        if isinstance(rec, dict)
        for w in rec.get("warnings") or []
    }


def release_stage_warnings(*, printed: bool | None = None) -> None:
    """The held warnings: dropped where the job printed its summary or progress line and its
    manifest records them; shown now otherwise (idempotent).

    ``printed``: whether the summary or progress line was printed; None: whether the job prints
    its summary (as it ends, from its final manifest: a run that failed before writing one
    shows every warning here)."""
    while _held:
        handler, held = _held.pop(0)
        handler.removeFilter(held)
        shown = held.summary if printed is None else printed
        recorded = recorded_warnings(held.run_dir) if shown else set()
        for record in held.held:
            stage, message = record.args  # type: ignore[misc]
            if (str(stage), str(message)) not in recorded:
                handler.handle(record)


_installed: dict[str, tuple[_AppendLines, dict[str, bool]]] = {}  # sweep dir -> handler, propagate


def log_launch_lines(sweep_dir: Path, verbose: bool) -> None:
    """Until :func:`end_launch_lines`: the launchers' lines go to ``sweep_dir/multirun.log``,
    and reach the screen only with ``verbose``."""
    end_launch_lines(sweep_dir)
    handler = _AppendLines(Path(sweep_dir) / SWEEP_LOG, screen=not verbose)
    propagate = {}
    for name in LAUNCH_LOGGERS:
        logger = logging.getLogger(name)
        propagate[name] = logger.propagate
        logger.addHandler(handler)
        if not verbose:
            logger.propagate = False  # not to the root's console handler
    _installed[str(sweep_dir)] = (handler, propagate)


def end_launch_lines(sweep_dir: Path) -> None:
    """The launchers' loggers as they were before :func:`log_launch_lines` (idempotent)."""
    handler, propagate = _installed.pop(str(sweep_dir), (None, {}))
    if handler is None:
        return
    for name, was in propagate.items():
        logger = logging.getLogger(name)
        with contextlib.suppress(ValueError):
            logger.removeHandler(handler)
        logger.propagate = was
    handler.close()


__all__ = [
    "CONSOLE",
    "LAUNCH_LOGGERS",
    "STAGE_WARNING",
    "SWEEP_LOG",
    "VERBOSE_FLAGS",
    "end_launch_lines",
    "hold_stage_warnings",
    "log_launch_lines",
    "recorded_warnings",
    "release_stage_warnings",
    "show_info",
    "verbose_argv",
]
