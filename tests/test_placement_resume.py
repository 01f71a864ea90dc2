"""A lowering with layouts or memory kinds from config, compiled again in a resumed run
(``resume_from=<run> start_at=compile``): the compile goes through the lowering's export, which
keeps neither (jax 0.10.2), and asks for the recorded ones again. The executable takes the same
input formats as the first run's and gives the same outputs bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jaxaot.stages.execute import load_outputs

pytestmark = pytest.mark.slow

MLP = ("program=mlp", "execute.warmup=0", "execute.repeats=1")
STEP = ("program=offload_train", "execute.warmup=0", "execute.repeats=1")
CASES = {
    "layouts": (*MLP, "lower.in_layouts={x: [1, 0]}", "lower.out_layouts=[1, 0]"),
    "auto_layouts": (*MLP, "lower.in_layouts=auto"),
    "memory_kinds": (
        *STEP,
        "lower.in_memory_kinds={params/**: pinned_host, opt_state/**: pinned_host}",
        "lower.out_memory_kinds={output/1/**: pinned_host, output/2/**: pinned_host}",
    ),
}


def _rows(run_dir: Path) -> dict[str, list[Any]]:
    shardings = json.loads((run_dir / "compile" / "shardings.json").read_text())
    return {
        side: [(r["memory_kind"], r["layout"]) for r in shardings[side]]
        for side in ("inputs", "outputs")
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_compile_keeps_the_layouts_and_memory_kinds(compose_run: Any, case: str) -> None:
    first = compose_run(*CASES[case])
    assert json.loads((first.run_dir / "lower" / "lowered.json").read_text())["placement"]
    again = compose_run(*CASES[case], f"resume_from={first.run_dir}", "start_at=compile")
    stages = again.manifest["stages"]
    assert stages["lower"]["status"] == "resumed" and stages["compile"]["status"] == "ran"
    # Another compile (the export's), not the first run's executable from the store.
    assert stages["compile"]["key"] != first.manifest["stages"]["compile"]["key"]
    a, b = first["compile"].compiled, again["compile"].compiled
    assert b.input_formats == a.input_formats and b.output_formats == a.output_formats
    assert _rows(again.run_dir) == _rows(first.run_dir)
    want, got = (load_outputs(r.run_dir / "execute") for r in (first, again))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k  # bit for bit
