"""Parameter and optimizer-state offload by config alone: a program written for device memory
(no ``jax.device_put`` of its own) whose optimizer state ``lower.in_memory_kinds`` puts in
pinned host memory compiles for a TPU and runs here, jaxaot moving the host-placed leaves to
device memory at the program's entry. Compared with plain JAX: the same step written with the
move (``jaxaot.examples.offload.moved_train_step``), and ``jax.jit`` of the step itself."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jaxaot
import numpy as np
import pytest
from jaxaot.examples.offload import moved_train_step, train_step
from jaxaot.stages.execute import load_outputs
from jaxaot.stages.inputs import spec_inputs

STEP = ("program=offload_train", "execute.warmup=0", "execute.repeats=1")
# The momentum (the optimizer state) in host memory between steps: in, and the updated one out.
OPT_ON_HOST = (
    "lower.in_memory_kinds={opt_state/**: pinned_host}",
    "lower.out_memory_kinds={output/2/**: pinned_host}",
)
ON_2X2 = (
    "program=offload_train",
    "compile.topology=v5e:2x2",
    "mesh.shape=[4]",
    "mesh.axes=[data]",
    "lower.in_shardings={x: [data], y: [data]}",
)
MOVED = "program.target=jaxaot.examples.offload:moved_train_step"
# The momentum's bytes: [4, 512, 512] and [512, 128] f32, replicated (whole on every device).
OPT_BYTES = (4 * 512 * 512 + 512 * 128) * 4


def _json(run_dir: Path, name: str) -> Any:
    return json.loads((run_dir / name).read_text())


def _kinds(rows: list[dict[str, Any]]) -> list[str]:
    return [r["memory_kind"] for r in rows]


def _tpu_args(opt_kind: str) -> tuple[Any, ...]:
    """train_step's arguments over the v5e:2x2 topology's mesh (replicated; x and y split),
    the momentum in ``opt_kind`` memory."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxaot.targets.tpu import resolve, topology_devices

    mesh = jax.sharding.Mesh(np.array(topology_devices(resolve("v5e:2x2"))), ("data",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def tree(sharding: Any) -> dict[str, Any]:
        return {
            "layers": jax.ShapeDtypeStruct((4, 512, 512), jnp.float32, sharding=sharding),
            "out": jax.ShapeDtypeStruct((512, 128), jnp.float32, sharding=sharding),
        }

    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=rows)
    y = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=rows)
    lr = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True, sharding=rep)
    return tree(rep), tree(rep.with_memory_kind(opt_kind)), x, y, lr


def test_plain_jax_refuses_the_step_with_its_state_on_the_host() -> None:
    """Why jaxaot moves the leaves: JAX will not add a host value to a device one."""
    args = _tpu_args("pinned_host")
    with pytest.raises(ValueError, match=r"memory_space of all inputs passed to `\w+` must be"):
        jax.jit(train_step, static_argnames=("remat",)).trace(*args, remat="save")
    jax.jit(moved_train_step, static_argnames=("remat",)).trace(*args, remat="save")


def _moves(run_dir: Path, to: str) -> int:
    """How many moves to memory ``to`` (device, pinned_host) the lowered module holds."""
    text = (run_dir / "lower" / "module.stablehlo.mlir").read_text()
    return len(
        re.findall(
            r"custom_call @annotate_device_placement\(.*_xla_buffer_placement = \"" + to + '"',
            text,
        )
    )


def test_each_host_leaf_is_moved_at_entry_in_the_lowering(compose_run: Any) -> None:
    """The lowering for the TPU holds one move to device memory per host-placed leaf (the
    momentum's two), first thing, and none for a program that places nothing; the outputs
    placed on the host are moved there by their out shardings (JAX's own moves); a program
    that moves its state itself keeps its moves (of values now in device memory) after ours."""
    lower = ("stop_after=lower", "program.kwargs.remat=save")  # no activation offload
    none = compose_run(*ON_2X2, *lower)
    assert _moves(none.run_dir, "device") == _moves(none.run_dir, "pinned_host") == 0
    ours = compose_run(*ON_2X2, *lower, *OPT_ON_HOST)
    assert _moves(ours.run_dir, "device") == 2
    assert _moves(ours.run_dir, "pinned_host") == 2  # the updated momentum, by out_shardings
    text = (ours.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    host_args = re.findall(r"%arg(\d+): tensor<[^>]*> \{mhlo.memory_kind = \"pinned_host\"", text)
    assert host_args == ["2", "3"]  # the momentum's leaves, after the parameters' two
    body = text[text.index("func.func public @main") :].splitlines()
    first = [re.search(r"@annotate_device_placement\((%arg\d+)\)", ln) for ln in body[1:3]]
    assert [m.group(1) if m else None for m in first] == ["%arg2", "%arg3"]  # at the entry
    moved = compose_run(*ON_2X2, *lower, *OPT_ON_HOST, MOVED)
    assert _moves(moved.run_dir, "device") == 2 + 4  # its own: the parameters' and momentum's


def _plain_outputs(result: Any) -> dict[str, np.ndarray]:
    """jax.jit(train_step), no memory kinds, on the run's inputs, as execute saves outputs."""
    args, kwargs = spec_inputs(result["stage_out"].bound, 0)
    assert not kwargs  # remat is static
    out = jax.jit(train_step, static_argnames=("remat",))(*args)
    flat = jax.tree_util.tree_flatten_with_path(out)[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


@pytest.mark.parametrize("mesh", [(), ("mesh.shape=[4]", "mesh.axes=[data]")])
def test_on_cpu_the_offloaded_step_is_plain_jits_bit_for_bit(
    compose_run: Any, mesh: tuple[str, ...]
) -> None:
    result = compose_run(*STEP, *mesh, *OPT_ON_HOST)
    want = _plain_outputs(result)
    got = load_outputs(result.run_dir / "execute")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k  # bit for bit
    rows = _json(result.run_dir, "compile/shardings.json")
    assert _kinds(rows["inputs"]) == ["device"] * 2 + ["pinned_host"] * 2 + ["device"] * 3
    assert _kinds(rows["outputs"]) == ["device"] * 3 + ["pinned_host"] * 2


def _plain_2x2(fn: Any) -> Any:
    """plain jax.jit(fn) over the v5e:2x2 topology with the momentum in pinned_host, compiled."""
    args = _tpu_args("pinned_host")
    rep, host = args[0]["out"].sharding, args[1]["out"].sharding
    outs = (rep, {"layers": rep, "out": rep}, {"layers": host, "out": host})
    jitted = jax.jit(fn, static_argnames=("remat",), out_shardings=outs)
    return jitted.lower(*args, remat="offload").compile()


def _hlo(run_dir: Path) -> str:
    return (run_dir / "compile" / "optimized.hlo.txt").read_text()


def _host_copies(run_dir: Path) -> list[str]:
    """What the compiled module copies between host memory (TPU memory space 5) and the
    device, asynchronously: the copy-start operands."""
    return [
        m.group(1)
        for line in _hlo(run_dir).splitlines()
        if "S(5)" in line and (m := re.search(r" copy-start\((%[\w.-]+)\)", line))
    ]


@pytest.mark.slow
def test_optimizer_state_offload_on_v5e_is_plain_jaxs_with_the_move_written(
    compose_run: Any,
) -> None:
    from jaxaot.stages.executable import memory_of

    result = compose_run(*ON_2X2, *OPT_ON_HOST)
    rd = result.run_dir
    memory = _json(rd, "compile/memory_analysis.json")
    plain = _plain_2x2(moved_train_step)
    assert memory == memory_of(plain)
    assert memory["host_argument_size_in_bytes"] == OPT_BYTES
    assert memory["host_output_size_in_bytes"] == OPT_BYTES
    rows = _json(rd, "compile/shardings.json")
    assert _kinds(rows["inputs"]) == ["device"] * 2 + ["pinned_host"] * 2 + ["device"] * 3
    assert _kinds(rows["outputs"]) == ["device"] * 3 + ["pinned_host"] * 2
    peak = _json(rd, "compile/memory_breakdown.json")["peak_bytes"]
    assert peak == plain.memory_analysis().peak_memory_in_bytes
    # The program's own moves add nothing: the same figures and the same copies.
    moved = compose_run(*ON_2X2, *OPT_ON_HOST, MOVED)
    assert _json(moved.run_dir, "compile/memory_analysis.json") == memory
    copies = _host_copies(rd)
    assert len(copies) == len(_host_copies(moved.run_dir)) == 4  # the momentum in, and out
    entry = _hlo(rd)[_hlo(rd).index("\nENTRY") :]
    params = re.findall(r"(%param[\w.]*) = \S+ parameter\((\d+)\)", entry)
    host_params = sorted(name for name, number in params if number in ("2", "3"))
    assert sorted(c for c in copies if c.startswith("%param")) == host_params


# -- an NNX train step: the optimizer state offloaded, its update back on the host -----------------

# One decoder block (the shipped toy has two): the step's offload, shardings and donation are
# per Variable, whatever the depth, and one block compiles in ~60% of the time.
NNX = (
    "program=llama_nnx_train",
    "+program.args.0._args_.0.n_layers=1",
    "mesh.shape=[4]",
    "mesh.axes=[data]",
    "lower.donate_argnums=[0, 1]",
    "execute.warmup=0",
    "execute.repeats=1",
    # both runs alike: what the offload changes is compared, not XLA:CPU's machine code
    "compile.compiler_options.xla_backend_optimization_level=0",
)


@pytest.mark.extra("models")
def test_nnx_optimizer_offload_returns_its_update_to_the_host(compose_run: Any) -> None:
    """nnx.Optimizer's state in pinned_host: each Variable's update keeps the memory kind and
    sharding it came in with (no lower.out_memory_kinds needed), the donated buffers still hold
    the updates, and the outputs are the run's without offload, bit for bit."""
    base = compose_run(*NNX)
    off = compose_run(*NNX, "lower.in_memory_kinds={optimizer/**: pinned_host}")
    got, want = load_outputs(off.run_dir / "execute"), load_outputs(base.run_dir / "execute")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
    rows = _json(off.run_dir, "compile/shardings.json")
    # Inputs by position (args[1]: the optimizer), outputs as (loss, {node: updates}).
    for side, mark in (("inputs", "args[1]"), ("outputs", "['optimizer']")):
        kinds = {r["path"]: r["memory_kind"] for r in rows[side]}
        opt = [k for p, k in kinds.items() if mark in p]
        assert opt and set(opt) == {"pinned_host"}, side
        assert {k for p, k in kinds.items() if mark not in p} == {"device"}, side
    moved = _json(off.run_dir, "lower/lowered.json")["placement"]["inputs"]
    assert {r["path"].split("/")[0] for r in moved} == {"optimizer"}
    aliased = [_json(r.run_dir, "compile/memory_analysis.json") for r in (base, off)]
    assert aliased[0]["alias_size_in_bytes"] == aliased[1]["alias_size_in_bytes"] > 0


def test_the_worked_example_experiment_sets_the_batch_once() -> None:
    """experiment=llama3_8b_v5e4: llama3_8b on one v5e:2x2 host; the targets follow the
    tokens' shape, so one override changes the batch."""
    from jaxaot.schema import validate
    from omegaconf import OmegaConf

    for batch in (8, 4):
        extra = [] if batch == 8 else [f"program.args.2={{shape:[{batch},2048],dtype:i32}}"]
        cfg = validate(jaxaot.compose(["experiment=llama3_8b_v5e4", *extra]))
        args = OmegaConf.to_container(OmegaConf.create({"a": list(cfg.program.args)}))["a"]
        assert args[2] == args[3] == {"shape": [batch, 2048], "dtype": "i32"}
        assert cfg.compile.topology == "v5e:2x2" and list(cfg.mesh.shape) == [4, 1]
        assert cfg.lower.donate_argnums == [0, 1]
