"""Hydra callback that turns a multirun into a sweep: plan, progress, heartbeat, report.

Configured in ``conf/config.yaml`` under ``hydra.callbacks.sweep``. Hydra calls the job hooks
in the process that runs the job (a joblib worker, a SLURM node) and the multirun hooks in the
launching process, so the two sides talk only through the sweep directory (see
:mod:`jaxaot.sweeps.progress`). A failing job never stops the sweep: it becomes a report row with
its error, and :func:`last_sweep_failures` lets the CLI exit non-zero afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from jaxaot.compat.hydra import job_return_value
from jaxaot.errors import EXIT_DOES_NOT_FIT
from jaxaot.rundir.logs import (
    end_launch_lines,
    hold_stage_warnings,
    log_launch_lines,
    release_stage_warnings,
)
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.sweeps.overrides import shorten_launcher_lines
from jaxaot.sweeps.progress import (
    JOB_NAME,
    Heartbeat,
    JobOutcome,
    ProgressRelay,
    SweepPlan,
    claim_finish_slot,
    override_key,
    planned_stages,
    print_error,
    print_line,
    progress_line,
    read_json,
    relay_line,
    write_job_record,
)
from jaxaot.sweeps.report import MD_NAME, SweepTable, collect, write_report
from omegaconf import DictConfig, OmegaConf

_heartbeats: dict[str, Heartbeat] = {}
_relays: dict[str, ProgressRelay] = {}  # module-level: launchers pickle the callbacks
_last_failed: int | None = None
_after: dict[str, list[Callable[[Path], None]]] = {}


def after_report(sweep_dir: Path, fn: Callable[[Path], None]) -> None:
    """Call ``fn(sweep_dir)`` once this process's :class:`SweepCallback` has written the sweep's
    report (or failed to): for a callback Hydra ends before it, that needs the report."""
    _after.setdefault(str(sweep_dir), []).append(fn)


def last_sweep_failures() -> int | None:
    """Failed jobs of the last sweep this process ran (None when no sweep finished)."""
    return _last_failed


def plan_of(config: DictConfig) -> SweepPlan:
    """Job count and varying keys from the sweep's overrides, before any job starts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from jaxaot.compat.hydra import split_sweep_arguments

    sweeper = config.hydra.sweeper
    params = sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()]
    args += [str(o) for o in config.hydra.overrides.task]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException:  # the sweep itself reports a bad override, with Hydra's message
        return SweepPlan(total=None, varying=())
    varying = tuple(override_key(o.get_key_element()) for o in parsed if o.is_sweep_override())
    total: int | None
    if sweeper.get("n_trials") is not None:
        total = int(sweeper.n_trials)
    else:
        try:
            total = len(split_sweep_arguments(parsed, None)[0])
        except HydraException:  # e.g. an interval sweep, which only a search sweeper samples
            total = None
    return SweepPlan(total=total, varying=varying)


def _output_hidden(config: DictConfig) -> bool:
    """Whether the launcher sends each job's output to a log instead of the user's terminal.

    submitit does (local and SLURM, also through jaxaot's SLURM launcher: ``.submitit/<id>/*.out``);
    the basic launcher runs jobs in this process and joblib's workers share its terminal.
    """
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    return "submitit" in target or "slurm" in target.lower()


def _outcome(job_return: JobReturn) -> tuple[str, int, str | None]:
    if job_return.status != JobStatus.COMPLETED:
        exc = job_return_value(job_return)
        return "failed", 2, f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    value = job_return_value(job_return)
    if isinstance(value, JobOutcome):
        status = {0: "ok", EXIT_DOES_NOT_FIT: "does_not_fit"}.get(value.code, "failed")
        return status, value.code, value.error
    code = value if isinstance(value, int) else 0
    return ("ok" if code == 0 else "failed"), code, None


def _snapshot(config: DictConfig) -> bool:
    """Whether the job writes or verifies a snapshot: it prints its summary even in a sweep."""
    return bool(
        OmegaConf.select(config, "snapshot.write", default=None)
        or OmegaConf.select(config, "snapshot.verify", default=None)
    )


def _import_plots() -> None:
    with contextlib.suppress(Exception):  # no matplotlib: write_report says so at the end
        import jaxaot.sweeps.plots  # noqa: F401


def _prefetch_plotting() -> None:
    """Import matplotlib (~1 s) on a background thread while the jobs run.

    XLA compiles and executes without holding the GIL, so the import mostly overlaps them
    instead of adding to the sweep's wall time at the end. numpy is imported first, here, so
    the two threads never import it at the same time.
    """
    import numpy  # noqa: F401

    threading.Thread(target=_import_plots, name="jaxaot-plots-import", daemon=True).start()


class SweepCallback(Callback):
    """Sweep plan, one progress line per job, a heartbeat for long stages, and the report."""

    def __init__(
        self,
        report: bool = True,
        plots: bool = True,
        progress: bool = True,
        heartbeat_s: float = 30.0,
    ) -> None:
        self.report, self.plots, self.progress = report, plots, progress
        self.heartbeat_s = float(heartbeat_s)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _last_failed
        _last_failed = None
        sweep_dir = Path(str(config.hydra.sweep.dir))
        plan = plan_of(config)
        plan.write(sweep_dir)
        # Hydra's "Launching N jobs" and "#0 : ..." lines: to multirun.log; the screen with -v.
        verbose = bool(OmegaConf.select(config, "verbose", default=False))
        log_launch_lines(sweep_dir, verbose)
        if not verbose and logging.getLogger("matplotlib").level == logging.NOTSET:
            # matplotlib's first use on a machine logs "generated new fontManager" at INFO,
            # which the launching process's Hydra logging would show as a [HYDRA] line.
            logging.getLogger("matplotlib").setLevel(logging.WARNING)
        if self.progress:  # the launcher's "#3 : key=value ..." lines, long values shortened
            shorten_launcher_lines()
        if self.progress and _output_hidden(config):
            _relays[str(sweep_dir)] = ProgressRelay(sweep_dir, plan.total, self.heartbeat_s).start()
        if self.report and self.plots:
            _prefetch_plotting()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = str(config.hydra.runtime.output_dir)
        quiet = not OmegaConf.select(config, "verbose", default=False)
        # A single run prints its summary, a sweep job its progress line (or, with a snapshot,
        # its summary): either shows the stages' warnings, which the screen then gets once.
        summary = config.hydra.mode != RunMode.MULTIRUN or _snapshot(config)
        if quiet and (summary or self.progress):
            hold_stage_warnings(Path(run_dir), summary=summary)
        if self.heartbeat_s <= 0:
            return
        if config.hydra.mode == RunMode.MULTIRUN:
            label = f"job {config.hydra.job.num}"
        else:
            label = str(OmegaConf.select(config, "program.name", default="run"))
        try:
            stages = planned_stages(config)
        except ValueError:  # a bad start_at/stop_after: the runner reports it
            return
        _heartbeats[run_dir] = Heartbeat(
            Path(run_dir), self.heartbeat_s, label, stages, screen=quiet
        ).start()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.runtime.output_dir))
        beat = _heartbeats.pop(str(run_dir), None)
        if beat is not None:
            beat.stop()
        if config.hydra.mode != RunMode.MULTIRUN:
            release_stage_warnings()  # the summary is printed: it shows them
            return
        status, code, error = _outcome(job_return)
        overrides = [str(o) for o in (job_return.overrides or [])]
        record = {
            "num": int(config.hydra.job.num),
            "overrides": overrides,
            "status": status,
            "code": code,
            "error": error,
            "host": socket.gethostname(),
            "finished": time.time(),
        }
        if not self.progress:
            write_job_record(run_dir, record)
            release_stage_warnings()
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        plan = SweepPlan.read(sweep_dir)
        n = claim_finish_slot(sweep_dir)
        # As the progress line numbers the job: the sweep's last line names failed jobs so.
        record["progress"] = f"[{n}/{plan.total if plan.total is not None else '?'}]"
        write_job_record(run_dir, record)
        shown = [o for o in overrides if override_key(o) in plan.varying] or overrides
        manifest = read_json(run_dir / MANIFEST_NAME)
        error = error or (manifest or {}).get("error")
        line = progress_line(n, plan.total, shown, status, manifest, error)
        print_line(line)
        release_stage_warnings(printed=True)  # the line counts them; sweep.md lists them
        if _output_hidden(config):
            relay_line(sweep_dir, n, line)  # for the launching process to print

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _last_failed
        sweep_dir = Path(str(config.hydra.sweep.dir))
        end_launch_lines(sweep_dir)
        relay = _relays.pop(str(sweep_dir), None)
        if relay is not None:
            relay.stop()
        try:
            table = write_report(sweep_dir, plots=self.plots) if self.report else collect(sweep_dir)
        finally:
            for fn in _after.pop(str(sweep_dir), []):
                try:
                    fn(sweep_dir)
                except Exception as exc:  # never the report's own error, never the summary
                    name = getattr(fn, "__qualname__", repr(fn))
                    print_error(f"jaxaot: {name} after the sweep report: {exc!r}")
        _last_failed = len(table.failed)
        ok = len(table.rows) - _last_failed - len(table.does_not_fit)
        misfits = f", {len(table.does_not_fit)} do not fit" if table.does_not_fit else ""
        if self.report:
            print(
                f"sweep: {len(table.rows)} jobs, {ok} ok{misfits}, {_last_failed} failed; "
                f"report: {sweep_dir / MD_NAME}",
                flush=True,
            )
        if table.failed:
            print_error(failed_line(sweep_dir, table, progress=self.progress))


def failed_line(sweep_dir: Path, table: SweepTable, *, progress: bool) -> str:
    """``sweep: 1 of 2 jobs failed: [2/2] (errors above and in sweep.md)``: each failed job as
    its progress line numbered it (``job 3``, its folder, for one that printed none: killed).
    Without progress lines, each failed job's error follows on a line of its own."""
    failed = table.failed
    head = f"sweep: {len(failed)} of {len(table.rows)} jobs failed"
    if not progress:
        return "\n".join(
            [f"{head} (errors in {MD_NAME}):"]
            + [f"  job {r['job']}: {r.get('error') or r['status']}" for r in failed]
        )
    names = []
    for r in failed:
        record = read_json(sweep_dir / str(r["dir"]) / JOB_NAME) or {}
        names.append(str(record.get("progress") or f"job {r['job']}"))
    return f"{head}: {', '.join(names)} (errors above and in {MD_NAME})"


__all__ = ["SweepCallback", "after_report", "failed_line", "last_sweep_failures", "plan_of"]
