"""A finite search space: its size, each point tried once, and a search of one on the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
from conftest import run_sweep
from jaxaot.sweeps.autotune import search_space
from jaxaot.sweeps.autotune_grid import FiniteSpace, space_size
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

SPACE = {"a": CategoricalDistribution(["x", "y"]), "b": IntDistribution(1, 5, step=2)}


def _study(sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=sampler or optuna.samplers.TPESampler(seed=0))


def test_the_size_of_a_space_is_the_product_of_its_parameters_sizes() -> None:
    space, _ = search_space(["a=choice(1,2,3)", "b=range(0,8,2)", "c=tag(int,interval(1,5))"], {})
    assert space_size(space) == 3 * 4 * 5
    continuous, _ = search_space(["a=choice(1,2,3)", "d=interval(0.0,1.0)"], {})
    assert space_size(continuous) is None
    assert FiniteSpace.of(continuous, _study(), 0) is None


def test_fewer_trials_than_points_never_repeat_a_point() -> None:
    """TPE with a constant objective proposes the same points again; none of them runs twice."""
    study = _study()
    finite = FiniteSpace.of(SPACE, study, seed=0)
    assert finite is not None and len(finite.points) == 6
    seen = []
    for _ in range(5):
        trial = finite.ask(study)
        seen.append((trial.params["a"], trial.params["b"]))
        study.tell(trial, 1.0)
    assert len(set(seen)) == 5
    assert all(b in (1, 3, 5) for _, b in seen)
    # The proposals that repeated a point are in the study as failed trials, never completed.
    repeats = [t for t in study.trials if t.user_attrs.get("repeat_of") is not None]
    assert all(t.state == TrialState.FAIL for t in repeats)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert sorted((t.params["a"], t.params["b"]) for t in done) == sorted(seen)


def test_every_untried_point_is_enqueued_once_counting_an_earlier_sweeps_trials() -> None:
    study = _study(optuna.samplers.RandomSampler(seed=0))
    earlier = study.ask(SPACE)  # a stored study: one point measured by a sweep before
    study.tell(earlier, 2.0)
    finite = FiniteSpace.of(SPACE, study, seed=0)
    assert finite is not None and len(finite.untried) == 5
    assert finite.enqueue_all(study) == 5
    got = []
    for _ in range(5):
        trial = finite.ask(study)
        got.append((trial.params["a"], trial.params["b"]))
        study.tell(trial, 1.0)
    expected = [(a, b) for a in ("x", "y") for b in (1, 3, 5)]
    expected.remove((earlier.params["a"], earlier.params["b"]))
    assert got == expected  # grid order, each untried point once
    assert finite.untried == []


def test_a_point_that_failed_in_an_earlier_sweep_runs_again() -> None:
    study = _study(optuna.samplers.RandomSampler(seed=0))
    done = study.ask(SPACE)  # a stored study: one point measured, one failed, by a sweep before
    study.tell(done, 2.0)
    study.enqueue_trial(
        {"a": "y", "b": 5} if done.params != {"a": "y", "b": 5} else {"a": "x", "b": 1}
    )
    failed = study.ask(SPACE)
    study.tell(failed, state=TrialState.FAIL)
    finite = FiniteSpace.of(SPACE, study, seed=0)
    assert finite is not None and finite.failed_before == 1
    assert len(finite.untried) == 5 and failed.params in finite.untried
    assert done.params not in finite.untried
    assert finite.enqueue_all(study) == 5
    got = []
    for _ in range(5):
        trial = finite.ask(study)
        got.append(trial.params)
        study.tell(trial, 1.0)
    assert failed.params in got and done.params not in got


def test_more_trials_than_points_run_each_point_once(tmp_path: Path) -> None:
    """n_trials=20 over a 3-value choice: 3 trials, one per value, and one line saying so."""
    proc, sweep_dir = run_sweep(
        tmp_path,
        "hydra/sweeper=jaxaot_optuna",
        "program=mlp",
        "stop_after=compile",
        "hydra.sweeper.objective=compile.temp_bytes",
        "hydra.sweeper.n_trials=20",
        "program.args.1=choice(f32[8,256],f32[64,256],f32[256,256])",
        "hydra.callbacks.sweep.plots=false",
    )
    result = json.loads((sweep_dir / "autotune.json").read_text())
    assert result["n_trials"] == 20 and result["space_points"] == 3
    values = sorted(t["params"]["program.args.1"] for t in result["trials"])
    assert values == ["f32\\[256\\,256\\]", "f32\\[64\\,256\\]", "f32\\[8\\,256\\]"]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0", "1", "2"]
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in sweep_dir.rglob("*.log"))
    capped = [ln for ln in logs.splitlines() if "n_trials=20 capped" in ln]
    assert len(set(capped)) == 1, logs[-3000:]
    assert (
        "3 trials (the search space has 3 points: each run once; n_trials=20 capped)" in capped[0]
    )
    progress = [ln.split()[0] for ln in proc.stdout.splitlines() if re.match(r"\[\d+/\d+\] ", ln)]
    assert progress == ["[1/3]", "[2/3]", "[3/3]"]


@pytest.mark.parametrize("n_jobs", [1, 2])
def test_batches_of_trials_hold_no_repeats_either(n_jobs: int) -> None:
    study = _study(optuna.samplers.RandomSampler(seed=3))
    finite = FiniteSpace.of(SPACE, study, seed=3)
    assert finite is not None
    seen: list[tuple[str, int]] = []
    while len(seen) < 6:
        batch = [finite.ask(study) for _ in range(min(n_jobs, 6 - len(seen)))]
        for trial in batch:
            seen.append((trial.params["a"], trial.params["b"]))
            study.tell(trial, float(len(seen)))
    assert len(set(seen)) == 6
