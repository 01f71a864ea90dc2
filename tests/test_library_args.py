"""Library models as derived arguments, written as their libraries' users write them: a Flax 0.12
NNX model with logical sharding names and eager sharding on (Flax's default), messages about a
failing init whose arguments are library objects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jaxaot.errors import ArgSpecError
from jaxaot.stages import derived_values
from jaxaot.stages.resolving import describe

QUICK = ("execute.warmup=0", "execute.repeats=1")
TINY = "{_init_: 'library_programs:Tiny', rngs: {_call_: 'flax.nnx:Rngs', _args_: [0]}}"


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr(derived_values, "_HOST_OBJECTS", {})


def test_flax_default_eager_sharding_model_keeps_its_names_as_metadata(compose_run: Any) -> None:
    """Created inside jaxaot with no mesh in context (stage_out's eval_shape, execute's jit):
    the kernel's names go through lower.logical_axis_rules; the outputs are nnx.jit's."""
    import library_programs as progs  # type: ignore[import-not-found]
    from flax import nnx
    from jaxaot.models.nnx import lazy_sharding
    from jaxaot.stages.execute import load_outputs

    with pytest.raises(ValueError, match="mesh"):  # Flax's default, outside any context
        progs.Tiny(nnx.Rngs(0))
    result = compose_run(
        "program.target=library_programs:forward",
        f"program.args=[{TINY}, {{shape: [4, 16], init: arange}}]",
        "mesh=data4_model2",
        "lower.logical_axis_rules=[[embed, data], [mlp, model]]",
        *QUICK,
    )
    assert result.ok, result.manifest["error"]
    decided = json.loads((result.run_dir / "lower" / "path_shardings.json").read_text())
    spec = {d["path"]: d["spec"] for d in decided["inputs"]}
    assert spec["model/dense/kernel"] == "P('data', 'model')"
    with lazy_sharding():
        model = progs.Tiny(nnx.Rngs(0))
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    want = np.asarray(nnx.jit(progs.forward)(model, x))
    got = list(load_outputs(result.run_dir / "execute").values())
    assert len(got) == 1
    # The contraction is split over 4 devices (embed -> data): sums in another order.
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5, strict=True)


def test_a_failing_init_of_library_objects_names_them_in_one_line(compose_run: Any) -> None:
    with pytest.raises(ArgSpecError) as err:
        compose_run(
            "program.target=library_programs:forward",
            "program.args=[{_init_: 'library_programs:failing', "
            "_args_: [{_call_: 'flax.nnx:Rngs', _args_: [0]}]}, f32[4,16]]",
            "stop_after=stage_out",
        )
    text = str(err.value)
    assert text.startswith("program.args[0]: library_programs:failing(Rngs(")
    assert "raised ValueError: this init fails (called under jax.eval_shape)" in text
    assert "\n" not in text


def test_describe_checks_types_never_attributes() -> None:
    import library_programs as progs  # type: ignore[import-not-found]
    from flax import nnx

    assert describe(np.zeros((2, 3), np.float32)) == "f32[2,3]"
    assert describe(jax.ShapeDtypeStruct((4,), jax.numpy.bfloat16)) == "bf16[4]"
    assert describe(jax.numpy.zeros((5,), jax.numpy.int32)) == "i32[5]"
    assert describe(np.float32(1.0)) == "f32[]"
    assert describe(progs.AnyAttribute()) == "AnyAttribute()"
    assert describe(progs.BadRepr()) == "<BadRepr>"
    assert describe(nnx.Rngs(0)).startswith("Rngs(")
    assert "\n" not in describe(nnx.Rngs(0))
