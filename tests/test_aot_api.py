"""Everything JAX's AOT API can say, said from config, and JAX's answer reproduced.

Each test states what ``jax.jit`` does for a case, and checks that jaxaot's run of the same
case gives the same (outputs bit for bit, the same output types) in the same test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aot_api_programs as progs
import jax
import jax.numpy as jnp
import jaxaot
import numpy as np
import pytest
from jax_reference import assert_same, run_inputs
from jaxaot.errors import ConfigError, TargetError
from jaxaot.stages.execute import load_outputs

T = "program.target=aot_api_programs"


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


# --- 1. static and donated arguments by position or name, however passed ------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ["program.args=[double, f32[3]]", "stage_out.static_argnames=[mode]"],
        [
            "+program.kwargs.mode=double",
            "program.args=[]",
            "+program.kwargs.y=f32[3]",
            "stage_out.static_argnums=[0]",
        ],
    ],
)
def test_static_by_name_or_position_however_passed(compose_run: Any, overrides: list[str]) -> None:
    # JAX: static_argnames=['mode'] makes a positional 'mode' static, and static_argnums=[0]
    # a 'mode' passed by keyword (mapped through the signature).
    result = compose_run(f"{T}:pick", *overrides, "execute.check=reference", "execute.repeats=1")
    staged = result.records["stage_out"]
    assert staged.signature["static"][0]["value"] == "double"
    args, kwargs = run_inputs(result)
    want = progs.pick("double", *args, **kwargs)
    assert_same(result.records["execute"].outputs, want, structure=True)


def test_donate_argnums_on_a_keyword_passed_dict(compose_run: Any) -> None:
    # JAX: donate_argnums=[0] donates 'params' passed by keyword: every leaf is donated.
    p = {"a": jnp.ones(4), "b": jnp.ones(4)}
    traced = jax.jit(progs.sgd, donate_argnums=[0]).trace(params=p, grads=p)
    jax_donated = [i.donated for i in jax.tree.leaves(traced.args_info)]
    result = compose_run(
        f"{T}:sgd",
        "program.args=[]",
        "+program.kwargs.params={a: f32[4], b: f32[4]}",
        "+program.kwargs.grads={a: f32[4], b: f32[4]}",
        "lower.donate_argnums=[0]",
        "execute.check=reference",
        "execute.repeats=2",
    )
    sig = result.records["stage_out"].signature["inputs"]
    assert [i["donated"] for i in sig] == jax_donated == [False, False, True, True]
    assert result.records["execute"].timings["donated_inputs_consumed"] is True


def test_unknown_donate_argname_is_an_error(compose_run: Any) -> None:
    with pytest.raises(ConfigError, match=r"lower\.donate_argnames: 'nope' names no argument"):
        compose_run(
            f"{T}:pick",
            "program.args=[double, f32[3]]",
            "stage_out.static_argnums=[0]",
            "lower.donate_argnames=[nope]",
        )


def test_resume_keeps_statics_resolved_through_the_signature(compose_run: Any) -> None:
    first = compose_run(
        f"{T}:pick",
        "program.args=[double, f32[3]]",
        "stage_out.static_argnames=[mode]",
        "stop_after=compile",
    )
    again = compose_run(
        f"{T}:pick",
        "program.args=[double, f32[3]]",
        "stage_out.static_argnames=[mode]",
        f"resume_from={first.run_dir}",
        "start_at=execute",
        "execute.repeats=1",
    )
    args, _ = run_inputs(again)
    assert_same(again.records["execute"].outputs, progs.pick("double", *args), structure=True)


# --- 2. any pytree as an argument; namedtuple and custom pytree outputs ---------------------

PYTREE_ARGS = (
    "program.args=[{_pytree_: 'aot_api_programs:Point', x: f32[3], y: f32[3]},"
    " {_pytree_: 'aot_api_programs:State', w: f32[3], b: f32[], steps: 3},"
    " {_pytree_: tuple, _args_: [f32[2], f32[]]}]"
)


def test_namedtuple_dataclass_and_tuple_arguments(compose_run: Any) -> None:
    result = compose_run(f"{T}:norms", PYTREE_ARGS, "execute.check=reference", "execute.repeats=1")
    args, _ = run_inputs(result)
    assert isinstance(args[0], progs.Point) and isinstance(args[1], progs.State)
    assert isinstance(args[2], tuple) and args[1].steps == 3
    want = jax.jit(progs.norms)(*args)  # JAX: the same containers out
    got = result.records["execute"].outputs
    assert isinstance(got["point"], progs.Point) and isinstance(got["pair"], progs.Pair)
    assert_same(got, want, structure=True)
    sig = result.records["stage_out"].signature
    assert [i["path"] for i in sig["inputs"]] == [
        "args[0].x",
        "args[0].y",
        "args[1].w",
        "args[1].b",
        "args[2][0]",
        "args[2][1]",
    ]
    saved = load_outputs(result.run_dir / "execute")
    # JAX's own key paths (a class registered without keys has flat indices)
    assert list(saved) == [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]
    ]


def test_pytree_outputs_resume_from_the_export(compose_run: Any) -> None:
    first = compose_run(f"{T}:norms", PYTREE_ARGS, "stop_after=lower")
    meta = json.loads((first.run_dir / "lower" / "lowered.json").read_text())
    assert set(meta["namedtuples"]) == {
        "aot_api_programs:Point",
        "aot_api_programs:State",
        "aot_api_programs:Pair",
    }
    again = compose_run(
        f"{T}:norms",
        PYTREE_ARGS,
        f"resume_from={first.run_dir}",
        "start_at=compile",
        "execute.repeats=1",
    )
    args, _ = run_inputs(again)
    got = again.records["execute"].outputs
    assert isinstance(got["point"], progs.Point)
    assert_same(got, jax.jit(progs.norms)(*args), structure=True)


def test_pytree_class_goes_through_the_trust_policy(compose_run: Any) -> None:
    with pytest.raises(ConfigError, match=r"program\.args\[0\]\._pytree_.*os"):
        compose_run(f"{T}:add", "program.args=[{_pytree_: 'os:system', x: f32[2]}, f32[2]]")
    with pytest.raises(TargetError, match=r"program\.args\[0\]\._pytree_.*no attribute 'Nope'"):
        compose_run(
            f"{T}:add", "program.args=[{_pytree_: 'aot_api_programs:Nope', x: f32[2]}, f32[2]]"
        )


# --- 3. weak types ---------------------------------------------------------------------------


@pytest.mark.parametrize("weak", ["f32[]~weak", "{shape: [], dtype: f32, weak_type: true}"])
def test_weak_type_promotion(compose_run: Any, weak: str) -> None:
    # JAX: a weakly typed f32 scalar plus bf16 is bf16; a strong one makes it f32.
    y = jnp.ones(3, jnp.bfloat16)
    assert jax.jit(progs.add)(2.0, y).dtype == jnp.bfloat16
    assert jax.jit(progs.add)(np.float32(2.0), y).dtype == jnp.float32
    result = compose_run(
        f"{T}:add",
        f"program.args=[{weak}, bf16[3]]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    sig = result.records["stage_out"].signature
    assert sig["inputs"][0]["weak_type"] is True and sig["outputs"][0]["dtype"] == "bfloat16"
    args, _ = run_inputs(result)
    assert args[0].weak_type
    assert_same(result.records["execute"].outputs, jax.jit(progs.add)(*args), structure=True)
    strong = compose_run(f"{T}:add", "program.args=[f32[], bf16[3]]", "stop_after=stage_out")
    assert strong.records["stage_out"].signature["outputs"][0]["dtype"] == "float32"


def test_donating_a_weakly_typed_argument(compose_run: Any) -> None:
    # JAX: a weakly typed f32[3] argument is donated (its buffer is consumed by the call).
    result = compose_run(
        f"{T}:add",
        "program.args=[f32[3]~weak, f32[3]]",
        "lower.donate_argnums=[0]",
        "execute.check=reference",
        "execute.repeats=2",
    )
    sig = result.records["stage_out"].signature["inputs"][0]
    assert sig["weak_type"] and sig["donated"]
    assert result.records["execute"].timings["donated_inputs_consumed"] is True
    args, _ = run_inputs(result)
    assert_same(
        result.records["execute"].outputs,
        jax.jit(progs.add, donate_argnums=0)(*args),
        structure=True,
    )


# --- 4. JAX configuration per run ------------------------------------------------------------


def test_x64_from_the_config_applies_to_the_run_and_is_restored(compose_run: Any) -> None:
    # JAX: with jax_enable_x64 two Python ints add as int64 (weakly typed); without, int32.
    assert not jax.config.jax_enable_x64
    result = compose_run(
        f"{T}:add",
        "program.args=[3, 4]",
        "+jax.config.jax_enable_x64=true",
        "execute.check=reference",
        "execute.repeats=1",
    )
    assert not jax.config.jax_enable_x64  # put back after the run
    jax.config.update("jax_enable_x64", True)
    try:
        want = np.asarray(jax.jit(progs.add)(3, 4))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert want.dtype == np.int64
    assert_same(result.records["execute"].outputs, want, structure=True)
    manifest = result.manifest
    assert manifest["config"]["jax"]["config"] == {"jax_enable_x64": True}
    assert manifest["environment"]["jax_config"]["jax_enable_x64"] is True
    plain = compose_run(f"{T}:add", "program.args=[3, 4]", "execute.repeats=1")
    assert np.asarray(plain.records["execute"].outputs).dtype == np.int32


def test_matmul_precision_is_lowered_and_keyed(compose_run: Any) -> None:
    # JAX: jax_default_matmul_precision=highest puts HIGHEST precision on the dot.
    args = ("program.args=[f32[2,2], f32[2,2]]", "stop_after=compile")
    with jax.default_matmul_precision("highest"):
        want = jax.jit(progs.matmul).trace(jnp.ones((2, 2)), jnp.ones((2, 2))).lower().as_text()
    assert "HIGHEST" in want
    high = compose_run(f"{T}:matmul", *args, "+jax.config.jax_default_matmul_precision=highest")
    default = compose_run(f"{T}:matmul", *args)
    text = (high.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    assert "HIGHEST" in text
    assert "HIGHEST" not in (default.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    keys = [r.manifest["stages"]["compile"]["key"] for r in (high, default)]
    assert keys[0] != keys[1] and default.manifest["stages"]["compile"]["status"] == "ran"
    assert jax.config.jax_default_matmul_precision is None


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("+jax.config.jax_nope=1", r"jax\.config\.jax_nope: not a JAX config option"),
        (
            "+jax.config.jax_default_matmul_precision=bogus",
            r"jax\.config\.jax_default_matmul_precision: expected one of default, high, "
            r"highest, .*, found 'bogus' \(a string\); use one of those values",
        ),
        (
            "+jax.config.jax_num_cpu_devices=4",
            r"jax\.config\.jax_num_cpu_devices: set by jaxaot "
            r"from compile\.num_devices",
        ),
        ("+jax.config.enable_x64=true", r"jax\.config\.enable_x64: expected a JAX config option"),
    ],
)
def test_bad_jax_options(compose_run: Any, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        compose_run(f"{T}:add", "program.args=[3, 4]", override, "stop_after=stage_out")
    assert jax.config.jax_default_matmul_precision is None


def test_x64_off_with_a_64_bit_argument_is_an_error(compose_run: Any) -> None:
    with pytest.raises(ConfigError, match=r"jax_enable_x64=false, but the program has 64-bit"):
        compose_run(f"{T}:add", "program.args=[f64[2], f64[2]]", "+jax.config.jax_enable_x64=false")


def test_jax_enable_x64_from_the_environment_is_respected(cli: Any, tmp_path: Path) -> None:
    from conftest import REPO, cli_env, run_cli

    env = cli_env(JAX_ENABLE_X64="1")
    env["PYTHONPATH"] = f"{REPO / 'tests'}:{env['PYTHONPATH']}"
    proc = run_cli(
        [f"{T}:add", "program.args=[3, 4]", "execute.repeats=1", f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert load_outputs(tmp_path / "r" / "execute")[""].dtype == np.int64


# --- 5. the mesh is in context while tracing -------------------------------------------------


def test_program_sees_the_mesh_while_traced_and_in_the_reference(compose_run: Any) -> None:
    # JAX: under jax.set_mesh the program gets the mesh from context (get_abstract_mesh, a bare
    # PartitionSpec, shard_map without mesh=); without one it fails.
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(Exception, match="mesh"):
        jax.jit(progs.with_mesh).trace(x)
    result = compose_run(
        f"{T}:with_mesh",
        "program.args=[f32[8]]",
        "mesh.shape=[4]",
        "mesh.axes=[data]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    args, _ = run_inputs(result)
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        want = jax.jit(progs.with_mesh)(*args)
    assert_same(result.records["execute"].outputs, want, structure=True)
    assert result.records["execute"].check["ok"]


# --- 6. explicit-axes sharding in types -------------------------------------------------------


def test_explicit_axes_shardings_are_part_of_the_types(compose_run: Any) -> None:
    # JAX: with Explicit axes the input sharding is in the argument type; the output that keeps
    # it is sharded the same way, the resharded one is replicated.
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    # The run first: it starts this process's JAX backend with the devices the mesh needs.
    result = compose_run(
        f"{T}:resharded",
        "program.args=[f32[8,2]]",
        "mesh.shape=[4]",
        "mesh.axes=[data]",
        "mesh.axis_types=[explicit]",
        "lower.in_shardings=[data]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )
    sds = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        traced = jax.jit(progs.resharded).trace(sds)
        want_specs = [o.sharding.spec for o in traced.out_info]
    assert want_specs == [P("data", None), P(None, None)]
    staged = result.records["stage_out"]
    assert [o.sharding.spec for o in staged.traced.out_info] == want_specs
    outs = result.records["compile"].compiled.output_shardings
    assert [s.spec for s in outs] == [P("data"), P()]
    args, _ = run_inputs(result)
    with jax.set_mesh(mesh):
        want = jax.jit(progs.resharded)(jax.device_put(args[0], NamedSharding(mesh, P("data"))))
    assert [o.sharding.spec for o in want] == [P("data", None), P(None, None)]
    assert_same(result.records["execute"].outputs, want, structure=True)


def test_a_one_device_mesh_compiles(compose_run: Any) -> None:
    result = compose_run(
        f"{T}:add",
        "program.args=[f32[2], f32[2]]",
        "mesh.shape=[1]",
        "mesh.axes=[data]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    args, _ = run_inputs(result)
    assert_same(result.records["execute"].outputs, jax.jit(progs.add)(*args), structure=True)


# --- 11. any platform JAX accepts ------------------------------------------------------------


def test_platforms_are_checked_against_jax(compose_run: Any) -> None:
    from jax._src import xla_bridge

    assert "rocm" in xla_bridge.known_platforms()
    want = jax.jit(progs.add).trace(jnp.ones(2), jnp.ones(2)).lower(lowering_platforms=("rocm",))
    result = compose_run(
        f"{T}:add", "program.args=[f32[2], f32[2]]", "lower.platforms=[rocm]", "stop_after=lower"
    )
    from jaxaot.stages.lower import canonical_stablehlo

    text = (result.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    assert canonical_stablehlo(text) == canonical_stablehlo(want.as_text())
    # JAX's set of platforms is open: a name it does not know is lowered with the default rules
    # (tests/test_aot_export.py has the rest).
    other = compose_run(
        f"{T}:add", "program.args=[f32[2], f32[2]]", "lower.platforms=[metal]", "stop_after=lower"
    )
    assert json.loads((other.run_dir / "lower" / "lowered.json").read_text())["platforms"] == [
        "metal"
    ]
    with pytest.raises(ConfigError, match=r"'gpu' \(gpu is an alias of cuda, oneapi, rocm"):
        compose_run(
            f"{T}:add", "program.args=[f32[2], f32[2]]", "lower.platforms=[gpu]", "stop_after=lower"
        )


# --- 7. every dtype round-trips on disk ------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", ["float8_e5m2", "float8_e4m3fn", "float4_e2m1fn", "int4", "uint4", "bfloat16"]
)
def test_every_dtype_round_trips_on_disk(compose_run: Any, dtype: str) -> None:
    result = compose_run(
        f"{T}:cast",
        f"program.args=[f32[5], {dtype}]",
        "stage_out.static_argnums=[1]",
        "execute.repeats=1",
    )
    args, _ = run_inputs(result)
    want = np.asarray(jax.jit(progs.cast, static_argnums=1)(args[0], dtype))
    assert want.dtype.name == dtype
    saved = load_outputs(result.run_dir / "execute")[""]
    assert saved.dtype == want.dtype
    np.testing.assert_array_equal(saved.view(f"u{want.itemsize}"), want.view(f"u{want.itemsize}"))
    with np.load(result.run_dir / "execute" / "outputs.npz") as z:  # plain NumPy reads numbers
        np.testing.assert_array_equal(z["out0"], want.astype(np.float32))


def test_int4_inputs_on_a_mesh(compose_run: Any) -> None:
    # JAX: jit with shardings on a 2-device mesh adds int4 arrays (jaxaot places them in the
    # layout the executable takes; an unpacked layout is refused).
    result = compose_run(
        f"{T}:add",
        "program.args=[i4[4], i4[4]]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "lower.in_shardings=[data]",
        "execute.check=reference",
        "execute.repeats=2",
    )
    args, _ = run_inputs(result)
    want = jax.jit(progs.add)(*args)
    assert want.dtype == jnp.int4
    assert_same(result.records["execute"].outputs, want, structure=True)


# --- 9. text with debug info on request --------------------------------------------------------


def test_debug_info_keeps_locations_in_the_texts_only(compose_run: Any) -> None:
    from jaxaot.stages.lower import canonical_stablehlo
    from jaxaot.util.canonical import canonical_hlo

    lowered = jax.jit(progs.add).trace(jnp.ones(2), jnp.ones(2)).lower()
    want = lowered.as_text(debug_info=True)
    assert 'loc("x")' in want and "aot_api_programs.py" in want
    assert "loc(" not in lowered.as_text()
    args = (f"{T}:add", "program.args=[f32[2], f32[2]]", "stop_after=lower")
    debug = compose_run(*args, "lower.debug_info=true")
    plain = compose_run(*args)
    texts = {
        n: (r.run_dir / "lower" / "module.stablehlo.mlir").read_text()
        for n, r in (("debug", debug), ("plain", plain))
    }
    assert 'loc("x")' in texts["debug"] and "aot_api_programs.py" in texts["debug"]
    assert "loc(" not in texts["plain"]
    assert canonical_stablehlo(texts["debug"]) == canonical_stablehlo(want)
    assert canonical_stablehlo(texts["debug"]) == canonical_stablehlo(texts["plain"])
    hlo = [(r.run_dir / "lower" / "module.hlo.txt").read_text() for r in (debug, plain)]
    assert "aot_api_programs.py" in hlo[0] and "aot_api_programs.py" not in hlo[1]
    assert canonical_hlo(hlo[0]) == canonical_hlo(hlo[1])
    assert debug.records["lower"].module_sha256 == plain.records["lower"].module_sha256


# --- 10. differentiable exports ----------------------------------------------------------------


def test_vjp_order_makes_the_export_differentiable(compose_run: Any) -> None:
    x = np.linspace(0.0, 1.0, 3, dtype=np.float32)
    want = jax.grad(lambda v: jnp.sum(jnp.sin(v) + v))(x)  # JAX: d/dx of add(sin x, x)
    result = compose_run(
        f"{T}:add", "program.args=[f32[3], f32[3]]", "lower.vjp_order=1", "stop_after=lower"
    )
    exp = jax.export.deserialize(
        bytearray((result.run_dir / "lower" / "exported.bin").read_bytes())
    )
    got = jax.grad(lambda v: jnp.sum(exp.call(jnp.sin(v), v)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = compose_run(f"{T}:add", "program.args=[f32[3], f32[3]]", "stop_after=lower")
    exp0 = jax.export.deserialize(
        bytearray((plain.run_dir / "lower" / "exported.bin").read_bytes())
    )
    with pytest.raises(ValueError, match="No VJP is available"):  # JAX: none was serialized
        jax.grad(lambda v: jnp.sum(exp0.call(v, v)))(x)


# --- 8. shape polymorphism ------------------------------------------------------------------

POLY = (f"{T}:rows", "program.args=[f32[b,4]]", "stage_out.shape_constraints=['b >= 2']")


def test_symbolic_dims_lower_once_and_compile_per_size(compose_run: Any) -> None:
    # JAX: a symbolic leading dimension exports one polymorphic artifact, callable at any b >= 2.
    scope = jax.export.SymbolicScope(["b >= 2"])
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 4", scope=scope), jnp.float32)
    want_exp = jax.export.export(jax.jit(progs.rows))(spec)
    lowered = compose_run(*POLY, "stop_after=lower")
    blob = (lowered.run_dir / "lower" / "exported.bin").read_bytes()
    exp = jax.export.deserialize(bytearray(blob))
    assert str(exp.in_avals) == str(want_exp.in_avals) == "(ShapedArray(float32[b,4]),)"
    assert lowered.records["stage_out"].signature["inputs"][0]["shape"] == ["b", 4]
    runs = {}
    for b in (3, 5, 3):
        runs[b] = compose_run(
            *POLY,
            f"+compile.shapes.b={b}",
            f"resume_from={lowered.run_dir}",
            "start_at=compile",
            "execute.check=reference",
            "execute.repeats=1",
        )
        assert runs[b].manifest["stages"]["lower"]["status"] == "resumed"  # lowered once
        args, _ = run_inputs(runs[b])
        assert args[0].shape == (b, 4)
        want = jax.jit(progs.rows)(*args)
        assert_same(runs[b].records["execute"].outputs, want, structure=True)
        assert_same(runs[b].records["execute"].outputs, exp.call(*args), structure=True)
    assert runs[3].manifest["stages"]["compile"]["status"] == "cached"  # the second b=3
    assert (
        runs[5].manifest["stages"]["compile"]["key"] != runs[3].manifest["stages"]["compile"]["key"]
    )


def test_symbolic_sizes_are_checked(compose_run: Any) -> None:
    with pytest.raises(ConfigError, match=r"compile\.shapes: the lowering is polymorphic in 'b'"):
        compose_run(*POLY, "stop_after=compile")
    with pytest.raises(ConfigError, match=r"compile\.shapes=\{'b': 1\}: .*b >= 2"):
        compose_run(*POLY, "+compile.shapes.b=1", "stop_after=compile")


def test_pytree_containers_on_a_mesh(compose_run: Any) -> None:
    # JAX: a container argument takes one sharding for all its leaves (a pytree prefix).
    result = compose_run(
        f"{T}:norms",
        PYTREE_ARGS,
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    args, _ = run_inputs(result)
    assert_same(result.records["execute"].outputs, jax.jit(progs.norms)(*args), structure=True)


def test_weak_type_of_given_inputs(compose_run: Any, tmp_path: Path) -> None:
    # 0.1 rounds differently in f16 and f32: a strongly typed reference (f32) fails the check.
    x, y = np.arange(3, dtype=np.float32) + 0.1, np.ones(3, dtype=np.float16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    result = compose_run(
        f"{T}:add",
        "program.args=[f32[3]~weak, f16[3]]",
        f"execute.inputs=[{tmp_path / 'x.npy'}, {tmp_path / 'y.npy'}]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    from jaxaot.stages.inputs import weakly_typed

    want = jax.jit(progs.add)(weakly_typed(x), y)  # JAX: weak f32 + f16 is f16
    assert want.dtype == jnp.float16
    assert_same(result.records["execute"].outputs, want, structure=True)


@pytest.mark.parametrize(
    "mesh",
    [
        ("mesh.shape=[1]", "mesh.axes=[data]"),
        (
            "mesh.shape=[4]",
            "mesh.axes=[data]",
            "mesh.axis_types=[explicit]",
            "lower.in_shardings=[data]",
        ),
    ],
)
def test_mesh_lowerings_resume_at_compile(compose_run: Any, mesh: tuple[str, ...]) -> None:
    args = (f"{T}:resharded", "program.args=[f32[8,2]]", *mesh)
    first = compose_run(*args, "stop_after=lower")
    again = compose_run(
        *args,
        f"resume_from={first.run_dir}",
        "start_at=compile",
        "execute.check=reference",
        "execute.repeats=1",
    )
    inputs, _ = run_inputs(again)
    from jax.sharding import AxisType

    n, kind = (4, AxisType.Explicit) if len(mesh) > 2 else (1, AxisType.Auto)
    with jax.set_mesh(
        jax.make_mesh((n,), ("data",), axis_types=(kind,), devices=jax.devices()[:n])
    ):
        want = jax.jit(progs.resharded)(*inputs)
    assert_same(again.records["execute"].outputs, want, structure=True)
    if len(mesh) > 2:  # explicit axes: the export keeps the output shardings JAX gave
        from jax.sharding import PartitionSpec as P

        outs = again.records["compile"].compiled.output_shardings
        assert [s.spec for s in outs] == [P("data"), P()]


def test_symbolic_dims_on_a_mesh(compose_run: Any) -> None:
    result = compose_run(
        *POLY,
        "+compile.shapes.b=4",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    args, _ = run_inputs(result)
    assert_same(result.records["execute"].outputs, jax.jit(progs.rows)(*args), structure=True)
    assert result.records["compile"].lowered.exported.nr_devices == 2
    with pytest.raises(ConfigError, match=r"program\.args\[0\]: f32\[b,4\] has symbolic dim"):
        compose_run(*POLY, "+compile.shapes.b=4", "stage_out.axis_env=[[i,2]]")


def test_given_inputs_for_named_containers_are_refused(compose_run: Any, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones(3, np.float32))
    with pytest.raises(ConfigError, match=r"execute\.inputs: program\.args\[0\] is a named pytree"):
        compose_run(f"{T}:norms", PYTREE_ARGS, f"execute.inputs=[{tmp_path / 'x.npy'}]")


def test_jax_options_come_with_a_resumed_lowering(compose_run: Any) -> None:
    args = (f"{T}:add", "program.args=[3, 4]")
    first = compose_run(*args, "jax.config.jax_enable_x64=true", "stop_after=lower")
    again = compose_run(
        *args, f"resume_from={first.run_dir}", "start_at=compile", "execute.repeats=1"
    )
    assert again.manifest["config"]["jax"]["config"] == {"jax_enable_x64": True}
    assert np.asarray(again.records["execute"].outputs).dtype == np.int64

    conflict = [
        *args,
        "jax.config.jax_enable_x64=false",
        f"resume_from={first.run_dir}",
        "start_at=compile",
    ]
    with pytest.raises(ConfigError, match=r"jax\.config\.jax_enable_x64: overridden to False"):
        jaxaot.run(jaxaot.compose(conflict), run_dir=first.run_dir.parent / "c", overrides=conflict)
