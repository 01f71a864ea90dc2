"""A static argument before the traced ones: every file names the inputs by their position in
``program.args`` (the executable numbers only the traced ones), arguments.txt shows each static
value, and a trace that needed a concrete value from a literal says which one to make static."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from jaxaot.errors import StageError
from jaxaot.stages import memory_breakdown as mb
from jaxaot.util.fsio import sha256_file

T = "program.target=static_first_programs"
EINSUM = '"ij,jk->ik"'


def _run(tmp_path: Path, name: str, *overrides: str) -> Any:
    return jaxaot.run(jaxaot.compose(list(overrides)), run_dir=tmp_path / name)


def _argument_paths(run_dir: Path) -> tuple[list[str], set[str], dict[str, Any]]:
    """(signature.json's input paths, memory_breakdown.json's argument paths, the breakdown)."""
    signature = json.loads((run_dir / "stage_out" / "signature.json").read_text())
    found = json.loads((run_dir / "compile" / mb.ARTIFACT).read_text())
    rows = {r["path"] for r in found["top"] if r["kind"] == "argument"}
    return [i["path"] for i in signature["inputs"]], rows, found


def _sharding_paths(run_dir: Path) -> list[str]:
    shardings = json.loads((run_dir / "compile" / "shardings.json").read_text())
    return [r["path"] for r in shardings["inputs"]]


def test_a_static_first_argument_leaves_the_traced_ones_their_positions(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        "a",
        "program.target=jax.numpy:einsum",
        f"program.args=[{EINSUM},f32[8,128],f32[128,8]]",
        "stage_out.static_argnums=[0]",
        "stop_after=compile",
    )
    inputs, rows, found = _argument_paths(tmp_path / "a")
    assert inputs == ["args[1]", "args[2]"] and rows == set(inputs)
    assert (
        set(found["groups"]["arguments"]) == set(inputs) == set(found["peak_groups"]["arguments"])
    )
    assert found["static_positions"] == [0]
    assert _sharding_paths(tmp_path / "a") == inputs  # shardings.json too
    top = result.manifest["stages"]["compile"]["metrics"]["peak_top"]
    assert "f32[8,128] args[1] (4.0 KiB)" in top and "f32[128,8] args[2] (4.0 KiB)" in top
    text = (tmp_path / "a" / "stage_out" / "arguments.txt").read_text()
    assert "static args[0] = 'ij,jk->ik'" in text and "= None" not in text
    table = json.loads((tmp_path / "a" / "stage_out" / "arguments.json").read_text())
    assert table["static"] == [{"path": "args[0]", "value": "'ij,jk->ik'"}]


def test_static_values_by_parameter_name_keyword_ones_too(tmp_path: Path) -> None:
    _run(
        tmp_path,
        "a",
        f"{T}:first",
        f"program.args=[{EINSUM},f32[8,128],f32[128,8]]",
        "stage_out.static_argnums=[0]",
        "stop_after=stage_out",
    )
    assert "static s = 'ij,jk->ik'" in (tmp_path / "a" / "stage_out" / "arguments.txt").read_text()
    _run(
        tmp_path,
        "b",
        f"{T}:scaled",
        "program.args=[f32[4]]",
        "+program.kwargs={times: 3}",
        "stage_out.static_argnames=[times]",
        "stop_after=stage_out",
    )
    assert "static times = 3" in (tmp_path / "b" / "stage_out" / "arguments.txt").read_text()


def test_a_store_hit_names_the_inputs_as_this_program_does(tmp_path: Path) -> None:
    """``first(s, x, y)`` and ``last(x, y, s)`` compile to one executable (one store entry):
    the second run's breakdown names x and y args[0] and args[1], as its signature.json does."""
    a = _run(
        tmp_path,
        "a",
        f"{T}:first",
        f"program.args=[{EINSUM},f32[8,128],f32[128,8]]",
        "stage_out.static_argnums=[0]",
        "stop_after=compile",
    )
    b = _run(
        tmp_path,
        "b",
        f"{T}:last",
        f"program.args=[f32[8,128],f32[128,8],{EINSUM}]",
        "stage_out.static_argnums=[2]",
        "stop_after=compile",
    )
    assert b.manifest["stages"]["compile"]["status"] == "cached"
    for run, want in (("a", ["args[1]", "args[2]"]), ("b", ["args[0]", "args[1]"])):
        inputs, rows, _ = _argument_paths(tmp_path / run)
        assert inputs == want and rows == set(want)
        assert _sharding_paths(tmp_path / run) == want
    top_a = a.manifest["stages"]["compile"]["metrics"]["peak_top"]
    top_b = b.manifest["stages"]["compile"]["metrics"]["peak_top"]
    assert top_b == top_a.replace("args[1]", "args[0]").replace("args[2]", "args[1]")
    for name in (mb.ARTIFACT, "shardings.json"):
        artifact = b.manifest["stages"]["compile"]["artifacts"][f"compile/{name}"]
        assert artifact["sha256"] == sha256_file(tmp_path / "b" / "compile" / name)


def test_relabelling_maps_executable_positions_through_the_static_ones() -> None:
    rows = [
        {"kind": "argument", "parameter": 0, "path": "args[0]['w']", "subtree": "args[0]['w']"},
        {"kind": "argument", "parameter": 1, "path": "args[1]", "subtree": "args[1]"},
        {"kind": "argument", "parameter": 2, "path": "kwargs['k']", "subtree": "kwargs['k']"},
        {"kind": "output", "instruction": "dot"},
    ]
    groups = {"arguments": {"args[0]['w']": 8, "args[1]": 4, "kwargs['k']": 2}, "outputs": 1}
    plain = {"top": rows, "groups": groups, "peak_groups": groups}
    assert mb.relabelled(plain, []) is plain
    moved = mb.relabelled(plain, [0, 2])  # f(s0, x, s2, y, *, k): x is 1, y is 3
    assert [r.get("path") for r in moved["top"]] == ["args[1]['w']", "args[3]", "kwargs['k']", None]
    assert moved["groups"]["arguments"] == {"args[1]['w']": 8, "args[3]": 4, "kwargs['k']": 2}
    assert moved["static_positions"] == [0, 2]
    back = mb.relabelled(moved, [])  # to a program with no static argument: as the executable
    assert back["top"] == rows and back["groups"] == groups and back["static_positions"] == []


@pytest.mark.parametrize(
    ("target", "args", "extra", "literal", "fix"),
    [
        ("predict", "[f32[16,16],f32[4,16],3]", [], "args[2] is the literal 3", "argnums=[2]"),
        ("branch", "[f32[4],true]", [], "args[1] is the literal True", "argnums=[1]"),
        # the positions already static stay in the fix
        (
            "activated",
            '["tanh",f32[4],2]',
            ["stage_out.static_argnums=[0]"],
            "args[2] is the literal 2",
            "argnums=[0,2]",
        ),
        (
            "scaled",
            "[f32[4]]",
            ["+program.kwargs={times: 3}"],
            "kwargs.times is the literal 3",
            "argnames=[times]",
        ),
    ],
)
def test_a_literal_used_in_python_gets_a_static_hint(
    tmp_path: Path, target: str, args: str, extra: list[str], literal: str, fix: str
) -> None:
    overrides = [f"{T}:{target}", f"program.args={args}", *extra, "stop_after=stage_out"]
    with pytest.raises(StageError) as info:
        _run(tmp_path, "a", *overrides)
    text = str(info.value)
    assert "\n" not in text and "https://" not in text and "The error occurred" not in text
    assert text.startswith("stage 'stage_out' failed: ") and "Error: " in text
    assert f"(while tracing static_first_programs:{target}(" in text  # what it was traced with
    assert text.endswith(
        f"; hint: {literal}; a value the function uses in Python (range, if, shapes) must be "
        f"static: stage_out.static_{fix}"
    )
    # the hint's fix works
    if "argnums" in fix:
        overrides = [o for o in overrides if not o.startswith("stage_out.static_argnums")]
    result = _run(tmp_path, "b", *overrides, f"stage_out.static_{fix}")
    assert result.manifest["stages"]["stage_out"]["status"] == "ran"


def test_other_trace_errors_get_no_static_hint(tmp_path: Path) -> None:
    with pytest.raises(StageError) as info:
        _run(tmp_path, "a", f"{T}:mismatched", "program.args=[f32[4,4],1]", "stop_after=stage_out")
    assert "hint:" not in str(info.value) and "TypeError" in str(info.value)
