"""The HTML page of one run (a single run's dir, or one job of a sweep): what ran and how it
ended, each stage's time and summary line, the memory breakdown at the peak, the optimized HLO
as a graph, and a link to every file the run left.

Read from disk only (``manifest.json``, ``compile/memory_breakdown.json``, ``.hydra/``), like
the sweep report; a field of the wrong type is left out, an unreadable file said on the page.
The HLO graph is the one the run drew (``snapshot.graph``) when the image's and the HLO's
sha256 are those its manifest records; else the one this page drew into ``graph/report/`` (a
folder no manifest records) when the sha256 of the HLO and of the image written beside it
(``<stem>.source.json``) are the current ones; else it is drawn there anew, at the run's
``snapshot.graph_max_nodes``. A graph nothing vouches for (``jaxaot-graph``'s in ``graph/``, one
older or newer than its HLO) is never shown. It is shown as an image, so that nothing in it can
run, with the size-limit note its DOT file carries.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import OutputFigure, RunMetrics
from jaxaot.sweeps.html_page import (
    Cell,
    data_uri,
    document,
    esc,
    legend,
    link,
    stacked_bar,
    table,
)
from jaxaot.sweeps.progress import PLAN_NAME, STATE_DIR, read_json
from jaxaot.sweeps.report import memory_pair
from jaxaot.util.fsio import atomic_write_text, sha256_bytes, sha256_file
from jaxaot.util.humanize import human_bytes, human_seconds, json_number, signed_bytes

HTML_NAME = "report.html"
REPORT_GRAPH_DIR = "report"  # under graph/: the graphs this page draws, recorded by no manifest
SOURCE_SUFFIX = ".source.json"  # beside a graph this page drew: the sha256 of its HLO and image
DEFAULT_MAX_NODES = 250  # snapshot.graph_max_nodes' default (conf/snapshot/default.yaml)
BREAKDOWN = "compile/memory_breakdown.json"
# What a sweep folder holds from its start: Hydra's multirun.yaml, jaxaot's sweep plan.
SWEEP_FILES = ("multirun.yaml", f"{STATE_DIR}/{PLAN_NAME}")
_DOT_NOTE = re.compile(r'^\s*note \[shape=note, [^\n]*?label="((?:[^"\\]|\\.)*)"\];$', re.M)
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


def _map(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a JSON object, else an empty one (a field of the wrong type)."""
    return value if isinstance(value, Mapping) else {}


def _texts(value: Any) -> list[str]:
    """A list of lines (a JSON list, or one string), each as text."""
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, list) else []


def read_manifest(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    """The run's manifest, and why it could not be read (None: read, or not there)."""
    path = run_dir / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"{MANIFEST_NAME} could not be read ({exc.strerror or exc})"
    except ValueError as exc:  # cut short (a full disk, a killed copy) or not JSON
        return {}, f"{MANIFEST_NAME} is not valid JSON ({exc}): the run's record is unreadable"
    if not isinstance(data, dict):
        return {}, f"{MANIFEST_NAME} holds a {type(data).__name__}, not a JSON object"
    return data, None


def sweep_of(run_dir: Path, levels: int = 4) -> Path | None:
    """The sweep folder ``run_dir`` is a job of (the nearest parent holding a sweep's markers)."""
    for parent in list(Path(run_dir).resolve().parents)[:levels]:
        if any((parent / m).is_file() for m in SWEEP_FILES):
            return parent
    return None


def _stage_details(stage: str, metrics: Any) -> str:
    """The summary line's details of a stage (the one ``jaxaot`` prints)."""
    from jaxaot.stages import NODE_BY_NAME

    node = NODE_BY_NAME.get(stage)
    if node is None or not isinstance(metrics, Mapping) or not metrics:
        return ""
    try:
        return str(node.show.line(dict(metrics)))
    except (TypeError, ValueError, KeyError, AttributeError):  # a figure of the wrong type
        return "(its figures could not be read)"


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
    backend = _map(manifest.get("backend"))
    versions = _map(manifest.get("versions"))
    rows: list[tuple[str, str]] = []
    if backend:
        where = f"{backend.get('platform')} x{backend.get('device_count')} ({backend.get('device_kind')})"
        if backend.get("topology"):
            where += f", topology {backend['topology']} (compile only)"
        rows.append(("backend", where))
    started = json_number(manifest.get("started"))
    if started is not None:
        try:
            stamp = datetime.datetime.fromtimestamp(started, datetime.UTC)
            rows.append(("started", stamp.strftime("%Y-%m-%d %H:%M:%S UTC")))
        except (OverflowError, OSError, ValueError):
            rows.append(("started", str(started)))
    wall = json_number(manifest.get("wall_seconds"))
    if wall is not None:
        rows.append(("wall time", human_seconds(wall)))
    overrides = _overrides(run_dir)
    rows.append(("overrides", " ".join(overrides) if overrides else "(none)"))
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))))
    for stage, rec in _map(manifest.get("stages")).items():
        if isinstance(rec, Mapping) and rec.get("key"):
            rows.append((f"{stage} key", str(rec["key"])))
    if manifest.get("resumed_from"):
        rows.append(("resumed from", str(manifest["resumed_from"])))
    rows.append(("run dir", str(manifest.get("run_dir") or run_dir)))
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _stages_table(manifest: Mapping[str, Any]) -> str:
    rows = []
    entries = _map(manifest.get("stages"))
    # manifest.json's keys are sorted: the stages in run order, then any other
    order = [s for s in STAGES if s in entries] + [s for s in entries if s not in STAGES]
    for stage in order:
        rec = _map(entries[stage])
        status, seconds = str(rec.get("status")), json_number(rec.get("seconds"))
        rows.append(
            (
                "",
                [
                    Cell(stage),
                    Cell(status),
                    Cell(
                        "-" if status == "skipped" else human_seconds(seconds),
                        sort=seconds,
                        numeric=True,
                    ),
                    Cell(_stage_details(stage, rec.get("metrics")) or str(rec.get("note") or "")),
                ],
            )
        )
    heads = [("stage", ""), ("status", ""), ("time", ""), ("details", "")]
    return table(heads, rows, table_id="stages")


def read_breakdown(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``compile/memory_breakdown.json`` when this jaxaot reads its format, and why not."""
    from jaxaot.stages.memory_breakdown import FORMAT

    path = run_dir / BREAKDOWN
    if not path.is_file():
        return None, None
    data = read_json(path)
    if data is None:
        return (
            None,
            f"{BREAKDOWN} is unreadable (not a JSON object): the peak's makeup is not shown",
        )
    if data.get("format") != FORMAT:
        return None, (
            f"{BREAKDOWN} has format {data.get('format')!r}, this jaxaot reads format {FORMAT}: "
            "the peak's makeup is not shown"
        )
    return data, None


def _peak_buffers(top: Any) -> str:
    rows = []
    for buf in top if isinstance(top, list) else []:
        if not isinstance(buf, Mapping):
            continue
        size = json_number(buf.get("bytes"))
        live = buf.get("live")
        steps = [x for x in live if json_number(x) is not None] if isinstance(live, list) else []
        rows.append(
            (
                "",
                [
                    Cell(str(buf.get("shape") or "")),
                    Cell(str(buf.get("path") or buf.get("instruction") or "")),
                    Cell(str(buf.get("kind") or "")),
                    Cell(str(buf.get("opcode") or "")),
                    Cell(human_bytes(size), sort=size, numeric=True),
                    Cell(
                        "-".join(str(x) for x in steps),
                        sort=steps[0] if steps else None,
                        numeric=True,
                    ),
                ],
            )
        )
    if not rows:
        return ""
    heads = [
        ("shape", ""),
        ("what", "the program's argument path, else XLA's instruction"),
        ("kind", ""),
        ("op", ""),
        ("bytes", ""),
        ("live", "schedule steps the buffer is live"),
    ]
    return table(heads, rows, table_id="peak-buffers")


def _breakdown_section(run_dir: Path, metrics: RunMetrics) -> str:
    """The peak's makeup (``compile/memory_breakdown.json``), else XLA's memory figures."""
    breakdown, why = read_breakdown(run_dir)
    comp = metrics.compile
    parts: list[str] = [f'<p class="note" id="breakdown-note">{esc(why)}</p>'] if why else []
    if breakdown:
        groups = _map(breakdown.get("peak_groups")) or _map(breakdown.get("groups"))
        segments: list[tuple[str, float]] = [
            (f"argument {name}", float(v))
            for name, raw in _map(groups.get("arguments")).items()
            if (v := json_number(raw)) is not None
        ]
        for name in ("outputs", "temporaries", "constants", "host"):
            v = json_number(groups.get(name))
            if v is not None and v > 0:
                segments.append((name, float(v)))
        live = json_number(breakdown.get("live_peak_bytes"))
        live = live if live is not None else sum(v for _, v in segments)
        peak = json_number(breakdown.get("peak_bytes"))
        said = (
            f"XLA's peak: <strong>{esc(human_bytes(peak))}</strong>; live at the peak"
            if peak is not None
            else "XLA gives no peak figure; live at the peak"
        )
        parts.append(
            f'<p id="peak">{said} (device memory, by what it holds): '
            f"<strong>{esc(human_bytes(live))}</strong>; the largest buffers live then are "
            "listed below.</p>"
        )
        parts.append(stacked_bar(segments, sum(v for _, v in segments) or 1.0, width_px=720))
        parts.append(legend([f"{label} {human_bytes(v)}" for label, v in segments]))
        parts.append(_peak_buffers(breakdown.get("top")))
    figures = [(label, getattr(comp, name)) for label, name in _MEMORY_FIGURES]
    known = [(label, float(v)) for label, v in figures if json_number(v) is not None]
    if known:
        total = sum(v for _, v in known)
        parts.append("<p>XLA's memory analysis (argument, output, temp and generated code):</p>")
        parts.append(stacked_bar(known, total or 1.0, width_px=720))
        parts.append(legend([f"{label} {human_bytes(v)}" for label, v in known]))
    verdict = comp.verdict
    if verdict.known:
        fits = "fits" if verdict.fits else "does not fit"
        need, have = memory_pair(verdict.hbm_bytes_needed, verdict.hbm_bytes_available)
        parts.append(
            f'<p id="verdict">On {esc(verdict.topology)}: {esc(fits)}: HBM needed {esc(need)} '
            f"of {esc(have)} (headroom {esc(signed_bytes(verdict.headroom_bytes))}).</p>"
        )
    if not parts:
        return '<p class="note">No memory figures: the run stopped before compile.</p>'
    return "\n".join(p for p in parts if p)


def dot_note(dot: Path) -> str:
    """The size-limit note a DOT file of ``jaxaot-graph`` carries ("" when none, or unreadable)."""
    try:
        found = _DOT_NOTE.search(dot.read_text(errors="replace"))
    except OSError:
        return ""
    return re.sub(r"\\(.)", r"\1", found[1]) if found else ""


def _sha256(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None


def _recorded_sha256(manifest: Mapping[str, Any], rel: str) -> str | None:
    """The sha256 the manifest records for the stage artifact ``rel`` (None: not recorded)."""
    for rec in _map(manifest.get("stages")).values():
        found = _map(_map(_map(rec).get("artifacts")).get(rel)).get("sha256")
        if isinstance(found, str):
            return found
    return None


def _recorded_graph(
    run_dir: Path, manifest: Mapping[str, Any], rel: str, hlo_sha: str
) -> tuple[Path, str] | None:
    """The image the run drew of ``rel`` (``snapshot.graph``) with its note, when the manifest
    records the HLO as it is now and the image as it is now."""
    record = _map(_map(manifest.get("snapshot")).get("graph"))
    if record.get("source") != rel or _recorded_sha256(manifest, rel) != hlo_sha:
        return None
    for name, file_rec in _map(record.get("files")).items():
        safe = not Path(name).is_absolute() and ".." not in Path(name).parts
        if not (safe and Path(name).suffix in (".svg", ".png")):
            continue
        sha = _map(file_rec).get("sha256")
        if isinstance(sha, str) and _sha256(run_dir / name) == sha:
            return run_dir / name, str(record.get("note") or "")
    return None


def _page_graph(run_dir: Path, rel: str, stem: str, hlo_sha: str) -> tuple[Path, str] | None:
    """The image this page drew of ``rel`` earlier, with its note, when the sha256 of the HLO
    and of the image written beside it (``<stem>.source.json``) are those of the files now."""
    from jaxaot.snapshots.hlo_graph import GRAPH_DIR

    folder = run_dir / GRAPH_DIR / REPORT_GRAPH_DIR
    source = read_json(folder / f"{stem}{SOURCE_SUFFIX}")
    if source is None or source.get("source") != rel or source.get("source_sha256") != hlo_sha:
        return None
    image = source.get("image")
    if not isinstance(image, str) or image not in (f"{stem}.svg", f"{stem}.png"):
        return None
    path = folder / image
    if _sha256(path) != source.get("image_sha256"):
        return None
    return path, dot_note(folder / f"{stem}.dot")


def _write_source(dot: Path, rel: str, hlo_sha: str, image: Path) -> None:
    """Beside a graph this page drew: which HLO (and its sha256) it shows, and the image's."""
    record = {
        "source": rel,
        "source_sha256": hlo_sha,
        "image": image.name,
        "image_sha256": sha256_file(image),
    }
    atomic_write_text(
        dot.with_name(dot.name.removesuffix(".dot") + SOURCE_SUFFIX),
        json.dumps(record, indent=2) + "\n",
    )


def _max_nodes(manifest: Mapping[str, Any]) -> int:
    snapshot = _map(_map(manifest.get("config")).get("snapshot"))
    n = snapshot.get("graph_max_nodes")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else DEFAULT_MAX_NODES


def _graph_section(run_dir: Path, manifest: Mapping[str, Any], *, draw: bool) -> str:
    """The optimized (else lowered) HLO as ``jaxaot-graph`` draws it, inline as an image."""
    from jaxaot.snapshots.hlo_graph import GRAPH_DIR, write_graph

    for rel in ("compile/optimized.hlo.txt", "lower/module.hlo.txt"):
        if (run_dir / rel).is_file():
            break
    else:
        return '<p class="note">No HLO to draw: the run stopped before lower.</p>'
    stem = Path(rel).name.removesuffix(".txt")
    try:
        hlo = (run_dir / rel).read_bytes()
    except OSError as exc:
        return f'<p class="note">No graph: {link(rel)} could not be read ({esc(exc)}).</p>'
    hlo_sha = sha256_bytes(hlo)
    found = _recorded_graph(run_dir, manifest, rel, hlo_sha) or _page_graph(
        run_dir, rel, stem, hlo_sha
    )
    if found is None and not draw:
        return f'<p class="note">Graph not drawn (--no-graph): {link(rel)} holds the HLO.</p>'
    if found is None:
        dot = run_dir / GRAPH_DIR / REPORT_GRAPH_DIR / f"{stem}.dot"
        try:
            dot.with_name(f"{stem}{SOURCE_SUFFIX}").unlink(missing_ok=True)  # vouches no more
            drawn = write_graph(
                hlo.decode(), dot, image_format="svg", max_nodes=_max_nodes(manifest)
            )
            if drawn.get("image") is not None:
                _write_source(dot, rel, hlo_sha, drawn["image"])
        except (OSError, ValueError) as exc:  # an unreadable or truncated HLO text
            return f'<p class="note">No graph: {link(rel)} could not be drawn ({esc(exc)}).</p>'
        if drawn.get("image") is None:
            return (
                f'<p class="note">{esc(drawn["render_note"])}: {link(dot.relative_to(run_dir))} '
                f"(from {link(rel)}).</p>"
            )
        found = drawn["image"], str(drawn.get("note") or "")
    image, note = found
    shown = image.relative_to(run_dir)
    mime = "image/svg+xml" if image.suffix == ".svg" else "image/png"
    return (
        f"<p>From {link(rel)}; full size: {link(shown)}"
        + (f' <span class="note" id="graph-note">({esc(note)})</span>' if note else "")
        + f'</p>\n<p class="graph"><a href="{esc(shown.as_posix())}">'
        f'<img id="hlo-graph" alt="HLO graph of {esc(rel)}" '
        f'src="{data_uri(image, mime)}"></a></p>'
    )


def run_page(run_dir: Path, *, up: str | None = None, draw_graph: bool = True) -> str:
    """The page of the run in ``run_dir``; ``up``: a relative link to the sweep's page."""
    manifest, unreadable = read_manifest(run_dir)
    config = _map(manifest.get("config"))
    program = _map(config.get("program"))
    backend = _map(manifest.get("backend"))
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
    if unreadable:
        body.append(f'<p class="error" id="manifest-error">{esc(unreadable)}</p>')
    if manifest.get("error"):
        label = "verdict" if status == "does_not_fit" else "error"
        body.append(f'<p class="error" id="error">{esc(label)}: {esc(manifest["error"])}</p>')
    body.append(_facts(manifest, run_dir))
    body.append("<h2>Stages</h2>")
    body.append(_stages_table(manifest))
    outputs = metrics.execute.outputs
    if outputs:
        body.append("<pre>" + esc("\n".join(_output_text(o) for o in outputs)) + "</pre>")
    warnings = _texts(manifest.get("warnings"))
    if warnings:
        body.append("<h2>Warnings</h2><ul>")
        body += [f"<li>{esc(w)}</li>" for w in warnings]
        body.append("</ul>")
    body.append('<h2 id="memory">Memory</h2>')
    body.append(_breakdown_section(run_dir, metrics))
    body.append('<h2 id="graph">HLO graph</h2>')
    body.append(_graph_section(run_dir, manifest, draw=draw_graph))
    body.append('<h2 id="files">Files</h2>')
    body.append(files_section(run_dir, run_files(run_dir)))
    return document(title, "\n".join(body))


__all__ = [
    "BREAKDOWN",
    "HTML_NAME",
    "MAX_FILES",
    "REPORT_GRAPH_DIR",
    "SOURCE_SUFFIX",
    "SWEEP_FILES",
    "dot_note",
    "files_section",
    "read_breakdown",
    "read_manifest",
    "run_files",
    "run_page",
    "sweep_of",
]
