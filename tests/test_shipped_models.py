"""The shipped model programs, each against the same program written in plain JAX.

``program=llama_nnx`` / ``llama_nnx_train`` (a Llama-style Flax NNX decoder, jaxaot_examples/
llama.py: forward, and an AdamW step through ``nnx.Optimizer``), ``program=eqx_mlp`` /
``eqx_mlp_train`` (``eqx.nn.MLP``, jaxaot_examples/eqx_mlp.py) and ``experiment=llama3_8b``.
Each toy program runs through jaxaot from its YAML alone (the model and optimizer state built
by ``_init_``) and is compared with what a Flax or Equinox user writes: the outputs with
``nnx.jit`` / ``eqx.filter_jit`` of the same step, bit for bit on CPU; the lowered module, the
FLOPs (XLA's and loop-counted) and XLA's memory analysis with ``jax.jit`` of the step over the
split state (``nnx.split``/``merge``, ``eqx.partition``/``combine``), which is the function
jaxaot traces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jaxaot
import numpy as np
import pytest
from conftest import FAST_CPU_CODEGEN
from jaxaot.api import conf_dir
from jaxaot.models.nnx import lazy_sharding
from jaxaot.util.canonical import canonical_stablehlo

SHIPPED = ("llama_nnx", "llama_nnx_train", "eqx_mlp", "eqx_mlp_train")


@pytest.fixture(autouse=True)
def _watching() -> None:
    """Flax and Equinox import ``jax.extend``; jaxaot starts watching XLA's HLO module
    transformations before that (as the CLI does before any program code), else its compiles
    skip the store (jaxaot.stages.xla_passes)."""
    from jaxaot.stages import xla_passes

    xla_passes.watch()


def _npy(tmp_path: Path, name: str, arr: np.ndarray) -> str:
    path = tmp_path / f"{name}.npy"
    np.save(path, arr)
    return str(path)


def _run(
    tmp_path: Path, program: str, arrays: dict[int, np.ndarray], *extra: str
) -> jaxaot.RunResult:
    """``program`` through all four stages, its array arguments at ``arrays``' positions
    replaced by those very arrays (``.npy`` leaves), ``extra`` overrides added. These runs are
    also the shipped-config runs of these programs (tests/test_shipped_configs.py runs every
    other program): each stage ran, no warning, the compile's FLOPs counted, every output
    finite."""
    overrides = [f"program={program}", "execute.repeats=1", "execute.warmup=0", *extra]
    cfg = jaxaot.compose(overrides)
    for i, arr in arrays.items():
        cfg.program.args[i] = _npy(tmp_path, f"arg{i}", arr)
    result = jaxaot.run(cfg, run_dir=tmp_path / program)
    assert result.ok, result.manifest["error"]
    stages = result.manifest["stages"]
    assert [stages[s]["status"] for s in ("stage_out", "lower")] == ["ran", "ran"]
    assert stages["compile"]["status"] in ("ran", "cached")
    assert result.manifest["warnings"] == []
    assert result["compile"].cost and result["compile"].cost["flops"] > 0
    with np.load(result.run_dir / "execute" / "outputs.npz") as z:
        assert z.files and all(np.isfinite(z[k]).all() for k in z.files)
    return result


def _keys(text: str) -> tuple[str, ...]:
    """Path components of ``jax.tree_util.keystr`` text or a jaxaot output path, without NNX's
    ``.value`` (``[1]['model']['embed']['embedding'].value`` -> ``('1', 'model', ...)``)."""
    found = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", text)
    return tuple(k for k in ("".join(parts) for parts in found) if k != "value")


def _outputs(result: jaxaot.RunResult) -> dict[tuple[str, ...], np.ndarray]:
    from jaxaot.stages.execute import load_outputs

    return {_keys(k): v for k, v in load_outputs(result.run_dir / "execute").items()}


def _leaves(tree: Any) -> dict[tuple[str, ...], np.ndarray]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_keys(jax.tree_util.keystr(p)): np.asarray(v) for p, v in flat}


def _same_bits(got: dict[Any, np.ndarray], want: dict[Any, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v, err_msg=str(k), strict=True)


def _module(text: str) -> str:
    """Canonical StableHLO without result names (jaxaot names outputs by pytree path, jax.jit
    by its own keystr)."""
    return re.sub(r' \{jax\.result_info = "[^"]*"\}', "", canonical_stablehlo(text))


def _same_compile(result: jaxaot.RunResult, lowered: Any) -> Any:
    """The run's lowered module, FLOPs and memory analysis are plain ``jax.jit``'s, compiled
    with the run's compiler options; its executable, whose outputs the run's are compared
    with."""
    from jaxaot.stages.executable import costs_of

    rd = result.run_dir
    mine = (rd / "lower" / "module.stablehlo.mlir").read_text()
    assert _module(mine) == _module(lowered.as_text())
    compiled = lowered.compile(result.manifest["config"]["compile"]["compiler_options"] or None)
    cost = json.loads((rd / "compile" / "cost_analysis.json").read_text())
    assert cost["flops_xla"] == compiled.cost_analysis()["flops"]
    assert cost["flops"] == costs_of(compiled)[0]["flops"]
    memory = json.loads((rd / "compile" / "memory_analysis.json").read_text())
    stats = compiled.memory_analysis()
    assert memory == {k: getattr(stats, k) for k in memory}
    assert memory["argument_size_in_bytes"] > 0 and memory["output_size_in_bytes"] > 0
    return compiled


def _ids(seed: int, shape: tuple[int, ...], high: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, shape).astype(np.int32)


# -- Flax NNX: the Llama-style decoder ------------------------------------------------------

# conftest.FAST_CPU_CODEGEN for the run; _same_compile compiles plain JAX's side with the
# run's options: the lowered module, FLOPs and memory figures are the default level's, and
# the outputs are compared between two executables built alike.
LLAMA_CODEGEN = tuple(f"compile.compiler_options.{k}={v}" for k, v in FAST_CPU_CODEGEN.items())


def test_llama_forward_is_flaxs(tmp_path: Path) -> None:
    import jax
    from flax import nnx
    from jaxaot.examples import llama

    tokens = _ids(1, (2, 16), 256)
    result = _run(tmp_path, "llama_nnx", {1: tokens}, *LLAMA_CODEGEN)

    with lazy_sharding():  # the names stay metadata (no mesh), as jaxaot builds it
        model = llama.Llama(llama.LlamaConfig.toy(), rngs=nnx.Rngs(0))
    # Plain JAX's program: jit of the function of the model's state (what nnx.jit runs).
    graphdef, state = nnx.split(model)
    plain = jax.jit(lambda state, tokens: llama.forward(nnx.merge(graphdef, state), tokens))
    logits = _same_compile(result, plain.lower(state, tokens))(state, tokens)
    # With NNX arguments the traced function returns (outputs, the Variables it updated: none).
    _same_bits(_outputs(result), {("0",): np.asarray(logits)})
    cost = json.loads((result.run_dir / "compile" / "cost_analysis.json").read_text())
    assert cost["flops"] > 1.5 * cost["flops_xla"]  # the 2-block nnx.scan, counted per trip


def test_llama_adamw_step_is_flaxs(tmp_path: Path) -> None:
    import jax
    import optax
    from flax import nnx
    from jaxaot.examples import llama

    tokens, targets = _ids(1, (2, 16), 256), _ids(2, (2, 16), 256)
    result = _run(tmp_path, "llama_nnx_train", {2: tokens, 3: targets}, *LLAMA_CODEGEN)

    def fresh() -> tuple[Any, Any]:
        with lazy_sharding():
            model = llama.Llama(llama.LlamaConfig.toy(), rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1.0e-3), wrt=nnx.Param)

    # Plain JAX's program: jit of the step as a function of the states (what nnx.jit runs).
    model, optimizer = fresh()
    (gm, sm), (go, so) = nnx.split(model), nnx.split(optimizer)

    def step(sm: Any, so: Any, tokens: Any, targets: Any) -> Any:
        model, optimizer = nnx.merge(gm, sm), nnx.merge(go, so)
        loss = llama.train_step(model, optimizer, tokens, targets)
        return loss, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}

    compiled = _same_compile(result, jax.jit(step).lower(sm, so, tokens, targets))
    loss, updated = compiled(sm, so, tokens, targets)
    want = {("0",): np.asarray(loss)}
    want.update({("1", "model", *k): v for k, v in _leaves(updated["model"]).items()})
    want.update({("1", "optimizer", *k): v for k, v in _leaves(updated["optimizer"]).items()})
    _same_bits(_outputs(result), want)  # the loss, and every parameter and moment it updated
    assert float(loss) > 0 and want[("1", "optimizer", "step")] == 1


def test_llama_config_counts_its_parameters() -> None:
    import jax
    from flax import nnx
    from jaxaot.examples import llama

    cfg = llama.LlamaConfig.toy()
    with pytest.raises(ValueError, match="mesh"):  # Flax's default: sharded at creation
        llama.Llama(cfg, rngs=nnx.Rngs(0))
    with lazy_sharding():
        model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == cfg.num_params()
    assert llama.LlamaConfig.llama3_8b().num_params() == 8_030_261_248  # Llama 3 8B
    names = {k: v.get_metadata()["out_sharding"] for k, v in nnx.to_flat_state(nnx.state(model))}
    assert names[("layers", "attn", "wq", "kernel")] == ("layers", "embed", "heads")
    assert names[("embed", "embedding")] == ("vocab", "embed")


# -- Equinox: eqx.nn.MLP ---------------------------------------------------------------------


def test_eqx_forward_is_equinoxs(tmp_path: Path) -> None:
    import equinox as eqx
    import jax
    from jaxaot.examples import eqx_mlp

    x = np.random.default_rng(3).normal(size=(32, 64)).astype(np.float32)
    result = _run(tmp_path, "eqx_mlp", {1: x})

    model = eqx.nn.MLP(in_size=64, out_size=10, width_size=128, depth=2, key=jax.random.key(0))
    # Plain JAX's program: jit of the function of the arrays (what eqx.filter_jit runs).
    params, static = eqx.partition(model, eqx.is_array)
    plain = jax.jit(lambda params, x: eqx_mlp.forward(eqx.combine(params, static), x))
    logits = _same_compile(result, plain.lower(params, x))(params, x)
    _same_bits(_outputs(result), {(): np.asarray(logits)})


def test_eqx_adamw_step_is_equinoxs(tmp_path: Path) -> None:
    import equinox as eqx
    import jax
    import optax
    from jaxaot.examples import eqx_mlp

    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 64)).astype(np.float32)
    y = rng.integers(0, 10, (32,)).astype(np.int32)
    result = _run(tmp_path, "eqx_mlp_train", {2: x, 3: y})

    model = eqx.nn.MLP(in_size=64, out_size=10, width_size=128, depth=2, key=jax.random.key(0))
    optimizer = optax.adamw(1.0e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    # Plain JAX's program: jit of the step as a function of the arrays (what eqx.filter_jit runs).
    params, static = eqx.partition(model, eqx.is_array)

    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        model = eqx.combine(params, static)
        new, state, loss = eqx_mlp.train_step(model, opt_state, x, y, optimizer)
        return eqx.filter(new, eqx.is_array), state, loss

    compiled = _same_compile(result, jax.jit(step).lower(params, opt_state, x, y))
    new_params, new_state, loss = compiled(params, opt_state, x, y)
    want = {("0", *k): v for k, v in _leaves(new_params).items()}
    want.update({("1", *k): v for k, v in _leaves(new_state).items()})
    want[("2",)] = np.asarray(loss)
    _same_bits(_outputs(result), want)


# -- the configs: a few lines of YAML each ---------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_model_program_is_a_few_lines_of_yaml(name: str) -> None:
    """The README's claim: target and arguments in at most 10 lines of YAML, no Python."""
    text = (conf_dir() / "program" / f"{name}.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("target:"))
    end = next(i for i, line in enumerate(text) if line.startswith("kwargs:"))
    lines = [line for line in text[start:end] if line.split("#")[0].strip()]
    assert 2 <= len(lines) <= 10, lines


# -- Llama 3 8B for a TPU pod slice ----------------------------------------------------------


def test_llama3_8b_experiment_composes_for_v5e_and_v6e() -> None:
    from jaxaot.schema import validate
    from jaxaot.targets.tpu import resolve

    for topology in ("v5e-256", "v6e-256"):
        cfg = validate(jaxaot.compose(["experiment=llama3_8b", f"compile.topology={topology}"]))
        assert cfg.stop_after == "compile" and cfg.program.name == "llama3_8b"
        assert resolve(cfg.compile.topology).devices == 256 == 32 * 8
        assert cfg.lower.donate_argnums == [0, 1]


@pytest.mark.extra("models", "tpu")
def test_llama3_8b_lowers_for_v5e_256_with_its_own_logical_axes(tmp_path: Path) -> None:
    """Nothing allocated (the model and AdamW state are jax.eval_shape of their inits); every
    parameter and moment sharded by its nnx metadata through the rules; the lowering only (a
    deviceless compile of the step takes ~10 minutes on 2 cores)."""
    cfg = jaxaot.compose(["experiment=llama3_8b", "stop_after=lower"])
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    assert result.ok, result.manifest["error"]
    assert result.manifest["stages"]["lower"]["status"] == "ran"
    table = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    by_path = {a["path"]: a for a in table["arguments"]}
    params = [a for p, a in by_path.items() if p.startswith("model/")]
    assert sum(a["elements"] for a in params) == 8_030_261_248
    assert sum(a["bytes"] for a in params) == 2 * 8_030_261_248  # bf16
    decided = json.loads((result.run_dir / "lower" / "path_shardings.json").read_text())
    spec = {d["path"]: d["spec"] for d in decided["inputs"]}
    for prefix in ("model", "optimizer/opt_state/0/mu", "optimizer/opt_state/0/nu"):
        assert spec[f"{prefix}/layers/attn/wq/kernel"] == "P(None, 'fsdp', 'model')"
        assert spec[f"{prefix}/layers/attn/wo/kernel"] == "P(None, 'model', 'fsdp')"
        assert spec[f"{prefix}/layers/mlp/down/kernel"] == "P(None, 'model', 'fsdp')"
        assert spec[f"{prefix}/embed/embedding"] == "P('model', 'fsdp')"
        assert spec[f"{prefix}/lm_head/kernel"] == "P('fsdp', 'model')"
    assert spec["tokens"] == spec["targets"] == "P('fsdp')"
    # Every leaf decided: the scalars (AdamW's count, the optimizer's step) are replicated,
    # not listed (nothing to split), and no warning names them.
    assert decided["unmatched_inputs"] == []
    assert spec["optimizer/step"] == spec["optimizer/opt_state/0/count"] == "P()"
    warnings = result.manifest["stages"]["lower"].get("warnings", [])
    assert not any("no pattern" in w for w in warnings), warnings
    assert by_path["model/layers/attn/wq/kernel"]["bytes_per_device"] == 32 * 4096 * 4096 * 2 // 256
