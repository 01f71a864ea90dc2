"""PNG plots for the sweep report: each swept parameter against compile time, execute time,
achieved FLOP/s and memory, the optimisation history of an autotuning search, the jobs on
their device's roofline (``execute.roofline=true``), and a fit search's probes and Pareto front.

One figure per varying parameter, its values on the x axis as categories (sweeps are usually
powers of two or names, where even spacing reads best), in the order of the numbers in them
(``bf16[1024,...]`` before ``bf16[16384,...]``); what all values share is said once, in the
axis label, and the ticks show what differs. The other varying parameters become
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

from jaxaot.sweeps.progress import read_json, short_names
from jaxaot.util.fsio import atomic_write_bytes
from jaxaot.util.humanize import human_bytes
from matplotlib import style
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


_CHUNKS = re.compile(r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def _natural(value: str) -> tuple[tuple[int, float, str], ...]:
    """A sort key that orders the numbers inside values by size: ``f32[8,256]`` before
    ``f32[16,256]``, ``2.5`` before ``10``, names by their text."""
    parts = _CHUNKS.split(value)
    return tuple(
        (0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts) if p != ""
    )


def _x_values(rows: list[Row], param: str) -> list[str]:
    """The parameter's values in the order of the numbers in them (then by text)."""
    seen = dict.fromkeys(str(r.get(param, "")) for r in rows)
    return sorted(seen, key=_natural)


def _boundary(text: str, at: int, *, end: bool) -> int:
    """The nearest cut at or inside ``at`` that falls next to a separator (not mid-number)."""
    while 0 < at < len(text) and (text[at - 1].isalnum() and text[at].isalnum()):
        at += -1 if end else 1
    return at


def _common_prefix(values: Sequence[str]) -> int:
    """How many leading characters all ``values`` share."""
    first, last = min(values), max(values)  # the extremes bound every other value's prefix
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return n


def compact(values: Sequence[str]) -> tuple[list[str], str]:
    """Tick labels and what they share: ``['bf16[1024,1048576]', 'bf16[2048,1048576]']`` ->
    ``(['1024', '2048'], 'bf16[·,1048576]')``; the values themselves (and "") when they share
    nothing worth saying or differ in more than one place."""
    if len(values) < 2:
        return list(values), ""
    head = _common_prefix(values)
    tail = _common_prefix([v[::-1] for v in values])
    shortest = min(len(v) for v in values)
    tail = min(tail, shortest - head)
    head = min(_boundary(v, head, end=True) for v in values)
    tail = min(len(v) - _boundary(v, len(v) - tail, end=False) for v in values)
    if head + tail < 4:
        return list(values), ""
    cut = [v[head : len(v) - tail] for v in values]
    if any(not c for c in cut):
        return list(values), ""
    v0 = values[0]
    return cut, f"{v0[:head]}·{v0[len(v0) - tail :]}"


def _label(value: str, width: int = 18) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"


def _ticks(ax: Axes, labels: Sequence[str]) -> None:
    """Category ticks that do not overlap: upright when short and few, else slanted and
    smaller, with long ones shortened."""
    longest = max((len(t) for t in labels), default=0)
    upright = len(labels) <= 3 or longest * len(labels) <= 40
    ax.set_xticks(
        range(len(labels)),
        [_label(t) for t in labels],
        rotation=0 if upright else 45 if longest > 4 else 30,
        ha="center" if upright else "right",
        rotation_mode="anchor",
        fontsize=8 if len(labels) <= 8 else 7,
    )


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
    """compile.topology: each bar's HBM per device as a dashed line, and what a job
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
    width = max(3.4, 0.3 * len(xs) * max(len(groups), 1))  # room for every bar's tick
    fig = Figure(figsize=(width * panels, 3.3), layout="constrained")
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
    ticks, shared = compact(xs)
    for ax in axes:
        _ticks(ax, ticks)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel(f"{param} = {shared}" if shared else param, fontsize=8)
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
        # Each trial's noise band (its timings' interquartile range) as an error bar.
        bands = [
            t.get("band") or (t["value"], t["value"]) for t in trials if t.get("value") is not None
        ]
        errors = [
            [max(v - b[0], 0.0) for (_, v), b in zip(done, bands, strict=True)],
            [max(b[1] - v, 0.0) for (_, v), b in zip(done, bands, strict=True)],
        ]
        xs, ys = [n for n, _ in done], [v for _, v in done]
        ax.errorbar(xs, ys, yerr=errors, fmt="o", capsize=2, label="trial")
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


_STATUS_COLORS = {"fits": "#55A868", "does_not_fit": "#C44E52"}
_NO_VERDICT_COLOR = "0.6"


def _fit_panel(ax: Axes, search: dict[str, Any]) -> None:
    """One search's probes by value: each bar the HBM it needed, green fits, red does not;
    a value without a verdict (crashed, timed out, failed) a grey cross named by its status."""
    probes = sorted(search.get("probes", []), key=lambda p: p["n"])
    xs = list(range(len(probes)))
    for x, p in zip(xs, probes, strict=True):
        need = p.get("hbm_bytes_needed")
        if p["fits"] is None:
            ax.plot([x], [0.0], "x", color="red", markersize=9, mew=2)
            ax.annotate(
                p["status"].replace("_", " "),
                (x, 0.0),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                rotation=90,
                color=_NO_VERDICT_COLOR,
            )
            continue
        ax.bar(x, need or 0.0, 0.7, color=_STATUS_COLORS[p["status"]], edgecolor="black", lw=0.4)
    avail = next((p["hbm_bytes_available"] for p in probes if p.get("hbm_bytes_available")), None)
    if avail:
        ax.axhline(avail, color="black", linestyle="--", lw=1)
    labels = [str(p["n"]) for p in probes]
    if labels:
        _ticks(ax, labels)
    ax.set_xlabel("n (probes in order of n)", fontsize=8)
    boundary = search.get("largest_fit")
    title = search.get("label") or "all jobs"
    ax.set_title(
        f"{_label(title, 40)}\nlargest fit: {boundary if boundary else 'none'} "
        "(green fits, red does not)",
        fontsize=8,
    )
    top = ax.get_ylim()[1]
    if top > 0:
        ax.yaxis.set_major_locator(MultipleLocator(2 ** math.floor(math.log2(top / 4))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", alpha=0.3)


def _fit_figure(fit: dict[str, Any]) -> Figure | None:
    """A fit search's probes, one panel per search (the dashed line: HBM per device)."""
    searches = [s for s in fit.get("searches", []) if s.get("probes")]
    if not searches:
        return None
    cols = min(len(searches), 3)
    rows = math.ceil(len(searches) / cols)
    widest = max(len(s["probes"]) for s in searches)
    fig = Figure(figsize=(max(4.8, 0.5 * widest) * cols, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, search in zip(axes, searches, strict=False):
        _fit_panel(ax, search)
    for ax in axes[len(searches) :]:
        ax.set_visible(False)
    fig.suptitle("fit search: HBM needed per probe", fontsize=10)
    return fig


def _pareto_figure(fit: dict[str, Any]) -> Figure | None:
    """Per topology with two or more choices: each choice at its largest fit (x) and its
    estimated step per unit of n (y, the front's time objective, ``est_s_per_n``); the Pareto
    front filled and joined, dominated choices hollow."""
    found = [f for f in fit.get("fronts", []) if len(f.get("points", [])) >= 2]
    if not found:
        return None
    fig = Figure(figsize=(5.5 * len(found), 4), layout="constrained")
    axes = fig.subplots(1, len(found), squeeze=False)[0]
    for ax, front in zip(axes, found, strict=True):
        points = [p for p in front["points"] if p.get("est_s_per_n") is not None]
        on = sorted((p for p in points if p["on_front"]), key=lambda p: p["largest_fit"])
        if on:
            ax.plot(
                [p["largest_fit"] for p in on],
                [p["est_s_per_n"] for p in on],
                "-o",
                color="#4C72B0",
                label="Pareto front",
            )
        off = [p for p in points if not p["on_front"]]
        if off:
            ax.plot(
                [p["largest_fit"] for p in off],
                [p["est_s_per_n"] for p in off],
                "o",
                mfc="none",
                color="0.5",
                label="dominated",
            )
        for p in points:
            ax.annotate(
                f"{_label(p['choice'], 28)}\n{human_bytes(p['hbm_bytes_needed'])}",
                (p["largest_fit"], p["est_s_per_n"]),
                xytext=(4, 4),
                textcoords="offset points",
                fontsize=6,
            )
        ax.set_xlabel("largest n that fits", fontsize=8)
        ax.set_ylabel("estimated step per n (roofline)", fontsize=8)
        ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
        ax.set_title(f"{front['topology']}: choices at their largest fit", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def _file_name(param: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", param).strip("_") or "param"


def write_plots(table: SweepTable, out_dir: Path) -> list[Path]:
    """Write one PNG per varying parameter (and the autotune history); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Figures read rcParams when built and when drawn: both happen under matplotlib's default
    # style, whatever another library (Optuna's views: ggplot) or the user set globally.
    with style.context("default"):
        figures = [(_file_name(p), _figure(table, p)) for p in table.varying]
        if table.autotune and table.autotune.get("pareto") is None:  # one objective: history
            figures.append(("autotune_history", _history(table)))
        if (roof := _roofline(table)) is not None:
            figures.append(("roofline", roof))
        fit = read_json(table.sweep_dir / "fit.json")
        if fit:
            if (probes := _fit_figure(fit)) is not None:
                figures.append(("fit_search", probes))
            if (front := _pareto_figure(fit)) is not None:
                figures.append(("fit_pareto", front))
        paths = []
        for name, fig in figures:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=90)
            paths.append(out_dir / f"{name}.png")
            atomic_write_bytes(paths[-1], buf.getvalue())
    return paths


__all__ = ["MAX_SERIES", "compact", "write_plots"]
