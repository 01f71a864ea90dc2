"""The optimized HLO as a picture: a DOT graph, rendered to SVG/PNG when Graphviz is installed.

This is what ``as_hlo_dot_graph`` gave in the removed ``xla_computation`` API, built from the
HLO text jaxaot already writes (no JAX needed, so it works on any run or snapshot): one node
per instruction of the entry computation, each fusion collapsed into one node that lists the
ops it fused, loop bodies and called computations drawn as dashed clusters. Constants and
``get-tuple-element`` are folded away (a tuple index labels its edge). A graph over
``max_nodes`` first loses its clusters, then shows the first instructions in schedule order
with a note saying how many were left out.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.util.fsio import atomic_write_text, sha256_file
from jaxaot.util.hlo_parse import COLLECTIVES, Computation, Instruction, module_name, parse_hlo

GRAPH_DIR = "graph"
_LAYOUT = re.compile(r"\{[^{}]*\}|/\*.*?\*/")
_CONTROL = ("while", "conditional", "call")
_FOLDED = ("constant", "get-tuple-element")
_CLUSTER_DEPTH = 3


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _ops_summary(comps: dict[str, Computation], name: str, limit: int = 4) -> str:
    """``multiply x3, add x2, tanh`` for a fused or called computation (nested fusions included)."""
    counts: Counter[str] = Counter()

    def walk(comp_name: str) -> None:
        for ins in comps[comp_name].instructions if comp_name in comps else ():
            if ins.opcode == "fusion":
                for _, callee in ins.callees:
                    walk(callee)
            elif ins.opcode not in ("parameter", "constant", "tuple", "get-tuple-element"):
                counts[ins.opcode] += 1

    walk(name)
    items = [f"{op} x{n}" if n > 1 else op for op, n in counts.most_common()]
    more = f", +{len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _style(ins: Instruction, fused: str) -> str:
    if ins.opcode == "parameter":
        color, shape = "#d9f2d9", "ellipse"
    elif ins.opcode in COLLECTIVES or ins.opcode.split("-start")[0] in COLLECTIVES:
        color, shape = "#f8d7da", "box"
    elif ins.opcode in _CONTROL:
        color, shape = "#e2d9f3", "box"
    elif ins.opcode in ("dot", "convolution", "custom-call") or re.search(
        r"\b(dot|convolution)\b", fused
    ):
        color, shape = "#cfe2ff", "box"
    elif ins.opcode == "fusion":
        color, shape = "#ffe0b3", "box"
    else:
        color, shape = "#f2f2f2", "box"
    bold = ", penwidth=2" if ins.root else ""
    return f'shape={shape}, fillcolor="{color}"{bold}'


def _label(comps: dict[str, Computation], ins: Instruction) -> tuple[str, str]:
    """(label, fused-ops summary) for a node."""
    head, extra, fused = ins.opcode, "", ""
    if ins.opcode == "parameter":
        head = f"parameter {ins.operands[0] if ins.operands else ''}".strip()
    elif ins.opcode == "fusion":
        kind = (ins.attr("kind") or "").removeprefix("k").lower()
        head = f"fusion ({kind})" if kind else "fusion"
        fused = ", ".join(_ops_summary(comps, c) for _, c in ins.callees)
        extra = fused
    elif ins.opcode == "get-tuple-element":
        extra = f"index {ins.attr('index')}"
    elif ins.callees:
        extra = "; ".join(f"{role}: {_ops_summary(comps, c) or c}" for role, c in ins.callees)
    groups = ins.attr("replica_groups")
    if groups:
        extra = f"{extra} groups={groups}".strip()
    shape = _LAYOUT.sub("", ins.shape)
    lines = [("ROOT " if ins.root else "") + head, _short(ins.name, 40), _short(shape)]
    if extra:
        lines.append(_short(extra, 60))
    return "\\n".join(_esc(line) for line in lines), fused


@dataclass(frozen=True)
class GraphDot:
    """DOT text and what it shows: nodes drawn, entry instructions, the size-limit note."""

    text: str
    nodes: int
    instructions: int
    note: str | None


def _drawn(comp: Computation) -> list[Instruction]:
    """Instructions that get a node: all but constants and tuple indexing, except the ROOT."""
    return [i for i in comp.instructions if i.root or i.opcode not in _FOLDED]


def _clusters(comps: dict[str, Computation], comp: Computation, depth: int) -> dict[str, str]:
    """Computations called by control flow in ``comp`` (nested ones too) -> their caption."""
    out: dict[str, str] = {}
    if depth >= _CLUSTER_DEPTH:
        return out
    for ins in _drawn(comp):
        if ins.opcode in _CONTROL:
            for role, callee in ins.callees:
                if callee in comps and callee not in out:
                    out[callee] = f"{role} of {ins.name}: {callee}"
                    for name, caption in _clusters(comps, comps[callee], depth + 1).items():
                        out.setdefault(name, caption)
    return out


def to_dot(comps: dict[str, Computation], *, max_nodes: int, title: str) -> GraphDot:
    """DOT text for the entry computation (and control-flow clusters when they fit)."""
    entry = next((c for c in comps.values() if c.entry), None) or list(comps.values())[-1]
    shown = _drawn(entry)
    clusters = _clusters(comps, entry, 0)
    total = len(shown) + sum(len(_drawn(comps[c])) for c in clusters)
    note = None
    if total > max_nodes and clusters:
        note = f"{len(clusters)} loop/call bodies collapsed ({total} nodes > max {max_nodes})"
        clusters, total = {}, len(shown)
    if total > max_nodes:
        note = (
            f"showing the first {max_nodes} of {len(shown)} instructions in schedule order "
            f"(max_nodes={max_nodes})"
        )
        shown = shown[:max_nodes]
    ids: dict[tuple[str, str], str] = {}
    body: list[str] = []

    def emit(comp: Computation, instrs: list[Instruction], indent: str) -> None:
        for ins in instrs:
            node = f"n{len(ids)}"
            ids[(comp.name, ins.name)] = node
            label, fused = _label(comps, ins)
            body.append(f'{indent}{node} [label="{label}", {_style(ins, fused)}];')

    emit(entry, shown, "  ")
    order = list(clusters)
    for k, (name, caption) in enumerate(clusters.items()):
        body.append(f"  subgraph cluster_{k} {{")
        body.append(f'    label="{_esc(caption)}"; style=dashed; color="#8c7ab8";')
        emit(comps[name], _drawn(comps[name]), "    ")
        body.append("  }")
    for comp, instrs in [(entry, shown)] + [(comps[c], _drawn(comps[c])) for c in clusters]:
        body += _edges(comp, instrs, ids)
        for ins in instrs:
            for role, callee in ins.callees if ins.opcode in _CONTROL else ():
                first = next(iter(_drawn(comps[callee])), None) if callee in comps else None
                if first is not None and (callee, first.name) in ids:
                    body.append(
                        f"  {ids[(comp.name, ins.name)]} -> {ids[(callee, first.name)]} "
                        f'[style=dashed, label="{role}", lhead=cluster_{order.index(callee)}];'
                    )
    if note:
        body.append(f'  note [shape=note, fillcolor="#fff3cd", label="{_esc(note)}"];')
    head = [
        "digraph hlo {",
        f'  graph [rankdir=TB, compound=true, labelloc=t, fontname="Helvetica", '
        f'label="{_esc(title)}"];',
        '  node [style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9, color="#555555"];',
    ]
    return GraphDot("\n".join([*head, *body, "}"]) + "\n", len(ids), len(_drawn(entry)), note)


def _edges(
    comp: Computation, instrs: list[Instruction], ids: dict[tuple[str, str], str]
) -> list[str]:
    by_name = comp.by_name()

    def source(name: str, label: str = "") -> tuple[str, str] | None:
        ins = by_name.get(name)
        if ins is None or (ins.opcode == "constant" and not ins.root):
            return None
        if ins.opcode == "get-tuple-element" and ins.operands and not ins.root:
            return source(ins.operands[0], f"[{ins.attr('index')}]{label}")
        node = ids.get((comp.name, name))
        return (node, label) if node else None

    out = []
    for ins in instrs:
        for operand in ins.operands:
            found = source(operand)
            if found:
                attrs = f' [label="{found[1]}"]' if found[1] else ""
                out.append(f"  {found[0]} -> {ids[(comp.name, ins.name)]}{attrs};")
    return out


def render(dot_path: Path, image_format: str) -> tuple[Path | None, str | None]:
    """Render with Graphviz's ``dot``: (image, None), or (None, why not) when it cannot."""
    exe = shutil.which("dot")
    if exe is None:
        return None, (
            "Graphviz 'dot' is not on PATH: wrote DOT only (install Graphviz, e.g. the "
            "Debian package graphviz, to render it)"
        )
    out = dot_path.with_suffix(f".{image_format}")
    try:
        proc = subprocess.run(
            [exe, f"-T{image_format}", str(dot_path), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return None, f"dot -T{image_format} timed out after 300 s: wrote DOT only"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[0]
        return None, f"dot -T{image_format} failed ({why}): wrote DOT only"
    return out, None


def write_graph(
    hlo_text: str, dot_path: Path, *, image_format: str = "svg", max_nodes: int = 250
) -> dict[str, Any]:
    """Write the DOT file (and the image when Graphviz is there); describe what was written."""
    comps = parse_hlo(hlo_text)
    if not comps:
        raise ValueError("no HLO computations in the text")
    dot = to_dot(comps, max_nodes=max_nodes, title=f"{dot_path.stem} · {module_name(hlo_text)}")
    atomic_write_text(dot_path, dot.text)
    image, why = render(dot_path, image_format)
    return {
        "dot": dot_path,
        "image": image,
        "nodes": dot.nodes,
        "instructions": dot.instructions,
        "note": dot.note,
        "render_note": why,
    }


def graph_of_run(
    run_dir: Path, *, image_format: str = "svg", max_nodes: int = 250
) -> dict[str, Any]:
    """Draw a run's (or snapshot's) optimized HLO into ``graph/``, or its lowered HLO when the
    run stopped before compile; paths in the result are relative to ``run_dir``."""
    run_dir = Path(run_dir)
    for rel in ("compile/optimized.hlo.txt", "lower/module.hlo.txt"):
        if (run_dir / rel).is_file():
            break
    else:
        return {"source": None, "summary": "no HLO to draw (the run stopped before lower)"}
    stem = Path(rel).name.removesuffix(".txt")
    out = write_graph(
        (run_dir / rel).read_text(),
        run_dir / GRAPH_DIR / f"{stem}.dot",
        image_format=image_format,
        max_nodes=max_nodes,
    )
    files = {
        str(p.relative_to(run_dir)): {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in (out["dot"], out["image"])
        if p is not None
    }
    notes = "; ".join(n for n in (out["note"], out["render_note"]) if n)
    summary = f"{' + '.join(files)} ({out['nodes']} nodes from {rel})" + (
        f"; {notes}" if notes else ""
    )
    return {
        "source": rel,
        "files": files,
        "nodes": out["nodes"],
        "note": out["note"],
        "render_note": out["render_note"],
        "summary": summary,
    }


def _is_snapshot(folder: Path) -> bool:
    return (folder / "snapshot.json").is_file()


__all__ = [
    "GRAPH_DIR",
    "GraphDot",
    "graph_of_run",
    "render",
    "to_dot",
    "write_graph",
]
