"""The sweep report: ``sweep.csv``, ``sweep.md`` and plots, one row per job, from the sweep dir.

The report is built from what the jobs left on disk (``manifest.json``, ``job.json`` and Hydra's
``.hydra/overrides.yaml``), never from memory, so it is the same whichever launcher ran the jobs,
and ``jaxaot-report <sweep dir>`` rebuilds it after a sweep that was interrupted.
CSV cells hold the manifests' raw numbers; the Markdown table holds them in human units.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import (
    OBJECTIVE_BY_NAME,
    REPORT_METRICS,
    TOPOLOGY_METRICS,
    RunMetrics,
)
from jaxaot.stages.fit_verdict import pair_figures
from jaxaot.sweeps.overrides import short_value
from jaxaot.sweeps.progress import (
    JOB_NAME,
    STATE_DIR,
    SweepPlan,
    human_value,
    override_key,
    override_value,
    read_json,
    short_names,
)
from jaxaot.util.fsio import atomic_write_text
from jaxaot.util.humanize import NOT_AVAILABLE, human_bytes, human_count, human_seconds

log = logging.getLogger("jaxaot")

CSV_NAME = "sweep.csv"
EFFORT_HEADS = {
    "compile.optimization_level": "opt. level",
    "compile.memory_fitting_level": "mem. fit level",
}
MD_NAME = "sweep.md"
PLOTS_DIR = "plots"
AUTOTUNE_NAME = "autotune.json"

# Each stage's report figures, as <stage>.<metric> columns (jaxaot.rundir.metrics lists them
# with their units): column name -> (stage, metric).
METRICS: dict[str, tuple[str, str]] = {m.column: (m.stage, m.name) for m in REPORT_METRICS}
# compile.topology's verdict (jaxaot.stages.fit_verdict): columns only in sweeps that have a
# topology job. Device memory (less the reserve) and host memory, apart.
TOPOLOGY_COLUMNS: dict[str, tuple[str, str]] = {
    m.column: (m.stage, m.name) for m in TOPOLOGY_METRICS
}
# XLA's effort levels each job compiled at (its config, not a metric): columns only in sweeps
# where a job sets one.
EFFORT_COLUMNS: tuple[str, ...] = ("compile.optimization_level", "compile.memory_fitting_level")
STAGE_COLUMNS: tuple[str, ...] = tuple(f"{s}.{f}" for s in STAGES for f in ("status", "seconds"))
# SLURM jobs (jaxaot's SLURM launcher): job id, state, where the state was read (squeue, sacct,
# submitit's result file) and how often the job was requeued (resuming from its last stage).
SLURM_COLUMNS: tuple[str, ...] = ("slurm_job", "slurm_state", "slurm_state_source", "requeued")
# Every numeric column an autotuning objective may name (jaxaot.rundir.metrics.objective).
NUMERIC_COLUMNS: tuple[str, ...] = tuple(OBJECTIVE_BY_NAME)
# A job whose program does not fit its topology is a result, not a failure: its manifest's
# status is does_not_fit and it is counted apart.
RESULT_STATUSES: tuple[str, ...] = ("ok", "does_not_fit")


@dataclass
class SweepTable:
    """All rows of a sweep, the override keys that vary, and the best trial of a search."""

    sweep_dir: Path
    rows: list[dict[str, Any]]
    varying: list[str]
    fixed: list[str]
    autotune: dict[str, Any] | None = None
    plots: list[Path] = field(default_factory=list)
    plot_note: str | None = None

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] not in RESULT_STATUSES]

    @property
    def does_not_fit(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "does_not_fit"]

    @property
    def topology(self) -> bool:
        """Whether any job compiled for a ``compile.topology`` (its verdict columns show)."""
        return any(r.get("compile.fits") is not None for r in self.rows)

    @property
    def effort(self) -> list[str]:
        """The effort-level columns some job sets (not those a varying override already shows)."""
        return [
            c
            for c in EFFORT_COLUMNS
            if c not in self.varying and any(r.get(c) is not None for r in self.rows)
        ]

    @property
    def host(self) -> bool:
        """Whether a job holds host memory (its host figures show in the Markdown table)."""
        return any(r.get("compile.host_bytes_needed") for r in self.rows)

    @property
    def peaks(self) -> bool:
        """Whether a job has the buffers live at its peak (compile.peak_top)."""
        return any(r.get("compile.peak_top") for r in self.rows)

    @property
    def slurm(self) -> bool:
        """Whether the jobs ran as SLURM jobs (their records carry a job id and state)."""
        return any(r.get("slurm_job") for r in self.rows)

    @property
    def profiled(self) -> bool:
        """Whether a job ran with execute.profile=true (its top op is a column then)."""
        return any(r.get("execute.profile_top_op") for r in self.rows)

    @property
    def columns(self) -> list[str]:
        best = ["best"] if self.autotune else []
        if self.autotune and self.autotune.get("pareto") is not None:
            best = ["pareto"]  # a multi-objective study has a front, not one best trial
        topo = list(TOPOLOGY_COLUMNS) if self.topology else []
        slurm = list(SLURM_COLUMNS) if self.slurm else []
        return [
            "job",
            *self.varying,
            *self.effort,
            "status",
            *best,
            *STAGE_COLUMNS,
            *METRICS,
            *topo,
            *slurm,
            "error",
            "warnings",
            "dir",
        ]


def row_of(manifest: dict[str, Any] | None) -> dict[str, Any]:
    """The stage and metric columns of one job's manifest (missing values are None)."""
    run = RunMetrics.from_manifest(manifest)
    row: dict[str, Any] = {}
    for s in STAGES:
        row[f"{s}.status"] = run.run(s).status
        row[f"{s}.seconds"] = run.run(s).seconds
    for m in (*REPORT_METRICS, *TOPOLOGY_METRICS):
        # XLA's "unknown" sentinels (flops: -2) are no figure: never a best value to autotune.
        row[m.column] = run.figure(m)
    config = (manifest or {}).get("config")
    comp = config.get("compile") if isinstance(config, dict) else None
    for col in EFFORT_COLUMNS:
        row[col] = comp.get(col.split(".", 1)[1]) if isinstance(comp, dict) else None
    return row


def _overrides_of(job_dir: Path, record: dict[str, Any] | None) -> list[str]:
    if record and record.get("overrides") is not None:
        return [str(o) for o in record["overrides"]]
    path = job_dir / ".hydra" / "overrides.yaml"
    try:
        import yaml

        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, ImportError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every job folder under the sweep dir: one holding a job record or a run manifest."""
    found = {p.parent for name in (JOB_NAME, MANIFEST_NAME) for p in sweep_dir.rglob(name)}
    jobs = [d for d in found if STATE_DIR not in d.relative_to(sweep_dir).parts]
    # Natural order (job 2 before job 10) for jobs without a record of their number.
    return sorted(
        jobs,
        key=lambda d: [
            (0, int(p), "") if p.isdigit() else (1, 0, p) for p in d.relative_to(sweep_dir).parts
        ],
    )


def _status(record: dict[str, Any] | None, manifest: dict[str, Any] | None) -> str:
    if record:
        return str(record.get("status", "failed"))
    if manifest and manifest.get("status") in ("ok", "failed", "interrupted", "does_not_fit"):
        return str(manifest["status"])
    return "incomplete"  # started, never finished: killed or still running


def collect(sweep_dir: Path | str) -> SweepTable:
    """Read every job of a sweep into rows, ordered by Hydra job number."""
    root = Path(sweep_dir)
    plan = SweepPlan.read(root)
    rows, all_overrides = [], []
    for i, d in enumerate(job_dirs(root)):
        record, manifest = read_json(d / JOB_NAME), read_json(d / MANIFEST_NAME)
        overrides = _overrides_of(d, record)
        all_overrides.append(overrides)
        status = _status(record, manifest)
        error = (record or {}).get("error") or (manifest or {}).get("error")
        if status == "incomplete" and not error:
            error = "job did not finish (killed, or still running)"
        num = (record or {}).get("num")
        row = {"job": num if num is not None else i, "status": status}
        row.update({override_key(o): override_value(o) for o in overrides})
        row.update(row_of(manifest))
        slurm = (record or {}).get("slurm") or {}
        if slurm:
            row.update(
                slurm_job=slurm.get("job_id"),
                slurm_state=slurm.get("state"),
                slurm_state_source=slurm.get("source"),
                requeued=(manifest or {}).get("requeued", 0),
            )
        warned = (manifest or {}).get("warnings") or []  # ["stage: message", ...]
        warned = [warned] if isinstance(warned, str) else warned
        warned = [str(w) for w in warned] if isinstance(warned, list) else []
        row.update(error=error, warnings=warned, dir=str(d.relative_to(root)))
        rows.append(row)
    rows.sort(key=lambda r: (r["job"], r["dir"]))
    varying = _varying(all_overrides, plan.varying)
    fixed = list(
        dict.fromkeys(
            f"{override_key(o)}={override_value(o)}"
            for ovs in all_overrides
            for o in ovs
            if override_key(o) not in varying
        )
    )
    autotune = read_json(root / AUTOTUNE_NAME)
    if autotune:
        best = (autotune.get("best") or {}).get("job")
        front = {t.get("job") for t in autotune.get("pareto") or []}
        for r in rows:
            r["best"] = r["job"] == best
            if autotune.get("pareto") is not None:
                r["pareto"] = r["job"] in front
    return SweepTable(sweep_dir=root, rows=rows, varying=varying, fixed=fixed, autotune=autotune)


def _varying(all_overrides: list[list[str]], planned: Sequence[str]) -> list[str]:
    """Keys the sweep was asked to vary, then any other key whose value differs between jobs."""
    order: list[str] = []
    values: dict[str, set[str]] = {}
    for ovs in all_overrides:
        for o in ovs:
            k = override_key(o)
            if k not in values:
                order.append(k)
                values[k] = set()
            values[k].add(override_value(o))
    differs = {k for k, v in values.items() if len(v) > 1}
    differs |= {
        k for k in values if any(k not in {override_key(o) for o in ovs} for ovs in all_overrides)
    }
    return [k for k in order if k in planned or k in differs]


def to_csv(table: SweepTable) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    cols = table.columns
    writer.writerow(cols)
    for r in table.rows:
        writer.writerow([_csv_cell(r.get(c)) for c in cols])
    return buf.getvalue()


def _csv_cell(value: Any) -> Any:
    """None as empty; a list (a job's warnings) as its items joined by "; "."""
    if value is None:
        return ""
    return "; ".join(str(v) for v in value) if isinstance(value, list) else value


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def stage_cell(r: dict[str, Any], s: str) -> str:
    if r.get(f"{s}.status") is None:
        return "-"
    return f"{r[f'{s}.status']} {human_seconds(r.get(f'{s}.seconds'))}"


def metric_cell(r: dict[str, Any], col: str, fmt: Any) -> str:
    """A figure; "n/a" where its stage ran but gave none (or XLA's unknown sentinel)."""
    if r.get(col) is None and r.get(f"{col.split('.', 1)[0]}.status") in (
        "ran",
        "cached",
        "resumed",
    ):
        return NOT_AVAILABLE
    return str(fmt(r.get(col)))


def memory_pair(need: Any, have: Any) -> tuple[str, str]:
    """Needed and available, printed so that they compare as the bytes do (the verdict's)."""
    if need is None or have is None or have <= 0:
        return human_bytes(need), human_bytes(have)
    return pair_figures(need, have)


def _topology_cells(r: dict[str, Any], host: bool) -> list[str]:
    fits = r.get("compile.fits")
    coll = r.get("compile.collectives")
    need, have = memory_pair(
        r.get("compile.hbm_bytes_needed"), r.get("compile.hbm_bytes_available")
    )
    reserve = r.get("compile.hbm_reserve_bytes")
    if reserve:
        have += f" ({human_bytes(reserve)} reserved)"
    verdict = "-" if fits is None else ("yes" if fits else "**no**")
    if fits is False and r.get("compile.host_fits") is False:  # which memory did not fit
        verdict += " (HBM and host)" if r.get("compile.hbm_fits") is False else " (host)"
    cells = [r.get("compile.topology") or "-", verdict, need, have]
    if host:
        host_need, host_have = memory_pair(
            r.get("compile.host_bytes_needed"), r.get("compile.host_bytes_available")
        )
        cells.append(f"{host_need} of {host_have}" if r.get("compile.host_bytes_needed") else "-")
    return [
        *cells,
        human_seconds(r.get("compile.est_step_s")),
        "-" if coll is None else f"{coll} ({human_bytes(r.get('compile.collective_bytes'))})",
    ]


def peak_cell(r: dict[str, Any]) -> str:
    top, peak = r.get("compile.peak_top"), r.get("compile.peak_bytes")
    if not top:
        return "-"
    if peak is None or r.get("compile.fits") is not None:
        return top  # beside a verdict: XLA's peak counts on-chip and host memory too
    return f"{human_bytes(peak)}: {top}"


def profile_cell(r: dict[str, Any]) -> str:
    op, share = r.get("execute.profile_top_op"), r.get("execute.profile_top_share")
    return f"{op} ({share:.0%})" if op and share is not None else ""


def slurm_cell(r: dict[str, Any]) -> str:
    """``12_3 COMPLETED, requeued 1x``: the SLURM job, its state and its requeues."""
    if not r.get("slurm_job"):
        return "-"
    text = f"{r['slurm_job']} {r.get('slurm_state') or '?'}"
    return text + (f", requeued {r['requeued']}x" if r.get("requeued") else "")


def _shown(override: str) -> str:
    """An unescaped ``key=value`` with a long value shortened (sweep.csv keeps it whole)."""
    key, sep, value = override.partition("=")
    return key + sep + short_value(value)


def summary_lines(table: SweepTable) -> list[str]:
    """The report's opening lines (Markdown): the jobs by status, the fixed overrides, the best
    trial or Pareto front of a search."""
    n_ok = len(table.rows) - len(table.failed) - len(table.does_not_fit)
    lines: list[str] = []
    misfits = f", {len(table.does_not_fit)} do not fit" if table.does_not_fit else ""
    lines.append(f"{len(table.rows)} jobs: {n_ok} ok{misfits}, {len(table.failed)} failed.")
    if table.fixed:
        lines.append(f"Fixed overrides: `{' '.join(_shown(o) for o in table.fixed)}`.")
    best = (table.autotune or {}).get("best")
    if table.autotune and table.autotune.get("pareto") is not None:
        targets = ", ".join(
            f"{d} `{o}`"
            for o, d in zip(table.autotune["objectives"], table.autotune["directions"], strict=True)
        )
        jobs = ", ".join(
            str(t["job"]) if t.get("job") is not None else "one of an earlier sweep"
            for t in table.autotune["pareto"]
        )
        drawn = any(
            str(v).startswith(f"{PLOTS_DIR}/") for v in (table.autotune.get("views") or {}).values()
        )
        views = f"; Optuna's views are in {PLOTS_DIR}/." if drawn else "."
        lines.append(
            f"Pareto front ({targets}): jobs {jobs or 'none'} (marked **pareto** below){views}"
        )
    elif table.autotune:
        obj, direction = table.autotune.get("objective"), table.autotune.get("direction")
        if best:
            where = (
                f"job {best['job']}"
                if best.get("job") is not None
                else "an earlier sweep of this study"
            )
            mark = " (marked **best** below)" if best.get("job") is not None else ""
            tied = ", ".join(str(j) for j in best.get("tied_with") or [])
            lines.append(
                f"Best trial ({direction} `{obj}`): {where}, value "
                f"{human_value(str(obj), best['value'])}: "
                f"`{' '.join(_shown(o) for o in best.get('overrides', []))}`{mark}."
                + (
                    f" Tied with job(s) {tied} (within the measured noise): no clear winner."
                    if tied
                    else ""
                )
            )
        else:
            lines.append(f"No trial produced `{obj}`.")
    return lines


def to_markdown(table: SweepTable) -> str:
    names = short_names(table.varying)
    topology, slurm, profiled = table.topology, table.slurm, table.profiled  # each scans every row
    effort, host, peaks = table.effort, table.host, table.peaks
    lines = [f"# Sweep report: {table.sweep_dir}", "", *summary_lines(table), ""]
    head = [
        "job",
        *(names[k] for k in table.varying),
        *(EFFORT_HEADS[c] for c in effort),
        "status",
        *(s for s in STAGES),
        "FLOPs",
        "bytes accessed",
        "arg",
        "out",
        "temp",
        "code",
        "exec median",
        "FLOP/s",
        *(("target", "fits", "HBM needed", "HBM available") if topology else ()),
        *(("host memory needed of available",) if topology and host else ()),
        *(("est. step (roofline)", "collectives") if topology else ()),
        *(["peak: live buffers"] if peaks else []),
        *(["top op (share of op time)"] if profiled else []),
        *(["SLURM"] if slurm else []),
        "error",
    ]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in table.rows:
        status = f"**{r['status']}**" if r["status"] != "ok" else "ok"
        if r.get("warnings"):
            n = len(r["warnings"])
            status += f", {n} warning{'s' if n > 1 else ''}"
        if r.get("best"):
            status += " **best**"
        if r.get("pareto"):
            status += " **pareto**"
        cells = [
            r["job"],
            *(short_value(str(r.get(k, ""))) for k in table.varying),
            *(r.get(c) or "-" for c in effort),
            status,
            *(stage_cell(r, s) for s in STAGES),
            *(
                metric_cell(r, c, human_count if c.endswith("flops") else human_bytes)
                for c in (
                    "compile.flops",
                    "compile.bytes_accessed",
                    "compile.argument_bytes",
                    "compile.output_bytes",
                    "compile.temp_bytes",
                    "compile.code_bytes",
                )
            ),
            metric_cell(r, "execute.median_s", human_seconds),
            metric_cell(r, "execute.flops_per_s", human_count),
            *(_topology_cells(r, host) if topology else ()),
            *([peak_cell(r)] if peaks else []),
            *([profile_cell(r)] if profiled else []),
            *([slurm_cell(r)] if slurm else []),
            (r.get("error") or "")[:160],
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    warned = [r for r in table.rows if r.get("warnings")]
    if warned:  # in full: a progress line shows the first, shortened
        lines += ["", "## Warnings", ""]
        lines += [f"- job {r['job']}: {w}" for r in warned for w in r["warnings"]]
    if names:
        lines += ["", "Columns: " + ", ".join(f"`{v}` = `{k}`" for k, v in names.items()) + "."]
    from jaxaot.sweeps.fit_search import report_section

    fit = report_section(table.sweep_dir)  # a fit search's boundaries and fronts (fit.json)
    if fit:
        lines += ["", *fit]
    if table.plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(table.sweep_dir).as_posix()})" for p in table.plots]
    if table.plot_note:
        lines += ["", table.plot_note]
    return "\n".join(lines) + "\n"


def write_report(sweep_dir: Path | str, *, plots: bool = True) -> SweepTable:
    """Write ``sweep.csv``, ``sweep.md`` and (with matplotlib) ``plots/*.png``."""
    table = collect(sweep_dir)
    if plots and table.rows:
        try:
            from jaxaot.sweeps.plots import write_plots
        except ImportError as exc:
            table.plot_note = (
                f"Plots skipped: {(exc.name or 'matplotlib').split('.')[0]} is not installed "
                "(pip install 'jaxaot[sweep]')."
            )
            log.warning(table.plot_note)
        else:
            table.plots = write_plots(table, table.sweep_dir / PLOTS_DIR)
    atomic_write_text(table.sweep_dir / CSV_NAME, to_csv(table))
    atomic_write_text(table.sweep_dir / MD_NAME, to_markdown(table))
    return table


__all__ = [
    "AUTOTUNE_NAME",
    "CSV_NAME",
    "EFFORT_COLUMNS",
    "MD_NAME",
    "METRICS",
    "NUMERIC_COLUMNS",
    "PLOTS_DIR",
    "SLURM_COLUMNS",
    "STAGE_COLUMNS",
    "TOPOLOGY_COLUMNS",
    "SweepTable",
    "collect",
    "job_dirs",
    "memory_pair",
    "metric_cell",
    "peak_cell",
    "profile_cell",
    "row_of",
    "slurm_cell",
    "stage_cell",
    "summary_lines",
    "to_csv",
    "to_markdown",
    "write_report",
]
