"""Memory kinds from config (lower.in_memory_kinds / out_memory_kinds): checks, the compiled
shardings against plain JAX's, outputs bit for bit, store keys, and host offload on a TPU
topology (jax.checkpoint's offload policy; parameters and optimizer state in pinned_host)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jaxaot
import numpy as np
import pytest
from jaxaot.config.path_shardings import PathLeaf
from jaxaot.config.placement import Placement, check_kinds, resolve_placement
from jaxaot.errors import ConfigError
from jaxaot.examples.offload import moved_train_step
from jaxaot.stages.execute import load_outputs
from jaxaot.stages.inputs import spec_inputs

STEP = ("program=offload_train", "execute.warmup=0", "execute.repeats=1")
# The parameters and the momentum offloaded, and the updated ones returned to host memory.
OFFLOAD_STATE = (
    "lower.in_memory_kinds={params/**: pinned_host, opt_state/**: pinned_host}",
    "lower.out_memory_kinds={output/1/**: pinned_host, output/2/**: pinned_host}",
)


def _validate(*overrides: str) -> Any:
    return jaxaot.validate(jaxaot.compose(list(overrides)))


def _json(run_dir: Path, name: str) -> Any:
    return json.loads((run_dir / name).read_text())


# -- checks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "lower.in_memory_kinds=host",
            r"^lower.in_memory_kinds: expected a memory kind \(device, ",
        ),
        (
            "lower.out_memory_kinds={output: hbm}",
            r"^lower.out_memory_kinds\['output'\]: expected a memory kind .* found hbm",
        ),
        (
            "lower.in_memory_kinds={params//w: pinned_host}",
            r"^lower.in_memory_kinds\[.params//w.\]: expected /-separated components",
        ),
    ],
)
def test_bad_kinds_are_one_line_errors_before_jax(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        _validate("program=mlp", override)
    assert "\n" not in str(info.value)


def test_a_list_of_kinds_is_refused_naming_the_mapping_form() -> None:
    with pytest.raises(ConfigError) as info:
        _validate("program=mlp", "lower.in_memory_kinds=[pinned_host]")
    assert str(info.value) == (
        "lower.in_memory_kinds: expected a memory kind (device, pinned_host, unpinned_host) for "
        "every leaf, a mapping {leaf-path pattern: kind} (e.g. "
        "lower.in_memory_kinds={params/**: pinned_host}) or null, found [pinned_host]"
    )


TPU_MESH = ("compile.topology=v5e:2x2", "mesh.shape=[4]", "mesh.axes=[data]")


@pytest.mark.parametrize(
    ("overrides", "where", "target"),
    [
        (
            (*TPU_MESH, "lower.out_memory_kinds=unpinned_host"),
            "lower.out_memory_kinds",
            "compile.topology=v5e:2x2",
        ),
        (
            (*TPU_MESH, "lower.in_memory_kinds={params/**: unpinned_host}"),
            "lower.in_memory_kinds['params/**']",
            "compile.topology=v5e:2x2",
        ),
        (
            ("compile.backend=tpu", "lower.in_memory_kinds=unpinned_host"),
            "lower.in_memory_kinds",
            "compile.backend=tpu",
        ),
    ],
)
def test_unpinned_host_is_refused_for_tpu_before_jax(
    overrides: tuple[str, ...], where: str, target: str
) -> None:
    """v5e devices list unpinned_host, but XLA fails on it (jax 0.10.2): refused up front."""
    with pytest.raises(ConfigError) as info:
        _validate("program=offload_train", *overrides)
    message = str(info.value)
    assert message.startswith(f"{where}: unpinned_host on a TPU target ({target}) fails in XLA")
    assert message.endswith("use pinned_host") and "\n" not in message
    # pinned_host is what it says to use, and passes the same check
    _validate("program=offload_train", *(o.replace("unpinned", "pinned") for o in overrides))


def test_unpinned_host_is_refused_on_tpu_devices_and_kept_on_cpu(compose_run: Any) -> None:
    got = resolve_placement([PathLeaf("x", (2, 4), "args[0]")], "unpinned_host", None, "in")
    kinds = ["device", "pinned_host", "unpinned_host"]
    with pytest.raises(ConfigError, match=r"^lower.in_memory_kinds: unpinned_host on a TPU"):
        check_kinds(got, kinds, "TPU v5 lite")
    check_kinds(got, kinds, "cpu")
    result = compose_run(*STEP, "lower.out_memory_kinds={output/1/**: unpinned_host}")
    shardings = _json(result.run_dir, "compile/shardings.json")
    assert _kinds(shardings["outputs"])[1:3] == ["unpinned_host"] * 2


def test_a_per_replica_program_takes_no_memory_kinds() -> None:
    with pytest.raises(ConfigError, match=r"^lower.in_memory_kinds: a per-replica program"):
        _validate("program=collectives_psum", "lower.in_memory_kinds=pinned_host")


def test_patterns_decide_in_order_and_kinds_are_checked_against_the_devices() -> None:
    leaves = [PathLeaf("params/w", (4, 4), "args[0]/w"), PathLeaf("x", (2, 4), "args[1]")]
    got = resolve_placement(
        leaves, {"args[0]/**": "pinned_host", "**": "unpinned_host"}, None, "in"
    )
    assert got == {
        "params/w": Placement("pinned_host"),
        "x": Placement("unpinned_host"),
    }
    assert got["x"].kind_from == "lower.in_memory_kinds['**']"
    check_kinds(got, ["device", "pinned_host", "unpinned_host"], "cpu")
    with pytest.raises(ConfigError, match=r"^lower.in_memory_kinds\['\*\*'\]: x is to be in "):
        check_kinds(got, ["device", "pinned_host"], "TPU v5 lite")
    with pytest.raises(ConfigError, match=r"^lower.in_memory_kinds\['opt/\*\*'\]: matches no leaf"):
        resolve_placement(leaves, {"opt/**": "pinned_host"}, None, "in")
    assert resolve_placement(leaves, None, None, "in") == {}


@pytest.mark.requires_jax("0.7.0")  # jax 0.6's CPU devices have unpinned_host alone
def test_every_device_here_and_on_a_topology_has_the_three_kinds() -> None:
    from jaxaot.stages.jax_placement import memory_kinds_of
    from jaxaot.targets.tpu import resolve, topology_devices

    assert memory_kinds_of(jax.devices("cpu")[0]) == ["device", "pinned_host", "unpinned_host"]
    tpu = topology_devices(resolve("v5e:2x2"))[0]
    assert memory_kinds_of(tpu) == ["device", "pinned_host", "unpinned_host"]


# -- on CPU: the compiled shardings and outputs against plain JAX ---------------------------------


def _host_inputs(result: Any) -> list[Any]:
    args, kwargs = spec_inputs(result["stage_out"].bound, 0)
    assert not kwargs  # remat is static
    return args


def _plain_outputs(result: Any, in_sh: Any, out_sh: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """jax.jit(moved_train_step) with the given shardings on the run's inputs: (compiled,
    outputs by path as execute saves them)."""
    args = _host_inputs(result)
    jitted = jax.jit(
        moved_train_step, static_argnames=("remat",), in_shardings=in_sh, out_shardings=out_sh
    )
    put = [jax.device_put(a, s) if s is not None else a for a, s in zip(args, in_sh, strict=True)]
    compiled = jitted.lower(*put).compile()
    out = compiled(*put)
    flat = jax.tree_util.tree_flatten_with_path(out)[0]
    return compiled, {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def _same_outputs(run_dir: Path, want: dict[str, np.ndarray]) -> None:
    got = load_outputs(run_dir / "execute")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k  # bit for bit


def _kinds(rows: list[dict[str, Any]]) -> list[str]:
    return [r["memory_kind"] for r in rows]


def test_one_device_state_offload_is_plain_jaxs_bit_for_bit(compose_run: Any) -> None:
    from jax.sharding import SingleDeviceSharding

    result = compose_run(*STEP, *OFFLOAD_STATE)
    rd = result.run_dir
    dev = jax.devices("cpu")[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    state = {"layers": host, "out": host}
    plain, want = _plain_outputs(result, (state, state, None, None, None), (None, state, state))
    _same_outputs(rd, want)
    shardings = _json(rd, "compile/shardings.json")
    assert shardings["mesh"] is None
    compiled_in = jax.tree.leaves(plain.input_shardings)
    assert _kinds(shardings["inputs"]) == [s.memory_kind for s in compiled_in]
    assert _kinds(shardings["inputs"]) == ["pinned_host"] * 4 + ["device"] * 3
    assert _kinds(shardings["outputs"]) == [
        s.memory_kind for s in jax.tree.leaves(plain.output_shardings)
    ]
    placement = _json(rd, "lower/lowered.json")["placement"]
    assert [r["path"] for r in placement["inputs"]] == [
        "params/layers",
        "params/out",
        "opt_state/layers",
        "opt_state/out",
    ]
    assert [r["path"] for r in placement["outputs"]] == [
        "output/1/layers",
        "output/1/out",
        "output/2/layers",
        "output/2/out",
    ]


def test_on_a_mesh_kinds_join_the_shardings_and_keys_cover_them(compose_run: Any) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh_args = ("mesh.shape=[4]", "mesh.axes=[data]", "lower.in_shardings={x: [data], y: [data]}")
    plain_run = compose_run(*STEP, *mesh_args)
    offloaded = compose_run(*STEP, *mesh_args, *OFFLOAD_STATE)
    off = compose_run(*STEP, *mesh_args, *OFFLOAD_STATE, "store.enabled=false")
    hit = compose_run(*STEP, *mesh_args, *OFFLOAD_STATE)

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices("cpu")[:4])
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    host = rep.with_memory_kind("pinned_host")
    state = {"layers": host, "out": host}
    plain, want = _plain_outputs(offloaded, (state, state, rows, rows, rep), (rep, state, state))
    for result in (offloaded, off, hit):
        _same_outputs(result.run_dir, want)
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    assert off.manifest["stages"]["compile"]["status"] == "ran"
    rd = offloaded.run_dir
    assert _json(rd, "compile/memory_analysis.json")["argument_size_in_bytes"] == (
        plain.memory_analysis().argument_size_in_bytes
    )
    shardings = _json(rd, "compile/shardings.json")
    assert _kinds(shardings["inputs"]) == [
        s.memory_kind for s in jax.tree.leaves(plain.input_shardings)
    ]
    assert [r["sharding"] for r in shardings["inputs"]][4:6] == ["P('data',)"] * 2
    # Differing only in the memory kinds: another module and another executable.
    lowered = [_json(r.run_dir, "lower/lowered.json") for r in (plain_run, offloaded, hit)]
    assert lowered[0]["module_sha256"] != lowered[1]["module_sha256"] == lowered[2]["module_sha256"]
    keys = [r.manifest["stages"]["compile"]["key"] for r in (plain_run, offloaded, hit)]
    assert keys[0] != keys[1] == keys[2]
    warned = offloaded.manifest["stages"]["lower"]["warnings"]
    assert any("4 output leaves" in w and "output/1/layers" in w for w in warned)


def test_without_a_mesh_a_topology_needs_one(tmp_path: Path) -> None:
    base = [
        "program=offload_train",
        "compile.topology=v5e:2x2",
        "lower.in_memory_kinds=pinned_host",
    ]
    with pytest.raises(ConfigError) as err:
        jaxaot.run(jaxaot.compose(base), run_dir=tmp_path / "r")
    assert str(err.value) == (
        "lower.in_memory_kinds with compile.topology=v5e:2x2 needs a mesh over the topology's "
        "4 devices, found none; add mesh.shape=[4] mesh.axes=[data]"
    )
    both = [*base, "lower.out_layouts=default"]
    with pytest.raises(ConfigError, match=r"^lower.in_memory_kinds/lower.out_layouts with comp"):
        jaxaot.run(jaxaot.compose(both), run_dir=tmp_path / "r2")
    # The fix the message names compiles.
    fixed = jaxaot.run(
        jaxaot.compose([*base, "mesh.shape=[4]", "mesh.axes=[data]"]), run_dir=tmp_path / "r3"
    )
    assert fixed.manifest["status"] == "ok"


# -- a TPU topology: host offload, compared with plain JAX on the same compile ---------------------

ON_2X2 = (
    "program=offload_train",
    "compile.topology=v5e:2x2",
    "mesh.shape=[4]",
    "mesh.axes=[data]",
    "lower.in_shardings={x: [data], y: [data]}",
)


def _plain_topology(remat: str, state_kind: str) -> Any:
    """plain jax.jit(moved_train_step) over the v5e:2x2 topology's mesh, compiled."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxaot.targets.tpu import resolve, topology_devices

    devs = topology_devices(resolve("v5e:2x2"))
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    st = rep.with_memory_kind(state_kind)

    def sds(shape: tuple[int, ...], sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    def params(sharding: Any) -> dict[str, Any]:
        return {"layers": sds((4, 512, 512), sharding), "out": sds((512, 128), sharding)}

    args = (params(st), params(st), sds((256, 512), rows), sds((256, 128), rows))
    lr = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True, sharding=rep)
    state = {"layers": st, "out": st}
    jitted = jax.jit(
        moved_train_step, static_argnames=("remat",), out_shardings=(rep, state, state)
    )
    return jitted.lower(*args, lr, remat=remat).compile()


@pytest.mark.slow
def test_checkpoint_offload_policy_reports_host_bytes_on_v5e(compose_run: Any) -> None:
    from jaxaot.stages.executable import memory_of

    offload = compose_run(*ON_2X2)
    memory = _json(offload.run_dir, "compile/memory_analysis.json")
    # Each of the 4 layers' [64, 512] f32 activation shard per device, on the host.
    assert memory["host_temp_size_in_bytes"] == 4 * 64 * 512 * 4
    assert memory == memory_of(_plain_topology("offload", "device"))
    saved = compose_run(*ON_2X2, "program.kwargs.remat=save")
    assert _json(saved.run_dir, "compile/memory_analysis.json")["host_temp_size_in_bytes"] == 0


@pytest.mark.slow
def test_state_offload_on_v5e_is_plain_jaxs_host_figures(compose_run: Any) -> None:
    from jaxaot.stages.executable import memory_of

    result = compose_run(*ON_2X2, *OFFLOAD_STATE)
    rd = result.run_dir
    memory = _json(rd, "compile/memory_analysis.json")
    plain = memory_of(_plain_topology("offload", "pinned_host"))
    assert plain is not None and memory == plain
    # The parameters and momentum: 2 x (4*512*512 + 512*128) f32, replicated: on every host.
    state_bytes = 2 * (4 * 512 * 512 + 512 * 128) * 4
    assert memory["host_argument_size_in_bytes"] == state_bytes
    assert memory["host_output_size_in_bytes"] == state_bytes
    rows = _json(rd, "compile/shardings.json")
    assert _kinds(rows["inputs"]) == ["pinned_host"] * 4 + ["device"] * 3
    assert rows["inputs"][0]["layout"]["tiling"]  # TPU layouts are tiled
