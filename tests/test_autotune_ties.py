"""A search's winner must clear the measured noise: noise bands, ties, the verdict line, and
the report of a search where two points are equal."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env, run_cli
from jaxaot.sweeps.autotune_ties import band, median_band, tied_with, verdict


def _run_dir(tmp: Path, samples: list[float] | None) -> Path:
    run = tmp / "run"
    (run / "execute").mkdir(parents=True)
    if samples is not None:
        (run / "execute" / "timings.json").write_text(json.dumps({"samples_s": samples}))
    return run


def _manifest(median: float, sd: float) -> dict[str, Any]:
    return {"stages": {"execute": {"metrics": {"median_s": median, "stddev_s": sd}}}}


def test_a_timed_objectives_band_is_the_interquartile_range_of_its_samples(
    tmp_path: Path,
) -> None:
    samples = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    run = _run_dir(tmp_path, samples)
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    assert median_band(run, _manifest(5.0, 2.7)) == (q1, q3) == (3.0, 7.0)
    assert band("execute.median_s", 5.0, run, _manifest(5.0, 2.7)) == (3.0, 7.0)
    # A rate is flops / median: the median's band, inverted.
    lo, hi = band("execute.flops_per_s", 100.0, run, _manifest(5.0, 2.7))
    assert (lo, hi) == pytest.approx((100.0 * 5.0 / 7.0, 100.0 * 5.0 / 3.0))
    # A count measured once has no spread.
    assert band("compile.temp_bytes", 4096.0, run, _manifest(5.0, 2.7)) == (4096.0, 4096.0)


def test_without_samples_the_band_comes_from_the_standard_deviation(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, None)
    lo, hi = band("execute.median_s", 5.0, run, _manifest(5.0, 2.0))
    assert (lo, hi) == pytest.approx((5.0 - 0.6745 * 2.0, 5.0 + 0.6745 * 2.0))


def _trial(job: int, value: float, lo: float, hi: float) -> dict[str, Any]:
    return {"job": job, "value": value, "band": [lo, hi]}


def test_trials_whose_bands_reach_the_best_ones_are_tied() -> None:
    best = _trial(0, 1.00, 0.95, 1.05)
    near = _trial(1, 1.03, 1.01, 1.08)  # its lower quartile is below the best's upper one
    close = _trial(3, 1.02, 1.04, 1.10)  # so is its
    far = _trial(2, 1.20, 1.15, 1.25)
    trials = [best, near, far, close]
    assert tied_with(best, trials, "minimize") == [3, 1]  # best value first
    assert tied_with(best, [best, far], "minimize") == []
    top = _trial(0, 10.0, 9.0, 11.0)
    assert tied_with(
        top, [top, _trial(1, 9.5, 8.5, 9.2), _trial(2, 5.0, 4.0, 8.9)], "maximize"
    ) == [1]


def test_the_verdict_names_the_tie_or_the_runner_up() -> None:
    best = _trial(4, 0.001, 0.0009, 0.0011)
    runner = _trial(1, 0.0013, 0.0012, 0.0014)
    line = verdict("execute.median_s", {**best, "tied_with": []}, [best, runner])
    assert line == (
        "best execute.median_s = 0.001 (job 4), ahead of job 1 (0.0013) beyond the timing noise"
    )
    line = verdict("execute.median_s", {**best, "tied_with": [1, 7]}, [best, runner])
    assert line.startswith(
        "no clear best execute.median_s: jobs 4, 1, 7 are tied within the timing noise"
    )
    assert line.endswith("job 4 has the best value, 0.001")
    line = verdict("compile.temp_bytes", {**best, "tied_with": [1]}, [best, runner])
    assert "jobs 4, 1 are tied (equal)" in line and "execute.repeats" not in line


def test_a_search_with_two_equal_best_points_reports_the_tie(tmp_path: Path) -> None:
    """fast-math changes no buffer: the two smallest-argument points need the same temp memory."""
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "hydra/sweeper=jaxaot_optuna",
            "program=mlp",
            "stop_after=compile",
            "hydra.sweeper.objective=compile.temp_bytes",
            "program.args.1=choice(f32[8,256],f32[256,256])",
            "compile.compiler_options.xla_cpu_enable_fast_math=choice(false,true)",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        env=cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((sweep_dir / "autotune.json").read_text())
    small = sorted(t["job"] for t in result["trials"] if "8" in t["params"]["program.args.1"])
    best = result["best"]
    assert best["job"] == small[0] and best["tied_with"] == small[1:]
    md = (sweep_dir / "sweep.md").read_text()
    assert f"Tied with job(s) {small[1]} (within the measured noise): no clear winner." in md
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in sweep_dir.rglob("*.log"))
    assert f"no clear best compile.temp_bytes: jobs {small[0]}, {small[1]} are tied (equal)" in logs
