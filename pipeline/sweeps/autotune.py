"""Autotuning: an Optuna study over Hydra overrides, one launched sweep job per trial.

The study asks for trial parameters, the configured Hydra launcher runs them as ordinary
jaxaot jobs (so the store, the progress lines and the report all apply), and each trial's
objective is read back from its job's ``manifest.json``: ``execute.median_s`` by default, or a
compile-time figure (``compile.flops``, ``compile.bytes_accessed``, ``compile.temp_bytes``) for
compile-only searches. The search space is written in Hydra's sweep syntax:
``choice(a,b)``/``a,b`` (categorical), ``range(lo,hi[,step])`` (integers),
``interval(lo,hi)`` (floats; ``tag(int, ...)`` for integers, ``tag(log, ...)`` for log scale).

The Sweeper class itself lives in ``hydra_plugins/jaxaot_optuna_sweeper`` (Hydra only
instantiates sweepers from that namespace); this module holds everything it does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.compat.hydra import job_return_value
from jaxaot.errors import ConfigError, MissingDependencyError
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import RunMetrics
from jaxaot.rundir.metrics import objective as figure
from jaxaot.sweeps import autotune_ties
from jaxaot.sweeps.autotune_grid import FiniteSpace
from jaxaot.sweeps.progress import JobOutcome, SweepPlan, print_error, print_line, read_json
from jaxaot.sweeps.report import AUTOTUNE_NAME, PLOTS_DIR
from jaxaot.util.fsio import atomic_write_json

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override
    from hydra.core.utils import JobReturn
    from hydra.plugins.launcher import Launcher
    from omegaconf import DictConfig

DIRECTIONS = ("minimize", "maximize")
SAMPLERS = ("tpe", "random")
COMPILE_ONLY_OBJECTIVES = ("compile.flops", "compile.bytes_accessed", "compile.temp_bytes")


@dataclass(frozen=True)
class AutotuneOptions:
    """``hydra.sweeper.*`` of ``hydra/sweeper=jaxaot_optuna`` (see the plugin's config)."""

    objective: str = "execute.median_s"
    direction: str = "minimize"
    n_trials: int = 20
    n_jobs: int = 1
    sampler: str = "tpe"
    seed: int | None = 0
    study_name: str | None = None
    storage: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    # Stop when the first this-many trials all fail with the same error (0: never stop early):
    # a fixed override that breaks every point wastes no more trials.
    stop_after_failures: int = 3
    # A multi-objective study (e.g. [execute.median_s, compile.temp_bytes]): its result is the
    # Pareto front; `objective`/`direction` are then unused. `directions`: one per objective
    # (empty: minimize all).
    objectives: list[str] = field(default_factory=list)
    directions: list[str] = field(default_factory=list)

    @property
    def targets(self) -> list[tuple[str, str]]:
        """(objective, direction) for each objective of the study."""
        if not self.objectives:
            return [(self.objective, self.direction)]
        return list(
            zip(
                self.objectives,
                self.directions or ["minimize"] * len(self.objectives),
                strict=False,
            )
        )

    def check(self, stop_after: str) -> None:
        """Refuse a search that cannot produce its objective, naming the key."""
        if self.directions and not self.objectives:
            raise ConfigError(
                "hydra.sweeper.directions: set with hydra.sweeper.objectives (for one objective, "
                f"hydra.sweeper.direction); found directions={self.directions} and no objectives"
            )
        if self.objectives and self.directions and len(self.directions) != len(self.objectives):
            raise ConfigError(
                f"hydra.sweeper.directions: expected one per objective ({len(self.objectives)}), "
                f"found {len(self.directions)}"
            )
        if len(set(self.objectives)) != len(self.objectives) or len(self.objectives) == 1:
            raise ConfigError(
                "hydra.sweeper.objectives: expected two or more different objectives (one: use "
                f"hydra.sweeper.objective), found {self.objectives}"
            )
        key = "objectives" if self.objectives else "objective"
        for objective, direction in self.targets:
            metric = figure(objective, f"hydra.sweeper.{key}")
            if metric.stage == "execute" and stop_after != "execute":
                raise ConfigError(
                    f"hydra.sweeper.{key}={objective!r} needs stop_after=execute, found "
                    f"stop_after={stop_after!r}; for a compile-only search use one of "
                    f"{', '.join(COMPILE_ONLY_OBJECTIVES)}"
                )
            if direction not in DIRECTIONS:
                which = "directions" if self.objectives else "direction"
                raise ConfigError(
                    f"hydra.sweeper.{which}: expected minimize or maximize, found {direction!r}"
                )
        if self.sampler not in SAMPLERS:
            raise ConfigError(
                f"hydra.sweeper.sampler: expected one of {', '.join(SAMPLERS)}, "
                f"found {self.sampler!r}"
            )
        for key, value in (("n_trials", self.n_trials), ("n_jobs", self.n_jobs)):
            if value < 1:
                raise ConfigError(f"hydra.sweeper.{key}: expected >= 1, found {value}")
        if self.stop_after_failures < 0:
            raise ConfigError(
                f"hydra.sweeper.stop_after_failures: expected >= 0 (0: never "
                f"stop early), found {self.stop_after_failures}"
            )


def unescape(value: str) -> str:
    """An override value as the user wrote it: Hydra's sweep values come back escaped for its
    grammar (``f32\\[8\\,256\\]``); logs and reports show ``f32[8,256]``."""
    return re.sub(r"\\([\\()\[\]{}:=, \t])", r"\1", value)


def shown(override: str) -> str:
    """``key=value`` with the value unescaped (see :func:`unescape`)."""
    key, sep, value = override.partition("=")
    return key + sep + unescape(value)


def _same_failure(trials: list[dict[str, Any]]) -> str | None:
    """The error every one of ``trials`` failed with, or None. A trial's own parameter values
    are masked first: "f32[8,256] does not fit" and "f32[64,256] does not fit" are one error."""
    if not trials or any(t["value"] is not None or not t["error"] for t in trials):
        return None
    masked = set()
    for t in trials:
        text = str(t["error"])
        for v in sorted(t["params"].values(), key=len, reverse=True):
            for form in {v, unescape(v)}:
                if form:
                    text = text.replace(form, "<value>")
        masked.add(text)
    return str(trials[0]["error"]) if len(masked) == 1 else None


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise MissingDependencyError(
            "hydra/sweeper=jaxaot_optuna needs optuna, which is not installed; "
            "install it with: pip install 'jaxaot[sweep]'"
        ) from None
    return optuna


def distribution(override: Override) -> Any:
    """The Optuna distribution for one sweep override."""
    from hydra.core.override_parser.types import IntervalSweep, RangeSweep

    dist = _optuna().distributions
    value = override.value()
    key = override.get_key_element()
    if override.is_interval_sweep():
        assert isinstance(value, IntervalSweep) and value.start is not None
        assert value.end is not None
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return dist.IntDistribution(int(value.start), int(value.end), log=log_scale)
        return dist.FloatDistribution(value.start, value.end, log=log_scale)
    if override.is_range_sweep():
        assert isinstance(value, RangeSweep)
        steps = list(override.sweep_string_iterator())
        if not steps:
            raise ConfigError(f"{key}: the range {override.input_line} is empty")
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
            step = int(value.step)
            return dist.IntDistribution(int(steps[0]), int(steps[-1]), step=abs(step))
        return dist.CategoricalDistribution(steps)
    if override.is_choice_sweep():
        return dist.CategoricalDistribution(list(override.sweep_string_iterator()))
    raise ConfigError(f"{key}: {override.input_line} is not a choice, range or interval sweep")


def search_space(
    arguments: Sequence[str], params: dict[str, str], config_loader: Any = None
) -> tuple[dict[str, Any], list[str]]:
    """(distributions by override key, fixed overrides) from ``params`` and the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=config_loader)
    parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(arguments))
    space, fixed = {}, []
    for o in parsed:
        if o.is_sweep_override():
            space[o.get_key_element()] = distribution(o)
        else:
            fixed.append(f"{o.get_key_element()}={o.get_value_element_as_str()}")
    if not space:
        raise ConfigError(
            "hydra.sweeper.params: nothing to search; expected at least one sweep such as "
            "compile.compiler_options.xla_cpu_enable_fast_math=choice(true,false)"
        )
    return space, fixed


def _run_dir(job: JobReturn) -> Path | None:
    return Path(str(job.hydra_cfg.hydra.runtime.output_dir)) if job.hydra_cfg else None


def noise_band(job: JobReturn, objective: str, value: float) -> dict[str, Any]:
    """A trial's ``band`` (its measured noise; None: not measured) and timed ``samples``
    (:mod:`jaxaot.sweeps.autotune_ties`)."""
    run_dir = _run_dir(job)
    manifest = read_json(run_dir / MANIFEST_NAME) if run_dir else None
    if run_dir is None or not manifest:
        return {"band": None, "samples": None}
    return autotune_ties.noise(objective, value, run_dir, manifest)


def objective_value(job: JobReturn, objective: str) -> tuple[float | None, str | None]:
    """(value, None) for a trial whose job produced the objective, else (None, why not)."""
    from hydra.core.utils import JobStatus

    value = job_return_value(job)
    if job.status != JobStatus.COMPLETED:
        return None, f"job raised {type(value).__name__}"
    if isinstance(value, JobOutcome) and value.code != 0:
        return None, value.error
    run_dir = _run_dir(job)
    manifest = read_json(run_dir / MANIFEST_NAME) if run_dir else None
    if not manifest or manifest.get("status") != "ok":
        return None, (manifest or {}).get("error") or "no manifest"
    value = RunMetrics.from_manifest(manifest).figure(figure(objective))
    if value is None:
        return None, f"{objective} not in the manifest"
    return float(value), None


def _sampler(opts: AutotuneOptions) -> Any:
    samplers = _optuna().samplers
    if opts.sampler == "random":
        return samplers.RandomSampler(seed=opts.seed)
    return samplers.TPESampler(seed=opts.seed)


def optimize(
    *,
    opts: AutotuneOptions,
    arguments: Sequence[str],
    config: DictConfig,
    launcher: Launcher,
    config_loader: Any,
    validate: Callable[[Sequence[Sequence[str]]], None],
) -> list[Sequence[JobReturn]]:
    """Run ``opts.n_trials`` trials, ``opts.n_jobs`` at a time; write ``autotune.json``. A finite
    space runs each point at most once (:mod:`jaxaot.sweeps.autotune_grid`), and the best
    trial is named a winner only beyond the measured noise (:mod:`jaxaot.sweeps.autotune_ties`)."""
    optuna = _optuna()
    from optuna.trial import TrialState

    opts.check(str(config.get("stop_after", "execute")))
    space, fixed = search_space(arguments, opts.params, config_loader)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    targets = opts.targets
    study = optuna.create_study(
        directions=[d for _, d in targets],
        sampler=_sampler(opts),
        study_name=opts.study_name,
        storage=opts.storage,
        load_if_exists=opts.storage is not None,
    )
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    views = _draws_views(config)
    finite = FiniteSpace.of(space, study, opts.seed)
    n_trials = opts.n_trials
    points = ""
    if finite is not None:
        left = len(finite.untried)
        earlier = len(finite.points) - left
        if left <= n_trials:
            n_trials = finite.enqueue_all(study)
            points = (
                f" (the search space has {len(finite.points)} points"
                + (f", {earlier} completed by earlier sweeps of this study" if earlier else "")
                + (
                    f", {finite.failed_before} that failed there run again"
                    if finite.failed_before
                    else ""
                )
                + f": each run once; n_trials={opts.n_trials} capped)"
                if n_trials < opts.n_trials
                else " (every point of the search space once)"
            )
        else:
            points = f" of the {len(finite.points)} points of the search space, none twice" + (
                f" ({finite.failed_before} that failed in earlier sweeps may run again)"
                if finite.failed_before
                else ""
            )
    plan = SweepPlan.read(sweep_dir)
    if plan.total is not None and plan.total != n_trials:  # the progress lines' [i/total]
        SweepPlan(total=n_trials, varying=plan.varying).write(sweep_dir)
    print_line(
        f"autotune: {', '.join(f'{d} {o}' for o, d in targets)} over {', '.join(space)}, "
        f"{n_trials} trials{points}"
    )
    trials: list[dict[str, Any]] = []
    returns: list[Sequence[JobReturn]] = []
    while len(trials) < n_trials:
        count = min(opts.n_jobs, n_trials - len(trials))
        asked = [finite.ask(study) if finite else study.ask(space) for _ in range(count)]
        batch = [[*fixed, *(f"{k}={v}" for k, v in t.params.items())] for t in asked]
        validate(batch)
        results = launcher.launch(batch, initial_job_idx=len(trials))
        for trial, overrides, job in zip(asked, batch, results, strict=True):
            got = [objective_value(job, o) for o, _ in targets]
            why = next((w for _, w in got if w is not None), None)
            values = [v for v, _ in got]
            if why is not None:
                study.tell(trial, state=TrialState.FAIL)
            else:
                study.tell(trial, values if len(values) > 1 else values[0])
            value = values[0] if why is None and len(values) == 1 else None
            trials.append(
                {
                    "number": trial.number,
                    "job": len(trials),
                    "value": value,
                    **({"values": None if why else values} if len(values) > 1 else {}),
                    # The value's measured noise (autotune_ties): a winner must clear it.
                    **(
                        {"band": None, "samples": None}
                        if value is None
                        else noise_band(job, opts.objective, value)
                    ),
                    "error": why,
                    "params": {k: str(v) for k, v in trial.params.items()},
                    "overrides": [shown(o) for o in overrides[len(fixed) :]],
                }
            )
        returns.append(results)
        _write(sweep_dir, opts, study, trials, fixed, finite)
        first = trials[: opts.stop_after_failures]
        if len(first) == opts.stop_after_failures and len(trials) < n_trials:
            error = _same_failure(first)
            if error is not None:
                print_error(
                    f"autotune: stopped after {len(trials)} of {n_trials} trials: the first "
                    f"{len(first)} all failed with: {error} "
                    "(hydra.sweeper.stop_after_failures=0 runs every trial)"
                )
                if views:
                    write_views(sweep_dir, study, opts)
                return returns
    if views:
        write_views(sweep_dir, study, opts)
    if len(targets) > 1:
        front = _pareto(study, trials)
        print_line(
            f"autotune: Pareto front of {' and '.join(o for o, _ in targets)}: "
            f"{len(front)} trial(s), jobs {', '.join(str(t['job']) for t in front)}"
        )
        return returns
    best = _best(study, trials, opts.direction)
    if best:
        print_line(
            f"autotune: {autotune_ties.verdict(opts.objective, best, trials)}: "
            + " ".join(best["overrides"])
        )
    else:
        print_error(f"autotune: no trial produced {opts.objective}")
    return returns


def _pareto(study: Any, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials of the Pareto front (a multi-objective study's result), this sweep's only."""
    mine = {t["number"]: t for t in trials}
    front = []
    for best in study.best_trials:  # an earlier sweep's trials too (hydra.sweeper.storage)
        if best.number in mine:
            front.append(mine[best.number])
        else:
            params = {k: str(v) for k, v in best.params.items()}
            front.append(
                {
                    "number": best.number,
                    "job": None,
                    "value": None,
                    "values": list(best.values),
                    "error": None,
                    "params": params,
                    "overrides": [shown(f"{k}={v}") for k, v in params.items()],
                }
            )
    return front


VIEWS = {  # Optuna's matplotlib views, written into <sweep>/plots/ with the report
    "autotune_optuna_history": "plot_optimization_history",
    "autotune_importances": "plot_param_importances",
    "autotune_parallel": "plot_parallel_coordinate",
    "autotune_pareto": "plot_pareto_front",
}


def _draws_views(config: DictConfig) -> bool:
    """Whether the sweep's report draws its plots (``hydra.callbacks.sweep``: ``report`` and
    ``plots``, both true by default), which Optuna's views go with."""
    from omegaconf import OmegaConf

    sweep = OmegaConf.select(config, "hydra.callbacks.sweep", default=None)
    return sweep is not None and bool(sweep.get("report", True)) and bool(sweep.get("plots", True))


def write_views(sweep_dir: Path, study: Any, opts: AutotuneOptions) -> dict[str, str]:
    """Optuna's own visualisations of the study as PNGs: history, parameter importances and
    parallel coordinates (per objective of a multi-objective study), and the Pareto front.
    A view the study cannot give yet (too few trials, one parameter) is skipped with the
    reason, in ``autotune.json``'s ``views``."""
    import sys
    import warnings

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # no window; a session's own choice stays
        matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from optuna.visualization import matplotlib as views

    targets = opts.targets
    out = sweep_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, str] = {}
    jobs: list[tuple[str, str, dict[str, Any]]] = []
    if len(targets) == 1:
        for name in ("autotune_optuna_history", "autotune_importances", "autotune_parallel"):
            jobs.append((name, VIEWS[name], {"target_name": targets[0][0]}))
    else:
        names = [o for o, _ in targets]
        jobs.append(("autotune_pareto", VIEWS["autotune_pareto"], {"target_names": names}))
        for i, objective in enumerate(names):
            for name in ("autotune_optuna_history", "autotune_importances", "autotune_parallel"):
                kw = {"target": (lambda t, i=i: t.values[i]), "target_name": objective}
                jobs.append((f"{name}_{i}", VIEWS[name], kw))
    before = set(plt.get_fignums())
    for name, plot, kwargs in jobs:
        # Each Optuna view calls plt.style.use("ggplot") (optuna 4.x-5.0), which changes the
        # process's rcParams: the context restores them, so later figures keep their style.
        try:
            with warnings.catch_warnings(), matplotlib.rc_context():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib views experimental
                ax = getattr(views, plot)(study, **kwargs)
                fig = (ax[0] if hasattr(ax, "__len__") else ax).figure
                fig.savefig(out / f"{name}.png", dpi=90, bbox_inches="tight")
                plt.close(fig)
            done[name] = f"{PLOTS_DIR}/{name}.png"
        except Exception as exc:
            done[name] = f"skipped: {' '.join(str(exc).split())[:200]}"
        finally:
            for number in set(plt.get_fignums()) - before:  # only the figures Optuna opened
                plt.close(number)
    data = read_json(sweep_dir / AUTOTUNE_NAME) or {}
    if data:
        data["views"] = done
        atomic_write_json(sweep_dir / AUTOTUNE_NAME, data)
    return done


def _best(study: Any, trials: list[dict[str, Any]], direction: str) -> dict[str, Any] | None:
    """The study's best trial; for one of this sweep, ``tied_with`` lists the jobs whose bands
    reach its own (empty: it won beyond the noise) and ``provisional`` says no winner is claimed
    (some trial's noise is not measured)."""
    if len(study.directions) > 1:
        return None  # a multi-objective study has a Pareto front instead
    try:
        best = study.best_trial
    except ValueError:  # no completed trial
        return None
    mine = next((t for t in trials if t["number"] == best.number), None)
    if mine is not None:
        return autotune_ties.judge(mine, trials, direction)
    # The best trial ran in an earlier sweep of a stored study (hydra.sweeper.storage).
    params = {k: str(v) for k, v in best.params.items()}
    return {
        "number": best.number,
        "job": None,
        "value": best.value,
        "error": None,
        "params": params,
        "overrides": [shown(f"{k}={v}") for k, v in params.items()],
    }


def _write(
    sweep_dir: Path,
    opts: AutotuneOptions,
    study: Any,
    trials: list[dict[str, Any]],
    fixed: list[str],
    finite: FiniteSpace | None,
) -> None:
    atomic_write_json(
        sweep_dir / AUTOTUNE_NAME,
        {
            "objective": opts.objective if not opts.objectives else None,
            "direction": opts.direction if not opts.objectives else None,
            "objectives": [o for o, _ in opts.targets],
            "directions": [d for _, d in opts.targets],
            "pareto": _pareto(study, trials) if opts.objectives else None,
            "sampler": opts.sampler,
            "seed": opts.seed,
            "study_name": study.study_name,
            "n_trials": opts.n_trials,
            # A finite space's size (None: a parameter is continuous); trials never repeat one.
            "space_points": len(finite.points) if finite else None,
            "fixed": [shown(o) for o in fixed],
            "best": _best(study, trials, opts.direction),
            "trials": trials,
        },
    )


__all__ = [
    "COMPILE_ONLY_OBJECTIVES",
    "DIRECTIONS",
    "SAMPLERS",
    "AutotuneOptions",
    "distribution",
    "noise_band",
    "objective_value",
    "optimize",
    "search_space",
]
