"""A search's winner must clear the measured noise: the median's confidence interval, ties,
the verdict line, and the report of a search where two points are equal."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import run_sweep
from jaxaot.sweeps.autotune_ties import (
    LEVEL,
    MIN_SAMPLES,
    RATES,
    TIMED,
    interval_rank,
    judge,
    median_interval,
    noise,
    verdict,
)
from jaxaot.util.humanize import human_seconds


def _run_dir(tmp: Path, samples: list[float] | None, name: str = "run") -> Path:
    run = tmp / name
    (run / "execute").mkdir(parents=True)
    if samples is not None:
        (run / "execute" / "timings.json").write_text(json.dumps({"samples_s": samples}))
    return run


def _manifest(median: float) -> dict[str, Any]:
    return {"stages": {"execute": {"metrics": {"median_s": median}}}}


def _spread(n: int, lo: float, hi: float, seed: int) -> list[float]:
    """n per-call times spread evenly over [lo, hi], shuffled as calls come."""
    xs = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    random.Random(seed).shuffle(xs)
    return xs


def _coverage(n: int, k: int) -> float:
    """P(x(k) <= true median <= x(n+1-k)) for n samples of any continuous distribution."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize("n", [6, 9, 12, 20, 37, 100, 400])
def test_the_interval_ranks_are_the_widest_binomial_ones_covering_95_percent(n: int) -> None:
    k = interval_rank(n)
    assert _coverage(n, k) >= LEVEL > _coverage(n, k + 1)


def test_the_interval_ranks_of_the_textbook_table() -> None:
    # The distribution-free 95% interval of a median: ranks (6, 15) of 20, (40, 61) of 100.
    assert (interval_rank(20), 20 + 1 - interval_rank(20)) == (6, 15)
    assert (interval_rank(100), 100 + 1 - interval_rank(100)) == (40, 61)
    # Above 1,000 samples, the normal approximation n/2 - 1.96 sqrt(n)/2.
    assert interval_rank(10_000) == math.floor(5000 - 1.959964 * 100 / 2)


def test_fewer_than_five_samples_measure_no_noise(tmp_path: Path) -> None:
    assert MIN_SAMPLES == 5
    for n in range(MIN_SAMPLES):
        assert median_interval([1.0 + i for i in range(n)]) is None
    # Five samples: the whole range, the widest interval there is (it covers 93.8%).
    assert median_interval([3.0, 1.0, 5.0, 2.0, 4.0]) == (1.0, 5.0)
    one = _run_dir(tmp_path, [0.5])
    assert noise("execute.median_s", 0.5, one, _manifest(0.5)) == {"band": None, "samples": 1}
    assert noise("execute.median_s", 0.5, _run_dir(tmp_path, None, "none"), _manifest(0.5)) == {
        "band": None,
        "samples": 0,
    }


def test_the_interval_narrows_with_more_samples_while_the_spread_of_calls_does_not() -> None:
    widths, iqrs = [], []
    for n in (10, 40, 160, 640, 2560):
        samples = _spread(n, 1.0, 2.0, seed=n)
        lo, hi = median_interval(samples) or (0.0, 0.0)
        assert lo <= statistics.median(samples) <= hi
        widths.append(hi - lo)
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        iqrs.append(q3 - q1)
    assert all(b < a for a, b in itertools.pairwise(widths))
    # Each fourfold of samples about halves it (1/sqrt(n)); the quartiles stay 0.5 apart.
    assert widths[-1] < widths[1] / 3
    assert all(iqr == pytest.approx(0.5, abs=0.05) for iqr in iqrs)


def test_a_timed_objectives_band_is_its_medians_interval(tmp_path: Path) -> None:
    samples = _spread(20, 1.0, 2.0, seed=0)
    run = _run_dir(tmp_path, samples)
    xs = sorted(samples)
    median = statistics.median(samples)
    got = noise("execute.median_s", median, run, _manifest(median))
    assert got == {"band": [xs[5], xs[14]], "samples": 20}
    # A rate is flops / median: the median's interval, inverted.
    rate = noise("execute.flops_per_s", 100.0, run, _manifest(median))
    assert rate["band"] == pytest.approx([100.0 * median / xs[14], 100.0 * median / xs[5]])
    # A count has no noise: its band is the value itself.
    assert noise("compile.temp_bytes", 4096.0, run, _manifest(median)) == {
        "band": [4096.0, 4096.0],
        "samples": None,
    }


def _timed(tmp: Path, job: int, samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    run = _run_dir(tmp, samples, f"job{job}")
    return {"job": job, "value": median, **noise("execute.median_s", median, run, {})}


def _best(trials: list[dict[str, Any]], direction: str = "minimize") -> dict[str, Any]:
    pick = min if direction == "minimize" else max
    return judge(pick(trials, key=lambda t: t["value"]), trials, direction)


def test_a_clear_winner_of_20_samples_wins_beyond_the_noise(tmp_path: Path) -> None:
    fast = _timed(tmp_path, 0, _spread(20, 1.00, 1.10, seed=1))
    slow = _timed(tmp_path, 1, _spread(20, 1.20, 1.30, seed=2))
    best = _best([slow, fast])
    assert best["job"] == 0 and best["tied_with"] == [] and not best["provisional"]
    line = verdict("execute.median_s", best, [slow, fast])
    assert line.startswith("best execute.median_s = ") and "(job 0), ahead of job 1" in line
    assert line.endswith("beyond the timing noise (95% confidence)")


def test_overlapping_timings_tie_and_more_repeats_separate_them(tmp_path: Path) -> None:
    """A difference (0.1 s) ten times smaller than the spread of single calls (1 s)."""
    a = _timed(tmp_path / "20", 0, _spread(20, 1.0, 2.0, seed=3))
    b = _timed(tmp_path / "20", 1, _spread(20, 1.1, 2.1, seed=4))
    best = _best([a, b])
    assert best["job"] == 0 and best["tied_with"] == [1] and not best["provisional"]
    line = verdict("execute.median_s", best, [a, b])
    assert line.startswith(
        "no clear best execute.median_s: jobs 0, 1 are tied within the timing noise "
        "(their medians' 95% confidence intervals overlap); more execute.repeats may separate them"
    )
    a = _timed(tmp_path / "2000", 0, _spread(2000, 1.0, 2.0, seed=5))
    b = _timed(tmp_path / "2000", 1, _spread(2000, 1.1, 2.1, seed=6))
    assert _best([a, b])["tied_with"] == []


def test_one_sample_claims_no_winner(tmp_path: Path) -> None:
    """execute.repeats=1: one call per trial, however far apart, names no winner."""
    a = _timed(tmp_path, 0, [1.0])
    b = _timed(tmp_path, 1, [3.0])
    best = _best([a, b])
    assert best["job"] == 0 and best["provisional"] and best["tied_with"] == []
    line = verdict("execute.median_s", best, [a, b])
    assert line == (
        f"provisional best execute.median_s = {human_seconds(1.0)} (job 0): noise not measured "
        "(1 sample): no winner claimed (execute.repeats=5 or more measures it)"
    )
    assert "beyond" not in line
    # One trial short of samples is enough: the best may not be compared with it.
    c = _timed(tmp_path, 2, _spread(20, 1.0, 1.1, seed=7))
    d = _timed(tmp_path, 3, [2.0, 2.1, 2.2])
    best = _best([c, d])
    assert best["provisional"] and "(3 samples)" in verdict("execute.median_s", best, [c, d])


def test_counts_have_no_noise_and_tie_only_when_equal() -> None:
    def count(job: int, v: float) -> dict[str, Any]:
        return {"job": job, "value": v, "band": [v, v], "samples": None}

    trials = [count(0, 4096.0), count(1, 4097.0), count(2, 4096.0)]
    best = _best(trials)
    assert best["job"] == 0 and best["tied_with"] == [2] and not best["provisional"]
    line = verdict("compile.temp_bytes", best, trials)
    assert "jobs 0, 2 are tied (equal)" in line and "execute.repeats" not in line
    best = _best(trials[:2])
    assert best["tied_with"] == []
    line = verdict("compile.temp_bytes", best, trials[:2])
    assert "ahead of job 1" in line and "noise" not in line
    top = _best([count(0, 10.0), count(1, 9.0), count(2, 10.0)], "maximize")
    assert top["tied_with"] == [2]


"""A search's winner must clear the measured noise: noise bands, ties, the verdict line, and
the report of a search where two points are equal."""


def test_a_best_trial_of_an_earlier_sweep_is_named_so() -> None:
    earlier = {"job": None, "value": 4096.0}
    mine = {"job": 0, "value": 8192.0, "band": [8192.0, 8192.0], "samples": None}
    assert verdict("compile.temp_bytes", earlier, [mine]) == (
        "best compile.temp_bytes = 4.0 KiB (a trial of an earlier sweep of this study)"
    )


@pytest.mark.extra("sweep")
def test_a_search_with_two_equal_best_points_reports_the_tie(tmp_path: Path) -> None:
    """fast-math changes no buffer: the two smallest-argument points need the same temp memory."""
    proc, sweep_dir = run_sweep(
        tmp_path,
        "hydra/sweeper=jaxaot_optuna",
        "program=mlp",
        "stop_after=compile",
        "hydra.sweeper.objective=compile.temp_bytes",
        "program.args.1=choice(f32[8,256],f32[256,256])",
        "compile.compiler_options.xla_cpu_enable_fast_math=choice(false,true)",
        "hydra.callbacks.sweep.plots=false",
    )
    result = json.loads((sweep_dir / "autotune.json").read_text())
    small = sorted(t["job"] for t in result["trials"] if "8" in t["params"]["program.args.1"])
    best = result["best"]
    assert best["job"] == small[0] and best["tied_with"] == small[1:]
    md = (sweep_dir / "sweep.md").read_text()
    assert f"Tied with job(s) {small[1]} (within the measured noise): no clear winner." in md
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in sweep_dir.rglob("*.log"))
    assert f"no clear best compile.temp_bytes: jobs {small[0]}, {small[1]} are tied (equal)" in logs


def test_the_timed_objectives_are_catalogued_figures() -> None:
    """The objectives whose noise is measured name figures the records have (a renamed metric
    fails here, not as a silently unmeasured band)."""
    from jaxaot.rundir.metrics import OBJECTIVE_BY_NAME

    assert OBJECTIVE_BY_NAME[TIMED].unit == "s"
    assert [OBJECTIVE_BY_NAME[r].unit for r in RATES] == ["FLOP/s", "share"]
