"""The HTML report (``jaxaot-report --html``): ``report.html``, one self-contained page that a
browser opens from disk, for a sweep dir or a run dir.

A sweep's page holds what ``sweep.md`` says (its opening lines, its table with every column
sortable by a click, its warnings and fit search), the plots inline, each job's memory as a
bar, and links to every file; each job with a manifest gets a page of its own in its folder
(:mod:`jaxaot.sweeps.html_run`: its stages, memory breakdown at the peak and HLO graph),
linked from its row. A run dir's page is that page alone. Everything is read from disk, so
the pages are the same whichever launcher ran the jobs.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.sweeps.fit_search import report_section
from jaxaot.sweeps.html_page import (
    Cell,
    data_uri,
    document,
    esc,
    href,
    legend,
    link,
    markdown_block,
    stacked_bar,
    table,
)
from jaxaot.sweeps.html_run import (
    HTML_NAME,
    files_section,
    read_manifest,
    run_files,
    run_page,
    sweep_of,
)
from jaxaot.sweeps.progress import SweepPlan, short_names
from jaxaot.sweeps.report import (
    PLOTS_DIR,
    SweepTable,
    memory_pair,
    metric_cell,
    peak_cell,
    profile_cell,
    slurm_cell,
    stage_cell,
    summary_lines,
)
from jaxaot.util.fsio import atomic_write_text
from jaxaot.util.humanize import (
    human_bytes,
    human_count,
    human_seconds,
    json_number,
    signed_bytes,
)

_FIGURES = (
    ("FLOPs", "compile.flops", human_count),
    ("bytes accessed", "compile.bytes_accessed", human_bytes),
    ("arg", "compile.argument_bytes", human_bytes),
    ("out", "compile.output_bytes", human_bytes),
    ("temp", "compile.temp_bytes", human_bytes),
    ("code", "compile.code_bytes", human_bytes),
    ("exec median", "execute.median_s", human_seconds),
    ("FLOP/s", "execute.flops_per_s", human_count),
)
_MEMORY = (
    ("argument", "compile.argument_bytes"),
    ("output", "compile.output_bytes"),
    ("temp", "compile.temp_bytes"),
    ("code", "compile.code_bytes"),
)


def _sort(value: Any) -> float | int | str:
    """A cell's sort key: its number, else "" (no figure: last, whichever the direction)."""
    n = json_number(value)
    return "" if n is None else n


def _written(table_: SweepTable) -> str:
    """When the page was written, and how many jobs had finished when the sweep is not done."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    total = SweepPlan.read(table_.sweep_dir).total
    finished = sum(1 for r in table_.rows if r["status"] != "incomplete")
    planned = total if total is not None else len(table_.rows)
    if finished >= planned and finished == len(table_.rows):
        return f'<p class="note" id="written">Written {esc(when)}.</p>'
    return (
        f'<p class="note" id="written"><strong>{finished} of {esc(planned)} jobs finished'
        f"</strong> when this page was written ({esc(when)}): the sweep was still running, "
        "or stopped; <code>jaxaot-report --html</code> again writes it anew.</p>"
    )


def _status_cell(r: dict[str, Any]) -> Cell:
    status = str(r["status"])
    badges = "".join(
        f'<span class="badge">{name}</span>' for name in ("best", "pareto") if r.get(name)
    )
    warned = len(r.get("warnings") or [])
    warn = (
        f' <span class="note">{warned} warning{"s" if warned > 1 else ""}</span>' if warned else ""
    )
    return Cell(
        sort=status,
        html=f'<span class="status {esc(status)}">{esc(status)}</span>{badges}{warn}',
    )


def _topology_cells(r: dict[str, Any], host: bool) -> list[Cell]:
    fits = r.get("compile.fits")
    need, have = memory_pair(
        r.get("compile.hbm_bytes_needed"), r.get("compile.hbm_bytes_available")
    )
    verdict = "-" if fits is None else ("yes" if fits else "no")
    if fits is False and r.get("compile.host_fits") is False:
        verdict += " (HBM and host)" if r.get("compile.hbm_fits") is False else " (host)"
    coll = r.get("compile.collectives")
    cells = [
        Cell(r.get("compile.topology") or "-"),
        Cell(verdict),
        Cell(need, sort=json_number(r.get("compile.hbm_bytes_needed")), numeric=True),
        Cell(have, sort=json_number(r.get("compile.hbm_bytes_available")), numeric=True),
        Cell(
            signed_bytes(r.get("compile.headroom_bytes")),
            sort=json_number(r.get("compile.headroom_bytes")),
            numeric=True,
        ),
    ]
    if host:
        h_need, h_have = memory_pair(
            r.get("compile.host_bytes_needed"), r.get("compile.host_bytes_available")
        )
        shown = f"{h_need} of {h_have}" if r.get("compile.host_bytes_needed") else "-"
        cells.append(
            Cell(shown, sort=json_number(r.get("compile.host_bytes_needed")), numeric=True)
        )
    return [
        *cells,
        Cell(
            human_seconds(r.get("compile.est_step_s")),
            sort=json_number(r.get("compile.est_step_s")),
            numeric=True,
        ),
        Cell(
            "-" if coll is None else f"{coll} ({human_bytes(r.get('compile.collective_bytes'))})",
            sort=json_number(coll),
            numeric=True,
        ),
    ]


def _jobs_table(table_: SweepTable, pages: dict[str, str], unwritten: dict[str, str]) -> str:
    names = short_names(table_.varying)
    topology, slurm, profiled = table_.topology, table_.slurm, table_.profiled
    effort, host, peaks = table_.effort, table_.host, table_.peaks
    heads: list[tuple[str, str]] = [
        ("job", "Hydra's job number; the link opens the job's page"),
        *((names[k], k) for k in table_.varying),
        *((c.split(".", 1)[1], c) for c in effort),
        ("status", ""),
        *((s, f"{s}: status and wall time") for s in STAGES),
        *((head, col) for head, col, _ in _FIGURES),
    ]
    if topology:
        heads += [
            ("target", "compile.topology"),
            ("fits", "compile.fits"),
            ("HBM needed", "compile.hbm_bytes_needed"),
            ("HBM available", "compile.hbm_bytes_available"),
            ("headroom", "compile.headroom_bytes"),
        ]
        heads += [("host memory needed of available", "compile.host_bytes_needed")] if host else []
        heads += [("est. step (roofline)", "compile.est_step_s"), ("collectives", "")]
    heads += [("peak: live buffers", "compile.peak_top")] if peaks else []
    heads += [("top op (share of op time)", "execute.profile_top_op")] if profiled else []
    heads += [("SLURM", "job, state, requeues")] if slurm else []
    heads += [("error", ""), ("dir", "the job's folder")]
    rows = []
    for r in table_.rows:
        page = pages.get(r["dir"])
        job = Cell(sort=r["job"], html=link(page, r["job"]) if page else esc(r["job"]))
        cells = [
            job,
            *(Cell(str(r.get(k, ""))) for k in table_.varying),
            *(Cell(r.get(c) or "-") for c in effort),
            _status_cell(r),
            *(Cell(stage_cell(r, s), sort=_sort(r.get(f"{s}.seconds"))) for s in STAGES),
            *(
                Cell(metric_cell(r, col, fmt), sort=json_number(r.get(col)), numeric=True)
                for _, col, fmt in _FIGURES
            ),
            *(_topology_cells(r, host) if topology else ()),
            *(
                [Cell(peak_cell(r), sort=json_number(r.get("compile.peak_bytes")), clip=True)]
                if peaks
                else []
            ),
            *([Cell(profile_cell(r))] if profiled else []),
            *([Cell(slurm_cell(r))] if slurm else []),
            Cell(
                html=f'<span class="error">{esc(r.get("error") or "")}</span>'
                + (
                    f' <span class="note">(no page: {esc(unwritten[r["dir"]])})</span>'
                    if r["dir"] in unwritten
                    else ""
                ),
                wrap=True,
            ),
            Cell(html=link(r["dir"] + "/", r["dir"])),
        ]
        rows.append((str(r["status"]), cells))
    return table(heads, rows, table_id="jobs")


def _memory_section(table_: SweepTable) -> str:
    bars = []
    totals = [
        sum(v for _, col in _MEMORY if (v := json_number(r.get(col))) is not None)
        for r in table_.rows
    ]
    scale = max(totals, default=0) or 1.0
    for r, total in zip(table_.rows, totals, strict=True):
        parts = [(label, float(json_number(r.get(col)) or 0)) for label, col in _MEMORY]
        peak = json_number(r.get("compile.peak_bytes"))
        bars.append(
            (
                str(r["status"]),
                [
                    Cell(sort=r["job"], html=esc(r["job"])),
                    Cell(
                        ", ".join(f"{k}={r.get(k, '')}" for k in table_.varying) or r["dir"],
                    ),
                    Cell(html=stacked_bar(parts, scale) if total else "-", sort=total or ""),
                    Cell(human_bytes(total) if total else "-", sort=total or "", numeric=True),
                    Cell(human_bytes(peak), sort=peak, numeric=True),
                ],
            )
        )
    heads = [
        ("job", ""),
        ("overrides", ""),
        ("argument + output + temp + code", "XLA's memory analysis, to one scale"),
        ("total", ""),
        ("XLA's peak", "compile.peak_bytes"),
    ]
    return legend([label for label, _ in _MEMORY]) + table(heads, bars, table_id="memory")


def _plots_section(table_: SweepTable, plots: bool) -> str:
    if not plots:
        return ""
    shown = list(table_.plots)
    folder = table_.sweep_dir / PLOTS_DIR
    if folder.is_dir():  # Optuna's views, which the autotune sweeper writes beside them
        shown += sorted(p for p in folder.glob("*.png") if p not in shown)
    if not shown and not table_.plot_note:
        return ""
    parts = ['<h2 id="plots">Plots</h2>']
    if table_.plot_note:
        parts.append(f'<p class="note">{esc(table_.plot_note)}</p>')
    for p in shown:
        rel = p.relative_to(table_.sweep_dir)
        parts.append(
            f'<figure><a href="{href(rel)}"><img alt="{esc(p.stem)}" '
            f'src="{data_uri(p, "image/png")}"></a>'
            f"<figcaption>{link(rel)}</figcaption></figure>"
        )
    return "\n".join(parts)


def _files_section(table_: SweepTable, pages: dict[str, str]) -> str:
    root = table_.sweep_dir
    job_dirs = [root / r["dir"] for r in table_.rows]
    parts = ["<h3>The sweep's own</h3>", files_section(root, run_files(root, skip=job_dirs))]
    parts.append("<h3>Each job's</h3>")
    for r in table_.rows:
        folder = root / r["dir"]
        files = run_files(folder) if folder.is_dir() else []
        page = pages.get(r["dir"])
        head = f"job {esc(r['job'])}: {link(r['dir'] + '/', r['dir'])}, {len(files)} files"
        if page:
            head += f", {link(page, 'its page')}"
        parts.append(
            f"<details><summary>{head}</summary>"
            f"{files_section(folder, files, prefix=r['dir'] + '/')}</details>"
        )
    return "\n".join(parts)


def sweep_page(
    table_: SweepTable,
    pages: dict[str, str],
    *,
    plots: bool = True,
    unwritten: dict[str, str] | None = None,
) -> str:
    """The page of a sweep; ``pages``: job dir -> its page (relative to the sweep dir);
    ``unwritten``: job dir -> why its page could not be written."""
    title = f"Sweep report: {table_.sweep_dir}"
    body = [
        f"<h1>{esc(title)}</h1>",
        f'<div id="summary">{markdown_block(summary_lines(table_))}</div>',
        _written(table_),
    ]
    body.append('<h2 id="jobs-head">Jobs</h2>')
    body.append('<p class="note">Click a column\'s head to sort by it (again: descending).</p>')
    body.append(_jobs_table(table_, pages, unwritten or {}))
    warned = [r for r in table_.rows if r.get("warnings")]
    if warned:
        body.append("<h2>Warnings</h2><ul>")
        body += [f"<li>job {esc(r['job'])}: {esc(w)}</li>" for r in warned for w in r["warnings"]]
        body.append("</ul>")
    fit = report_section(table_.sweep_dir)
    if fit:
        body.append(markdown_block(fit))
    body.append(_plots_section(table_, plots))
    body.append('<h2 id="memory-head">Memory</h2>')
    body.append(_memory_section(table_))
    body.append('<h2 id="files">Files</h2>')
    body.append(_files_section(table_, pages))
    return document(title, "\n".join(b for b in body if b))


def write_sweep_html(table_: SweepTable, *, plots: bool = True, draw_graph: bool = True) -> Path:
    """``report.html`` in the sweep dir and in each job's folder that holds a manifest."""
    root = table_.sweep_dir
    pages: dict[str, str] = {}
    unwritten: dict[str, str] = {}
    for r in table_.rows:
        folder = root / r["dir"]
        if not (folder / "manifest.json").is_file():
            continue
        up = "/".join([".."] * len(Path(r["dir"]).parts)) + f"/{HTML_NAME}"
        try:
            page = run_page(folder, up=up, draw_graph=draw_graph)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            # One job's unreadable files: a note in its row, not a failed report.
            unwritten[r["dir"]] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            continue
        atomic_write_text(folder / HTML_NAME, page)
        pages[r["dir"]] = f"{Path(r['dir']).as_posix()}/{HTML_NAME}"
    out = root / HTML_NAME
    atomic_write_text(out, sweep_page(table_, pages, plots=plots, unwritten=unwritten))
    return out


def write_run_html(run_dir: Path, *, draw_graph: bool = True) -> tuple[Path, str]:
    """``report.html`` in a run dir (a sweep job's links to the sweep's page), and the run's
    status as the page shows it."""
    run_dir = Path(run_dir)
    sweep = sweep_of(run_dir)
    up = None
    if sweep is not None:
        rel = Path(os.path.relpath(sweep, run_dir.resolve())).as_posix()
        up = f"{rel}/{HTML_NAME}" if (sweep / HTML_NAME).is_file() else f"{rel}/"
    out = run_dir / HTML_NAME
    atomic_write_text(out, run_page(run_dir, up=up, draw_graph=draw_graph))
    manifest, _ = read_manifest(run_dir)
    return out, str(manifest.get("status") or "incomplete")


__all__ = ["HTML_NAME", "sweep_page", "write_run_html", "write_sweep_html"]
