"""What a sweep shows while it runs: one line per finished job and a heartbeat for long stages.

Jobs may run in other processes (joblib) or on other machines (submitit), so everything here
goes through the sweep directory rather than through memory: the sweep's plan (job count, the
overrides that vary) in ``.jaxaot/sweep.json``, finish order through exclusively created
marker files, and each job's outcome in ``job.json`` next to its ``manifest.json``. Where a
job's own output does not reach the user (submitit writes it to per-job logs), the job also
leaves its progress line in ``.jaxaot/progress/<n>`` and the launching process prints it
(:class:`ProgressRelay`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from jaxaot.config.order import STAGES
from jaxaot.config.sections import override_key
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import OBJECTIVE_BY_NAME, RunMetrics
from jaxaot.stages import NODES
from jaxaot.sweeps.overrides import override_value, short_names, short_value
from jaxaot.util.fsio import atomic_write_json, atomic_write_text
from jaxaot.util.humanize import human_bytes, human_count, human_seconds

log = logging.getLogger("jaxaot")

STATE_DIR = ".jaxaot"
PLAN_NAME = "sweep.json"
JOB_NAME = "job.json"
LINES_DIR = "progress"
FINISHED_DIR = "finished"  # under STATE_DIR: one empty file per finish slot claimed

_VERB = {node.name: node.show.verb for node in NODES}  # "still compiling (...)"


class AtMost(int):
    """A job count known as an upper bound only (a fit search decides its next job from the
    last one's verdict): shown as ``≤14``."""

    def __str__(self) -> str:
        return f"≤{int(self)}"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else int.__format__(self, spec)


@dataclass(frozen=True)
class SweepPlan:
    """What every job of a sweep needs to know about the whole: its size and what varies.

    ``bound``: ``total`` is an upper bound that the sweeper lowers as it learns (it rewrites
    the plan before each job); jobs show it as ``[3/≤14]``.
    """

    total: int | None
    varying: tuple[str, ...]
    bound: bool = False

    def write(self, sweep_dir: Path) -> None:
        atomic_write_json(Path(sweep_dir) / STATE_DIR / PLAN_NAME, asdict(self))

    @classmethod
    def read(cls, sweep_dir: Path) -> SweepPlan:
        try:
            data = json.loads((Path(sweep_dir) / STATE_DIR / PLAN_NAME).read_text())
        except (OSError, ValueError):
            return cls(total=None, varying=())
        total, bound = data.get("total"), bool(data.get("bound", False))
        if bound and total is not None:
            total = AtMost(total)
        return cls(total=total, varying=tuple(data.get("varying", ())), bound=bound)


@dataclass(frozen=True)
class JobOutcome:
    """A sweep job's result as the task function returns it: the exit code and the error line.

    Errors raised before the runner writes a manifest (a bad override value) exist only here,
    so the report learns them through ``job.json``.
    """

    code: int
    error: str | None = None


def write_job_record(run_dir: Path, record: dict[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / JOB_NAME, record)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when missing or unreadable (a job still running)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def claim_finish_slot(sweep_dir: Path) -> int:
    """This job's place in finish order (1-based), unique across processes and hosts.

    ``O_CREAT | O_EXCL`` is atomic on local file systems and on NFS v3+, so two jobs finishing
    together never print the same number.
    """
    folder = Path(sweep_dir) / STATE_DIR / FINISHED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        try:
            os.close(os.open(folder / str(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1


def finished_count(sweep_dir: Path) -> int:
    """Finish slots claimed in ``sweep_dir`` so far, by every run of the sweep: the next job to
    finish is numbered at least one more."""
    try:
        return sum(p.name.isdigit() for p in (Path(sweep_dir) / STATE_DIR / FINISHED_DIR).iterdir())
    except FileNotFoundError:
        return 0


def key_figures(manifest: dict[str, Any] | None) -> str:
    """Compile status/time, FLOPs, temp memory, execute median and FLOP/s, in one phrase."""
    run = RunMetrics.from_manifest(manifest)
    parts = []
    comp, ex = run.compile, run.execute
    if run.run("compile").status is not None:
        parts.append(
            f"compile {run.run('compile').status} {human_seconds(run.run('compile').seconds)}"
        )
        if comp.flops is not None:
            parts.append(human_count(comp.flops, "FLOP"))
        if comp.temp_bytes is not None:
            parts.append(f"temp {human_bytes(comp.temp_bytes)}")
    if ex.median_s is not None:
        text = f"execute {human_seconds(ex.median_s)}"
        if ex.flops_per_s:
            text += f" ({human_count(ex.flops_per_s, 'FLOP/s')})"
        parts.append(text)
    return ", ".join(parts)


def progress_line(
    n: int,
    total: int | None,
    overrides: Sequence[str],
    status: str,
    manifest: dict[str, Any] | None,
    error: str | None,
) -> str:
    """``[3/8] key=value ... | ok | compile ran 1.2 s, 12 MFLOP, ...`` for one finished job
    (``[3/≤8]`` where the total is a bound, :class:`AtMost`); a job whose stages warned:
    ``| ok, 1 warning | ... | warning: execute: non-finite values ...``."""
    head = f"[{n}/{total if total is not None else '?'}]"
    names = short_names([override_key(o) for o in overrides])
    shown = " ".join(
        f"{names[override_key(o)]}={short_value(override_value(o))}" for o in overrides
    )
    shown = shown or "(no overrides)"
    tail = key_figures(manifest) if status == "ok" else (error or "failed")
    warned = [str(w) for w in (manifest or {}).get("warnings") or []]
    if warned:  # the stages' warnings: counted, the first one shortened (sweep.md has all)
        status += f", {len(warned)} warning{'s' if len(warned) > 1 else ''}"
        more = f" (+{len(warned) - 1} more)" if len(warned) > 1 else ""
        tail = f"{tail} | warning: {_shorten(warned[0], WARNING_CHARS)}{more}"
    return f"{head} {shown} | {status} | {tail}".rstrip(" |")


WARNING_CHARS = 80  # of a warning on a progress line


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def human_value(objective: str, value: float) -> str:
    """An objective's value for people, in its unit (:meth:`Metric.human`): a time
    (``execute.median_s``, ``compile.seconds``) as ``389.3 us``, a size (``compile.temp_bytes``)
    as ``1.5 MiB``, any other figure (or a name no objective has) with six significant
    digits."""
    metric = OBJECTIVE_BY_NAME.get(objective)
    return metric.human(value) if metric is not None else f"{value:.6g}"


def relay_line(sweep_dir: Path, n: int, line: str) -> None:
    """Leave job ``n``'s progress line for :class:`ProgressRelay` (written atomically)."""
    atomic_write_text(Path(sweep_dir) / STATE_DIR / LINES_DIR / str(n), line + "\n")


class _Ticker:
    """A daemon thread that calls :meth:`tick` every ``period_s`` until :meth:`stop`."""

    def __init__(self, period_s: float, name: str) -> None:
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Self:
        self._started()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _started(self) -> None:
        """Called as the thread starts (reset clocks here)."""

    def tick(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            self.tick()


class ProgressRelay(_Ticker):
    """Prints, in the launching process, the progress lines that jobs elsewhere relay.

    Polls ``.jaxaot/progress/`` and prints each new line once, in finish order as far as it
    can tell. When nothing has finished for ``heartbeat_s``, it says how many jobs are done and
    how long the sweep has run, so a sweep of long compiles on a cluster shows it is alive.
    """

    def __init__(
        self,
        sweep_dir: Path,
        total: int | None,
        heartbeat_s: float,
        poll_s: float = 0.5,
        write: Any = None,
    ) -> None:
        super().__init__(poll_s, "jaxaot-progress")
        self.folder = Path(sweep_dir) / STATE_DIR / LINES_DIR
        self.total, self.heartbeat_s = total, heartbeat_s
        self._write = write or print_line
        self._printed: set[str] = set()
        self._t0 = self._last = time.monotonic()

    def _started(self) -> None:
        self._t0 = self._last = time.monotonic()

    def stop(self) -> None:
        """Print whatever arrived last, then stop."""
        super().stop()
        self.poll()

    def poll(self) -> int:
        """Print the lines not printed yet; return how many."""
        try:
            names = [n for n in os.listdir(self.folder) if n.isdigit() and n not in self._printed]
        except OSError:
            return 0
        for name in sorted(names, key=int):
            try:
                line = (self.folder / name).read_text().rstrip("\n")
            except OSError:
                continue
            self._printed.add(name)
            self._write(line)
        if names:
            self._last = time.monotonic()
        return len(names)

    def tick(self) -> None:
        self.poll()
        now = time.monotonic()
        if self.heartbeat_s > 0 and now - self._last >= self.heartbeat_s:
            self._last = now
            total = self.total if self.total is not None else "?"
            self._write(
                f"[sweep] {len(self._printed)}/{total} jobs finished, "
                f"{human_seconds(now - self._t0)} in; the others are queued or running"
            )


def print_line(line: str) -> None:
    """One line to stdout in one write, so lines of jobs finishing together in parallel
    workers (or of the relay thread) never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_error(text: str) -> None:
    """Plain lines on stderr, for a sweep's own warnings and errors: not log records, which
    in the launching process carry Hydra's ``[time][HYDRA]`` prefix."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def planned_stages(config: Any) -> list[str]:
    """The stages a job's config runs, from ``start_at`` to ``stop_after`` (compile at the
    latest for ``compile.topology``: there is nothing here to execute on, see
    jaxaot.config.topology_config)."""
    first = STAGES.index(str(config.get("start_at", STAGES[0])))
    last = STAGES.index(str(config.get("stop_after", STAGES[-1])))
    compile_ = config.get("compile")
    if compile_ is not None and compile_.get("topology"):
        last = min(last, STAGES.index("compile"))
    return list(STAGES[first : last + 1])


class Heartbeat(_Ticker):
    """Logs ``still compiling ...`` every ``interval_s`` while a job runs.

    The stage in progress is read from the job's manifest (rewritten after every stage), so the
    heartbeat needs no hook inside the runner and works for any launcher. ``screen``: also
    write the line to stderr, for a quiet run whose screen does not show INFO log lines.
    """

    def __init__(
        self,
        run_dir: Path,
        interval_s: float,
        label: str,
        stages: Sequence[str],
        *,
        screen: bool = False,
    ):
        super().__init__(interval_s, "jaxaot-heartbeat")
        self.run_dir, self.interval_s, self.label = Path(run_dir), interval_s, label
        self.stages = list(stages)
        self.screen = screen
        self._t0 = time.time()

    def _started(self) -> None:
        self._t0 = time.time()

    def current(self) -> tuple[str | None, float | None]:
        """The stage now running and since when (the manifest's last write); (None, None)
        before the first stage has finished, when JAX may still be starting up."""
        path = self.run_dir / MANIFEST_NAME
        manifest = read_json(path)
        if manifest is None:
            return None, None
        done = set(manifest.get("stages", {}))
        stage = next((s for s in self.stages if s not in done), None)
        try:
            return stage, path.stat().st_mtime
        except OSError:
            return stage, None

    def message(self) -> str | None:
        """The line to log now, or None when every planned stage has finished."""
        stage, since = self.current()
        now = time.time()
        job = human_seconds(now - self._t0)
        if since is None:
            return f"still starting or {_VERB[self.stages[0]]} ({self.label}): {job} in this job"
        if stage is None:
            return None
        return (
            f"still {_VERB.get(stage, stage)} ({self.label}): {human_seconds(now - since)} "
            f"in {stage}, {job} in this job"
        )

    def tick(self) -> None:
        line = self.message()
        if line:
            log.info("%s", line)
            if self.screen:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()


__all__ = [
    "JOB_NAME",
    "LINES_DIR",
    "PLAN_NAME",
    "STATE_DIR",
    "WARNING_CHARS",
    "AtMost",
    "Heartbeat",
    "JobOutcome",
    "ProgressRelay",
    "SweepPlan",
    "claim_finish_slot",
    "finished_count",
    "human_value",
    "key_figures",
    "override_key",
    "override_value",
    "planned_stages",
    "print_error",
    "print_line",
    "progress_line",
    "read_json",
    "relay_line",
    "short_names",
    "write_job_record",
]
