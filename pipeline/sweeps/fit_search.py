"""Fit search: the largest value of an integer override that still fits a
topology, for every choice of the other sweep arguments, and the Pareto front of the choices.

``hydra/sweeper=jaxaot_fit`` (hydra_plugins/jaxaot_fit_sweeper) launches one compile per probe,
each in a process of its own (:mod:`jaxaot.sweeps.probe_process`), and bisects on the verdict:
a job that exits 0 fits, one that exits with :data:`jaxaot.errors.EXIT_DOES_NOT_FIT` does not.
A probe without a verdict (a crashed compiler, a timeout, an error) is recorded and the search
goes on around it; ``hydra.sweeper.max_failures`` of them end that search. Fitting is assumed
monotone in the value (more batch never needs less memory), which makes bisection sound;
``fit.json`` in the sweep dir records every probe, so a non-monotone case is visible.

Overrides carry the value through a ``{n}`` placeholder, so one value can set several keys::

    hydra.sweeper.overrides=['program.args.1=i32[{n},2048]','program.args.2=i32[{n},2048]']

and every combination of the other sweep arguments (``compile.topology=v5e-256,v6e-256
program.remat=none,full``) gets a search of its own. Per topology, the choices at their largest
fit form a Pareto front (a larger fit, a shorter estimated step per unit of n, less HBM needed),
as MaxText's estimator searches batch size x remat policy. The time objective is per unit of n
(``est_s_per_n``, the roofline's ``est_step_s`` at the largest fit divided by it): steps at
different n do different amounts of work, so their times alone would favour the smaller n.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxaot.errors import ConfigError
from jaxaot.rundir.metrics import CompileMetrics
from jaxaot.sweeps.overrides import override_value

log = logging.getLogger("jaxaot")

FIT_NAME = "fit.json"
# fit.json's format. 2: "format", "next_job" and "fronts"; probes carry "status"
# (fits | does_not_fit | crashed | timed_out | failed) and the estimate at each value.
# 1 (no "format" key, not resumed): one search per combination, stopped by the first failure.
FIT_FORMAT = 2
TOPOLOGY_KEY = "compile.topology"
# Probe statuses that are no verdict: the value is neither known to fit nor known not to.
NO_VERDICT: tuple[str, ...] = ("crashed", "timed_out", "failed")
# The front's objectives, each at a choice's largest fitting value; "min" or "max".
# est_s_per_n: the estimated step divided by that value (time per unit of work).
OBJECTIVES: tuple[tuple[str, str], ...] = (
    ("largest_fit", "max"),
    ("est_s_per_n", "min"),
    ("hbm_bytes_needed", "min"),
)
# Figures each probe keeps from its job's compile metrics (fit.json's probe keys).
PROBE_METRICS: tuple[str, ...] = (
    "topology",
    "hbm_bytes_needed",
    "hbm_bytes_available",
    "est_step_s",
    "peak_bytes",
    "host_bytes_needed",
)


def probe_figures(compiled: CompileMetrics) -> dict[str, Any]:
    """The :data:`PROBE_METRICS` of a probe's compile (all None for a compile without a
    topology's verdict), as fit.json records them."""
    verdict = compiled.verdict
    return {
        "topology": verdict.topology,
        "hbm_bytes_needed": verdict.hbm_bytes_needed,
        "hbm_bytes_available": verdict.hbm_bytes_available,
        "est_step_s": verdict.est_step_s,
        "peak_bytes": compiled.peak_bytes,
        "host_bytes_needed": verdict.host_bytes_needed,
    }


@dataclass(frozen=True)
class FitOptions:
    """``hydra.sweeper.*`` of the fit sweeper."""

    overrides: list[str] = field(default_factory=list)  # each with a {n} placeholder
    low: int = 1  # smallest value tried; must fit for a boundary to exist
    high: int = 1024  # largest value tried
    multiple: int = 1  # values are multiples of this (divisibility by a mesh axis)
    isolate: bool = True  # each probe in a process of its own (a crash is a row, not the end)
    max_failures: int = 3  # probes without a verdict that end one search
    timeout_s: float = 0.0  # a probe running longer is killed (no verdict); 0: no limit

    def check(self) -> None:
        if not self.overrides or any("{n}" not in o or "=" not in o for o in self.overrides):
            raise ConfigError(
                f"hydra.sweeper.overrides: expected key=value overrides with a {{n}} placeholder, "
                f"e.g. ['program.args.1=i32[{{n}},2048]'], found {self.overrides}"
            )
        if self.multiple < 1:
            raise ConfigError(f"hydra.sweeper.multiple: expected >= 1, found {self.multiple}")
        if not 0 < self.low <= self.high:
            raise ConfigError(
                f"hydra.sweeper.low/high: expected 0 < low <= high, found low={self.low} "
                f"high={self.high}"
            )
        if self.low % self.multiple or self.high % self.multiple:
            raise ConfigError(
                f"hydra.sweeper.low/high: expected multiples of hydra.sweeper.multiple="
                f"{self.multiple}, found low={self.low} high={self.high}"
            )
        if self.max_failures < 1:
            raise ConfigError(
                f"hydra.sweeper.max_failures: expected >= 1, found {self.max_failures}"
            )
        if self.timeout_s < 0:
            raise ConfigError(
                f"hydra.sweeper.timeout_s: expected seconds >= 0 (0: no limit), found "
                f"{self.timeout_s}"
            )

    def with_value(self, n: int) -> list[str]:
        """The overrides for value ``n``, array types quoted for Hydra as on the command line."""
        from jaxaot.config.argspec import quote_array_types

        return [quote_array_types(o.replace("{n}", str(n))) for o in self.overrides]

    def header(self) -> dict[str, Any]:
        return {
            "format": FIT_FORMAT,
            "overrides": self.overrides,
            "low": self.low,
            "high": self.high,
            "multiple": self.multiple,
        }


def shown(override: str) -> str:
    """``compile.topology=v5e\\:2x2`` (as Hydra's parser returns it) as a user writes it."""
    key, sep, _ = override.partition("=")
    return f"{key}={override_value(override)}" if sep else override


@dataclass
class Search:
    """One bisection: the probes so far and, when done, the boundary."""

    fixed: list[str]  # this combination's overrides, as Hydra takes them
    label: str = ""  # the overrides that tell this search from the others, unescaped
    probes: list[dict[str, Any]] = field(default_factory=list)
    largest_fit: int | None = None
    smallest_misfit: int | None = None
    error: str | None = None  # why the search stopped before a boundary
    done: bool = False
    remaining: int = 0  # at most this many more probes (none failing), the next one included

    @property
    def topology(self) -> str | None:
        """The topology the probes compiled for, else this combination's override."""
        found = next((p["topology"] for p in self.probes if p.get("topology")), None)
        if found:
            return str(found)
        return next(
            (override_value(o) for o in self.fixed if o.split("=", 1)[0] == TOPOLOGY_KEY), None
        )

    @property
    def choice(self) -> str:
        """The label without the topology: what the Pareto front compares."""
        parts = [p for p in self.label.split(" ") if p and not p.startswith(TOPOLOGY_KEY + "=")]
        return " ".join(parts) or "(one choice)"

    def no_verdict(self) -> list[dict[str, Any]]:
        return sorted((p for p in self.probes if p["fits"] is None), key=lambda p: p["n"])

    def to_json(self, opts: FitOptions) -> dict[str, Any]:
        at = next((p for p in self.probes if p["n"] == self.largest_fit), None) or {}
        return {
            "fixed": self.fixed,
            "label": self.label,
            "choice": self.choice,
            "topology": self.topology,
            "done": self.done,
            "largest_fit": self.largest_fit,
            "smallest_misfit": self.smallest_misfit,
            "hbm_bytes_needed_at_fit": at.get("hbm_bytes_needed"),
            "hbm_bytes_available": at.get("hbm_bytes_available"),
            "est_step_s_at_fit": at.get("est_step_s"),
            "peak_bytes_at_fit": at.get("peak_bytes"),
            "no_verdict": [p["n"] for p in self.no_verdict()],
            # made by this process; "reused": taken from an earlier run's fit.json
            "compiles": sum(not p.get("reused") for p in self.probes),
            "reused": sum(bool(p.get("reused")) for p in self.probes),
            "linear_scan_compiles": linear_scan_compiles(
                opts, self.largest_fit, self.smallest_misfit
            ),
            "error": self.error,
            "probes": self.probes,
        }


def linear_scan_compiles(
    opts: FitOptions, largest_fit: int | None, smallest_misfit: int | None
) -> int:
    """Compiles a scan upwards from ``low`` in steps of ``multiple`` needs for the same answer:
    every value up to the first misfit, that one included."""
    if largest_fit is None:
        return 1  # low itself does not fit
    stop = smallest_misfit if smallest_misfit is not None else opts.high
    return (stop - opts.low) // opts.multiple + 1


@dataclass
class _State:
    """What is known, in units of ``multiple``: the largest fit, the smallest misfit and the
    values without a verdict."""

    first: int
    last: int
    lo: int | None = None
    hi: int | None = None
    unknown: set[int] = field(default_factory=set)

    def candidates(self) -> tuple[int, int, list[int]]:
        """(bottom, top, unknowns between): the values still worth a probe are [bottom, top]
        without the unknowns."""
        bottom = self.lo + 1 if self.lo is not None else self.first
        top = self.hi - 1 if self.hi is not None else self.last
        return bottom, top, sorted(u for u in self.unknown if bottom <= u <= top)

    def count(self) -> int:
        bottom, top, gaps = self.candidates()
        return max(top - bottom + 1 - len(gaps), 0)

    def _top_untried(self) -> bool:
        """Whether ``high`` still needs its probe (nothing above ``lo`` is known not to fit)."""
        return self.hi is None and self.last not in self.unknown and self.lo != self.last

    def next(self) -> int | None:
        """The value to probe next: ``low``, then ``high``, then the median of what is left
        (by count, so that values without a verdict never unbalance the halves)."""
        bottom, top, gaps = self.candidates()
        left = top - bottom + 1 - len(gaps)
        if left <= 0:
            return None
        if self.lo is None:
            k = 0  # the smallest candidate: nothing is known to fit yet
        elif self._top_untried():
            return self.last
        else:
            k = (left - 1) // 2
        value = bottom + k
        for g in gaps:  # the k-th candidate, skipping the unknowns
            if g <= value:
                value += 1
        return value

    def bound(self) -> int:
        """At most this many more probes, if none fails: a bisection of r candidates takes at
        most r.bit_length() probes (ceil(log2(r + 1)))."""
        left = self.count()
        if left == 0:
            return 0
        if self.lo is None:  # the smallest, then as if it fitted
            after = left - 1
            top_next = self.hi is None and self.last not in self.unknown and after > 0
            return 1 + ((1 + (after - 1).bit_length()) if top_next else after.bit_length())
        if self._top_untried():
            return 1 + (left - 1).bit_length()
        return left.bit_length()


def bisect(opts: FitOptions, probe: Callable[[int], bool | None], search: Search) -> Search:
    """Fill ``search`` by probing values; ``probe(n)`` is True (fits), False (does not) or None
    (no verdict at ``n``: the search goes on around it, up to ``opts.max_failures`` of them).
    A probe that sets ``search.error`` ends the search."""
    m = opts.multiple
    state = _State(first=opts.low // m, last=opts.high // m)
    failures = 0
    while (unit := state.next()) is not None:
        search.remaining = state.bound()
        verdict = probe(unit * m)
        if search.error:
            break
        if verdict is None:
            state.unknown.add(unit)
            failures += 1
            if failures >= opts.max_failures:
                where = ", ".join(f"n={u * m}" for u in sorted(state.unknown))
                search.error = (
                    f"{failures} probes without a verdict ({where}); "
                    f"hydra.sweeper.max_failures={opts.max_failures}"
                )
                break
        elif verdict:
            state.lo = unit
        else:
            state.hi = unit
    search.remaining = 0
    search.largest_fit = state.lo * m if state.lo is not None else None
    search.smallest_misfit = state.hi * m if state.hi is not None else None
    search.done = True
    return search


def initial_bound(opts: FitOptions) -> int:
    """At most this many probes for one search, if none fails."""
    return _State(first=opts.low // opts.multiple, last=opts.high // opts.multiple).bound()


# -- the Pareto front ----------------------------------------------------------------------


def _point(result: dict[str, Any]) -> dict[str, Any]:
    n, est = result["largest_fit"], result["est_step_s_at_fit"]
    return {
        "choice": result["choice"],
        "largest_fit": n,
        "est_step_s": est,
        "est_s_per_n": est / n if est is not None and n else None,
        "hbm_bytes_needed": result["hbm_bytes_needed_at_fit"],
    }


def _worse_or_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``a`` is no better than ``b`` in every objective (a missing figure is worst)."""
    for key, sense in OBJECTIVES:
        x, y = a.get(key), b.get(key)
        if y is None:
            if x is not None:
                return False
            continue
        if x is None:
            continue
        if (x < y) if sense == "min" else (x > y):
            return False
    return True


def _dominated(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ``b`` dominates ``a``: no worse in any objective and better in one."""
    return _worse_or_equal(a, b) and not _worse_or_equal(b, a)


def fronts(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per topology, the choices at their largest fit and which of them no other beats in
    every objective (:data:`OBJECTIVES`). Marks each result's ``on_front``."""
    by_topology: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        r["on_front"] = None
        if r["largest_fit"] is not None:
            by_topology.setdefault(r.get("topology") or "-", []).append(r)
    out = []
    for topology, group in by_topology.items():
        points = [_point(r) for r in group]
        for r, p in zip(group, points, strict=True):
            p["on_front"] = r["on_front"] = not any(_dominated(p, q) for q in points if q is not p)
        points.sort(key=lambda p: (not p["on_front"], -p["largest_fit"], p["est_s_per_n"] or 0.0))
        out.append({"topology": topology, "objectives": dict(OBJECTIVES), "points": points})
    return out


# -- what the user reads -------------------------------------------------------------------


def _probe_note(p: dict[str, Any]) -> str:
    return f"n={p['n']} {p.get('error') or p.get('status')}"


def _compiles(result: dict[str, Any]) -> str:
    """``5 compiles``, or ``3 compiles, 5 reused`` when some probes came from fit.json."""
    made, reused = result["compiles"], result.get("reused") or 0
    return f"{made} compile{'' if made == 1 else 's'}" + (f", {reused} reused" if reused else "")


def summary_line(result: dict[str, Any]) -> str:
    """One line per search: boundary, memory at it, values without a verdict, compiles."""
    from jaxaot.stages.fit_verdict import pair_text
    from jaxaot.util.humanize import human_bytes

    where = result.get("label") or "all jobs"
    unknown = [p for p in result["probes"] if p["fits"] is None]
    notes = f"; no verdict: {'; '.join(_probe_note(p) for p in unknown)}" if unknown else ""
    stopped = f"; stopped: {result['error']}" if result["error"] else ""
    if result["largest_fit"] is None:
        if result["smallest_misfit"] is None:
            return f"fit search [{where}]: no value fits or fails to fit{notes}{stopped}"
        return (
            f"fit search [{where}]: nothing fits, not even n={result['smallest_misfit']}"
            f"{notes}{stopped}"
        )
    misfit = result["smallest_misfit"]
    if misfit is not None:
        bound = f"n={result['largest_fit']} fits, n={misfit} does not"
    elif unknown and max(p["n"] for p in unknown) > result["largest_fit"]:
        bound = f"n={result['largest_fit']} fits (no verdict above it)"
    else:
        bound = f"n={result['largest_fit']} fits (the whole range fits)"
    need, have = result["hbm_bytes_needed_at_fit"], result["hbm_bytes_available"]
    memory = (
        pair_text(need, have)  # as the verdict prints them
        if need is not None and have is not None
        else f"{human_bytes(need)} of {human_bytes(have)}"
    )
    return (
        f"fit search [{where}]: {bound}; {memory} per device at the boundary; "
        f"{_compiles(result)} (a linear scan: {result['linear_scan_compiles']})"
        f"{notes}{stopped}"
    )


def _point_text(p: dict[str, Any]) -> str:
    from jaxaot.util.humanize import human_bytes, human_seconds

    per = f", {human_seconds(p['est_s_per_n'])} per n" if p.get("est_s_per_n") else ""
    return (
        f"{p['choice']}: n={p['largest_fit']}, {human_bytes(p['hbm_bytes_needed'])}, "
        f"est. step {human_seconds(p['est_step_s'])}{per}"
    )


def front_lines(found: Sequence[dict[str, Any]]) -> list[str]:
    """The Pareto front of each topology with more than one choice, one line per choice."""
    lines = []
    for f in found:
        if len(f["points"]) < 2:
            continue
        on = [p for p in f["points"] if p["on_front"]]
        lines.append(
            f"fit search: Pareto front on {f['topology']} (largest n, est. step per n, HBM "
            f"needed at it): {len(on)} of {len(f['points'])} choices"
        )
        lines += [f"  {_point_text(p)}" for p in on]
        lines += [f"  dominated: {_point_text(p)}" for p in f["points"] if not p["on_front"]]
    return lines


def report_lines(fit: dict[str, Any]) -> list[str]:
    """A Markdown section for ``sweep.md``: every search's boundary and each topology's front."""
    from jaxaot.util.humanize import human_bytes, human_seconds

    lines = ["## Fit search", ""]
    lines.append(
        "| choice | topology | largest fit | smallest misfit | HBM needed at fit | "
        "est. step at fit | no verdict | compiles | Pareto |"
    )
    lines.append("|" + "---|" * 9)
    for r in fit.get("searches", []):
        unknown = ", ".join(_probe_note(p) for p in r["probes"] if p["fits"] is None)
        front = {None: "-", True: "**front**", False: "dominated"}[r.get("on_front")]
        cells = [
            r["choice"],
            r.get("topology") or "-",
            "-" if r["largest_fit"] is None else str(r["largest_fit"]),
            "-" if r["smallest_misfit"] is None else str(r["smallest_misfit"]),
            human_bytes(r["hbm_bytes_needed_at_fit"]),
            human_seconds(r["est_step_s_at_fit"]),
            (unknown or "-") + (f" (stopped: {r['error']})" if r["error"] else ""),
            str(r["compiles"]) + (f", {r['reused']} reused" if r.get("reused") else ""),
            front,
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    for line in front_lines(fit.get("fronts", [])):
        lines += ["", line] if not line.startswith("  ") else [f"- {line.strip()}"]
    return lines


def report_section(sweep_dir: Path) -> list[str]:
    """:func:`report_lines` for the fit search in ``sweep_dir`` (none: no lines)."""
    from jaxaot.sweeps.progress import read_json

    fit = read_json(Path(sweep_dir) / FIT_NAME)
    return report_lines(fit) if fit and fit.get("format") == FIT_FORMAT else []


def combinations(overrides: Sequence[Any]) -> list[list[str]]:
    """Parsed sweep arguments as one list of fixed overrides per combination
    (``a=1,2 b=x`` -> ``[[a=1, b=x], [a=2, b=x]]``), as Hydra's basic sweeper expands them."""
    from jaxaot.compat.hydra import split_sweep_arguments

    batches = split_sweep_arguments(overrides, None)
    return [list(c) for batch in batches for c in batch] or [[]]


__all__ = [
    "FIT_FORMAT",
    "FIT_NAME",
    "NO_VERDICT",
    "OBJECTIVES",
    "PROBE_METRICS",
    "FitOptions",
    "Search",
    "bisect",
    "combinations",
    "front_lines",
    "fronts",
    "initial_bound",
    "linear_scan_compiles",
    "probe_figures",
    "report_lines",
    "report_section",
    "shown",
    "summary_line",
]
