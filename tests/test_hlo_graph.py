"""The optimized-HLO graph (pipeline/snapshots/hlo_graph.py): parsing, DOT, limits, Graphviz rendering."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env
from jaxaot.snapshots import hlo_graph
from jaxaot.snapshots.hlo_graph import render, to_dot, write_graph
from jaxaot.util.hlo_parse import parse_hlo, parse_instruction

# A scan-like program as XLA prints it after optimization: fusions, a while loop whose state
# is a tuple, get-tuple-element, constants, and metadata with debug tables.
LOOP_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[4,8]{1,0}, f32[8,8]{1,0})->f32[4,8]{1,0}}

FileNames
1 "/home/u/model.py"

%fused_computation (param_0: f32[4,8], param_1: f32[8,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,8]{1,0} parameter(1)
  %dot.1 = f32[4,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tanh.1 = f32[4,8]{1,0} tanh(%dot.1), metadata={op_name="jit(step)/tanh" stack_frame_id=1}
}

%body (arg: (s32[], f32[4,8], f32[8,8])) -> (s32[], f32[4,8], f32[8,8]) {
  %arg = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%arg), index=1
  %w = f32[8,8]{1,0} get-tuple-element(%arg), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[4,8]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_computation
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%next, %y, %w)
}

%cond (arg.1: (s32[], f32[4,8], f32[8,8])) -> pred[] {
  %arg.1 = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main.9 (x.1: f32[4,8], w.1: f32[8,8]) -> f32[4,8] {
  %x.1 = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f32[8,8]{1,0} parameter(1), metadata={op_name="w"}
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, /*index=2*/f32[8,8]{1,0}) tuple(%zero, %x.1, %w.1)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def _nodes(dot: str) -> dict[str, str]:
    return dict(re.findall(r'^\s+(n\d+) \[label="([^"]*(?:\\"[^"]*)*)"', dot, re.MULTILINE))


def test_parse_instruction_shapes_operands_and_attributes() -> None:
    ins = parse_instruction(
        "  ROOT %f = (f32[2]{0}, /*index=1*/s32[]) fusion(f32[2]{0} %a, %b.1), kind=kLoop, "
        'calls=%fused_computation.3, backend_config={"x":[1,2]}'
    )
    assert ins is not None and ins.root
    assert (ins.name, ins.opcode, ins.operands) == ("f", "fusion", ("a", "b.1"))
    assert ins.shape == "(f32[2]{0}, /*index=1*/s32[])"
    assert ins.attr("kind") == "kLoop" and ins.callees == [("calls", "fused_computation.3")]
    assert parse_instruction("FileNames") is None


def test_loop_program_as_dot() -> None:
    comps = parse_hlo(LOOP_HLO)
    assert list(comps) == ["fused_computation", "body", "cond", "main.9"]
    assert comps["main.9"].entry and not comps["body"].entry
    dot = to_dot(comps, max_nodes=100, title="step")
    nodes = _nodes(dot.text)
    labels = list(nodes.values())
    # entry: 2 parameters, tuple, while, ROOT (the constant is folded away)
    assert dot.instructions == 5 and dot.note is None
    assert "parameter 0\\nx.1\\nf32[4,8]" in labels
    assert any(lb.startswith("while\\nloop\\n(s32[], f32[4,8], f32[8,8])") for lb in labels)
    # the body is a cluster; its fusion is one node naming what it fused, coloured as a dot
    body = re.search(r'subgraph (cluster_\d+) \{\n    label="body of loop: body"', dot.text)
    assert body and 'label="condition of loop: cond"' in dot.text
    fusion = next(n for n, lb in nodes.items() if lb.startswith("fusion (output)"))
    assert nodes[fusion].endswith("\\ndot, tanh")
    assert re.search(rf'{fusion} \[.*fillcolor="#cfe2ff"', dot.text)
    assert not any(lb.startswith(("constant", "get-tuple-element", "dot\\n")) for lb in labels)
    # a tuple index labels the edge that get-tuple-element folded away
    arg = next(n for n, lb in nodes.items() if lb.startswith("parameter 0\\narg\\n"))
    assert re.search(rf'{arg} -> {fusion} \[label="\[1\]"\];', dot.text)
    assert re.search(rf'n\d+ -> n\d+ \[style=dashed, label="body", lhead={body[1]}\];', dot.text)
    # a folded kind is still drawn when it is the ROOT: the program's output stays visible
    loop = next(n for n, lb in nodes.items() if lb.startswith("while"))
    out = next(n for n, lb in nodes.items() if lb.startswith("ROOT get-tuple-element\\nout"))
    assert nodes[out].endswith("\\nindex 1") and f"  {loop} -> {out};" in dot.text
    assert re.search(rf"{out} \[.*penwidth=2\];", dot.text)


def test_large_graphs_collapse_then_truncate_with_a_note() -> None:
    collapsed = to_dot(parse_hlo(LOOP_HLO), max_nodes=6, title="step")
    assert "subgraph" not in collapsed.text and collapsed.nodes == 5
    assert "loop/call bodies collapsed" in (collapsed.note or "")
    chain = "\n".join(f"  %a{i} = f32[8]{{0}} add(%a{i - 1}, %a{i - 1})" for i in range(1, 40))
    text = f"HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n  %a0 = f32[8]{{0}} parameter(0)\n{chain}\n}}\n"
    cut = to_dot(parse_hlo(text), max_nodes=10, title="chain")
    assert cut.nodes == 10 and cut.instructions == 40
    assert "showing the first 10 of 40 instructions" in cut.text
    assert re.search(r'note \[shape=note, .*label="showing the first 10', cut.text)


def test_rendering_with_and_without_graphviz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = write_graph(LOOP_HLO, tmp_path / "loop.dot", image_format="png")
    assert (tmp_path / "loop.dot").read_text().startswith("digraph hlo {")
    if shutil.which("dot"):  # `make test` installs Graphviz; the image must then exist
        assert out["image"] == tmp_path / "loop.png" and out["render_note"] is None
        assert (tmp_path / "loop.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert out["image"] is None and "wrote DOT only" in out["render_note"]
    monkeypatch.setattr(hlo_graph.shutil, "which", lambda _name: None)
    image, note = render(tmp_path / "loop.dot", "svg")
    assert image is None and "Graphviz 'dot' is not on PATH: wrote DOT only" in (note or "")


def test_graph_of_a_run(compose_run, tmp_path: Path) -> None:
    result = compose_run("program=mlp", "stop_after=compile", "snapshot.graph=true")
    graph = result.manifest["snapshot"]["graph"]
    dot = (result.run_dir / "graph" / "optimized.hlo.dot").read_text()
    assert graph["source"] == "compile/optimized.hlo.txt" and graph["nodes"] == 13
    assert "graph/optimized.hlo.dot" in graph["files"]
    assert dot.count("fusion (") == 6 and "parameter 6\\nx.1\\nf32[64,256]" in dot
    svg = result.run_dir / "graph" / "optimized.hlo.svg"
    if shutil.which("dot"):
        assert "graph/optimized.hlo.svg" in graph["files"]
        assert "<svg" in svg.read_text() and "ynn_fusion" in svg.read_text()
    else:
        assert not svg.exists() and "wrote DOT only" in graph["render_note"]
    # jaxaot-graph draws any run, here the lowered (unoptimized) HLO into a file of its own
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxaot.cli.graph_cmd",
            str(result.run_dir / "lower" / "module.hlo.txt"),
            "-o",
            str(tmp_path / "lowered.dot"),
            "--max-nodes",
            "20",
        ],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"dot: {tmp_path / 'lowered.dot'}" in proc.stdout
    assert "showing the first 20 of" in (tmp_path / "lowered.dot").read_text()
