"""Every shipped ``conf/program/*.yaml`` composed, validated and run through all four stages,
as shipped: the collective programs carry their own ``axis_env``."""

from __future__ import annotations

import jaxaot
import numpy as np
import pytest
from jaxaot.api import conf_dir
from jaxaot.config.argspec import bind
from jaxaot.config.order import STAGES
from jaxaot.config.trust import make_policy
from jaxaot.stages.stage_out import resolve_target

PROGRAMS = sorted(p.stem for p in (conf_dir() / "program").glob("*.yaml"))
# The model programs run through all four stages in tests/test_shipped_models.py, from their
# YAML with the data arguments given as arrays, with this file's checks (its _run): every
# other program runs here.
MODEL_PROGRAMS = ("llama_nnx", "llama_nnx_train", "eqx_mlp", "eqx_mlp_train")
RUNNABLE = [p for p in PROGRAMS if p not in MODEL_PROGRAMS]


def test_the_issues_examples_are_shipped() -> None:
    assert {"axpy", "mlp", "transformer", "transformer_train", "attention"} <= set(RUNNABLE)


def test_the_model_programs_run_elsewhere_are_shipped() -> None:
    assert set(MODEL_PROGRAMS) <= set(PROGRAMS)


def test_a_collectives_program_brings_its_axis_env_and_an_override_wins() -> None:
    shipped = jaxaot.validate(jaxaot.compose(["program=collectives"]))
    assert shipped.stage_out.axis_env == [["i", 4], ["j", 2]]
    given = jaxaot.validate(
        jaxaot.compose(["program=collectives", "stage_out.axis_env=[[i,2],[j,2]]"])
    )
    assert given.stage_out.axis_env == [["i", 2], ["j", 2]]
    assert jaxaot.validate(jaxaot.compose(["program=axpy"])).stage_out.axis_env is None


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_config_composes_validates_and_passes_the_default_policy(name: str) -> None:
    typed = jaxaot.validate(jaxaot.compose([f"program={name}"]))
    assert typed.program.name == name
    assert callable(resolve_target(typed.program.target, policy=make_policy()))
    bound = bind(
        typed.program.args,
        typed.program.kwargs,
        static_argnums=typed.stage_out.static_argnums,
        static_argnames=typed.stage_out.static_argnames,
    )
    assert bound.traced_args()


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_program_config_runs_through_all_stages(compose_run, name: str) -> None:
    result = compose_run(f"program={name}", "execute.repeats=1", "execute.warmup=0")
    assert result.ok, result.manifest["error"]
    assert [result.manifest["stages"][s]["status"] for s in STAGES[:2]] == ["ran", "ran"]
    assert result.manifest["stages"]["compile"]["status"] in ("ran", "cached")
    # captured_constant exists to draw the advice to pass big constants as arguments.
    advice = ["large constant"] if name == "captured_constant" else []
    assert [w for w in result.manifest["warnings"] if "large constant" not in w] == []
    assert [
        "large constant" for w in result.manifest["warnings"] if "large constant" in w
    ] == advice
    assert result["compile"].cost and result["compile"].cost["flops"] > 0
    with np.load(result.run_dir / "execute" / "outputs.npz") as z:
        assert z.files and all(np.isfinite(z[k]).all() for k in z.files)
