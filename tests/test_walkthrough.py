"""JAX's ahead-of-time walkthrough (``shared/reference/jax_aot_walkthrough.md``), through the CLI.

``f(x, y) = 2 * x + y`` is the shipped ``axpy`` program. Each case is one ``jaxaot`` process
with ``hydra.run.dir`` set, and reads the stage folders' files the way a script would.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import read_manifest

# the walkthrough as a user runs it: one `jaxaot` process a case
pytestmark = pytest.mark.plain_process


def _module(run_dir: Path) -> str:
    return (run_dir / "lower" / "module.stablehlo.mlir").read_text()


def _output(run_dir: Path) -> np.ndarray:
    with np.load(run_dir / "execute" / "outputs.npz") as z:
        return z["out0"]


def test_lower_3_4_multiplies_by_2_costs_2_flops_and_runs_to_10(cli) -> None:
    proc, run_dir = cli("program=axpy", "program.args=[3,4]")
    module = _module(run_dir)
    # %c = stablehlo.constant dense<2> : tensor<i32>; %0 = stablehlo.multiply %c, %arg0
    assert re.search(r"stablehlo\.constant dense<2> : tensor<i32>", module)
    assert re.search(r"stablehlo\.multiply %\w+, %arg0 : tensor<i32>", module)
    assert "stablehlo.add" in module
    assert "@main(%arg0: tensor<i32>, %arg1: tensor<i32>)" in module
    cost = json.loads((run_dir / "compile" / "cost_analysis.json").read_text())
    assert cost["flops"] == 2.0
    out = _output(run_dir)
    assert out.shape == () and out.dtype == np.int32 and int(out) == 10
    assert "2 FLOP" in proc.stdout  # the summary


def test_static_x_7_folds_the_constant_14_and_runs_to_19(cli) -> None:
    _, run_dir = cli("program=axpy", "stage_out.static_argnums=[0]", "program.args=[7,5]")
    module = _module(run_dir)
    assert re.search(r"stablehlo\.constant dense<14> : tensor<i32>", module)
    assert "stablehlo.multiply" not in module
    assert "@main(%arg0: tensor<i32>)" in module  # only the non-static y is an argument
    assert int(_output(run_dir)) == 19


def test_int32_3_arrays_for_scalar_types_are_refused_naming_the_input(cli, tmp_path: Path) -> None:
    """The walkthrough calls the scalar-typed executable with int32[3] arrays and JAX refuses
    ("Argument types differ ..."); jaxaot refuses the same inputs before the call, naming the
    file, the declared and the found type (inputs are never converted)."""
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, np.arange(3, dtype=np.int32))
    np.save(b, np.arange(3, dtype=np.int32))
    proc, run_dir = cli(
        "program=axpy", "program.args=[i32[],i32[]]", f"execute.inputs=[{a},{b}]", expect_ok=False
    )
    assert proc.returncode != 0
    assert f"execute.inputs[0]: '{a}' holds i32[3], expected i32[]" in proc.stderr
    assert "Traceback" not in proc.stderr
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed"
    assert [manifest["stages"][s]["status"] for s in ("lower", "execute")] == ["ran", "failed"]
