"""Canonical artifact text (pipeline/util/canonical.py) and the diff helpers (pipeline/util/textdiff.py)."""

from __future__ import annotations

from jaxaot.util.canonical import (
    CANONICAL_ARTIFACTS,
    canonical_hlo,
    canonical_jaxpr,
    canonical_json,
    canonical_stablehlo,
)
from jaxaot.util.textdiff import bounded, changed_keys, line_counts, unified

OPTIMIZED = """\
HloModule jit_f.3, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

FileNames
1 "/home/alice/project/model.py"
2 "/usr/lib/python3/site-packages/_pytest/python.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=4 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}


%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %tanh.0 = f32[8]{0} tanh(%param_0), metadata={op_name="jit(f)/tanh \\"q}\\"" stack_frame_id=1}
}

ENTRY %main.2 (x.1: f32[8]) -> f32[8] {
  %x.1 = f32[8]{0} parameter(0), metadata={op_name="x"}
  ROOT %f = f32[8]{0} fusion(%x.1), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/tanh" source_file="/home/alice/project/model.py" source_line=12}, backend_config={"outer_dimension_partitions":["2"]}
}
"""


def test_canonical_hlo_drops_debug_tables_metadata_and_module_name() -> None:
    text = canonical_hlo(OPTIMIZED)
    assert text.startswith("HloModule main_module, is_scheduled=true")
    for gone in ("FileNames", "StackFrames", "/home/alice", "_pytest", "metadata", "stack_frame"):
        assert gone not in text
    # what describes the program stays: fusion kind, callee, backend config, shapes
    assert "kind=kLoop, calls=%fused_computation, backend_config=" in text
    assert "ROOT %tanh.0 = f32[8]{0} tanh(%param_0)\n" in text
    assert "\n\n\n" not in text and text.endswith("}\n")


def test_canonical_hlo_is_the_same_from_another_checkout_and_caller() -> None:
    moved = (
        OPTIMIZED.replace("/home/alice/project", "/srv/ci/checkout")
        .replace("line=12", "line=40")
        .replace("jit_f.3", "jit_f")
    )
    assert canonical_hlo(moved) == canonical_hlo(OPTIMIZED)


def test_canonical_jaxpr_masks_object_addresses() -> None:
    a = "{ lambda ; a:f32[]. let b = f[cb=<obj at 0x7f12ab34cd56>] a in (b,) }"
    b = a.replace("0x7f12ab34cd56", "0x55d0aa0b1c2f")
    assert canonical_jaxpr(a) == canonical_jaxpr(b)
    assert "0x7f" not in canonical_jaxpr(a)


def test_canonical_stablehlo_and_json() -> None:
    mlir = 'module @jit_f_7 attributes {x = 1} {\n  %0 = stablehlo.add %a, %b loc(#loc3)\n}\n#loc3 = loc("f.py":1:2)\n'
    assert (
        canonical_stablehlo(mlir)
        == "module @main_module attributes {x = 1} {\n  %0 = stablehlo.add %a, %b\n}\n"
    )
    assert (
        canonical_json('{"b": 1, "a": [1, 2]}') == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    )


def test_artifacts_are_in_pipeline_order() -> None:
    stages = [a.stage for a in CANONICAL_ARTIFACTS]
    assert stages == sorted(stages, key=["stage_out", "lower", "compile"].index)
    assert CANONICAL_ARTIFACTS[0].where == "stage_out (jaxpr)"


def test_changed_keys_speak_hydra_override_paths() -> None:
    old = {"program": {"args": [{"shape": [8]}, {"shape": [8]}], "name": "f"}, "debug": False}
    new = {"program": {"args": [{"shape": [16]}, "f32[8]"], "name": "f"}}
    assert changed_keys(old, new) == [
        "debug: false -> (absent)",
        "program.args.0.shape: [8] -> [16]",
        'program.args.1: {"shape": [8]} -> f32[8]',
    ]


def test_bounded_diff_says_how_much_is_left_out() -> None:
    diff = unified("a\nb\nc\n", "a\nB\nc\nd\n", "old", "new")
    assert line_counts(diff) == (2, 1)
    text = bounded(diff, 3, "/run/snapshot.diff")
    assert text.splitlines()[:2] == ["--- old", "+++ new"]
    assert text.endswith(f"... {len(diff) - 3} more diff lines; full diff: /run/snapshot.diff")
    assert bounded(diff, 100) == "\n".join(diff)
