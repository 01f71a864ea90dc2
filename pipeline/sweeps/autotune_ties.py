"""Whether a search's best trial won beyond the measured noise, or ties with others.

A timed objective is the median of the ``execute.repeats`` timed calls (after
``execute.warmup`` untimed ones); ``execute/timings.json``'s ``samples_s`` holds each call's
wall time. A trial's noise band is a 95% confidence interval of that median, distribution-free
(from order statistics): the ``k``-th smallest and ``k``-th largest sample, ``k`` the largest
rank whose interval covers the true median with probability >= 95% under the binomial
distribution of ranks (the normal approximation ``n/2 - 1.96 sqrt(n)/2`` above 1,000 samples).
It narrows as 1/sqrt(n): more ``execute.repeats`` separate a real difference smaller than the
spread of single calls. At exactly 5 samples the interval is the whole range (93.8%); below
5 (``MIN_SAMPLES``) the noise is not measured and the best trial is reported as provisional,
with no winner claimed. Rates computed from the median (``execute.flops_per_s``,
``execute.roofline_fraction``) get the median's interval, inverted. Every other objective is a
count or a figure measured once: no noise, its band is the value itself (ties only on equality).

The best trial (lowest median for minimize) wins only when no other trial's band reaches its
own; the trials whose bands do are tied with it, and the search reports the tie, naming them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxaot.rundir.metrics import RunMetrics
from jaxaot.sweeps.progress import human_value  # the report's units: 389.3 us, 1.5 MiB

TIMED = "execute.median_s"
# Proportional to 1 / median: the band of the median, inverted.
RATES = ("execute.flops_per_s", "execute.roofline_fraction")
LEVEL = 0.95
Z = 1.959964  # the normal quantile of (1 + LEVEL) / 2
# Fewer timed calls than this measure no noise: no winner is claimed.
MIN_SAMPLES = 5
EXACT_UP_TO = 1000  # the binomial ranks exactly up to here; the normal approximation above


def samples_of(run_dir: Path) -> list[float]:
    """The per-call times of a run's execute stage (``execute/timings.json``), [] without."""
    try:
        data = json.loads((run_dir / "execute" / "timings.json").read_text())
    except (OSError, ValueError):
        return []
    samples = data.get("samples_s") if isinstance(data, dict) else None
    if not isinstance(samples, list):
        return []
    return [float(s) for s in samples if isinstance(s, int | float)]


def interval_rank(n: int) -> int:
    """The rank ``k`` (1-based) of a median's ``LEVEL`` confidence interval from ``n`` samples:
    [k-th smallest, k-th largest]. 1 (the whole range) when no rank reaches ``LEVEL``."""
    if n > EXACT_UP_TO:
        return max(1, math.floor(n / 2 - Z * math.sqrt(n) / 2))
    # The interval [x(k), x(n+1-k)] misses the median with probability 2 P(B <= k-1),
    # B ~ Binomial(n, 1/2): the largest k keeping that within 1 - LEVEL, in whole numbers.
    limit = (1 - LEVEL) / 2 * 2**n
    k, below, term = 1, 1, 1  # below = sum of C(n, i) for i < k + 1
    while k < (n + 1) // 2 and below <= limit:
        term = term * (n - k + 1) // k
        below += term
        k += 1
    # The loop stops one past the last rank whose tail is within the limit.
    return max(1, k - 1) if below > limit else k


def median_interval(samples: list[float]) -> tuple[float, float] | None:
    """The ``LEVEL`` confidence interval of the samples' median; None below ``MIN_SAMPLES``."""
    n = len(samples)
    if n < MIN_SAMPLES:
        return None
    xs = sorted(samples)
    k = interval_rank(n)
    return xs[k - 1], xs[n - k]


def noise(objective: str, value: float, run_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A trial's ``band`` (see the module docstring) and, for a timed objective, its
    ``samples`` count; ``band`` is None where the noise is not measured."""
    if objective not in (TIMED, *RATES):
        return {"band": [value, value], "samples": None}
    samples = samples_of(run_dir)
    got = median_interval(samples)
    if got is None:
        return {"band": None, "samples": len(samples)}
    lo, hi = got
    if objective == TIMED:
        return {"band": [min(lo, value), max(hi, value)], "samples": len(samples)}
    median = RunMetrics.from_manifest(manifest).execute.median_s
    if not isinstance(median, int | float) or median <= 0 or lo <= 0:
        return {"band": None, "samples": len(samples)}
    band = [min(value * median / hi, value), max(value * median / lo, value)]
    return {"band": band, "samples": len(samples)}


def _rivals(best: dict[str, Any], trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in trials if t["job"] != best["job"] and t.get("value") is not None]


def judge(best: dict[str, Any], trials: list[dict[str, Any]], direction: str) -> dict[str, Any]:
    """``best`` with ``tied_with`` (the jobs whose band reaches its own, best first; empty: it
    won beyond the noise) and ``provisional`` (True: some trial's noise is not measured, so
    neither a winner nor a tie is claimed)."""
    if best.get("band") is None or any(t.get("band") is None for t in _rivals(best, trials)):
        return {**best, "tied_with": [], "provisional": True}
    lo, hi = best["band"]
    ties = []
    for t in _rivals(best, trials):
        t_lo, t_hi = t["band"]
        if (t_lo <= hi) if direction == "minimize" else (t_hi >= lo):
            ties.append(t)
    ties.sort(key=lambda t: t["value"], reverse=direction == "maximize")
    return {**best, "tied_with": [t["job"] for t in ties], "provisional": False}


def verdict(objective: str, best: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    """One line: the clear winner and the runner-up it beat, the tie and its jobs, or the
    provisional best when the noise is not measured."""
    value = human_value(objective, best["value"])
    if best["job"] is None:  # the best trial ran in an earlier sweep of a stored study
        return f"best {objective} = {value} (a trial of an earlier sweep of this study)"
    timed = objective in (TIMED, *RATES)
    if best.get("provisional"):
        counts = [
            t.get("samples") or 0 for t in [best, *_rivals(best, trials)] if t.get("band") is None
        ]
        n = min(counts, default=0)
        return (
            f"provisional best {objective} = {value} (job {best['job']}): noise not measured "
            f"({n} sample{'s' if n != 1 else ''}): no winner claimed "
            f"(execute.repeats={MIN_SAMPLES} or more measures it)"
        )
    tied = best.get("tied_with") or []
    if tied:
        why = (
            f"within the timing noise (their medians' {LEVEL:.0%} confidence intervals overlap)"
            if timed
            else "(equal)"
        )
        jobs = ", ".join(str(j) for j in [best["job"], *tied])
        more = "; more execute.repeats may separate them" if timed else ""
        return (
            f"no clear best {objective}: jobs {jobs} are tied {why}{more}; "
            f"job {best['job']} has the best value, {value}"
        )
    others = _rivals(best, trials)
    if not others:
        return f"best {objective} = {value} (job {best['job']})"
    runner = min(others, key=lambda t: abs(t["value"] - best["value"]))
    beyond = f" beyond the timing noise ({LEVEL:.0%} confidence)" if timed else ""
    return (
        f"best {objective} = {value} (job {best['job']}), "
        f"ahead of job {runner['job']} ({human_value(objective, runner['value'])}){beyond}"
    )


__all__ = [
    "LEVEL",
    "MIN_SAMPLES",
    "human_value",
    "interval_rank",
    "judge",
    "median_interval",
    "noise",
    "samples_of",
    "verdict",
]
