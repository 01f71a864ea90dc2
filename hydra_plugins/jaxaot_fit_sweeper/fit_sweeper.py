"""``hydra/sweeper=jaxaot_fit``: bisect an integer override for the largest value that fits.

Each probe is an ordinary sweep job launched with the configured launcher (one compile, stored
like any other), its task run in a process of its own (jaxaot.sweeps.probe_process) unless
``hydra.sweeper.isolate=false``; the job's exit code is the verdict (0 fits, 3 does not fit), a
crash or another failure is no verdict for that value. Every combination of the other sweep
arguments gets a search; per topology, the choices' largest fits form a Pareto front.
``fit.json`` in the sweep dir is rewritten before and after every probe, and a search run again
with the same ``hydra.sweep.dir`` takes the verdicts recorded there (fits, does not fit) instead
of running those probes again; a probe recorded without a verdict (crashed, timed out, failed,
or still ``running`` when that process was killed) runs again, since what ended it may have been
transient or fixed since.

A resumed search's outcome is its own: each value counts once, by its latest probe. When a
search resumes, the folders of the earlier jobs that left no verdict (their fit.json record has
none, or they have none: an interrupted job) move to ``<sweep dir>/.jaxaot/superseded/``, out of
sweep.md/sweep.csv and the exit status; the search runs those values again where it needs them
(the new probe's record says which job it ``supersedes``). So a resumed search that finds its
boundary exits 0 although an earlier process was killed, while a probe of its own that
crashes still makes the sweep exit 1. The summary counts the compiles made in this process
apart from the probes taken from fit.json ("3 compiles, 5 reused").
No ``from __future__ import annotations`` here: Hydra executes plugin modules before
registering them in ``sys.modules``, where dataclasses would look string annotations up.
"""

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from jaxaot.compat.hydra import job_return_value
from jaxaot.errors import EXIT_DOES_NOT_FIT, ConfigError
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import RunMetrics
from jaxaot.sweeps.compose_cache import LaunchingSweeper
from jaxaot.sweeps.fit_search import (
    FIT_FORMAT,
    FIT_NAME,
    FitOptions,
    Search,
    bisect,
    combinations,
    front_lines,
    fronts,
    initial_bound,
    probe_figures,
    shown,
    summary_line,
)
from jaxaot.sweeps.probe_process import CRASHED, TIMED_OUT, IsolatedTask
from jaxaot.sweeps.progress import (
    JOB_NAME,
    STATE_DIR,
    JobOutcome,
    SweepPlan,
    finished_count,
    override_key,
    print_line,
    read_json,
)
from jaxaot.util.fsio import atomic_write_json, flock_file
from omegaconf import DictConfig, OmegaConf

NO_TOPOLOGY = "the job has no fit verdict (set compile.topology)"
RUNNING = "running"  # a probe launched and not finished (yet, or ever: its process was killed)
SUPERSEDED_DIR = "superseded"  # under the sweep's state dir: earlier jobs a resume replaces
LOCK_NAME = "fit.lock"  # under the sweep's state dir: held by the search running there


@dataclass
class JaxaotFitSweeperConf:
    _target_: str = "hydra_plugins.jaxaot_fit_sweeper.fit_sweeper.JaxaotFitSweeper"
    overrides: list[str] = field(default_factory=list)
    low: int = 1
    high: int = 1024
    multiple: int = 1
    isolate: bool = True
    max_failures: int = 3
    timeout_s: float = 0.0


ConfigStore.instance().store(
    group="hydra/sweeper", name="jaxaot_fit", node=JaxaotFitSweeperConf, provider="jaxaot"
)


def probe_record(n: int, job: JobReturn, num: int) -> dict[str, Any]:
    """One probe as fit.json keeps it: the verdict (None: none), its status and figures."""
    value = job_return_value(job)
    run_dir = Path(str(job.hydra_cfg.hydra.runtime.output_dir)) if job.hydra_cfg else None
    manifest = read_json(run_dir / MANIFEST_NAME) if run_dir else None
    compiled = RunMetrics.from_manifest(manifest).compile
    fits: bool | None = None
    error: str | None = None
    if job.status != JobStatus.COMPLETED:
        status, error = "failed", f"job raised {type(value).__name__}: {value}"
    else:
        code = value.code if isinstance(value, JobOutcome) else int(value or 0)
        error = value.error if isinstance(value, JobOutcome) else None
        if code == 0 and not compiled.verdict.known:
            status, error = "failed", NO_TOPOLOGY
        elif code in (0, EXIT_DOES_NOT_FIT):
            fits = code == 0
            status = "fits" if fits else "does_not_fit"
        elif (error or "").startswith(CRASHED):
            status = "crashed"
        elif (error or "").startswith(TIMED_OUT):
            status = "timed_out"
        else:
            status, error = "failed", error or f"exit code {code}"
    record: dict[str, Any] = {"n": n, "fits": fits, "status": status, "job": num}
    record["error"] = error if fits is None else None
    record.update(probe_figures(compiled))
    return record


class _Previous:
    """The probes an earlier run of this search recorded in fit.json (none for a new one):
    :meth:`get` gives those with a verdict, :meth:`without_verdict` the others."""

    def __init__(self, path: Path, opts: FitOptions) -> None:
        self.probes: dict[tuple[str, ...], dict[int, dict[str, Any]]] = {}
        self.next_job = 0
        data = read_json(path)
        if data is None:
            return
        where = f"hydra.sweep.dir={str(path.parent)!r}"
        if data.get("format") != FIT_FORMAT:
            raise ConfigError(
                f"{where}: its {FIT_NAME} is format {data.get('format', 1)}, this jaxaot resumes "
                f"format {FIT_FORMAT}; choose a new hydra.sweep.dir"
            )
        if list(data.get("overrides") or []) != list(opts.overrides):
            raise ConfigError(
                f"{where}: its {FIT_NAME} is a search of hydra.sweeper.overrides="
                f"{data.get('overrides')}, not {opts.overrides}; resume with the same overrides "
                "or choose a new hydra.sweep.dir"
            )
        self.resumed = True
        for s in data.get("searches", []):
            done = {int(p["n"]): p for p in s.get("probes", []) if p.get("status")}
            self.probes[tuple(s.get("fixed", []))] = done
        jobs = [p["job"] for ps in self.probes.values() for p in ps.values()]
        self.next_job = max(
            [int(data.get("next_job") or 0), *(j + 1 for j in jobs if j is not None)]
        )

    resumed = False  # whether a fit.json of this search was there

    def verdict_jobs(self) -> set[int]:
        """The jobs whose verdicts this search takes (their folders stay report rows)."""
        return {
            int(p["job"])
            for ps in self.probes.values()
            for p in ps.values()
            if p.get("fits") is not None and p.get("job") is not None
        }

    def get(self, fixed: Sequence[str], n: int) -> dict[str, Any] | None:
        """The probe of ``n`` recorded with a verdict, to take instead of running it again."""
        found = self.probes.get(tuple(fixed), {}).get(n)
        return dict(found) if found is not None and found.get("fits") is not None else None

    def without_verdict(self, fixed: Sequence[str], n: int) -> dict[str, Any] | None:
        """The probe of ``n`` recorded without a verdict (it runs again)."""
        found = self.probes.get(tuple(fixed), {}).get(n)
        return dict(found) if found is not None and found.get("fits") is None else None

    @property
    def count(self) -> int:
        """Jobs the earlier runs finished: every probe recorded, with a verdict or not (not
        one still running when its process was killed)."""
        return sum(p.get("status") != RUNNING for ps in self.probes.values() for p in ps.values())


def _job_num(job_dir: Path) -> int | None:
    """A job folder's Hydra job number: its job record's, else its .hydra/hydra.yaml's."""
    record = read_json(job_dir / JOB_NAME)
    if record is not None and record.get("num") is not None:
        return int(record["num"])
    try:
        num = OmegaConf.select(OmegaConf.load(job_dir / ".hydra" / "hydra.yaml"), "hydra.job.num")
    except (OSError, ValueError):
        return None
    return int(num) if num is not None else None


def supersede_earlier(sweep_dir: Path, keep: set[int]) -> dict[int, Path]:
    """Move the folders of the jobs in ``sweep_dir`` not in ``keep`` (the jobs whose verdicts a
    resumed search takes) under ``.jaxaot/superseded/``: {job number: where it went}."""
    from jaxaot.sweeps.report import job_dirs

    moved: dict[int, Path] = {}
    for d in job_dirs(sweep_dir):
        num = _job_num(d)
        if num is None or num in keep:
            continue
        to = sweep_dir / STATE_DIR / SUPERSEDED_DIR / d.relative_to(sweep_dir)
        if to.exists():  # superseded before, by a resume that was killed too
            shutil.rmtree(to)
        to.parent.mkdir(parents=True, exist_ok=True)
        d.rename(to)
        moved[num] = to
    return moved


class JaxaotFitSweeper(LaunchingSweeper):
    """Bisects ``overrides``' ``{n}`` over [low, high] (multiples of ``multiple``) for every
    combination of the other sweep arguments."""

    def __init__(self, **options: Any) -> None:
        overrides = options.pop("overrides", None) or []
        if OmegaConf.is_config(overrides):
            overrides = OmegaConf.to_container(overrides, resolve=True)
        self.opts = FitOptions(overrides=[str(o) for o in overrides], **options)

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        if self.opts.isolate:
            task_function = IsolatedTask.of(task_function, self.opts.timeout_s)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Sequence[Any]:
        assert self.config is not None and self.hydra_context is not None
        self.opts.check()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))

        def waiting() -> None:
            print_line(f"fit search: another search is running in {sweep_dir}; waiting for it")

        # One search at a time in a sweep dir. A second one (the command run twice, or a resume
        # while a served search whose client was killed still winds down) waits for the first
        # to end, then resumes from what it recorded.
        with flock_file(sweep_dir / STATE_DIR / LOCK_NAME, waiting=waiting):
            return self._search(arguments, sweep_dir)

    def _search(self, arguments: list[str], sweep_dir: Path) -> Sequence[Any]:
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        combos = combinations(parser.parse_overrides(list(arguments)))
        previous = _Previous(sweep_dir / FIT_NAME, self.opts)
        if previous.resumed:
            moved = supersede_earlier(sweep_dir, previous.verdict_jobs())
            if moved:
                print_line(
                    f"fit search: {len(moved)} earlier job(s) without a verdict "
                    f"({', '.join(f'job {j}' for j in sorted(moved))}) moved to "
                    f"{sweep_dir / STATE_DIR / SUPERSEDED_DIR}; their values run again where "
                    "the search needs them"
                )
        common = set.intersection(*(set(c) for c in combos))
        searches = [
            Search(fixed=fixed, label=" ".join(shown(o) for o in fixed if o not in common))
            for fixed in combos
        ]
        varying = list(dict.fromkeys(override_key(o) for c in combos for o in c if o not in common))
        varying += [override_key(o) for o in self.opts.overrides]
        returns: list[list[JobReturn]] = []
        state = {"next_job": previous.next_job, "reused": 0}

        def write(final: bool = False) -> dict[str, Any]:
            results = [s.to_json(self.opts) for s in searches]
            doc = {
                **self.opts.header(),
                "next_job": state["next_job"],
                "reused_probes": state["reused"],
                "searches": results,
                "fronts": fronts(results) if final else [],
            }
            atomic_write_json(sweep_dir / FIT_NAME, doc)
            return doc

        def plan(current: Search) -> None:
            """The sweep's job count as a bound: jobs finished, plus at most this many more.
            Finished counts a job numbered by its progress line that fit.json never recorded
            (the search was killed between the two): a resumed search's lines go on from it."""
            left = sum(
                s.remaining if s is current else initial_bound(self.opts)
                for s in searches
                if not s.done
            )
            finished = max(previous.count + len(returns), finished_count(sweep_dir))
            total = finished + left
            SweepPlan(total=total, varying=tuple(varying), bound=True).write(sweep_dir)

        for search in searches:

            def probe(n: int, search: Search = search) -> bool | None:
                record = previous.get(search.fixed, n)
                if record is not None:
                    record["reused"] = True
                    state["reused"] += 1
                    print_line(
                        f"fit search [{search.label or 'all jobs'}]: n={n}: "
                        f"{record['status']}, as {FIT_NAME} records"
                    )
                else:
                    earlier = previous.without_verdict(search.fixed, n)
                    if earlier is not None:
                        why = (
                            "still running when its process was killed"
                            if earlier["status"] == RUNNING
                            else earlier.get("error") or earlier["status"]
                        )
                        print_line(
                            f"fit search [{search.label or 'all jobs'}]: n={n}: {FIT_NAME} "
                            f"records no verdict ({why}, job {earlier.get('job')}); "
                            "running it again"
                        )
                    batch = [[*search.fixed, *self.opts.with_value(n)]]
                    self.validate_batch_is_legal(batch)
                    num = state["next_job"]
                    state["next_job"] = num + 1
                    plan(search)
                    # next_job and the running probe first: a killed search never reuses this
                    # job's folder, and its resume knows the job it supersedes.
                    running = {"n": n, "fits": None, "status": RUNNING, "job": num, "error": None}
                    search.probes.append(running)
                    write()
                    job = self.launcher.launch(batch, initial_job_idx=num)[0]
                    returns.append([job])
                    search.probes.pop()
                    record = probe_record(n, job, num)
                    if earlier is not None and earlier.get("job") is not None:
                        record["supersedes"] = earlier["job"]
                search.probes.append(record)
                if record["error"] == NO_TOPOLOGY:
                    search.error = f"n={n}: {NO_TOPOLOGY}"
                write()
                return record["fits"]

            bisect(self.opts, probe, search)
            print_line(summary_line(search.to_json(self.opts)))  # as each search ends: once
        doc = write(final=True)
        finished = previous.count + len(returns)
        SweepPlan(total=finished, varying=tuple(varying)).write(sweep_dir)
        for line in front_lines(doc["fronts"]):
            print_line(line)
        return returns


__all__ = [
    "RUNNING",
    "SUPERSEDED_DIR",
    "JaxaotFitSweeper",
    "JaxaotFitSweeperConf",
    "probe_record",
    "supersede_earlier",
]
