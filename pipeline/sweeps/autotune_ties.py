"""Whether a search's best trial won beyond the measured noise, or ties with others.

A timed objective is the median of ``execute.repeats`` calls; the calls spread. Each trial's
noise band is the interquartile range of its samples (``execute/timings.json``'s
``samples_s``; without them, the median +- 0.674 standard deviations, a normal distribution's
quartiles). Rates computed from the median (``execute.flops_per_s``,
``execute.roofline_fraction``) get the band of the median, inverted. Every other objective is
a count or a wall time measured once: its band is the value itself.

The best trial (lowest median for minimize) wins only when no other trial's band reaches its
own; the trials whose bands do are tied with it, and the search reports the tie, naming them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

TIMED = "execute.median_s"
# Proportional to 1 / median: the band of the median, inverted.
RATES = ("execute.flops_per_s", "execute.roofline_fraction")
NORMAL_QUARTILE = 0.6745


def _samples(run_dir: Path) -> list[float]:
    try:
        data = json.loads((run_dir / "execute" / "timings.json").read_text())
    except (OSError, ValueError):
        return []
    samples = data.get("samples_s") if isinstance(data, dict) else None
    if not isinstance(samples, list):
        return []
    return [float(s) for s in samples if isinstance(s, int | float)]


def median_band(run_dir: Path, manifest: dict[str, Any]) -> tuple[float, float] | None:
    """(first, third) quartile of the run's execute timings; None without an execute record."""
    samples = _samples(run_dir)
    if len(samples) >= 2:
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return q1, q3
    metrics = (manifest.get("stages", {}).get("execute") or {}).get("metrics") or {}
    median, sd = metrics.get("median_s"), metrics.get("stddev_s")
    if not isinstance(median, int | float):
        return None
    half = NORMAL_QUARTILE * float(sd) if isinstance(sd, int | float) else 0.0
    return median - half, median + half


def band(
    objective: str, value: float, run_dir: Path, manifest: dict[str, Any]
) -> tuple[float, float]:
    """The noise band of one trial's objective ``value`` (see the module docstring)."""
    if objective not in (TIMED, *RATES):
        return value, value
    quartiles = median_band(run_dir, manifest)
    if quartiles is None:
        return value, value
    q1, q3 = quartiles
    if objective == TIMED:
        return min(q1, value), max(q3, value)
    median = (manifest.get("stages", {}).get("execute") or {}).get("metrics", {}).get("median_s")
    if not isinstance(median, int | float) or median <= 0 or q1 <= 0:
        return value, value
    return min(value * median / q3, value), max(value * median / q1, value)


def tied_with(best: dict[str, Any], trials: list[dict[str, Any]], direction: str) -> list[Any]:
    """The jobs of the trials (not ``best``) whose band reaches the best one's, best first."""
    lo, hi = best["band"]
    ties = []
    for t in trials:
        if t["job"] == best["job"] or t.get("value") is None or t.get("band") is None:
            continue
        t_lo, t_hi = t["band"]
        if (t_lo <= hi) if direction == "minimize" else (t_hi >= lo):
            ties.append(t)
    ties.sort(key=lambda t: t["value"], reverse=direction == "maximize")
    return [t["job"] for t in ties]


def verdict(objective: str, best: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    """One line: the clear winner and the runner-up it beat, or the tie and its jobs."""
    tied = best.get("tied_with") or []
    timed = objective in (TIMED, *RATES)
    if tied:
        why = "within the timing noise (their interquartile ranges overlap)" if timed else "(equal)"
        jobs = ", ".join(str(j) for j in [best["job"], *tied])
        more = "; more execute.repeats may separate them" if timed else ""
        return (
            f"no clear best {objective}: jobs {jobs} are tied {why}{more}; "
            f"job {best['job']} has the best value, {best['value']:.6g}"
        )
    others = [t for t in trials if t["job"] != best["job"] and t.get("value") is not None]
    if not others or best.get("band") is None:
        return f"best {objective} = {best['value']:.6g} (job {best['job']})"
    runner = min(others, key=lambda t: abs(t["value"] - best["value"]))
    beyond = " beyond the timing noise" if timed else ""
    return (
        f"best {objective} = {best['value']:.6g} (job {best['job']}), ahead of job "
        f"{runner['job']} ({runner['value']:.6g}){beyond}"
    )


__all__ = ["band", "median_band", "tied_with", "verdict"]
