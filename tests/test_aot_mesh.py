"""A mesh's lifecycle, measured against plain JAX in the same test: a lowering on an abstract
mesh compiled later on a concrete one, programs without arguments on a mesh, ``mesh.context``
(a program that builds its own mesh), and the reference check of each.

Each test states what JAX does for the case and compares jaxaot's run with that plain
``jax.jit``/``jax.export`` run (outputs bit for bit, compiled shardings) on the same virtual
CPU devices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aot_mesh_programs as progs
import jax
import jax.numpy as jnp
import jaxaot
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_reference import assert_same, cpu_mesh, run_inputs
from jaxaot.engine.resume import Checkpoint
from jaxaot.errors import ConfigError
from jaxaot.schema import validate

T = "program.target=aot_mesh_programs"
MATMUL = [
    f"{T}:matmul",
    "program.args=[f32[8,4],f32[4,4]]",
    "mesh.shape=[2]",
    "mesh.axes=[data]",
    "lower.in_shardings=[[data,null],null]",
]


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _spec(spec: Any) -> tuple[Any, ...]:
    """A PartitionSpec without trailing Nones: P('data') and P('data', None) shard alike (an
    export's shardings come back in the short form)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _described(shardings: Any) -> list[tuple[Any, ...]]:
    """Each leaf's (mesh axes, mesh sizes, device ids, spec, memory kind)."""
    return [
        (
            tuple(s.mesh.axis_names),
            tuple(s.mesh.axis_sizes),
            tuple(d.id for d in s.mesh.devices.flat),
            _spec(s.spec),
            s.memory_kind,
        )
        for s in jax.tree.leaves(shardings)
    ]


def _checked(result: Any) -> None:
    check = result.records["execute"].check
    assert check is not None and check["ok"], check


# --- 1. an abstract mesh's lowering, compiled later on a concrete mesh ----------------------


def test_abstract_lowering_compiles_on_resume_as_jax_does(compose_run: Any) -> None:
    # JAX: a lowering against AbstractMesh(('data', 2)) compiles on any concrete mesh of the
    # same axes (lowered.compile(device_assignment=...)), and its export is called on one.
    lowered = compose_run(*MATMUL, "mesh.abstract=true", "stop_after=lower")
    meta = json.loads((lowered.run_dir / "lower" / "lowered.json").read_text())
    assert meta["mesh"]["axes"] == ["data"] and meta["nr_devices"] == 2
    result = compose_run(
        *MATMUL,
        f"resume_from={lowered.run_dir}",
        "start_at=compile",
        "execute.check=reference",
        "execute.repeats=1",
    )
    _checked(result)
    x, w = run_inputs(result)[0]
    mesh = cpu_mesh()
    plain = jax.jit(
        progs.matmul,
        in_shardings=(NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())),
    )
    compiled = plain.lower(x, w).compile()
    assert_same(result.records["execute"].outputs, compiled(x, w))
    exe = result.records["compile"].compiled
    assert _described(exe.input_shardings) == _described(compiled.input_shardings)
    assert _described(exe.output_shardings) == _described(compiled.output_shardings)
    # The same export, called on the concrete mesh by hand.
    exported = jax.export.deserialize(
        bytearray((lowered.run_dir / "lower" / "exported.bin").read_bytes())
    )
    ins = jax.tree.unflatten(exported.in_tree, exported.in_shardings_jax(mesh))[0]
    outs = jax.tree.unflatten(exported.out_tree, exported.out_shardings_jax(mesh))
    by_hand = jax.jit(exported.call, in_shardings=ins, out_shardings=outs).lower(x, w).compile()
    assert_same(result.records["execute"].outputs, by_hand(x, w))
    assert _described(exe.input_shardings) == _described(by_hand.input_shardings)
    assert _described(exe.output_shardings) == _described(by_hand.output_shardings)


def test_abstract_mesh_override_false_at_resume_is_accepted(compose_run: Any) -> None:
    # mesh.abstract says whether this run may compile, not what was lowered: a resume at
    # compile may set it to false; any other frozen mesh key is still the checkpoint's.
    lowered = compose_run(*MATMUL, "mesh.abstract=true", "stop_after=lower")
    resume = [f"resume_from={lowered.run_dir}", "start_at=compile"]
    overrides = [*MATMUL, "mesh.abstract=false", *resume]
    cfg = Checkpoint(lowered.run_dir).apply(validate(jaxaot.compose(overrides)), overrides)
    assert cfg.mesh.abstract is False and list(cfg.mesh.shape) == [2]
    wrong = [*MATMUL[:2], "mesh.shape=[4]", *MATMUL[3:], *resume]
    with pytest.raises(ConfigError, match=r"mesh\.shape: overridden to \[4\], but start_at="):
        Checkpoint(lowered.run_dir).apply(validate(jaxaot.compose(wrong)), wrong)
    result = compose_run(*overrides, "execute.repeats=1", "execute.check=reference")
    _checked(result)


def test_abstract_mesh_override_true_over_a_concrete_lowering_is_refused(compose_run: Any) -> None:
    # Only the override to false is free at a resume: true over a lowering made to compile
    # would record a run that compiled as one that could not; the same value is accepted.
    lowered = compose_run(*MATMUL, "stop_after=lower")
    resume = [f"resume_from={lowered.run_dir}", "start_at=compile"]
    same = [*MATMUL, "mesh.abstract=false", *resume]
    cfg = Checkpoint(lowered.run_dir).apply(validate(jaxaot.compose(same)), same)
    assert cfg.mesh.abstract is False
    wrong = [*MATMUL, "mesh.abstract=true", *resume]
    with pytest.raises(ConfigError) as refused:
        Checkpoint(lowered.run_dir).apply(validate(jaxaot.compose(wrong)), wrong)
    assert str(refused.value) == (
        "mesh.abstract: overridden to True, but start_at=compile resumes stages whose options "
        f"come from the checkpoint (mesh.abstract = False in {lowered.run_dir}) (mesh.abstract "
        "may be overridden only to False at a resume); drop the override or start at an "
        "earlier stage"
    )


def test_fresh_abstract_mesh_run_that_compiles_is_refused(compose_run: Any) -> None:
    # An AbstractMesh has no devices: a fresh run that lowers on it cannot compile here.
    with pytest.raises(ConfigError, match=r"mesh\.abstract=true describes a mesh to lower for"):
        compose_run(*MATMUL, "mesh.abstract=true")


# --- 2. programs without arguments on a mesh --------------------------------------------------


def _plain_argless() -> Any:
    # JAX: with the mesh in context, jit of a program without arguments is lowered for the
    # mesh's devices (num_partitions = 2) and its output is sharded over the mesh.
    mesh = cpu_mesh()
    with jax.set_mesh(mesh):
        lowered = jax.jit(progs.argless).lower()
        compiled = lowered.compile()
        return lowered, compiled, compiled()


@pytest.mark.requires_jax("0.10.0")  # older: refused in one line (tests/test_compat.py)
def test_argless_program_on_a_mesh_as_under_set_mesh(compose_run: Any) -> None:
    result = compose_run(
        f"{T}:argless",
        "program.args=[]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    _checked(result)
    plain_lowered, compiled, want = _plain_argless()
    assert "mhlo.num_partitions = 2" in plain_lowered.as_text()
    meta = json.loads((result.run_dir / "lower" / "lowered.json").read_text())
    assert meta["nr_devices"] == 2
    assert_same(result.records["execute"].outputs, want)
    exe = result.records["compile"].compiled
    assert _described(exe.output_shardings) == _described(compiled.output_shardings)


@pytest.mark.requires_jax("0.10.0")
def test_argless_lowering_resumed_compiles_through_its_export(compose_run: Any) -> None:
    lowered = compose_run(
        f"{T}:argless", "program.args=[]", "mesh.shape=[2]", "mesh.axes=[data]", "stop_after=lower"
    )
    result = compose_run(
        f"{T}:argless",
        "program.args=[]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        f"resume_from={lowered.run_dir}",
        "start_at=compile",
        "execute.check=reference",
        "execute.repeats=1",
    )
    _checked(result)
    _, compiled, want = _plain_argless()
    assert_same(result.records["execute"].outputs, want)
    exe = result.records["compile"].compiled
    assert _described(exe.output_shardings) == _described(compiled.output_shardings)
    # JAX: the export called with the mesh in context.
    exported = jax.export.deserialize(
        bytearray((lowered.run_dir / "lower" / "exported.bin").read_bytes())
    )
    assert exported.nr_devices == 2
    with jax.set_mesh(cpu_mesh()):
        by_hand = jax.jit(exported.call).lower().compile()
    assert_same(result.records["execute"].outputs, by_hand())
    assert _described(exe.output_shardings) == _described(by_hand.output_shardings)


# --- 4. the reference check of a program without arguments under stage_out.axis_env ---------


def test_argless_per_replica_program_reference(compose_run: Any) -> None:
    # JAX: vmap of a function without arguments needs axis_size; the replicas' outputs
    # stacked along a leading axis (replica r = axis index r).
    result = compose_run(
        f"{T}:argless_psum",
        "program.args=[]",
        "stage_out.axis_env=[[i,2]]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    _checked(result)
    want = jax.vmap(progs.argless_psum, axis_name="i", axis_size=2)()
    assert_same(result.records["execute"].outputs, want)
    mesh = cpu_mesh(2, "i")
    shard = jax.shard_map(
        lambda: progs.argless_psum()[None], mesh=mesh, in_specs=(), out_specs=P("i")
    )
    assert_same(result.records["execute"].outputs, jax.jit(shard)())


# --- 3. mesh.context=false: a program that builds its own mesh -------------------------------


# Before jax 0.7.0 a mesh lowering compiles through its export, whose output shardings name the
# run's mesh axes, not the program's own mesh's (the same devices and split).
@pytest.mark.requires_jax("0.7.0")
@pytest.mark.parametrize("name", ["own_mesh", "own_mesh_data"])
def test_mesh_context_false_places_arguments_only(
    compose_run: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JAX: jax.jit(f, in_shardings=NamedSharding(mesh, P('data'))) without jax.set_mesh runs a
    # program that calls shard_map on a mesh of its own (another axis name, or the same).
    from jaxaot.stages import execute

    reference_inputs: list[Any] = []
    real = execute._placed_on

    def spy(*a: Any, **k: Any) -> Any:
        reference_inputs.append(real(*a, **k))
        return reference_inputs[-1]

    monkeypatch.setattr(execute, "_placed_on", spy)
    result = compose_run(
        f"{T}:{name}",
        "program.args=[f32[4]]",
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "lower.in_shardings=[data]",
        "mesh.context=false",
        "execute.check=reference",
        "execute.repeats=1",
    )
    _checked(result)
    (x,) = run_inputs(result)[0]
    fn = getattr(progs, name)
    plain = jax.jit(fn, in_shardings=NamedSharding(cpu_mesh(), P("data")))
    compiled = plain.lower(x).compile()
    assert_same(result.records["execute"].outputs, compiled(x))
    # The reference's own input, as plain JAX's: put on the run's mesh split over 'data' (the
    # program's output is the same however it is placed).
    assert [([a.sharding for a in args], kwargs) for args, kwargs in reference_inputs] == [
        ([NamedSharding(cpu_mesh(), P("data"))], {})
    ]
    exe = result.records["compile"].compiled
    assert _described(exe.input_shardings) == _described(compiled.input_shardings)
    assert _described(exe.output_shardings) == _described(compiled.output_shardings)


@pytest.mark.requires_jax("0.7.1")  # jax.set_mesh
def test_mesh_in_context_refuses_a_program_with_its_own_mesh_as_jax_does(
    compose_run: Any,
) -> None:
    # JAX: with another mesh in context, shard_map on the program's own mesh is refused.
    with pytest.raises(jaxaot.errors.StageError, match=r"The context mesh .* should match") as ours:
        compose_run(f"{T}:own_mesh", "program.args=[f32[4]]", "mesh.shape=[2]", "mesh.axes=[data]")
    assert str(ours.value).endswith(
        "; mesh.context=true traces the program with the mesh in context: expected "
        "mesh.context=false for a program that builds its own mesh"
    )
    # Plain JAX after the run: the run starts the virtual devices the mesh needs.
    x = jnp.arange(4.0)
    with (
        jax.set_mesh(cpu_mesh()),
        pytest.raises(ValueError, match="should match the mesh") as plain,
    ):
        jax.jit(progs.own_mesh)(x)
    assert "The context mesh" in str(plain.value)


def test_a_program_that_needs_the_context_mesh_under_context_false(compose_run: Any) -> None:
    # JAX: shard_map without mesh= and no mesh in context is refused ("cannot be empty").
    with pytest.raises(ValueError, match="context mesh cannot be empty"):
        jax.jit(progs.argless)()
    with pytest.raises(jaxaot.errors.StageError, match="context mesh cannot be empty") as ours:
        compose_run(
            f"{T}:argless",
            "program.args=[]",
            "mesh.shape=[2]",
            "mesh.axes=[data]",
            "mesh.context=false",
        )
    text = str(ours.value)
    assert "\n" not in text
    assert text.endswith(
        "; mesh.context=false traces the program without the mesh in context: expected "
        "mesh.context=true for a program that uses the context mesh"
    )


def test_own_mesh_without_a_jaxaot_mesh(compose_run: Any) -> None:
    # JAX: jax.jit(f)(x) of a program that builds its own 2-device mesh.
    result = compose_run(
        f"{T}:own_mesh",
        "program.args=[f32[4]]",
        "compile.num_devices=2",
        "execute.check=reference",
        "execute.repeats=1",
    )
    _checked(result)
    (x,) = run_inputs(result)[0]
    compiled = jax.jit(progs.own_mesh).lower(x).compile()
    assert_same(result.records["execute"].outputs, compiled(x))
    exe = result.records["compile"].compiled
    assert _described(exe.output_shardings) == _described(compiled.output_shardings)
