"""Behaviour of the shipped example programs and of their ``conf/program/*.yaml`` configs."""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import FAST_CPU_CODEGEN
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from jaxaot.examples import collectives, transformer
from jaxaot.examples.axpy import axpy
from jaxaot.examples.mlp import mlp, mlp_loss
from omegaconf import OmegaConf

PROGRAM_DIR = Path(__file__).resolve().parents[1] / "conf" / "program"
PROGRAM_FILES = sorted(PROGRAM_DIR.glob("*.yaml"))
# Programs whose arguments come from a model's own init (_init_): this file's spec-to-abstract
# conversion does not evaluate them; tests/test_shipped_models.py runs each through jaxaot and
# compares it with the same program in plain JAX.
DERIVED_FILES = [p for p in PROGRAM_FILES if "_init_" in p.read_text()]
SPEC_FILES = [p for p in PROGRAM_FILES if p not in DERIVED_FILES]
MESH = AbstractMesh((4, 2), ("i", "j"))
_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32, "bool": jnp.bool_}
_KEY_LINE = re.compile(r"^\s*(?:-\s+)*[A-Za-z_][\w-]*:(?:\s|$)")


# --- helpers ----------------------------------------------------------------------------


def _init_params(
    seed: int,
    dtype: Any = jnp.float32,
    *,
    vocab: int = 256,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    d_head: int = 16,
    d_ff: int = 128,
) -> dict[str, Any]:
    """Transformer params initialised as in ``transformer.yaml`` (normal(0.02), zero norms),
    at a smaller width so the tests compile fast. NumPy draws them: eager ``jax.random``
    compiles one kernel per shape, which costs seconds on a 2-core CPU."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(0.02 * rng.standard_normal(shape), dtype)

    head = (n_layers, d_model, n_heads, d_head)
    return {
        "embed": normal(vocab, d_model),
        "layers": {
            "ln1": jnp.zeros((n_layers, d_model), dtype),
            "wq": normal(*head),
            "wk": normal(*head),
            "wv": normal(*head),
            "wo": normal(n_layers, n_heads, d_head, d_model),
            "ln2": jnp.zeros((n_layers, d_model), dtype),
            "w1": normal(n_layers, d_model, d_ff),
            "w2": normal(n_layers, d_ff, d_model),
        },
        "ln_f": jnp.zeros((d_model,), dtype),
        "unembed": normal(d_model, vocab),
    }


def _tokens(seed: int, shape: tuple[int, int] = (2, 16), vocab: int = 256) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _abstract(spec: Any) -> Any:
    """Turn an argument spec into a ShapeDtypeStruct pytree (literals stay as they are)."""
    if isinstance(spec, list):
        return [_abstract(s) for s in spec]
    if isinstance(spec, dict) and "shape" in spec:
        return jax.ShapeDtypeStruct(tuple(spec["shape"]), _DTYPES[spec["dtype"]])
    if isinstance(spec, dict):
        return {k: _abstract(v) for k, v in spec.items()}
    match = re.fullmatch(r"(\w+)\[([\d,]*)\]", spec) if isinstance(spec, str) else None
    if match:
        dims = tuple(int(d) for d in match[2].split(",") if d)
        return jax.ShapeDtypeStruct(dims, _DTYPES[match[1]])
    return spec


def _lower_per_replica(fn: Callable[..., Any], dtype: Any = jnp.float32) -> str:
    """Lower a named-axis program under shard_map on the 4x2 abstract mesh; StableHLO text."""
    mapped = jax.shard_map(fn, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=False)
    traced = jax.jit(mapped).trace(jax.ShapeDtypeStruct((), dtype))
    return traced.lower(lowering_platforms=("cpu",)).as_text()


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.jit(fn)`` compiled with :data:`conftest.FAST_CPU_CODEGEN`."""
    return jax.jit(fn, compiler_options=FAST_CPU_CODEGEN)


@pytest.fixture(scope="module")
def params() -> dict[str, Any]:
    return _init_params(0)


# --- axpy -------------------------------------------------------------------------------


def test_axpy_lowers_to_multiply_by_two_and_add() -> None:
    text = jax.jit(axpy).lower(3, 4).as_text()
    assert "stablehlo.constant dense<2>" in text
    assert "stablehlo.multiply" in text
    assert "stablehlo.add" in text
    assert int(jax.jit(axpy)(3, 4)) == 10


# --- mlp --------------------------------------------------------------------------------


def test_mlp_output_shape_dtype_and_loss() -> None:
    rng = np.random.default_rng(0)
    sizes = [16, 32, 32, 8]
    params = [
        {
            "w": jnp.asarray(0.05 * rng.standard_normal((din, dout)), jnp.float32),
            "b": jnp.zeros(dout),
        }
        for din, dout in itertools.pairwise(sizes)
    ]
    x = jnp.asarray(rng.standard_normal((5, 16)), jnp.float32)
    out = jax.jit(mlp)(params, x)
    assert out.shape == (5, 8)
    assert out.dtype == jnp.float32
    loss = jax.jit(mlp_loss)
    assert float(loss(params, x, out)) == pytest.approx(0.0, abs=1e-6)
    assert float(loss(params, x, out + 2.0)) == pytest.approx(4.0)


# --- transformer ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_transformer_forward_shape_and_dtype(dtype: Any) -> None:
    params = _init_params(0, dtype)
    logits = _jit(transformer.forward)(params, _tokens(1))
    assert logits.shape == (2, 16, 256)
    assert logits.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32))))


def test_transformer_is_causal(params: dict[str, Any]) -> None:
    tokens = _tokens(1)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    forward = _jit(transformer.forward)
    before, after = np.asarray(forward(params, tokens)), np.asarray(forward(params, changed))
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])


def test_transformer_loss_at_init_is_near_log_vocab(params: dict[str, Any]) -> None:
    value = _jit(transformer.loss)(params, _tokens(1), _tokens(2))
    assert value.shape == ()
    assert value.dtype == jnp.float32
    assert abs(float(value) - math.log(256)) < 0.1


def test_train_step_decreases_loss_and_keeps_structure(params: dict[str, Any]) -> None:
    tokens, targets = _tokens(1), _tokens(2)
    step = _jit(transformer.train_step)
    state, losses = params, []
    for _ in range(3):
        state, value = step(state, tokens, targets, 0.1)
        losses.append(float(value))
    losses.append(float(_jit(transformer.loss)(state, tokens, targets)))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    # Same nested dict keys, and per leaf the same shape and dtype.
    layout = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    assert layout == jax.tree.map(lambda a: (a.shape, a.dtype), params)


def test_train_step_keeps_bf16_params() -> None:
    params = _init_params(0, jnp.bfloat16)
    new_params, value = _jit(transformer.train_step)(params, _tokens(1), _tokens(2))
    assert value.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(new_params)} == {jnp.dtype(jnp.bfloat16)}


# --- collectives ------------------------------------------------------------------------


def test_row_col_all_groups_by_axis() -> None:
    text = _lower_per_replica(collectives.row_col_all)
    groups = re.findall(r"replica_groups = dense<(.*?)>", text)
    assert groups == [
        "[[0, 2, 4, 6], [1, 3, 5, 7]]",  # over "i": same "j" coordinate
        "[[0, 1], [2, 3], [4, 5], [6, 7]]",  # over "j": same "i" coordinate
        "[[0, 1, 2, 3, 4, 5, 6, 7]]",  # over both
    ]


@pytest.mark.parametrize(
    ("fn", "dtype", "op"),
    [
        (collectives.psum_minus, jnp.int32, "stablehlo.all_reduce"),
        (collectives.mean_max, jnp.float32, "stablehlo.all_reduce"),
        (collectives.ring_shift, jnp.float32, "stablehlo.collective_permute"),
    ],
    ids=["psum_minus", "mean_max", "ring_shift"],
)
def test_collectives_lower_under_shard_map(fn: Callable[..., Any], dtype: Any, op: str) -> None:
    text = _lower_per_replica(fn, dtype)
    assert op in text
    assert "replica_groups" in text or "source_target_pairs" in text


def test_ring_shift_sends_each_replica_to_its_successor_on_i() -> None:
    text = _lower_per_replica(collectives.ring_shift)
    pairs = re.search(r"source_target_pairs = dense<(.*?)>", text)
    assert pairs is not None
    # Device ids are row-major over (i, j): moving one step along "i" adds 2.
    assert pairs[1] == "[[0, 2], [2, 4], [4, 6], [6, 0], [1, 3], [3, 5], [5, 7], [7, 1]]"


# --- program configs --------------------------------------------------------------------


def test_derived_programs_are_the_shipped_models_tests() -> None:
    """Every program built from _init_ is one tests/test_shipped_models.py runs."""
    shipped = (Path(__file__).parent / "test_shipped_models.py").read_text()
    assert {p.stem for p in DERIVED_FILES} >= {"llama_nnx", "eqx_mlp"}
    assert [p.stem for p in DERIVED_FILES if f'"{p.stem}"' not in shipped] == []


def test_every_example_has_a_program_config() -> None:
    names = {p.stem for p in PROGRAM_FILES}
    expected = {"axpy", "mlp", "transformer", "transformer_train", "attention"}
    assert expected | {"collectives", "collectives_psum"} <= names


@pytest.mark.parametrize("path", PROGRAM_FILES, ids=lambda p: p.stem)
def test_program_config_parses_and_comments_every_key(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    assert raw["defaults"] == ["base_program", "_self_"]
    assert raw["name"] == path.stem
    assert {"name", "description", "target", "args", "kwargs"} <= raw.keys()
    assert OmegaConf.to_container(OmegaConf.load(path)) == raw
    uncommented = [
        line
        for line in path.read_text().splitlines()
        if _KEY_LINE.match(line) and " # " not in line
    ]
    assert uncommented == []


_EXPECTED_OUTPUTS: dict[str, Any] = {
    "axpy": jax.ShapeDtypeStruct((), jnp.int32),
    "mlp": jax.ShapeDtypeStruct((64, 128), jnp.float32),
    "transformer": jax.ShapeDtypeStruct((4, 64, 256), jnp.float32),
    "attention": jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16),
    "collectives": (jax.ShapeDtypeStruct((), jnp.float32),) * 3,
    "collectives_psum": jax.ShapeDtypeStruct((), jnp.int32),
    "captured_constant": jax.ShapeDtypeStruct((8, 3584), jnp.float32),
}


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_program_config_args_fit_its_target(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    module, _, attr = raw["target"].partition(":")
    fn = functools.partial(getattr(importlib.import_module(module), attr), **raw["kwargs"])
    if module == collectives.__name__:
        fn = jax.shard_map(fn, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=False)
    args = _abstract(raw["args"])
    out = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), jax.eval_shape(fn, *args))
    if raw["name"] == "transformer_train":
        new_params, value = out
        assert new_params == args[0]
        assert value == jax.ShapeDtypeStruct((), jnp.float32)
    elif raw["name"] == "offload_train":  # (loss, new params, new momentum)
        value, new_params, mu = out
        assert new_params == args[0] and mu == args[1]
        assert value == jax.ShapeDtypeStruct((), jnp.float32)
    else:
        assert out == _EXPECTED_OUTPUTS[raw["name"]]
