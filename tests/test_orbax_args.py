"""An orbax checkpoint as an argument (jaxaot.models.orbax): shapes, dtypes and shardings from
its metadata without reading array data; the values restored, bit for bit, into the shardings
asked for."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import extra_reason

pytest.importorskip("orbax.checkpoint", reason=extra_reason("models"))

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxaot.errors import ArgSpecError
from jaxaot.models.orbax import checkpoint
from jaxaot.stages import jaxenv

abstract = checkpoint.jaxaot_abstract
materialize = checkpoint.jaxaot_materialize


def _params(seed: int = 0) -> dict[str, Any]:
    """A small model's params: nested dicts, bf16 and f32, one larger table (256 KiB)."""
    r = np.random.default_rng(seed)
    return {
        "embed": {"table": jnp.asarray(r.normal(size=(256, 256)), jnp.float32)},
        "layers": {
            "0": {
                "w": jnp.asarray(r.normal(size=(256, 64)), jnp.bfloat16),
                "b": jnp.asarray(r.normal(size=(64,)), jnp.float32),
            },
            "1": {
                "w": jnp.asarray(r.normal(size=(64, 16)), jnp.bfloat16),
                "b": jnp.asarray(r.normal(size=(16,)), jnp.float32),
            },
        },
        "count": jnp.asarray(7, jnp.int32),
    }


def _save(path: Path, tree: Any) -> Path:
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, tree)
        ck.wait_until_finished()
    return path


def _save_step(root: Path, step: int, **items: Any) -> Path:
    """A CheckpointManager step: each tree item a StandardSave, a dict named meta a JsonSave."""
    saves = {
        name: ocp.args.JsonSave(tree) if name == "meta" else ocp.args.StandardSave(tree)
        for name, tree in items.items()
    }
    with ocp.CheckpointManager(root) as mgr:
        mgr.save(step, args=ocp.args.Composite(**saves))
        mgr.wait_until_finished()
    return root / str(step)


def _same(got: Any, want: Any) -> None:
    """Equal structure, dtypes and bits."""
    assert str(jax.tree.structure(got)) == str(jax.tree.structure(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def _reads() -> dict[str, float]:
    """tensorstore's process-wide counters: chunks read (array data) and file bytes read."""
    out = {}
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/"):
        if metric["name"] in (
            "/tensorstore/cache/chunk_cache/reads",
            "/tensorstore/kvstore/file/bytes_read",
        ):
            out[metric["name"].rsplit("/", 1)[-1]] = sum(
                v.get("value", 0) for v in metric.get("values", [])
            )
    return out


def _delta(before: dict[str, float]) -> dict[str, float]:
    after = _reads()
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("reads", "bytes_read")}


@pytest.fixture(autouse=True)
def cpu_backend() -> Iterator[None]:
    """The CPU backend alone, as a run starts it (not every installed plugin's)."""
    previous = jaxenv.configure(backend="cpu", num_devices=None, x64=False)
    yield
    jaxenv.restore_config(previous)


@pytest.fixture
def eight_devices() -> Iterator[Mesh]:
    """8 virtual CPU devices (as a run with compile.num_devices=8 has) as a 4x2 mesh."""
    previous = jaxenv.configure(backend="cpu", num_devices=8, x64=False)
    try:
        yield Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    finally:
        jaxenv.restore_config(previous)


# --- the abstract value: metadata only -------------------------------------------------------


def test_abstract_is_the_tree_shapes_and_dtypes_and_reads_no_array_data(tmp_path: Path) -> None:
    params = _params()
    path = _save(tmp_path / "ckpt", params)
    before = _reads()
    got = abstract(str(path))
    seen = _delta(before)
    assert got == jax.eval_shape(lambda: params)
    # No chunk of any array was read; the metadata is a few hundred bytes of headers, where the
    # arrays hold ~300 KiB.
    assert seen["reads"] == 0
    assert seen["bytes_read"] < 16 * 1024
    before = _reads()
    restored = materialize(None, str(path))
    seen = _delta(before)
    assert seen["reads"] >= len(jax.tree.leaves(params))
    assert seen["bytes_read"] > 256 * 256 * 4 // 2  # the f32 table, compressed at most 2x
    _same(restored, params)


def test_the_plain_call_restores_bit_for_bit(tmp_path: Path) -> None:
    params = _params(1)
    _same(checkpoint(str(_save(tmp_path / "ckpt", params))), params)


def test_a_relative_path_is_read_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _params(2)
    _save(tmp_path / "ckpts" / "run1", params)
    monkeypatch.chdir(tmp_path)
    assert abstract("ckpts/run1") == jax.eval_shape(lambda: params)
    _same(checkpoint("ckpts/run1"), params)


def test_tuples_come_back_as_lists_and_python_numbers_as_numbers(tmp_path: Path) -> None:
    tree: dict[str, Any] = {"pair": (jnp.ones(2), jnp.zeros(3, jnp.int32)), "step": 3, "lr": 0.5}
    path = _save(tmp_path / "ckpt", tree)
    got = abstract(str(path))
    assert got == {
        "pair": [jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)],
        "step": jax.ShapeDtypeStruct((), jnp.int32, weak_type=True),  # as jax.jit traces 3
        "lr": jax.ShapeDtypeStruct((), jnp.float32, weak_type=True),
    }
    restored = checkpoint(str(path))
    assert restored["step"] == 3 and type(restored["step"]) is int
    assert restored["lr"] == 0.5 and type(restored["lr"]) is float
    _same(restored["pair"], list(tree["pair"]))


def test_dtype_casts_floating_arrays_only(tmp_path: Path) -> None:
    params = _params(3)
    path = _save(tmp_path / "ckpt", params)
    want = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a, params
    )
    assert abstract(str(path), dtype="bf16") == jax.eval_shape(lambda: want)
    _same(checkpoint(str(path), dtype="bf16"), want)
    assert checkpoint(str(path), dtype="f32")["layers"]["0"]["w"].dtype == jnp.float32


# --- items and subtrees ----------------------------------------------------------------------


def test_item_names_a_checkpoint_manager_item_and_a_subtree(tmp_path: Path) -> None:
    params = _params(4)
    big = {"mu": jnp.ones((512, 512), jnp.float32), "nu": jnp.full((512, 512), 2.0)}
    step = _save_step(tmp_path / "run1", 1000, params=params, opt=big, meta={"lr": 0.1})
    assert abstract(str(step), item="params") == jax.eval_shape(lambda: params)
    _same(checkpoint(str(step), item="params"), params)
    before = _reads()
    sub = checkpoint(str(step), item="params/layers/1")
    seen = _delta(before)
    _same(sub, params["layers"]["1"])
    assert seen["reads"] == 2  # w and b only
    assert seen["bytes_read"] < 64 * 1024  # never the 2 MiB of opt
    _same(checkpoint(str(step), item="opt/nu"), big["nu"])


def test_a_step_with_one_tree_item_needs_no_item(tmp_path: Path) -> None:
    params = _params(5)
    step = _save_step(tmp_path / "run1", 7, params=params, meta={"note": "x"})
    assert abstract(str(step)) == jax.eval_shape(lambda: params)
    _same(checkpoint(str(step)), params)


def test_item_indexes_into_a_plain_tree(tmp_path: Path) -> None:
    tree = {"layers": [{"w": jnp.arange(6.0).reshape(2, 3)}, {"w": jnp.ones((3, 1))}]}
    path = _save(tmp_path / "ckpt", tree)
    assert abstract(str(path), item="layers/1") == {"w": jax.ShapeDtypeStruct((3, 1), jnp.float32)}
    _same(checkpoint(str(path), item="layers/0"), tree["layers"][0])


# --- shardings -------------------------------------------------------------------------------


def test_materialize_restores_into_the_executables_shardings(
    tmp_path: Path, eight_devices: Mesh
) -> None:
    params = _params(6)
    path = _save(tmp_path / "ckpt", params)
    mesh = eight_devices
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract(str(path)))
    shardings["embed"]["table"] = NamedSharding(mesh, P("data", "model"))
    shardings["layers"]["0"]["w"] = NamedSharding(mesh, P(None, "model"))
    restored = materialize(shardings, str(path))
    _same(restored, params)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
        assert got.sharding == want
    table = restored["embed"]["table"]
    assert {s.data.shape for s in table.addressable_shards} == {(64, 128)}
    assert len(table.addressable_shards) == 8
    # One sharding for every array.
    one = materialize(NamedSharding(mesh, P()), str(path), item="layers")
    assert {a.sharding.spec for a in jax.tree.leaves(one)} == {P()}


def test_saved_shardings_come_from_the_metadata(tmp_path: Path, eight_devices: Mesh) -> None:
    mesh = eight_devices
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    path = _save(tmp_path / "ckpt", {"w": w, "b": jnp.ones(8)})
    plain = abstract(str(path))
    assert plain["w"].sharding is None  # the run's lower.in_shardings decide by default
    saved = abstract(str(path), saved_shardings=True)
    assert saved["w"].sharding.spec == P("data", "model")
    assert dict(saved["w"].sharding.mesh.shape) == {"data": 4, "model": 2}
    assert saved["b"].sharding is None  # saved on one device: no constraint
    restored = checkpoint(str(path), saved_shardings=True)
    assert restored["w"].sharding.spec == P("data", "model")
    _same(restored["w"], w)


def test_saved_shardings_this_process_cannot_rebuild_are_refused(
    tmp_path: Path, eight_devices: Mesh
) -> None:
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(eight_devices, P("data", "model")))
    path = _save(tmp_path / "ckpt", {"w": w})
    previous = jaxenv.configure(backend="cpu", num_devices=2, x64=False)
    try:
        text = _error(str(path), saved_shardings=True)
        assert abstract(str(path)) == {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    finally:
        jaxenv.restore_config(previous)
    assert text.startswith(f"saved_shardings: path '{path}': 'w' was saved over the mesh ")
    assert "{'data': 4, 'model': 2}, which this process's 2 device(s) cannot rebuild" in text


# --- errors: one line naming the argument, what was expected and found -----------------------


def _error(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(ArgSpecError) as info:
        abstract(*args, **kwargs)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_path_errors(tmp_path: Path) -> None:
    assert "does not exist" in _error(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    assert "is a file; expected an orbax checkpoint directory" in _error(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    assert "is not an orbax checkpoint: it has no _METADATA" in _error(str(tmp_path / "empty"))
    (tmp_path / "flax").mkdir()
    (tmp_path / "flax" / "checkpoint").write_bytes(b"\x80")
    assert "Flax msgpack checkpoint" in _error(str(tmp_path / "flax"))
    assert "only local directories" in _error("gs://bucket/run1/1000")
    assert "expected an orbax checkpoint directory (a string), found None" in _error(None)


def test_a_checkpoint_manager_root_lists_its_steps(tmp_path: Path) -> None:
    _save_step(tmp_path / "run1", 200, params=_params())  # listed by number, not as text
    _save_step(tmp_path / "run1", 1000, params=_params())
    text = _error(str(tmp_path / "run1"))
    assert "is a CheckpointManager directory with steps 200, 1000" in text
    assert f"(path: {tmp_path / 'run1' / '1000'})" in text


def test_item_errors_list_what_there_is(tmp_path: Path) -> None:
    step = _save_step(tmp_path / "run1", 1, params=_params(), opt=_params(), meta={"a": 1})
    assert _error(str(step)).endswith(
        "holds several items: opt, params (not array trees: meta); expected item: one of them "
        "(item: opt)"
    )
    assert "has no tree item 'parms'; its items are opt, params (not array trees: meta)" in _error(
        str(step), item="parms"
    )
    assert "has no 'params/layers/2' (the tree there has: 0, 1)" in _error(
        str(step), item="params/layers/2"
    )
    assert "has no 'params/count/x': the tree ends in a leaf above it" in _error(
        str(step), item="params/count/x"
    )


def test_a_string_leaf_and_bad_dtypes_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(path, {"w": jnp.ones(2), "name": "llama"})
    assert "the leaf 'name' is a string, not an array or number" in _error(str(path))
    assert abstract(str(path), item="w") == jax.ShapeDtypeStruct((2,), jnp.float32)
    assert "dtype: 'int8' is not a floating type" in _error(str(path), item="w", dtype="int8")
    assert "dtype: unknown dtype 'bfloat'; expected one of" in _error(
        str(path), item="w", dtype="bfloat"
    )


def test_64_bit_arrays_need_x64(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(path, {"ids": np.arange(4, dtype=np.int64), "x": np.ones(2)})
    assert not jax.config.jax_enable_x64  # type: ignore[attr-defined]
    text = _error(str(path), item="ids")
    assert "the leaf 'ids' is int64 and jax_enable_x64 is off" in text
    assert "+jax.config.jax_enable_x64=true" in text
    assert "dtype: f32" not in text  # an integer array cannot be cast
    assert _error(str(path), item="x").endswith("+jax.config.jax_enable_x64=true, or dtype: f32")
    assert abstract(str(path), item="x", dtype="f32") == jax.ShapeDtypeStruct((2,), jnp.float32)


# --- through jaxaot: a checkpoint as an argument of a run ------------------------------------


def _mlp_checkpoint(tmp_path: Path) -> tuple[Path, Path, list[dict[str, Any]]]:
    """A step of jaxaot.examples.mlp's params (bf16 and f32 layers) beside 2 MiB of optimizer
    state, and an input batch as .npy: (checkpoint dir, x.npy, params)."""
    r = np.random.default_rng(7)
    sizes, dtypes = [(256, 512), (512, 512), (512, 128)], [jnp.bfloat16, jnp.float32, jnp.bfloat16]
    params = [
        {
            "w": jnp.asarray(r.normal(size=s) * 0.05, d),
            "b": jnp.asarray(r.normal(size=s[1:]) * 0.1, jnp.float32),
        }
        for s, d in zip(sizes, dtypes, strict=True)
    ]
    opt = {"mu": jnp.ones((512, 1024), jnp.float32)}
    step = _save_step(tmp_path / "ckpts", 1000, params=params, opt=opt)
    x = tmp_path / "x.npy"
    np.save(x, r.normal(size=(64, 256)).astype(np.float32))
    return step, x, params


def _args(step: Path | str, x: Path | str) -> str:
    ckpt = f"{{_init_:'jaxaot.models.orbax:checkpoint',path:'{step}',item:params}}"
    return f"program.args=[{ckpt},'{x}']"


def _run(run_dir: Path, *overrides: str, in_shardings: Any = None) -> Any:
    import jaxaot

    cfg = jaxaot.compose(["program=mlp", "execute.warmup=0", "execute.repeats=1", *overrides])
    if in_shardings is not None:
        cfg.lower.in_shardings = in_shardings
    return jaxaot.run(cfg, run_dir=run_dir)


def _out(run_dir: Path) -> np.ndarray:
    with np.load(run_dir / "execute" / "outputs.npz") as z:
        return np.asarray(z["out0"])


def test_a_run_reads_no_array_data_before_execute_and_matches_plain_jax(tmp_path: Path) -> None:
    from jaxaot.examples.mlp import mlp

    step, x, params = _mlp_checkpoint(tmp_path)
    before = _reads()
    lowered = _run(tmp_path / "compiled", _args(step, x), "stop_after=compile")
    seen = _delta(before)
    assert lowered.manifest["stages"]["compile"]["status"] in ("ran", "hit")
    assert seen["reads"] == 0  # stage_out, lower and compile: metadata only
    assert seen["bytes_read"] < 32 * 1024  # the arrays hold 2.8 MiB
    before = _reads()
    _run(tmp_path / "run", _args(step, x))
    seen = _delta(before)
    assert seen["reads"] == 6  # execute restores the 6 params arrays, never opt
    want = jax.jit(mlp)(params, np.load(x))
    assert _out(tmp_path / "run").tobytes() == np.asarray(want).tobytes()


def test_with_a_mesh_the_restored_arrays_carry_the_executables_shardings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxaot.examples.mlp import mlp

    step, x, params = _mlp_checkpoint(tmp_path)
    seen: dict[str, Any] = {}
    real = checkpoint.jaxaot_materialize

    def spy(shardings: Any, *args: Any, **kwargs: Any) -> Any:
        seen["asked"], seen["restored"] = shardings, real(shardings, *args, **kwargs)
        return seen["restored"]

    monkeypatch.setattr(checkpoint, "jaxaot_materialize", spy)
    specs = {"params/*/w": [None, "model"], "params/*/b": ["model"], "x": ["data"]}
    _run(tmp_path / "run", _args(step, x), "mesh=data4_model2", in_shardings=specs)
    restored = seen["restored"]
    got = [a.sharding for a in jax.tree.leaves(restored)]
    assert got == list(jax.tree.leaves(seen["asked"]))  # the executable's, as execute gave them
    assert [s.spec for s in got] == [P("model"), P(None, "model")] * 3  # b, w per layer
    assert {len(s.mesh.devices.flat) for s in got} == {8}
    w0 = restored[0]["w"]
    assert {sh.data.shape for sh in w0.addressable_shards} == {(256, 256)}
    _same(restored, params)
    # Plain JAX, the same tree and shardings on the same mesh: the same bits.
    mesh = got[0].mesh
    x_sharding = NamedSharding(mesh, P("data"))
    in_shardings = (jax.tree.map(lambda a: a.sharding, restored), x_sharding)
    want = jax.jit(mlp, in_shardings=in_shardings)(restored, np.load(x))
    assert _out(tmp_path / "run").tobytes() == np.asarray(want).tobytes()


def test_the_cli_reads_a_relative_path_from_where_it_runs(tmp_path: Path, cli: Any) -> None:
    step, x, _ = _mlp_checkpoint(tmp_path)
    rel = step.relative_to(tmp_path)
    proc, run_dir = cli("program=mlp", _args(rel, x.name), "stop_after=compile")
    signature = (run_dir / "stage_out" / "arguments.txt").read_text()
    assert re.search(r"^params/0/w +\[256, ?512\] +bf16 ", signature, re.M), signature
    assert re.search(r"^params/1/w +\[512, ?512\] +f32 ", signature, re.M), signature
    proc, _ = cli("program=mlp", _args("ckpts", x.name), "stop_after=lower", expect_ok=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "is a CheckpointManager directory with steps 1000" in last


@pytest.mark.parametrize(
    ("specs", "want_w"),
    [
        (None, P("data", "model")),  # no lower.in_shardings: each leaf's saved sharding
        ({"x": ["data"]}, P("data", "model")),  # no pattern matches params: the saved one
        ({"params/*/w": [None, "model"], "x": ["data"]}, P(None, "model")),  # the rule wins
        ([["model"], ["data", "model"]], P("model")),  # the positional form decides every leaf
    ],
)
def test_saved_shardings_with_a_mesh_yield_to_the_run_rules(
    tmp_path: Path, eight_devices: Mesh, specs: Any, want_w: P
) -> None:
    from jaxaot.examples.mlp import mlp

    _, x, params = _mlp_checkpoint(tmp_path)
    on_mesh = [
        {"w": jax.device_put(p["w"], NamedSharding(eight_devices, P("data", "model"))), "b": p["b"]}
        for p in params
    ]
    saved = _save(tmp_path / "sharded", on_mesh)
    ckpt = f"{{_init_:'jaxaot.models.orbax:checkpoint',path:'{saved}',saved_shardings:true}}"
    result = _run(
        tmp_path / "run", f"program.args=[{ckpt},'{x}']", "mesh=data4_model2", in_shardings=specs
    )
    ins = result["compile"].compiled.input_shardings[0][0]
    assert [layer["w"].spec for layer in ins] == [want_w] * 3
    want = jax.jit(mlp)(params, np.load(x))
    np.testing.assert_allclose(_out(tmp_path / "run"), np.asarray(want), rtol=2e-2, atol=2e-2)
