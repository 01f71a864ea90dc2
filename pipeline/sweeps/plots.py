"""PNG plots for the sweep report: each swept parameter against compile time, execute time,
achieved FLOP/s and memory, the optimisation history of an autotuning search, and the jobs on
their device's roofline (``execute.roofline=true``).

One figure per varying parameter, its values on the x axis as categories (sweeps are usually
powers of two or names, where even spacing reads best). The other varying parameters become
series (grouped bars), up to ``MAX_SERIES``; beyond that each bar is the median over them.
Compiles served from the store are hatched, so a cached point is never mistaken for a fast
compile; failed points are red crosses. Uses matplotlib's object API (no pyplot state).
"""

from __future__ import annotations

import io
import math
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.sweeps.progress import short_names
from jaxaot.util.fsio import atomic_write_bytes
from jaxaot.util.humanize import human_bytes
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, FuncFormatter, MultipleLocator

if TYPE_CHECKING:
    from jaxaot.sweeps.report import SweepTable
    from matplotlib.axes import Axes

MAX_SERIES = 6
_MEMORY = (
    ("argument", "compile.argument_bytes"),
    ("output", "compile.output_bytes"),
    ("temp", "compile.temp_bytes"),
    ("code", "compile.code_bytes"),
)
_MEM_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2")
Row = dict[str, Any]


def _x_values(rows: list[Row], param: str) -> list[str]:
    """Numbers in numeric order; anything else (shapes, names) in the sweep's own order."""
    seen = list(dict.fromkeys(str(r.get(param, "")) for r in rows))
    try:
        return sorted(seen, key=float)
    except ValueError:
        return seen


def _label(value: str, width: int = 18) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"


def _series(rows: list[Row], param: str, others: list[str]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    names = short_names(others)
    for r in rows:
        name = ", ".join(f"{names[k]}={r.get(k, '')}" for k in others) or "all"
        groups.setdefault(name, []).append(r)
    if len(groups) > MAX_SERIES:
        return {f"median over {len(groups)} combinations": rows}
    return groups


def _value(rows: list[Row], x: str, param: str, get: Callable[[Row], float | None]) -> float | None:
    vals = [v for r in rows if r.get(param, "") == x and (v := get(r)) is not None]
    return statistics.median(vals) if vals else None


def _col(name: str) -> Callable[[Row], float | None]:
    return lambda r: r.get(name) if r["status"] == "ok" else None


def _bars(
    ax: Axes,
    xs: list[str],
    param: str,
    groups: dict[str, list[Row]],
    title: str,
    get: Callable[[Row], float | None],
    *,
    hatch_cached: bool = False,
    err: Callable[[Row], float | None] | None = None,
    unit: str = "",
) -> None:
    width = 0.8 / max(len(groups), 1)
    for i, (name, rows) in enumerate(groups.items()):
        pos = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(xs))]
        vals = [_value(rows, x, param, get) or 0.0 for x in xs]
        sd = [(_value(rows, x, param, err) or 0.0) if err else 0.0 for x in xs]
        errs = [[min(v, e) for v, e in zip(vals, sd, strict=True)], sd]  # clipped at zero
        hatches = [
            "//"
            if hatch_cached
            and any(r.get(param, "") == x and r.get("compile.status") == "cached" for r in rows)
            else ""
            for x in xs
        ]
        bars = ax.bar(pos, vals, width, label=name, yerr=errs if err else None, capsize=2)
        for b, h in zip(bars, hatches, strict=True):
            b.set_hatch(h)
        failed = [
            p
            for p, x in zip(pos, xs, strict=True)
            if any(r.get(param, "") == x and r["status"] != "ok" for r in rows)
        ]
        if failed:
            ax.plot(failed, [0.0] * len(failed), "x", color="red", markersize=9, mew=2)
    ax.set_title(title, fontsize=9)
    ax.yaxis.set_major_formatter(EngFormatter(unit=unit))


def _memory(ax: Axes, xs: list[str], param: str, groups: dict[str, list[Row]]) -> None:
    width = 0.8 / max(len(groups), 1)
    for i, rows in enumerate(groups.values()):
        pos = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(xs))]
        bottom = [0.0] * len(xs)
        for (name, col), color in zip(_MEMORY, _MEM_COLORS, strict=True):
            vals = [_value(rows, x, param, _col(col)) or 0.0 for x in xs]
            ax.bar(
                pos,
                vals,
                width,
                bottom=bottom,
                color=color,
                edgecolor="black",
                linewidth=0.4,
                label=name if i == 0 else None,
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    _hbm(ax, xs, param, groups, width)
    ax.set_title("memory (stacked)", fontsize=9)
    top = ax.get_ylim()[1]
    if top > 0:  # ticks on powers of two, so they read as round KiB/MiB
        ax.yaxis.set_major_locator(MultipleLocator(2 ** math.floor(math.log2(top / 4))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))


def _hbm(ax: Axes, xs: list[str], param: str, groups: dict[str, list[Row]], width: float) -> None:
    """compile.topology (issue 15): each bar's HBM per device as a dashed line, and what a job
    that does not fit needed as a red outline (it has no memory analysis to stack)."""
    labels = {"avail": "HBM per device", "need": "needed (does not fit)"}  # each shown once
    for i, rows in enumerate(groups.values()):
        pos = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(xs))]
        for p, x in zip(pos, xs, strict=True):
            avail = _value(rows, x, param, lambda r: r.get("compile.hbm_bytes_available"))
            if avail:
                ax.hlines(
                    avail,
                    p - width / 2,
                    p + width / 2,
                    colors="black",
                    linestyles="--",
                    label=labels.pop("avail", "_nolegend_"),
                )
            need = _value(
                rows,
                x,
                param,
                lambda r: (
                    r.get("compile.hbm_bytes_needed") if r["status"] == "does_not_fit" else None
                ),
            )
            if need:
                ax.bar(
                    p,
                    need,
                    width,
                    fill=False,
                    edgecolor="red",
                    hatch="xx",
                    label=labels.pop("need", "_nolegend_"),
                )


def _figure(table: SweepTable, param: str) -> Figure:
    rows = table.rows
    xs = _x_values(rows, param)
    groups = _series(rows, param, [k for k in table.varying if k != param])
    executed = any(r.get("execute.median_s") is not None for r in rows)
    panels = 4 if executed else 2
    fig = Figure(figsize=(3.4 * panels, 3.3), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    _bars(
        axes[0],
        xs,
        param,
        groups,
        "compile time (hatched: from store)",
        _col("compile.seconds"),
        hatch_cached=True,
        unit="s",
    )
    if executed:
        _bars(
            axes[1],
            xs,
            param,
            groups,
            "execute median (±sd)",
            _col("execute.median_s"),
            err=_col("execute.stddev_s"),
            unit="s",
        )
        _bars(axes[2], xs, param, groups, "achieved FLOP/s", _col("execute.flops_per_s"))
    _memory(axes[-1], xs, param, groups)
    for ax in axes:
        ax.set_xticks(
            range(len(xs)),
            [_label(x) for x in xs],
            rotation=30 if len(xs) > 3 else 0,
            ha="right" if len(xs) > 3 else "center",
            fontsize=8,
        )
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel(param, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if len(groups) > 1:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(
            handles, labels, loc="outside lower center", ncols=min(len(groups), 3), fontsize=7
        )
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"sweep over {param}", fontsize=10)
    return fig


def _history(table: SweepTable) -> Figure:
    auto = table.autotune or {}
    trials: Sequence[dict[str, Any]] = auto.get("trials", [])
    fig = Figure(figsize=(6, 3.3), layout="constrained")
    ax = fig.subplots()
    done = [(t["number"], t["value"]) for t in trials if t.get("value") is not None]
    failed = [t["number"] for t in trials if t.get("value") is None]
    if done:
        ax.plot(*zip(*done, strict=True), "o", label="trial")
        better = min if auto.get("direction", "minimize") == "minimize" else max
        best, run = [], None
        for _, v in done:
            run = v if run is None else better(run, v)
            best.append(run)
        ax.step([n for n, _ in done], best, where="post", label="best so far")
    if failed:
        ax.plot(failed, [0.0] * len(failed), "x", color="red", label="failed")
    ax.set_xlabel("trial", fontsize=8)
    ax.set_ylabel(str(auto.get("objective")), fontsize=8)
    ax.set_title(f"autotune: {auto.get('direction')} {auto.get('objective')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _roofline(table: SweepTable) -> Figure | None:
    """Each job as a point (intensity, achieved FLOP/s) under its device's roof, log-log;
    None when no job ran with execute.roofline=true."""
    points = [
        (r["execute.intensity"], r["execute.flops_per_s"], r)
        for r in table.rows
        if r.get("execute.intensity") and r.get("execute.flops_per_s")
    ]
    if not points:
        return None
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    names = short_names(table.varying)
    roofs = {(r.get("execute.peak_flops"), r.get("execute.peak_bytes_per_s")) for *_, r in points}
    lo = min(p[0] for p in points) / 4
    hi = max(p[0] for p in points) * 4
    for peak_f, peak_b in sorted((float(f), float(b)) for f, b in roofs if f and b):
        ridge = peak_f / peak_b
        xs = [lo, min(max(ridge, lo), hi), hi]
        ax.plot(xs, [min(peak_f, x * peak_b) for x in xs], "-", color="0.3", lw=1)
        ax.annotate("roof (calibrated)", (xs[-1], peak_f), fontsize=7, ha="right", va="bottom")
    for intensity, flops, r in points:
        ax.plot([intensity], [flops], "o", color="#4C72B0")
        label = ", ".join(f"{names[k]}={r.get(k)}" for k in table.varying) or str(r["job"])
        ax.annotate(
            _label(label, 28),
            (intensity, flops),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte accessed)", fontsize=8)
    ax.set_ylabel("achieved FLOP/s", fontsize=8)
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.set_title("roofline (execute.roofline=true)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    return fig


def _file_name(param: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", param).strip("_") or "param"


def write_plots(table: SweepTable, out_dir: Path) -> list[Path]:
    """Write one PNG per varying parameter (and the autotune history); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [(_file_name(p), _figure(table, p)) for p in table.varying]
    if table.autotune and table.autotune.get("pareto") is None:  # one objective: its history
        figures.append(("autotune_history", _history(table)))
    if (roof := _roofline(table)) is not None:
        figures.append(("roofline", roof))
    paths = []
    for name, fig in figures:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        paths.append(out_dir / f"{name}.png")
        atomic_write_bytes(paths[-1], buf.getvalue())
    return paths


__all__ = ["MAX_SERIES", "write_plots"]
