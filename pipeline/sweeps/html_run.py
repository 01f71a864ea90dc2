"""The HTML page of one run (a single run's dir, or one job of a sweep): what ran and how it
ended, each stage's time and summary line, the memory breakdown at the peak, the optimized HLO
as a graph, and a link to every file the run left.

Read from disk only (``manifest.json``, ``compile/memory_breakdown.json``, ``.hydra/``), like
the sweep report. The HLO graph is ``jaxaot-graph``'s (``graph/``, drawn now when missing or
older than the HLO), shown as an image so that nothing in it can run.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.rundir.metrics import OutputFigure, RunMetrics
from jaxaot.sweeps.html_page import (
    Cell,
    data_uri,
    document,
    esc,
    legend,
    link,
    signed_bytes,
    stacked_bar,
    table,
)
from jaxaot.sweeps.progress import STATE_DIR, read_json
from jaxaot.util.humanize import human_bytes, human_seconds

HTML_NAME = "report.html"
MAX_FILES = 2000  # files listed per folder; the rest are counted
_MEMORY_FIGURES = (
    ("argument", "argument_bytes"),
    ("output", "output_bytes"),
    ("temp", "temp_bytes"),
    ("code", "code_bytes"),
)


def run_files(folder: Path, skip: Iterable[Path] = ()) -> list[Path]:
    """Every file under ``folder`` (relative, sorted), less the report pages, temporary files,
    the sweep's own state and the folders in ``skip``."""
    skipped = {p.resolve() for p in skip}
    found = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if d != STATE_DIR and (here / d).resolve() not in skipped)
        for name in files:
            if name == HTML_NAME or name.startswith(".tmp-"):
                continue
            found.append((here / name).relative_to(folder))
    return sorted(found)


def files_section(folder: Path, files: list[Path], prefix: str = "") -> str:
    """A list of links to ``files`` (relative to ``folder``), each with its size."""
    items = []
    for rel in files[:MAX_FILES]:
        try:
            size = human_bytes((folder / rel).stat().st_size)
        except OSError:
            size = "?"
        items.append(f"<li>{link(prefix + rel.as_posix(), rel.as_posix())} ({esc(size)})</li>")
    more = (
        f'<p class="note">and {len(files) - MAX_FILES} more files</p>'
        if len(files) > MAX_FILES
        else ""
    )
    return f'<ul class="files">{"".join(items)}</ul>{more}'


def _stage_details(stage: str, metrics: Mapping[str, Any]) -> str:
    """The summary line's details of a stage (the one ``jaxaot`` prints)."""
    from jaxaot.stages import NODE_BY_NAME

    node = NODE_BY_NAME.get(stage)
    return node.show.line(dict(metrics)) if node is not None and metrics else ""


def _output_text(o: OutputFigure) -> str:
    shape = f"{o.dtype}[{','.join(str(d) for d in o.shape)}]"
    return f"output{o.path}  {shape}" + (f" = {o.value}" if o.has_value else "")


def _overrides(run_dir: Path) -> list[str]:
    try:
        import yaml

        data = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    except (OSError, ValueError, ImportError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def _facts(manifest: Mapping[str, Any], run_dir: Path) -> str:
    backend = manifest.get("backend") or {}
    versions = manifest.get("versions") or {}
    rows: list[tuple[str, str]] = []
    if backend:
        where = f"{backend.get('platform')} x{backend.get('device_count')} ({backend.get('device_kind')})"
        if backend.get("topology"):
            where += f", topology {backend['topology']} (compile only)"
        rows.append(("backend", where))
    started = manifest.get("started")
    if isinstance(started, int | float):
        stamp = datetime.datetime.fromtimestamp(started, datetime.UTC)
        rows.append(("started", stamp.strftime("%Y-%m-%d %H:%M:%S UTC")))
    if isinstance(manifest.get("wall_seconds"), int | float):
        rows.append(("wall time", human_seconds(manifest["wall_seconds"])))
    overrides = _overrides(run_dir)
    rows.append(("overrides", " ".join(overrides) if overrides else "(none)"))
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))))
    for stage, rec in (manifest.get("stages") or {}).items():
        if isinstance(rec, Mapping) and rec.get("key"):
            rows.append((f"{stage} key", str(rec["key"])))
    if manifest.get("resumed_from"):
        rows.append(("resumed from", str(manifest["resumed_from"])))
    rows.append(("run dir", str(manifest.get("run_dir") or run_dir)))
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _stages_table(manifest: Mapping[str, Any]) -> str:
    rows = []
    entries = manifest.get("stages") or {}
    # manifest.json's keys are sorted: the stages in run order, then any other
    order = [s for s in STAGES if s in entries] + [s for s in entries if s not in STAGES]
    for stage in order:
        rec = entries[stage]
        rec = rec if isinstance(rec, Mapping) else {}
        status, seconds = str(rec.get("status")), rec.get("seconds")
        rows.append(
            (
                "",
                [
                    Cell(stage),
                    Cell(status),
                    Cell(
                        "-" if status == "skipped" else human_seconds(seconds),
                        sort=seconds if isinstance(seconds, int | float) else None,
                        numeric=True,
                    ),
                    Cell(_stage_details(stage, rec.get("metrics") or {}) or rec.get("note", "")),
                ],
            )
        )
    heads = [("stage", ""), ("status", ""), ("time", ""), ("details", "")]
    return table(heads, rows, table_id="stages")


def _breakdown_section(run_dir: Path, metrics: RunMetrics) -> str:
    """The peak's makeup (``compile/memory_breakdown.json``), else XLA's memory figures."""
    breakdown = read_json(run_dir / "compile" / "memory_breakdown.json")
    comp = metrics.compile
    parts: list[str] = []
    if breakdown:
        groups = breakdown.get("peak_groups") or breakdown.get("groups") or {}
        segments: list[tuple[str, float]] = [
            (f"argument {name}", float(v))
            for name, v in (groups.get("arguments") or {}).items()
            if isinstance(v, int | float)
        ]
        for name in ("outputs", "temporaries", "constants", "host"):
            if isinstance(groups.get(name), int | float) and groups[name] > 0:
                segments.append((name, float(groups[name])))
        live = sum(v for _, v in segments)
        parts.append(
            f"<p>XLA's peak: <strong>{esc(human_bytes(breakdown.get('peak_bytes')))}</strong>; "
            f"live at the peak (device memory, by what it holds): {esc(human_bytes(live))}; "
            "the largest buffers live then are listed below.</p>"
        )
        parts.append(stacked_bar(segments, live or 1.0, width_px=720))
        parts.append(legend([f"{label} {human_bytes(v)}" for label, v in segments]))
        rows = []
        for buf in breakdown.get("top") or []:
            if not isinstance(buf, Mapping):
                continue
            live_range = buf.get("live") or []
            rows.append(
                (
                    "",
                    [
                        Cell(buf.get("shape", "")),
                        Cell(buf.get("path") or buf.get("instruction") or ""),
                        Cell(buf.get("kind", "")),
                        Cell(buf.get("opcode", "")),
                        Cell(human_bytes(buf.get("bytes")), sort=buf.get("bytes"), numeric=True),
                        Cell(
                            "-".join(str(x) for x in live_range),
                            sort=live_range[0] if live_range else None,
                            numeric=True,
                        ),
                    ],
                )
            )
        if rows:
            heads = [
                ("shape", ""),
                ("what", "the program's argument path, else XLA's instruction"),
                ("kind", ""),
                ("op", ""),
                ("bytes", ""),
                ("live", "schedule steps the buffer is live"),
            ]
            parts.append(table(heads, rows, table_id="peak-buffers"))
    figures = [(label, getattr(comp, name)) for label, name in _MEMORY_FIGURES]
    known = [(label, float(v)) for label, v in figures if isinstance(v, int | float)]
    if known:
        total = sum(v for _, v in known)
        parts.append("<p>XLA's memory analysis (argument, output, temp and generated code):</p>")
        parts.append(stacked_bar(known, total or 1.0, width_px=720))
        parts.append(legend([f"{label} {human_bytes(v)}" for label, v in known]))
    verdict = comp.verdict
    if verdict.known:
        fits = "fits" if verdict.fits else "does not fit"
        parts.append(
            f"<p>On {esc(verdict.topology)}: {esc(fits)}: HBM needed "
            f"{esc(human_bytes(verdict.hbm_bytes_needed))} of "
            f"{esc(human_bytes(verdict.hbm_bytes_available))} (headroom "
            f"{esc(signed_bytes(verdict.headroom_bytes))}).</p>"
        )
    if not parts:
        return '<p class="note">No memory figures: the run stopped before compile.</p>'
    return "\n".join(parts)


def _graph_section(run_dir: Path, *, draw: bool) -> str:
    """The optimized (else lowered) HLO as ``jaxaot-graph`` draws it, inline as an image."""
    from jaxaot.snapshots.hlo_graph import GRAPH_DIR, graph_of_run

    for rel in ("compile/optimized.hlo.txt", "lower/module.hlo.txt"):
        if (run_dir / rel).is_file():
            break
    else:
        return '<p class="note">No HLO to draw: the run stopped before lower.</p>'
    stem = Path(rel).name.removesuffix(".txt")
    svg, dot = run_dir / GRAPH_DIR / f"{stem}.svg", run_dir / GRAPH_DIR / f"{stem}.dot"
    note = ""
    fresh = svg.is_file() and svg.stat().st_mtime >= (run_dir / rel).stat().st_mtime
    if not fresh and not draw:
        return f'<p class="note">Graph not drawn (--no-graph): {link(rel)} holds the HLO.</p>'
    if not fresh:
        try:
            drawn = graph_of_run(run_dir)
        except (OSError, ValueError) as exc:  # an unreadable or truncated HLO text
            return f'<p class="note">No graph: {link(rel)} could not be drawn ({esc(exc)}).</p>'
        note = drawn.get("note") or ""
        if drawn.get("render_note"):
            return (
                f'<p class="note">{esc(drawn["render_note"])}: {link(dot.relative_to(run_dir))} '
                f"(from {link(rel)}).</p>"
            )
    shown = svg.relative_to(run_dir)
    return (
        f"<p>From {link(rel)}; full size: {link(shown)}"
        + (f' <span class="note">({esc(note)})</span>' if note else "")
        + f'</p>\n<p class="graph"><a href="{esc(shown.as_posix())}">'
        f'<img id="hlo-graph" alt="HLO graph of {esc(rel)}" '
        f'src="{data_uri(svg, "image/svg+xml")}"></a></p>'
    )


def run_page(run_dir: Path, *, up: str | None = None, draw_graph: bool = True) -> str:
    """The page of the run in ``run_dir``; ``up``: a relative link to the sweep's page."""
    manifest = read_json(run_dir / "manifest.json") or {}
    config = manifest.get("config") or {}
    program = config.get("program") or {}
    backend = manifest.get("backend") or {}
    status = str(manifest.get("status") or "incomplete")
    title = f"jaxaot · {program.get('name', '?')} ({program.get('target', '?')})"
    if backend:
        title += f" · {backend.get('platform')} x{backend.get('device_count')}"
    metrics = RunMetrics.from_manifest(manifest)
    body = []
    if up:
        body.append(f"<p>{link(up, '← the sweep')}</p>")
    body.append(f"<h1>{esc(title)}</h1>")
    body.append(
        f'<p>Status: <span class="status {esc(status)}" id="status">{esc(status)}</span></p>'
    )
    if manifest.get("error"):
        label = "verdict" if status == "does_not_fit" else "error"
        body.append(f'<p class="error" id="error">{esc(label)}: {esc(manifest["error"])}</p>')
    body.append(_facts(manifest, run_dir))
    body.append("<h2>Stages</h2>")
    body.append(_stages_table(manifest))
    outputs = metrics.execute.outputs
    if outputs:
        body.append("<pre>" + esc("\n".join(_output_text(o) for o in outputs)) + "</pre>")
    warnings = [str(w) for w in manifest.get("warnings") or []]
    if warnings:
        body.append("<h2>Warnings</h2><ul>")
        body += [f"<li>{esc(w)}</li>" for w in warnings]
        body.append("</ul>")
    body.append('<h2 id="memory">Memory</h2>')
    body.append(_breakdown_section(run_dir, metrics))
    body.append('<h2 id="graph">HLO graph</h2>')
    body.append(_graph_section(run_dir, draw=draw_graph))
    body.append('<h2 id="files">Files</h2>')
    body.append(files_section(run_dir, run_files(run_dir)))
    return document(title, "\n".join(body))


__all__ = ["HTML_NAME", "MAX_FILES", "files_section", "run_files", "run_page"]
