"""jaxaot-diff compares optimized HLO as structure: fusions by kind, ops added and removed,
collectives and their bytes, bytes per fusion, layouts; jaxlib's HLO parser first, the regex
reader when jaxlib refuses the text."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env
from jaxaot.snapshots.hlo_structure import compare, structure

A = textwrap.dedent("""\
    HloModule m

    %fused_computation (p0: f32[8,16]) -> f32[8,16] {
      %p0 = f32[8,16]{1,0} parameter(0)
      ROOT %t = f32[8,16]{1,0} tanh(%p0)
    }

    ENTRY %main (x: f32[8,16]) -> f32[8,16] {
      %x = f32[8,16]{1,0} parameter(0)
      ROOT %fusion = f32[8,16]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation
    }
    """)

B = textwrap.dedent("""\
    HloModule m

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %fused_computation (p0: f32[8,16]) -> f32[8,16] {
      %p0 = f32[8,16]{1,0} parameter(0)
      %e = f32[8,16]{1,0} exponential(%p0)
      ROOT %t = f32[8,16]{1,0} tanh(%e)
    }

    ENTRY %main (x: f32[8,16]) -> f32[8,16] {
      %x = f32[8,16]{1,0} parameter(0)
      %fusion = f32[8,16]{0,1} fusion(%x), kind=kOutput, calls=%fused_computation
      %copy = f32[8,16]{1,0} copy(%fusion)
      ROOT %ar = f32[8,16]{1,0} all-reduce(%copy), replica_groups={}, to_apply=%add
    }
    """)


@pytest.mark.requires_jax("0.10.2")  # jaxlib lists an HLO computation's instructions
def test_two_modules_compared_as_structure() -> None:
    got = compare(A, B)
    assert got["parsers"] == {"a": "jaxlib", "b": "jaxlib"}
    assert got["fusion_kinds"] == {"kLoop": {"a": 1, "b": 0}, "kOutput": {"a": 0, "b": 1}}
    assert got["opcodes"]["all-reduce"] == {"a": 0, "b": 1}
    assert got["opcodes"]["copy"] == {"a": 0, "b": 1}
    assert got["opcodes"]["exponential"] == {"a": 0, "b": 1}  # inside the fusion
    assert "tanh" not in got["opcodes"]  # in both
    assert got["collectives"] == {
        "all-reduce": {"a_count": 0, "b_count": 1, "a_bytes": 0.0, "b_bytes": 8 * 16 * 4}
    }
    assert got["fusion_bytes"]["a"] == 2 * 8 * 16 * 4  # operand + result
    assert got["layout_changes"] == {
        "count": 1,
        "examples": [{"name": "fusion", "a": "{1,0}", "b": "{0,1}"}],
    }
    assert not got["same"] and compare(A, A)["same"]


@pytest.mark.requires_jax("0.10.2")  # jaxlib lists an HLO computation's instructions
def test_text_jaxlib_refuses_is_read_by_the_regex_reader() -> None:
    """A text from another XLA (an opcode this one does not know): the regex reader reads it,
    says so, and finds the same facts."""
    other = A.replace(
        "  %x = f32[8,16]{1,0} parameter(0)\n",
        "  %x = f32[8,16]{1,0} parameter(0)\n  %y = f32[8,16]{1,0} frobnicate(%x)\n",
    )
    s, a = structure(other), structure(A)
    assert s.parser == "regex" and a.parser == "jaxlib"
    assert s.opcodes["frobnicate"] == 1 and s.fusion_kinds == a.fusion_kinds
    assert s.fusion_bytes == a.fusion_bytes and s.layouts["fusion"] == a.layouts["fusion"]
    elided = A.replace(  # jaxaot's elided constants are read by jaxlib's parser itself
        "  %x = f32[8,16]{1,0} parameter(0)\n",
        "  %x = f32[8,16]{1,0} parameter(0)\n  %c = f32[1024]{0} constant({...})\n",
    )
    assert structure(elided).parser == "jaxlib"


@pytest.mark.requires_jax("0.10.2")  # jaxlib lists an HLO computation's instructions
def test_jaxaot_diff_shows_the_structure_before_the_text(tmp_path: Path) -> None:
    for name, x in (("a", "f32[64,256]"), ("b", "f32[8,256]")):
        cfg = jaxaot.compose(["program=mlp", "stop_after=compile", f"program.args.1={x}"])
        jaxaot.run(cfg, run_dir=tmp_path / name)
    args = [sys.executable, "-m", "jaxaot.cli.diff_cmd", str(tmp_path / "a"), str(tmp_path / "b")]
    text = subprocess.run(args, capture_output=True, text=True, env=cli_env()).stdout
    assert text.index("optimized HLO structure (jaxlib parser)") < text.index("first difference")
    assert "fusion bytes touched" in text
    report = json.loads(
        subprocess.run([*args, "--json"], capture_output=True, text=True, env=cli_env()).stdout
    )
    s = report["stages"]["compile"]["hlo_structure"]
    assert s["fusion_bytes"]["a"] > s["fusion_bytes"]["b"] > 0
