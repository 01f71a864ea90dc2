"""Every shipped ``conf/program/*.yaml`` composed, validated and run through all four stages.

The collective programs need ``stage_out.axis_env`` and a mesh; they are run in their own
tests. Here they are composed and validated only.
"""

from __future__ import annotations

import numpy as np
import pytest

import pipeline
from pipeline.api import conf_dir
from pipeline.argspec import bind
from pipeline.config import STAGES

PROGRAMS = sorted(p.stem for p in (conf_dir() / "program").glob("*.yaml"))
NEEDS_AXIS_ENV = {p for p in PROGRAMS if p.startswith("collectives")}
RUNNABLE = [p for p in PROGRAMS if p not in NEEDS_AXIS_ENV]


def test_the_issues_examples_are_shipped() -> None:
    assert {"axpy", "mlp", "transformer", "transformer_train", "attention"} <= set(RUNNABLE)


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_config_composes_and_validates(name: str) -> None:
    typed = pipeline.validate(pipeline.compose([f"program={name}"]))
    assert typed.program.name == name
    bound = bind(typed.program.args, typed.program.kwargs,
                 static_argnums=typed.stage_out.static_argnums,
                 static_argnames=typed.stage_out.static_argnames)  # fmt: skip
    assert bound.traced_args()


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_program_config_runs_through_all_stages(compose_run, name: str) -> None:
    result = compose_run(f"program={name}", "execute.repeats=1", "execute.warmup=0")
    assert result.ok, result.manifest["error"]
    assert [result.manifest["stages"][s]["status"] for s in STAGES[:2]] == ["ran", "ran"]
    assert result.manifest["stages"]["compile"]["status"] in ("ran", "cached")
    # captured_constant exists to draw the advice to pass big constants as arguments (issue 19).
    advice = ["large constant"] if name == "captured_constant" else []
    assert [w for w in result.manifest["warnings"] if "large constant" not in w] == []
    assert ["large constant" for w in result.manifest["warnings"] if "large constant" in w] == advice
    assert result["compile"].cost and result["compile"].cost["flops"] > 0
    with np.load(result.run_dir / "execute" / "outputs.npz") as z:
        assert z.files and all(np.isfinite(z[k]).all() for k in z.files)
