"""Arguments as JAX's AOT API takes them, from config, compared with plain JAX.

Keyword arguments on a mesh (jax.jit refuses ``in_shardings`` with keyword arguments, so each
sharding rides on its ShapeDtypeStruct, as ``jax.jit(f).trace(x_sds, a=a_sds)``), symbolic
dimensions split by a mesh axis (JAX requires the split provable for every size), and every
mismatched input named in one error (JAX lists every mismatched argument).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import aot_args_programs as progs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_reference import assert_same, cpu_mesh, run_inputs, specs_of
from jaxaot.errors import ConfigError

T = "program.target=aot_args_programs"
MESH2 = ("mesh.shape=[2]", "mesh.axes=[data]")


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _arg_shardings(module: str) -> list[str]:
    """The sdy.sharding of each argument of a module's main function, in order."""
    head = next(ln for ln in module.splitlines() if "func.func public @main" in ln)
    args = head.split("->")[0]
    return [
        m.group(1) if m else "none"
        for m in (
            re.search(r"sdy\.sharding = (#sdy\.sharding<@\w+, \[[^\]]*\]>)", part)
            for part in re.split(r"%arg\d+: ", args)[1:]
        )
    ]


# --- 1. keyword arguments on a mesh -------------------------------------------------------


@pytest.mark.parametrize(
    ("shardings", "want_a"),
    [
        ("lower.in_shardings=[data]", P()),  # the positional list: keywords replicated
        ("lower.in_shardings={x: [data], a: [data]}", P("data")),  # named by keyword
    ],
)
def test_keyword_arguments_on_a_mesh(compose_run: Any, shardings: str, want_a: Any) -> None:
    # JAX: jax.jit(f, in_shardings=..., donate_argnames=...)(x, a=.., b=..) raises "pjit does
    # not support kwargs when in_shardings is specified"; the same shardings on the
    # ShapeDtypeStructs lower and compile, donating 'a'.
    result = compose_run(
        f"{T}:scaled",
        "program.args=[f32[8]]",
        "+program.kwargs.a=f32[8]",
        "+program.kwargs.b=f32[8]",
        *MESH2,
        shardings,
        "lower.donate_argnames=[a]",
        "execute.check=reference",
        "execute.repeats=2",
    )
    # Plain JAX after the run: the run starts the virtual devices the mesh needs.
    mesh = cpu_mesh()

    def sds(spec: Any) -> Any:
        return jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, spec))

    with pytest.raises(ValueError, match="does not support kwargs when in_shardings"):
        jax.jit(progs.scaled, in_shardings=NamedSharding(mesh, P("data"))).lower(
            sds(P("data")), a=sds(want_a), b=sds(P())
        )
    plain = jax.jit(progs.scaled, donate_argnames=("a",)).trace(
        sds(P("data")), a=sds(want_a), b=sds(P())
    )
    lowered = plain.lower()
    compiled = lowered.compile()
    module = (result.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    assert _arg_shardings(module) == _arg_shardings(lowered.as_text())
    ours = result.records["compile"].compiled
    assert specs_of(ours.input_shardings) == specs_of(compiled.input_shardings)
    assert specs_of(ours.output_shardings) == specs_of(compiled.output_shardings)
    assert (
        [i.donated for i in jax.tree.leaves(ours.args_info)]
        == [i.donated for i in jax.tree.leaves(compiled.args_info)]
        == [False, True, False]
    )  # flatten order: x, then a, b
    sig = result.records["stage_out"].signature["inputs"]
    assert [(i["path"], i["donated"]) for i in sig] == [
        ("args[0]", False),
        ("kwargs['a']", True),
        ("kwargs['b']", False),
    ]
    args, kwargs = run_inputs(result)
    on = {k: jax.device_put(v, compiled.input_shardings[1][k]) for k, v in kwargs.items()}
    with warnings.catch_warnings():  # JAX warns when a donated buffer cannot hold an output
        warnings.simplefilter("ignore")
        want = compiled(
            *(jax.device_put(v, s) for v, s in zip(args, compiled.input_shardings[0], strict=True)),
            **on,
        )
    assert_same(result.records["execute"].outputs, want)
    # 'a' is consumed when its buffer can hold the output (the same split), as in plain JAX.
    consumed = result.records["execute"].timings["donated_inputs_consumed"]
    assert consumed is on["a"].is_deleted() is (want_a == P("data"))


def test_keyword_arguments_on_an_explicit_mesh(compose_run: Any) -> None:
    # JAX: with explicit axes the shardings are part of the argument types, keyword arguments'
    # too: jax.jit(f).trace(x_sds, a=a_sds, b=b_sds) types each by its ShapeDtypeStruct.
    result = compose_run(
        f"{T}:scaled",
        "program.args=[f32[8]]",
        "+program.kwargs.a=f32[8]",
        "+program.kwargs.b=f32[8]",
        *MESH2,
        "mesh.axis_types=[explicit]",
        "lower.in_shardings={x: [data], a: [data]}",
        "execute.check=reference",
        "execute.repeats=1",
    )
    from jax.sharding import AxisType

    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )

    def sds(spec: Any) -> Any:
        return jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, spec))

    with jax.set_mesh(mesh):
        plain = jax.jit(progs.scaled).trace(sds(P("data")), a=sds(P("data")), b=sds(P()))
        compiled = plain.lower().compile()
    # The types stage_out traced carry the shardings, keyword arguments' included.
    staged = result.records["stage_out"]
    assert [str(a.sharding.spec) for a in jax.tree.leaves(staged.kwargs)] == [
        str(P("data")),
        str(P()),
    ]
    ours = result.records["compile"].compiled
    assert specs_of(ours.input_shardings) == specs_of(compiled.input_shardings)
    assert specs_of(ours.output_shardings) == specs_of(compiled.output_shardings)
    args, kwargs = run_inputs(result)
    want = compiled(
        *(jax.device_put(v, s) for v, s in zip(args, compiled.input_shardings[0], strict=True)),
        **{k: jax.device_put(v, compiled.input_shardings[1][k]) for k, v in kwargs.items()},
    )
    assert_same(result.records["execute"].outputs, want)


def test_a_donated_keyword_pytree_is_consumed_leaf_by_leaf_as_in_jax(compose_run: Any) -> None:
    # JAX: donating 'p' donates every leaf; XLA reuses a donated buffer only where an output
    # of its shape and sharding can take it, so p['inner']['c'] is consumed and p['w'] and
    # p['inner']['d'] are not.
    result = compose_run(
        f"{T}:nested",
        "program.args=[f32[8]]",
        "+program.kwargs.p={w: f32[8], inner: {c: f32[8], d: f32[4]}}",
        *MESH2,
        "lower.in_shardings={x: [data], p/w: [data], p/inner/c: [data]}",
        "lower.donate_argnames=[p]",
        "execute.repeats=1",
    )
    mesh = cpu_mesh()

    def sds(shape: tuple[int, ...], spec: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    p = {"w": sds((8,), P("data")), "inner": {"c": sds((8,), P("data")), "d": sds((4,), P())}}
    with warnings.catch_warnings():  # JAX warns that some donated buffers were not usable
        warnings.simplefilter("ignore")
        compiled = (
            (jax.jit(progs.nested, donate_argnames=("p",)).trace(sds((8,), P("data")), p=p))
            .lower()
            .compile()
        )
        args, kwargs = run_inputs(result)
        placed = jax.tree.map(
            lambda v, s: jax.device_put(v, s), kwargs, compiled.input_shardings[1]
        )
        want = compiled(jax.device_put(args[0], compiled.input_shardings[0][0]), **placed)
    assert_same(result.records["execute"].outputs, want)
    jax_consumed = {
        "kwargs['p']" + jax.tree_util.keystr(path): a.is_deleted()
        for path, a in jax.tree_util.tree_flatten_with_path(placed["p"])[0]
    }
    timings = result.records["execute"].timings
    assert timings["donated_leaves_consumed"] == jax_consumed
    assert jax_consumed == {
        "kwargs['p']['inner']['c']": True,
        "kwargs['p']['inner']['d']": False,
        "kwargs['p']['w']": False,
    }
    assert timings["donated_inputs_consumed"] is False
    # shardings.json says which inputs are donated, as JAX's args_info does.
    rows = json.loads((result.run_dir / "compile" / "shardings.json").read_text())["inputs"]
    assert (
        [r["donated"] for r in rows]
        == [i.donated for i in jax.tree.leaves(compiled.args_info)]
        == [False, True, True, True]
    )


def test_keyword_dict_with_a_static_keyword_and_memory_kind(compose_run: Any) -> None:
    # JAX: a dict keyword argument's leaves carry their own shardings (and memory kinds); a
    # static keyword is bound. Plain JAX: ShapeDtypeStructs with NamedSharding(...)
    # .with_memory_kind('device') and static_argnames=('mode',).
    result = compose_run(
        f"{T}:keyed",
        "program.args=[f32[4,8]]",
        "+program.kwargs.p={w: f32[4,8], b: f32[4,8]}",
        "+program.kwargs.mode=sum",
        "stage_out.static_argnames=[mode]",
        *MESH2,
        "lower.in_shardings={x: [data], p/w: [data]}",
        "lower.in_memory_kinds=device",
        "execute.check=reference",
        "execute.repeats=1",
    )
    mesh = cpu_mesh()
    sh = NamedSharding(mesh, P("data")).with_memory_kind("device")
    rep = NamedSharding(mesh, P()).with_memory_kind("device")
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=sh)
    p = {
        "b": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=rep),
        "w": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=sh),
    }
    compiled = (
        jax.jit(progs.keyed, static_argnames=("mode",)).trace(x, p=p, mode="sum").lower().compile()
    )
    ours = result.records["compile"].compiled
    assert specs_of(ours.input_shardings) == specs_of(compiled.input_shardings)
    paths = json_rows(result.run_dir / "lower" / "path_shardings.json")
    assert paths == {"x": "P('data')", "p/b": "P()", "p/w": "P('data')"}
    args, kwargs = run_inputs(result)
    ins = compiled.input_shardings
    want = compiled(jax.device_put(args[0], ins[0][0]), p=jax.device_put(kwargs["p"], ins[1]["p"]))
    assert_same(result.records["execute"].outputs, want)


def json_rows(path: Path) -> dict[str, str]:
    import json

    return {r["path"]: r["spec"] for r in json.loads(path.read_text())["inputs"]}


def test_the_resolution_recorded_holds_the_keyword_leaves() -> None:
    # path_shardings.json records every leaf a rule decided: under the positional list the
    # keyword arguments are resolved on their own (library metadata, else replicated), and
    # their leaves are merged with the positional ones' into the one resolution recorded.
    import jaxaot
    from jaxaot.config.argspec import bind_config
    from jaxaot.config.mesh import mesh_spec
    from jaxaot.config.path_shardings import Resolution, merged
    from jaxaot.config.sharding import Spec
    from jaxaot.schema import validate
    from jaxaot.stages.jax_inputs import resolved_with_keywords

    overrides = [f"{T}:scaled", "program.args=[f32[8]]", "+program.kwargs.a=f32[8]"]
    overrides += ["+program.kwargs.b=f32[8]", *MESH2, "lower.in_shardings=[[data]]"]
    cfg = validate(jaxaot.compose(overrides))
    mesh = mesh_spec(cfg.mesh, cfg.stage_out)
    assert mesh is not None
    s = jax.ShapeDtypeStruct((8,), jnp.float32)
    bound = bind_config(cfg.program, cfg.stage_out, cfg.lower, ["x"])
    found = resolved_with_keywords(
        cfg.lower, bound, mesh, (s,), {"a": s, "b": s}, ["x"], {"a": ("batch",)}
    )
    assert found.resolution is not None
    assert {r["path"]: r["by"] for r in found.resolution.table()} == {
        "a": "metadata [batch]",
        "b": "no rule: replicated",
    }
    assert found.resolution.unmatched == ["b"]
    pos = Resolution({"x": Spec(("data",))}, {"x": "x"}, {"x": (8,)}, [], ["n1"])
    kw = Resolution({"a": Spec(())}, {"a": "no rule"}, {"a": (8,)}, ["a"], ["n2"])
    both = merged([pos, kw])
    assert both is not None
    assert [r["path"] for r in both.table()] == ["x", "a"]
    assert (both.unmatched, both.notes) == (["a"], ["n1", "n2"])
    assert merged([kw]) is kw and merged([]) is None


def test_a_pattern_reaching_a_keyword_only_by_position_is_refused() -> None:
    # Keyword arguments are named by keyword (JAX's key paths: kwargs['a']); resolved after
    # the positional ones, the first keyword is also args[n]: a pattern reaching it only so
    # is refused, one naming it by keyword or by a wildcard over every path is not.
    from jaxaot.config.path_shardings import check_keyword_patterns

    kw = {"a": jax.ShapeDtypeStruct((8,), jnp.float32), "b": {"w": jnp.zeros(2)}}
    with pytest.raises(ConfigError, match=r"\['args\[1\]'\]: matches keyword argument leaf a only"):
        check_keyword_patterns({"args[1]": ["data"]}, 1, kw)
    with pytest.raises(ConfigError, match=r"leaf b/w only as args\[2\]/w"):
        check_keyword_patterns({"x": None, "args[*]/w": ["data"]}, 1, kw)
    check_keyword_patterns({"args[0]": ["data"], "a": ["data"], "**": None}, 1, kw)
    check_keyword_patterns([["data"]], 1, kw)  # the positional list names no keyword


# --- 2. symbolic dimensions split by a mesh axis ------------------------------------------


def test_symbolic_dimension_provably_divisible_compiles(compose_run: Any) -> None:
    # JAX: f32[2*b,4] on P('data') over 2 devices exports (2*b is divisible by 2 for every b)
    # and its export runs at b=2 on the mesh.
    result = compose_run(
        f"{T}:double",
        "program.args=[f32[2*b,4]]",
        *MESH2,
        "lower.in_shardings=[[data,null]]",
        "compile.shapes={b:2}",
        "execute.check=reference",
        "execute.repeats=1",
    )
    mesh = cpu_mesh()
    (shape,) = [jax.export.symbolic_shape("2*b, 4")]
    amesh = mesh.abstract_mesh
    with jax.sharding.use_abstract_mesh(amesh):
        exp = jax.export.export(
            jax.jit(progs.double, in_shardings=NamedSharding(amesh, P("data", None)))
        )(jax.ShapeDtypeStruct(shape, jnp.float32))
    assert result.records["compile"].lowered.exported.nr_devices == exp.nr_devices == 2
    (x,), _ = run_inputs(result)
    with jax.set_mesh(mesh):
        want = jax.jit(exp.call, in_shardings=NamedSharding(mesh, P("data", None)))(x)
    assert_same(result.records["execute"].outputs, want)
    ours = result.records["compile"].compiled
    assert specs_of(ours.input_shardings[0]) == ((("data",), "device"),)


@pytest.mark.parametrize(
    "overrides",
    [
        ("lower.in_shardings=[[data,null]]",),
        ("lower.in_shardings={x: [data, null]}",),
        ("lower.in_shardings=[[data,null]]", "mesh.axis_types=[explicit]"),
    ],
    ids=["positional", "mapping", "explicit-axes"],
)
def test_symbolic_dimension_not_provably_divisible_is_refused(
    compose_run: Any, overrides: tuple[str, ...]
) -> None:
    # JAX: f32[b,4] on P('data') raises IndivisibleError when traced, whatever b is later;
    # with explicit axes the sharding is part of the argument's type, and the
    # ShapeDtypeStruct carrying it is refused when traced.
    amesh = AbstractMesh((2,), ("data",))
    (shape,) = [jax.export.symbolic_shape("b, 4")]
    with (
        pytest.raises(ValueError, match="should evenly divide"),
        jax.sharding.use_abstract_mesh(amesh),
    ):
        jax.export.export(
            jax.jit(progs.double, in_shardings=NamedSharding(amesh, P("data", None)))
        )(jax.ShapeDtypeStruct(shape, jnp.float32))
    explicit = AbstractMesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    with (
        pytest.raises(ValueError, match="does not evenly divide the dimension size b"),
        jax.sharding.use_abstract_mesh(explicit),
    ):
        typed = NamedSharding(explicit, P("data", None))
        jax.jit(progs.double).trace(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=typed))
    with pytest.raises(ConfigError, match=r"program\.args\[0\]|x") as info:
        compose_run(
            f"{T}:double",
            "program.args=[f32[b,4]]",
            *MESH2,
            *overrides,
            "compile.shapes={b:2}",
        )
    text = str(info.value)
    assert text.startswith("lower.in_shardings") and "\n" not in text
    assert "dimension 0" in text and "size b" in text and "2 devices" in text


# --- 3. every mismatched input in one error -----------------------------------------------


def test_every_mismatched_input_is_named(compose_run: Any, tmp_path: Path) -> None:
    # JAX lists every mismatched argument: "Argument 'x' compiled with float32[4] and called
    # with int32[4]" and "Argument 'y' ... called with float32[3]".
    compiled = jax.jit(progs.add).lower(jnp.ones(4), jnp.ones(4)).compile()
    with pytest.raises(TypeError) as jax_err:
        compiled(jnp.ones(4, jnp.int32), jnp.ones(3))
    assert "Argument 'x'" in str(jax_err.value) and "Argument 'y'" in str(jax_err.value)
    i, j = tmp_path / "i.npy", tmp_path / "j.npy"
    np.save(i, np.ones(4, np.int32))
    np.save(j, np.ones(3, np.float32))
    with pytest.raises(ConfigError) as info:
        compose_run(f"{T}:add", "program.args=[f32[4],f32[4]]", f"execute.inputs=[{i},{j}]")
    text = str(info.value)
    assert "\n" not in text and text.startswith("execute.inputs: 2 inputs differ")
    assert "execute.inputs[0]" in text and "holds i32[4], expected f32[4]" in text
    assert "execute.inputs[1]" in text and "holds f32[3], expected f32[4]" in text
    archive = tmp_path / "in.npz"
    np.savez(archive, **{"args[0]": np.ones(4, np.int32), "args[1]": np.ones(3, np.float32)})
    with pytest.raises(ConfigError, match=r"2 inputs differ.*args\[0\].*args\[1\]"):
        compose_run(f"{T}:add", "program.args=[f32[4],f32[4]]", f"execute.inputs={archive}")


@pytest.mark.parametrize(
    ("shardings", "want"),
    [
        ("lower.in_shardings={x: [data], a: [data]}", {"x": P("data"), "a": P("data")}),
        ("lower.in_shardings=[data]", {"x": P("data")}),  # keywords replicated
        ("lower.in_shardings={x: [data], b: [data]}", {"x": P("data"), "b": P("data")}),
    ],
    ids=["keyword-a", "positional-list", "keyword-b"],
)
def test_stage_out_table_of_keyword_arguments_on_a_mesh(
    compose_run: Any, caplog: pytest.LogCaptureFixture, shardings: str, want: dict[str, Any]
) -> None:
    # JAX: jax.jit(f).trace(x_sds, a=a_sds, b=b_sds) with the shardings on the
    # ShapeDtypeStructs; stage_out's arguments table (before the lowering) gives each keyword
    # argument the sharding the compiled executable takes it with.
    caplog.set_level("INFO", logger="jaxaot")
    result = compose_run(
        f"{T}:scaled",
        "program.args=[f32[8]]",
        "+program.kwargs.a=f32[8]",
        "+program.kwargs.b=f32[8]",
        *MESH2,
        shardings,
        "stop_after=compile",
    )
    mesh = cpu_mesh()

    def sds(name: str) -> Any:
        spec = want.get(name, P())
        return jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, spec))

    plain = jax.jit(progs.scaled).trace(sds("x"), a=sds("a"), b=sds("b")).lower().compile()
    (x,), kw = plain.input_shardings
    compiled = {"x": x, "a": kw["a"], "b": kw["b"]}
    assert specs_of(result.records["compile"].compiled.input_shardings) == specs_of(
        plain.input_shardings
    )
    doc = json.loads((result.run_dir / "stage_out" / "arguments.json").read_text())
    assert doc["shardings_note"] is None
    rows = {r["path"]: r for r in doc["arguments"]}
    assert list(rows) == ["x", "a", "b"]
    for name, sharding in compiled.items():
        assert rows[name]["shard_shape"] == list(sharding.shard_shape((8,)))
        assert rows[name]["sharding"] == ("replicated" if name not in want else "P('data',)")
    assert doc["total"]["bytes_per_device"] == sum(
        4 * sharding.shard_shape((8,))[0] for sharding in compiled.values()
    )
    assert not [r.message for r in caplog.records if "not resolved at stage_out" in r.message]
