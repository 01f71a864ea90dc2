"""Autotuning: the search space, option checks, the shipped experiment, and searches via the CLI."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, cli_env, run_cli, run_sweep
from jaxaot.errors import ConfigError, MissingDependencyError
from jaxaot.sweeps.autotune import AutotuneOptions, _optuna, search_space
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from PIL import Image

EXPERIMENT = REPO / "conf" / "experiment" / "autotune_cpu.yaml"


def _search(tmp: Path, *overrides: str) -> tuple[int, str, Path]:
    proc, sweep_dir = run_sweep(tmp, *overrides)
    return proc.returncode, proc.stdout, sweep_dir


def test_search_space_from_params_and_command_line() -> None:
    space, fixed = search_space(
        [
            "program=mlp",
            "b=range(1,9,2)",
            "c=tag(log,interval(0.001,1.0))",
            "d=tag(int,interval(1,64))",
            "e=0.5,1.5",
        ],
        {"a": "choice(true,false)"},
    )
    assert fixed == ["program=mlp"]
    assert space["a"] == CategoricalDistribution(["True", "False"])
    assert space["b"] == IntDistribution(1, 7, step=2)
    assert space["c"] == FloatDistribution(0.001, 1.0, log=True)
    assert space["d"] == IntDistribution(1, 64)
    assert space["e"] == CategoricalDistribution(["0.5", "1.5"])


def test_compile_only_objectives_are_compiles_figures() -> None:
    from jaxaot.rundir.metrics import OBJECTIVE_BY_NAME
    from jaxaot.sweeps.autotune import COMPILE_ONLY_OBJECTIVES

    assert {OBJECTIVE_BY_NAME[o].stage for o in COMPILE_ONLY_OBJECTIVES} == {"compile"}
    for objective in COMPILE_ONLY_OBJECTIVES:
        AutotuneOptions(objective=objective).check("compile")


@pytest.mark.parametrize(
    ("opts", "stop_after", "match"),
    [
        (
            AutotuneOptions(objective="execute.mean"),
            "execute",
            r"hydra.sweeper.objective: expected one of stage_out.seconds, .*found 'execute.mean'",
        ),
        (
            AutotuneOptions(),
            "compile",
            r"objective='execute.median_s' needs stop_after=execute, found stop_after='compile'; "
            r"for a compile-only search use one of compile.flops",
        ),
        (AutotuneOptions(direction="down"), "execute", r"hydra.sweeper.direction: expected"),
        (AutotuneOptions(sampler="grid"), "execute", r"hydra.sweeper.sampler: expected one of"),
        (AutotuneOptions(n_trials=0), "execute", r"hydra.sweeper.n_trials: expected >= 1, found 0"),
        (
            AutotuneOptions(stop_after_failures=-1),
            "execute",
            r"hydra.sweeper.stop_after_failures: expected >= 0 \(0: never stop early\), found -1",
        ),
    ],
)
def test_options_are_checked_naming_the_key(
    opts: AutotuneOptions, stop_after: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        opts.check(stop_after)


def test_nothing_to_search_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"hydra.sweeper.params: nothing to search"):
        search_space(["program=mlp"], {})


def test_missing_optuna_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'jaxaot\[sweep\]'"):
        _optuna()


def test_every_option_the_experiment_searches_is_accepted_by_xla() -> None:
    """Each value of each searched compiler option compiles (catches options jaxlib dropped)."""
    import jax

    params = yaml.safe_load(EXPERIMENT.read_text())["hydra"]["sweeper"]["params"]
    space, _ = search_space([], params)
    assert len(space) == 6
    lowered = jax.jit(lambda x: 2.0 * x + 1.0).lower(1.0)
    for key, dist in space.items():
        option = key.removeprefix("compile.compiler_options.")
        for choice in dist.choices:
            value = yaml.safe_load(choice)
            assert lowered.compile(compiler_options={option: value})(1.0) == 3.0, (option, value)


def test_experiment_yaml_comments_every_key() -> None:
    for line in EXPERIMENT.read_text().splitlines():
        if re.match(r"^\s*[\w.]+:", line):
            assert " # " in line, line


def test_sweeper_schema_is_exactly_the_autotune_options(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from hydra_plugins.jaxaot_optuna_sweeper.optuna_sweeper import JaxaotOptunaSweeperConf

    defaults = OmegaConf.to_container(OmegaConf.structured(JaxaotOptunaSweeperConf))
    assert isinstance(defaults, dict)
    assert defaults.pop("_target_").endswith(".JaxaotOptunaSweeper")
    assert AutotuneOptions(**defaults) == AutotuneOptions()  # every field, every default
    for override, needle in (
        ("hydra.sweeper.n_trials=abc", "hydra.sweeper.n_trials=abc"),
        ("hydra.sweeper.n_trialz=3", "unknown key 'hydra.sweeper.n_trialz'"),
    ):
        proc = run_cli(["experiment=autotune_cpu", override, "--cfg", "hydra"], cwd=tmp_path)
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_autotune_experiment_records_the_best_trial(tmp_path: Path) -> None:
    _, stdout, sweep_dir = _search(
        tmp_path,
        "experiment=autotune_cpu",
        "program=mlp",
        "program.args.1=f32[8,256]",
        "hydra.sweeper.n_trials=3",
        "execute.repeats=3",
        "execute.warmup=1",
    )
    result = json.loads((sweep_dir / "autotune.json").read_text())
    values = [t["value"] for t in result["trials"]]
    assert len(values) == 3 and None not in values
    assert result["objective"] == "execute.median_s" and result["direction"] == "minimize"
    best = result["best"]
    assert best["value"] == min(values)
    with open(sweep_dir / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows if r["best"] == "True"] == [str(best["job"])]
    best_row = next(r for r in rows if r["best"] == "True")
    assert float(best_row["execute.median_s"]) == best["value"]
    assert all(best_row[o.split("=")[0]] == o.split("=")[1] for o in best["overrides"])
    md = (sweep_dir / "sweep.md").read_text()
    assert f"Best trial (minimize `execute.median_s`): job {best['job']}" in md
    assert md.count("**best**") == 2  # the line above the table and the row
    with Image.open(sweep_dir / "plots" / "autotune_history.png") as img:
        img.verify()
    assert [ln.split()[0] for ln in stdout.splitlines() if re.match(r"\[\d/3\] ", ln)] == [
        "[1/3]",
        "[2/3]",
        "[3/3]",
    ]


def test_optunas_views_are_drawn_with_the_reports_plots_only() -> None:
    from jaxaot.sweeps.autotune import _draws_views
    from omegaconf import OmegaConf

    def config(sweep: dict[str, Any] | None) -> Any:
        callbacks = {} if sweep is None else {"sweep": sweep}
        return OmegaConf.create({"hydra": {"callbacks": callbacks}})

    assert _draws_views(config({"_target_": "x"}))  # report and plots default to true
    assert _draws_views(config({"report": True, "plots": True}))
    assert not _draws_views(config({"report": True, "plots": False}))
    assert not _draws_views(config({"report": False, "plots": True}))  # no report, no plots
    assert not _draws_views(config(None))  # the sweep callback removed: no report at all


def test_compile_only_search_minimises_temp_memory(tmp_path: Path) -> None:
    _, stdout, sweep_dir = _search(
        tmp_path,
        "hydra/sweeper=jaxaot_optuna",
        "program=mlp",
        "stop_after=compile",
        "hydra.sweeper.objective=compile.temp_bytes",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.sampler=random",
        "hydra.sweeper.seed=1",
        "program.args.1=choice(f32[8,256],f32[64,256],f32[256,256])",
        "hydra.callbacks.sweep.plots=false",  # plots and Optuna's views: the views test's
    )
    result = json.loads((sweep_dir / "autotune.json").read_text())
    assert "views" not in result and not (sweep_dir / "plots").exists()  # plots off: no views
    temps = {t["params"]["program.args.1"]: t["value"] for t in result["trials"]}
    assert result["best"]["value"] == min(temps.values())
    assert all(v > 0 for v in temps.values())
    # values as the user wrote them, not Hydra's escaped f32\[8\,256\]
    assert all(
        re.fullmatch(r"program\.args\.1=f32\[\d+,256\]", o)
        for t in result["trials"]
        for o in t["overrides"]
    )
    md = (sweep_dir / "sweep.md").read_text()
    progress = [ln for ln in stdout.splitlines() if re.match(r"\[\d/3\] ", ln)]
    assert len(progress) == 3
    logged = stdout + "".join(p.read_text() for p in sweep_dir.rglob("*.log"))
    assert "\\[" not in logged and "\t#0 : " in logged  # the launcher's job lines too
    for text in (md, *progress, logged.split("autotune: best", 1)[1].splitlines()[0]):
        assert "\\" not in text and "f32[" in text, text
    assert "[HYDRA]" not in stdout  # the autotune lines are plain lines, like the progress lines
    [best] = [ln for ln in stdout.splitlines() if ln.startswith("autotune: ")][-1:]
    assert re.search(r"compile\.temp_bytes = \d+(\.\d)? (B|KiB|MiB) \(job \d\)", best), best


def test_a_search_whose_first_trials_all_fail_alike_stops_with_the_error_once(
    tmp_path: Path,
) -> None:
    # The README's compile-only search without program=mlp: every point fails on the default
    # transformer (its args.1 is the token ids), so 20 trials would all fail the same way.
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "hydra/sweeper=jaxaot_optuna",
            "stop_after=compile",
            "hydra.sweeper.objective=compile.temp_bytes",
            "program.args.1=choice(f32[8,256],f32[64,256],f32[256,256])",
            "compile.compiler_options.xla_cpu_enable_fast_math=choice(false,true)",
            f"hydra.sweep.dir={sweep_dir}",
            "hydra.callbacks.sweep.plots=false",  # the stop and its lines are checked
        ],
        cwd=tmp_path,
        env=cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store")),
    )
    assert proc.returncode == 1
    trials = json.loads((sweep_dir / "autotune.json").read_text())["trials"]
    assert len(trials) == 3 and all(t["value"] is None for t in trials)  # not 6
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0", "1", "2"]
    stop = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "autotune: stopped" in ln]
    assert len(stop) == 1
    assert "stopped after 3 of 6 trials: the first 3 all failed with: stage 'stage_out'" in stop[0]
    assert "hydra.sweeper.stop_after_failures=0 runs every trial" in stop[0]
    assert "jaxaot: error:" not in proc.stderr  # each job's error is in its progress line only
    out = proc.stdout + proc.stderr
    assert out.count("indices must have an integer type") == 4  # 3 progress lines + the stop
    assert proc.stderr.splitlines()[-1] == (
        "sweep: 3 of 3 jobs failed: [1/6], [2/6], [3/6] (errors above and in sweep.md)"
    )
    assert "[HYDRA]" not in out  # plain lines, like the progress lines


def test_same_failure_masks_each_trials_own_values() -> None:
    from jaxaot.sweeps.autotune import _same_failure, shown

    def trial(value: str, error: str | None) -> dict[str, object]:
        return {"value": None if error else 1.0, "error": error, "params": {"a.b": value}}

    same = [
        trial("f32\\[8\\,256\\]", "x=f32[8,256] does not fit"),
        trial("f32\\[64\\,256\\]", "x=f32[64,256] does not fit"),
    ]
    assert _same_failure(same) == "x=f32[8,256] does not fit"
    assert _same_failure([*same, trial("1", "another error")]) is None
    assert _same_failure([*same, trial("1", None)]) is None  # one trial succeeded
    assert shown("program.args.1=f32\\[8\\,256\\]") == "program.args.1=f32[8,256]"
    from jaxaot.sweeps.progress import override_value

    assert override_value("program.args.1=f32\\[8\\,256\\]") == "f32[8,256]"  # progress, report
    assert override_value("x=it\\'s") == "it\\'s"  # only Hydra's own escapes are undone


def test_optunas_views_are_written_with_the_report(tmp_path: Path) -> None:
    """History, parameter importances and parallel coordinates, Optuna's own, written as plots
    beside the report."""
    _, _, sweep_dir = _search(
        tmp_path,
        "hydra/sweeper=jaxaot_optuna",
        "program=mlp",
        "stop_after=compile",
        "hydra.sweeper.objective=compile.temp_bytes",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler=random",
        "program.args.1=choice(f32[8,256],f32[64,256],f32[256,256])",
        "compile.compiler_options.xla_cpu_enable_fast_math=choice(false,true)",
    )
    result = json.loads((sweep_dir / "autotune.json").read_text())
    assert result["space_points"] == 6
    points = {tuple(sorted(t["params"].items())) for t in result["trials"]}
    assert len(result["trials"]) == len(points) == 4  # sampled without repeats
    views = result["views"]
    for name in ("autotune_optuna_history", "autotune_importances", "autotune_parallel"):
        assert views[name] == f"plots/{name}.png", views
        with Image.open(sweep_dir / views[name]) as img:
            img.verify()


def test_a_multi_objective_study_reports_its_pareto_front(tmp_path: Path) -> None:
    """Execute time and temp memory at once: the result is the Pareto front, marked in the
    report, drawn by Optuna; every front trial is not dominated by any other trial."""
    _, _, sweep_dir = _search(
        tmp_path,
        "hydra/sweeper=jaxaot_optuna",
        "program=mlp",
        "execute.repeats=2",
        "hydra.sweeper.objectives=[execute.median_s,compile.temp_bytes]",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler=random",
        "program.args.1=choice(f32[8,256],f32[64,256],f32[256,256])",
    )
    result = json.loads((sweep_dir / "autotune.json").read_text())
    assert result["objectives"] == ["execute.median_s", "compile.temp_bytes"]
    assert result["directions"] == ["minimize", "minimize"] and result["best"] is None
    done = [t for t in result["trials"] if t.get("values")]
    front = result["pareto"]
    assert front and len(done) == 3  # n_trials=4 over 3 points: each point once

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

    for t in front:
        assert not any(dominates(o["values"], t["values"]) for o in done)
    for t in done:
        if t not in front:
            assert any(
                dominates(f["values"], t["values"]) or f["values"] == t["values"] for f in front
            )
    md = (sweep_dir / "sweep.md").read_text()
    assert "Pareto front (minimize `execute.median_s`, minimize `compile.temp_bytes`)" in md
    assert "(marked **pareto** below); Optuna's views are in plots/." in md
    assert md.count("**pareto**") == len(front) + 1
    with open(sweep_dir / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["job"] for r in rows if r["pareto"] == "True"} == {str(t["job"]) for t in front}
    with Image.open(sweep_dir / result["views"]["autotune_pareto"]) as img:
        img.verify()


def test_multi_objective_options_are_checked() -> None:
    with pytest.raises(
        ConfigError, match=r"^hydra\.sweeper\.directions: expected one per objective \(2\), found 1"
    ):
        AutotuneOptions(
            objectives=["execute.median_s", "compile.temp_bytes"], directions=["minimize"]
        ).check("execute")
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.directions: set with hydra"):
        AutotuneOptions(directions=["maximize"]).check("execute")
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.objectives: expected two or more"):
        AutotuneOptions(objectives=["execute.median_s"]).check("execute")
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.objectives: expected one of"):
        AutotuneOptions(objectives=["execute.median_s", "compile.bogus"]).check("execute")


def test_optunas_plot_style_stays_out_of_jaxaots_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optuna's views switch matplotlib to ggplot globally; after them the process's rcParams
    are what they were, and jaxaot's own plots draw in matplotlib's default style even when
    the global one is another."""
    import matplotlib
    import optuna
    from jaxaot.sweeps import plots
    from jaxaot.sweeps.autotune import write_views
    from jaxaot.sweeps.report import SweepTable
    from matplotlib import colors
    from optuna.visualization import matplotlib as views

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for i in range(4):
        trial = study.ask({"a": CategoricalDistribution(["x", "y"]), "b": IntDistribution(1, 4)})
        study.tell(trial, float(i + trial.params["b"]))
    with matplotlib.rc_context():  # what the views do to rcParams, left to themselves
        with pytest.warns(optuna.exceptions.ExperimentalWarning):
            views.plot_optimization_history(study)
        assert matplotlib.rcParams["axes.facecolor"] != matplotlib.rcParamsDefault["axes.facecolor"]
    before = dict(matplotlib.rcParams)
    done = write_views(tmp_path, study, AutotuneOptions(objective="compile.temp_bytes"))
    assert done["autotune_optuna_history"] == "plots/autotune_optuna_history.png"
    assert dict(matplotlib.rcParams) == before

    drawn = []
    history = plots._history

    def kept(table: SweepTable) -> Any:
        drawn.append(history(table))
        return drawn[-1]

    monkeypatch.setattr(plots, "_history", kept)
    trials = [
        {"number": i, "job": i, "value": v, "band": [v * 0.9, v * 1.1]}
        for i, v in enumerate([3.0, 2.0, 2.5])
    ]
    auto = {"objective": "execute.median_s", "direction": "minimize", "pareto": None}
    table = SweepTable(tmp_path, [], [], [], autotune={**auto, "trials": trials})
    with matplotlib.style.context("ggplot"):
        ggplot = colors.to_rgba(matplotlib.rcParams["axes.facecolor"])
        paths = plots.write_plots(table, tmp_path / "plots")
        assert colors.to_rgba(matplotlib.rcParams["axes.facecolor"]) == ggplot  # left as set
    assert [p.name for p in paths] == ["autotune_history.png"]
    face = colors.to_rgba(drawn[0].axes[0].get_facecolor())
    assert face == colors.to_rgba(matplotlib.rcParamsDefault["axes.facecolor"]) != ggplot
