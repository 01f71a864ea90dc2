"""Keyword arguments through the export, donated keyword arguments, one-argument specs.

A lowering whose program takes traced keyword arguments compiles from its ``exported.bin``
(``resume_from=<run> start_at=compile``, a multi-platform lowering, a polymorphic one made
concrete) as JAX compiles ``jax.jit(exported.call)``: jax.jit takes no ``in_shardings`` with
keyword arguments, so each sharding rides on its ShapeDtypeStruct, and ``donate_argnames``
donates the keyword inputs. Each test runs the plain-JAX reference in the same test and
compares outputs bit for bit, compiled shardings and donation.
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
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_reference import assert_same, cpu_mesh, run_inputs, specs_of
from jaxaot.config.sharding import Leaf, Spec, match_specs
from jaxaot.errors import ConfigError

T = "program.target=aot_args_programs"
MESH2 = ("mesh.shape=[2]", "mesh.axes=[data]")
SCALED = (f"{T}:scaled", "+program.kwargs.a=f32[8]", "+program.kwargs.b=f32[8]")


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _donated(compiled: Any) -> list[bool]:
    return [bool(i.donated) for i in jax.tree.leaves(compiled.args_info)]


def _lowered_json(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "lower" / "lowered.json").read_text()))


def _exported(run_dir: Path) -> jax.export.Exported:
    return jax.export.deserialize(bytearray((run_dir / "lower" / "exported.bin").read_bytes()))


def _called(compiled: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``compiled`` called on the inputs put where it wants them; (outputs, the kwargs passed)."""
    pos, kw = compiled.input_shardings
    on = {k: jax.device_put(v, kw[k]) for k, v in kwargs.items()}
    with warnings.catch_warnings():  # JAX warns when a donated buffer cannot hold an output
        warnings.simplefilter("ignore")
        out = compiled(*(jax.device_put(v, s) for v, s in zip(args, pos, strict=True)), **on)
    return out, on


def _export_compiled(run_dir: Path, mesh: Any, donate: tuple[str, ...]) -> Any:
    """Plain JAX on the run's export: ``jax.jit(exported.call, donate_argnames=...)`` traced
    with the export's shardings over ``mesh`` on ShapeDtypeStructs (no in_shardings: JAX
    refuses them with keyword arguments)."""
    exp = _exported(run_dir)
    ins = exp.in_shardings_jax(mesh)
    with pytest.raises(ValueError, match="does not support kwargs when in_shardings"):
        args, kwargs = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        shardings = jax.tree.unflatten(exp.in_tree, ins)[0]
        jax.jit(exp.call, in_shardings=shardings).trace(*args, **kwargs)
    structs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(exp.in_avals, ins, strict=True)
    ]
    args, kwargs = jax.tree.unflatten(exp.in_tree, structs)
    jitted = jax.jit(exp.call, donate_argnames=donate)
    return jitted.trace(*args, **kwargs).lower().compile()


# --- keyword arguments on a mesh, compiled from the export ---------------------------------


def test_keyword_arguments_on_a_mesh_resumed_from_the_export(compose_run: Any) -> None:
    # JAX: jax.jit(f, donate_argnames=('a',)) of ShapeDtypeStructs carrying P('data') for x
    # and a, P() for b; its export called through jax.jit(exported.call, donate_argnames=
    # ('a',)) with the export's shardings on ShapeDtypeStructs compiles to the same input
    # shardings and donates 'a' (the flat input 1).
    run = (
        *SCALED,
        "program.args=[f32[8]]",
        *MESH2,
        "lower.in_shardings={x: [data], a: [data]}",
        "lower.donate_argnames=[a]",
        "execute.check=reference",
        "execute.repeats=2",
    )
    fresh = compose_run(*run)
    lowered = compose_run(*run, "stop_after=lower")
    assert _lowered_json(lowered.run_dir)["donate_argnames"] == ["a"]
    resume = (f"resume_from={lowered.run_dir}", "start_at=compile")
    resumed = compose_run(*run, *resume)
    again = compose_run(*run, *resume)  # the store's entry for the export's compile
    assert [r.manifest["stages"]["compile"]["status"] for r in (resumed, again)] == [
        "ran",
        "cached",
    ]
    mesh = cpu_mesh()

    def sds(spec: Any) -> Any:
        return jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, spec))

    plain = (
        jax.jit(progs.scaled, donate_argnames=("a",))
        .trace(sds(P("data")), a=sds(P("data")), b=sds(P()))
        .lower()
        .compile()
    )
    through_export = _export_compiled(lowered.run_dir, mesh, ("a",))
    args, kwargs = run_inputs(fresh)
    want, on = _called(plain, args, kwargs)
    assert on["a"].is_deleted()  # donated and consumed (its buffer holds the output)
    got_export, on_export = _called(through_export, args, kwargs)
    assert on_export["a"].is_deleted()
    assert_same(got_export, want)
    for result in (fresh, resumed, again):
        exe = result.records["compile"].compiled
        assert specs_of(exe.input_shardings) == specs_of(plain.input_shardings)
        assert specs_of(exe.output_shardings) == specs_of(plain.output_shardings)
        assert _donated(exe) == _donated(plain) == _donated(through_export) == [False, True, False]
        assert_same(result.records["execute"].outputs, want)
        assert result.records["execute"].timings["donated_inputs_consumed"] is True
    assert resumed.records["compile"].lowered.state == "loaded"  # the export alone


def test_donated_keyword_argument_through_the_export_without_a_mesh(compose_run: Any) -> None:
    # JAX: a lowering for [cpu, tpu] compiles here only through its export; donate_argnames
    # on jax.jit(exported.call) donates the keyword input as jax.jit(f, donate_argnames)
    # does. Fresh (multi-platform) and resumed, both from the export.
    run = (
        *SCALED,
        "program.args=[f32[8]]",
        "lower.platforms=[cpu,tpu]",
        "lower.donate_argnames=[b]",
        "execute.check=reference",
        "execute.repeats=2",
    )
    fresh = compose_run(*run)
    lowered = compose_run(*run, "stop_after=lower")
    resumed = compose_run(*run, f"resume_from={lowered.run_dir}", "start_at=compile")
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    plain = jax.jit(progs.scaled, donate_argnames=("b",)).trace(x, a=x, b=x).lower().compile()
    args, kwargs = run_inputs(fresh)
    b = jnp.asarray(kwargs["b"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = plain(*args, a=kwargs["a"], b=b)
    assert b.is_deleted()
    for result in (fresh, resumed):
        assert _lowered_json(result.run_dir)["donate_argnames"] == ["b"]
        exe = result.records["compile"].compiled
        assert result.records["compile"].lowered.platforms == ("cpu", "tpu")  # export only
        assert _donated(exe) == _donated(plain) == [False, False, True]
        assert_same(result.records["execute"].outputs, want)
        assert result.records["execute"].timings["donated_inputs_consumed"] is True


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_symbolic_keyword_arguments_on_a_mesh(compose_run: Any, resumed: bool) -> None:
    # JAX: f(x, *, a, b) exported for f32[2*b] on P('data') (shardings on the
    # ShapeDtypeStructs, under the abstract mesh), then called at b=4 on the concrete mesh
    # through jax.jit(exported.call, donate_argnames=('a',)).
    run = (
        f"{T}:scaled",
        "program.args=[f32[2*b]]",
        "+program.kwargs.a=f32[2*b]",
        "+program.kwargs.b=f32[2*b]",
        *MESH2,
        "lower.in_shardings={x: [data], a: [data]}",
        "lower.donate_argnames=[a]",
        "compile.shapes={b:4}",
        "execute.check=reference",
        "execute.repeats=2",
    )
    if resumed:
        lowered = compose_run(*run, "stop_after=lower")
        result = compose_run(*run, f"resume_from={lowered.run_dir}", "start_at=compile")
    else:
        result = compose_run(*run)
    mesh = cpu_mesh()
    amesh = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,))
    (shape,) = [jax.export.symbolic_shape("2*b")]

    def sds(spec: Any, m: Any, s: Any = shape) -> Any:
        return jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(m, spec))

    with jax.sharding.use_abstract_mesh(amesh):
        exp = jax.export.export(jax.jit(progs.scaled))(
            sds(P("data"), amesh), a=sds(P("data"), amesh), b=sds(P(), amesh)
        )
    concrete = (
        jax.jit(exp.call, donate_argnames=("a",))
        .trace(sds(P("data"), mesh, (8,)), a=sds(P("data"), mesh, (8,)), b=sds(P(), mesh, (8,)))
        .lower()
        .compile()
    )
    args, kwargs = run_inputs(result)
    want, on = _called(concrete, args, kwargs)
    assert on["a"].is_deleted()
    exe = result.records["compile"].compiled
    assert specs_of(exe.input_shardings) == specs_of(concrete.input_shardings)
    assert specs_of(exe.output_shardings) == specs_of(concrete.output_shardings)
    assert _donated(exe) == _donated(concrete) == [False, True, False]
    assert_same(result.records["execute"].outputs, want)
    assert result.records["execute"].timings["donated_inputs_consumed"] is True


# --- one-argument specs read by meaning ----------------------------------------------------


def test_one_argument_spec_readings_compared_by_meaning() -> None:
    # JAX: P(('data',)) == P('data'): a one-axis group is that axis. For one argument,
    # [[data]] is [data] for it (one entry each) or the spec [[data]] for every array: the
    # same sharding, so not ambiguous. Two axes on one dimension differ from one per dimension.
    assert P(("data",)) == P("data") and P(("data", "model")) != P("data", "model")
    mesh = {"data": 2, "model": 2}
    one = (Leaf((8, 4), "f32[8,4]"),)
    got = match_specs([["data"]], one, key="lower.in_shardings", names=["x"], mesh=mesh)
    assert got == (Spec(("data",)),)
    tree = ({"w": Leaf((8,), "f32[8]"), "b": Leaf((4,), "f32[4]")},)
    got = match_specs([["data"]], tree, key="lower.in_shardings", names=["p"], mesh=mesh)
    assert got == ({"w": Spec(("data",)), "b": Spec(("data",))},)
    one_entry = (
        r"^lower\.in_shardings: \[\[data, model\]\] is ambiguous for 1 entry \(x\): .* write "
        r"\[\[\[data, model\]\]\] for the second, or the mapping form \{x: \[data, model\]\} "
        r"for the first$"
    )
    with pytest.raises(ConfigError, match=one_entry):
        match_specs([["data", "model"]], one, key="lower.in_shardings", names=["x"], mesh=mesh)


def test_one_argument_spec_on_a_mesh_as_jax(compose_run: Any) -> None:
    result = compose_run(
        f"{T}:double",
        "program.args=[f32[8,4]]",
        *MESH2,
        "lower.in_shardings=[[data]]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    mesh = cpu_mesh()
    plain = jax.jit(progs.double, in_shardings=NamedSharding(mesh, P(("data",))))
    (x,), _ = run_inputs(result)
    compiled = plain.lower(x).compile()
    exe = result.records["compile"].compiled
    assert specs_of(exe.input_shardings) == specs_of(compiled.input_shardings)
    assert specs_of(exe.output_shardings) == specs_of(compiled.output_shardings)
    assert_same(result.records["execute"].outputs, compiled(x))


# --- keyword arguments on a mesh, nothing donated ------------------------------------------


def _spy_reference_placement(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The (args, kwargs) each reference run of execute placed on the mesh, in order."""
    from jaxaot.stages import execute

    placed: list[Any] = []
    real = execute._placed_on

    def spy(*a: Any, **k: Any) -> Any:
        placed.append(real(*a, **k))
        return placed[-1]

    monkeypatch.setattr(execute, "_placed_on", spy)
    return placed


def _partitions(module: str) -> int:
    """A module's mhlo.num_partitions (1 when it has none)."""
    found = re.search(r"mhlo\.num_partitions = (\d+)", module)
    return int(found[1]) if found else 1


@pytest.mark.parametrize("context", [True, False], ids=["mesh-context", "no-mesh-context"])
def test_keyword_arguments_on_a_mesh_without_donation(
    compose_run: Any, context: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JAX: jax.jit(f).trace(x_sds, a=a_sds, b=b_sds), each ShapeDtypeStruct carrying its
    # sharding (P('data') for x and a, P() for b), lowers for the mesh's 2 devices; its
    # export says nr_devices 2. The reference, mesh.context=false: jax.jit(f) of arrays put
    # with those shardings, the mesh not in context. Fresh, resumed from the export, and the
    # store's entry for that compile.
    run = (
        *SCALED,
        "program.args=[f32[8]]",
        *MESH2,
        "lower.in_shardings={x: [data], a: [data]}",
        f"mesh.context={str(context).lower()}",
        "execute.check=reference",
        "execute.repeats=2",
    )
    reference_inputs = _spy_reference_placement(monkeypatch)
    fresh = compose_run(*run)
    lowered = compose_run(*run, "stop_after=lower")
    resume = (f"resume_from={lowered.run_dir}", "start_at=compile")
    resumed = compose_run(*run, *resume)
    again = compose_run(*run, *resume)
    assert [r.manifest["stages"]["compile"]["status"] for r in (resumed, again)] == [
        "ran",
        "cached",
    ]
    mesh = cpu_mesh()

    def sds(spec: Any) -> Any:
        return jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, spec))

    plain_lowered = (
        jax.jit(progs.scaled).trace(sds(P("data")), a=sds(P("data")), b=sds(P())).lower()
    )
    plain = plain_lowered.compile()
    assert _partitions(plain_lowered.as_text()) == 2
    for run_dir in (fresh.run_dir, lowered.run_dir):
        module = (run_dir / "lower" / "module.stablehlo.mlir").read_text()
        assert _partitions(module) == _exported(run_dir).nr_devices == 2
        assert _lowered_json(run_dir)["nr_devices"] == 2
        assert _partitions(_exported(run_dir).mlir_module()) == 2
    args, kwargs = run_inputs(fresh)
    want, _ = _called(plain, args, kwargs)
    placed = {
        k: jax.device_put(v, NamedSharding(mesh, P("data" if k == "a" else None)))
        for k, v in kwargs.items()
    }
    reference = jax.jit(progs.scaled)(
        jax.device_put(args[0], NamedSharding(mesh, P("data"))), **placed
    )
    assert_same(reference, want)
    for result in (fresh, resumed, again):
        exe = result.records["compile"].compiled
        assert specs_of(exe.input_shardings) == specs_of(plain.input_shardings)
        assert specs_of(exe.output_shardings) == specs_of(plain.output_shardings)
        assert _donated(exe) == _donated(plain) == [False, False, False]
        executed = result.records["execute"]
        assert_same(executed.outputs, want)
        assert executed.check["ok"] and executed.check["max_abs_err"] == 0
        assert executed.timings["donated_inputs_consumed"] is None
    # The reference's own inputs (an elementwise program gives the same outputs however they
    # are placed): with mesh.context=false, put on the run's mesh as the lowering placed them,
    # x and a split over 'data', b replicated; with the mesh in context, traced under it.
    assert len(reference_inputs) == (0 if context else 3)
    for args, kwargs in reference_inputs:
        assert [a.sharding for a in args] == [NamedSharding(mesh, P("data"))]
        assert {k: v.sharding for k, v in kwargs.items()} == {
            "a": NamedSharding(mesh, P("data")),
            "b": NamedSharding(mesh, P()),
        }
