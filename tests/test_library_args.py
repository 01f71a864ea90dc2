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


@pytest.mark.extra("models")
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


# --- _get_: an object by import path, not called ----------------------------------------------

MLP = (
    "{_init_: 'equinox.nn:MLP', in_size: 4, out_size: 3, width_size: 8, depth: 2, key: {_key_: 0}}"
)


def test_get_parses_and_refuses_other_keys_in_one_line() -> None:
    from jaxaot.config.argspec import bind
    from jaxaot.config.derived import GetNode, InitNode

    bound = bind([{"_init_": "equinox:filter", "_args_": [1, {"_get_": "equinox:is_array"}]}], {})
    node = bound.args[0]
    assert isinstance(node, InitNode) and node.args[1] == GetNode("equinox:is_array")
    for bad, message in (
        ({"_get_": "flax.nnx:Param", "x": 1}, r"^program.args\[0\]: a _get_ takes no other keys"),
        ({"_get_": 3}, r"^program.args\[0\]._get_: expected 'package.module:attribute'"),
    ):
        with pytest.raises(ArgSpecError, match=message):
            bind([bad], {})


@pytest.mark.extra("models")
def test_get_goes_through_the_import_policy(compose_run: Any) -> None:
    from jaxaot.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^program.args\[0\].x._get_='os:system' imports"):
        compose_run(
            "program.target=library_programs:total",
            "program.args=[{_init_: 'library_programs:total', x: {_get_: 'os:system'}}]",
            "stop_after=stage_out",
        )


def test_equinox_filter_of_an_abstract_model_keeps_every_array(compose_run: Any) -> None:
    """``eqx.filter(model, eqx.is_array)`` as an _init_ of the model's _init_: under
    jax.eval_shape the model's arrays are tracers (eqx.is_array is True for them; for a
    ShapeDtypeStruct it is False, which would drop every array): all 6 arrays stay, with
    the values eqx gives."""
    import equinox as eqx

    result = compose_run(
        "program.target=library_programs:total",
        f"program.args=[{{_init_: 'equinox:filter', _args_: [{MLP}, {{_get_: 'equinox:is_array'}}]}}]",
        *QUICK,
    )
    assert result.ok, result.manifest["error"]
    table = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    assert len(table["arguments"]) == 6  # 3 layers x (weight, bias)
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0))
    want = np.asarray(
        jax.jit(lambda m: sum(x.sum() for x in jax.tree.leaves(m)))(eqx.filter(model, eqx.is_array))
    )
    from jaxaot.stages.execute import load_outputs

    (got,) = load_outputs(result.run_dir / "execute").values()
    np.testing.assert_allclose(got, want, rtol=1e-6)


# --- NNX updates and lower.out_shardings -----------------------------------------------------


@pytest.mark.parametrize("out_shardings", ["[data]", "{output: [data]}"])
def test_out_shardings_describe_the_users_output_and_updates_keep_their_input_sharding(
    compose_run: Any, out_shardings: str
) -> None:
    """With NNX arguments the traced function returns (output, updated Variables):
    lower.out_shardings (positional or by pattern) is the user's output's; the doubled kernel
    comes out with the sharding it went in with (its logical names through the rules), not
    the output's spec; execute writes both, the output first."""
    import library_programs as progs  # type: ignore[import-not-found]
    from flax import nnx
    from jaxaot.models.nnx import lazy_sharding
    from jaxaot.stages.execute import load_outputs

    result = compose_run(
        "program.target=library_programs:scale_step",
        f"program.args=[{TINY}, {{shape: [8, 16], init: arange}}]",
        "mesh=data4_model2",
        "lower.logical_axis_rules=[[embed, data], [mlp, model]]",
        f"lower.out_shardings={out_shardings}",
        *QUICK,
    )
    assert result.ok, result.manifest["error"]
    compiled = json.loads((result.run_dir / "compile" / "shardings.json").read_text())
    outs = {r["path"]: r["sharding"] for r in compiled["outputs"]}
    ins = {r["path"]: r["sharding"] for r in compiled["inputs"]}
    assert outs == {"[0]": "P('data',)", "[1]['model']['dense']['kernel']": "P('data', 'model')"}
    assert ins["args[0]['dense']['kernel']"] == "P('data', 'model')"
    got = load_outputs(result.run_dir / "execute")
    assert list(got) == ["[0]", "[1]['model']['dense']['kernel']"]
    with lazy_sharding():
        model = progs.Tiny(nnx.Rngs(0))
    kernel = np.asarray(model.dense.kernel[...])
    np.testing.assert_array_equal(got["[1]['model']['dense']['kernel']"], kernel * 2, strict=True)
