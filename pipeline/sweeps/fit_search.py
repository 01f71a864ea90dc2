"""Fit search (issue 15): the largest value of an integer override that still fits a topology.

``hydra/sweeper=jaxaot_fit`` (hydra_plugins/jaxaot_fit_sweeper) launches one compile per probe
and bisects on the verdict: a job that exits 0 fits, one that exits with
:data:`jaxaot.errors.EXIT_DOES_NOT_FIT` does not; any other failure stops that search (it is
no verdict). Fitting is assumed monotone in the value (more batch never needs less memory),
which is what makes bisection sound; ``fit.json`` in the sweep dir records every probe, so a
non-monotone case is visible.

Overrides carry the value through a ``{n}`` placeholder, so one value can set several keys::

    hydra.sweeper.overrides=['program.args.1=i32[{n},2048]','program.args.2=i32[{n},2048]']

and the other sweep arguments (``compile.topology=v5e-256,v6e-256``) give one search each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.errors import ConfigError

log = logging.getLogger("jaxaot")

FIT_NAME = "fit.json"


@dataclass(frozen=True)
class FitOptions:
    """``hydra.sweeper.*`` of the fit sweeper."""

    overrides: list[str] = field(default_factory=list)  # each with a {n} placeholder
    low: int = 1  # smallest value tried; must fit for a boundary to exist
    high: int = 1024  # largest value tried
    multiple: int = 1  # values are multiples of this (divisibility by a mesh axis)

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

    def with_value(self, n: int) -> list[str]:
        """The overrides for value ``n``, array types quoted for Hydra as on the command line."""
        from jaxaot.config.argspec import quote_array_types

        return [quote_array_types(o.replace("{n}", str(n))) for o in self.overrides]


@dataclass
class Search:
    """One bisection: the probes so far and, when done, the boundary."""

    fixed: list[str]
    label: str = ""  # the overrides that tell this search from the others
    probes: list[dict[str, Any]] = field(default_factory=list)
    largest_fit: int | None = None
    smallest_misfit: int | None = None
    error: str | None = None

    def to_json(self, opts: FitOptions) -> dict[str, Any]:
        at = next((p for p in self.probes if p["n"] == self.largest_fit), None)
        return {
            "fixed": self.fixed,
            "label": self.label,
            "largest_fit": self.largest_fit,
            "smallest_misfit": self.smallest_misfit,
            "hbm_bytes_needed_at_fit": (at or {}).get("hbm_bytes_needed"),
            "hbm_bytes_available": (at or {}).get("hbm_bytes_available"),
            "compiles": len(self.probes),
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


def bisect(opts: FitOptions, probe: Callable[[int], bool | None], search: Search) -> Search:
    """Fill ``search`` by probing values; ``probe(n)`` is True (fits), False (does not) or None
    (no verdict: the search stops, with ``search.error`` set by the caller's probe)."""
    lo, hi = opts.low // opts.multiple, opts.high // opts.multiple  # in units of `multiple`
    first = probe(lo * opts.multiple)
    if first is None:
        return search
    if not first:
        search.smallest_misfit = lo * opts.multiple
        return search
    top = probe(hi * opts.multiple) if hi != lo else True
    if top is None:
        return search
    if top:
        search.largest_fit = hi * opts.multiple
        return search
    # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        verdict = probe(mid * opts.multiple)
        if verdict is None:
            return search
        lo, hi = (mid, hi) if verdict else (lo, mid)
    search.largest_fit, search.smallest_misfit = lo * opts.multiple, hi * opts.multiple
    return search


def summary_line(result: dict[str, Any]) -> str:
    """One line per search for the log: boundary, memory at it, compiles vs a linear scan."""
    from jaxaot.util.humanize import human_bytes

    where = result.get("label") or "all jobs"
    if result["error"]:
        return f"fit search [{where}]: stopped: {result['error']}"
    if result["largest_fit"] is None:
        return f"fit search [{where}]: nothing fits, not even n={result['smallest_misfit']}"
    misfit = result["smallest_misfit"]
    bound = f"n={result['largest_fit']} fits" + (
        f", n={misfit} does not" if misfit else " (the whole range fits)"
    )
    return (
        f"fit search [{where}]: {bound}; {human_bytes(result['hbm_bytes_needed_at_fit'])} of "
        f"{human_bytes(result['hbm_bytes_available'])} per device at the boundary; "
        f"{result['compiles']} compiles (a linear scan: {result['linear_scan_compiles']})"
    )


def combinations(overrides: Sequence[Any]) -> list[list[str]]:
    """Parsed sweep arguments as one list of fixed overrides per combination
    (``a=1,2 b=x`` -> ``[[a=1, b=x], [a=2, b=x]]``), as Hydra's basic sweeper expands them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    batches = BasicSweeper.split_arguments(list(overrides), None)
    return [list(c) for batch in batches for c in batch] or [[]]


__all__ = [
    "FIT_NAME",
    "FitOptions",
    "Search",
    "bisect",
    "combinations",
    "linear_scan_compiles",
    "summary_line",
]
