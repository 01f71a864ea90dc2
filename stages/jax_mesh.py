"""The JAX side of parallel programs: meshes, NamedShardings and per-replica programs.

``jaxaot.config.mesh`` checks the config and says which mesh a run has; this module builds the
JAX objects. Lowering always uses an ``AbstractMesh`` (no devices, any size); compiling binds it
to the first N devices of the backend.

Per-replica programs (``stage_out.axis_env``, what ``jax.xla_computation(axis_env=...)`` used to
lower) run under ``jax.shard_map`` with every axis manual, so each collective carries the
replica groups that ``xla_computation`` gave. The program's argument specs describe one
replica; the global program takes and returns every array with a leading replica axis of size
R = prod(axis sizes), row-major over the axes in ``axis_env`` order (replica r = the device id
in the replica groups). Python-scalar arguments are shared by all replicas. Its reference is an
independent formulation of the same thing: nested ``jax.vmap`` with one ``axis_name`` per axis.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import ArraySpec, BoundArgs, map_tree
from jaxaot.config.mesh import MeshSpec
from jaxaot.config.sharding import Leaf, match_specs
from jaxaot.errors import ConfigError

_UNBOUND = re.compile(r"unbound axis name:\s*([^\s.]+)")


def axis_types(mesh: MeshSpec) -> tuple[Any, ...]:
    """``mesh.axis_types`` (``explicit``, ``auto``, ...) as JAX's ``AxisType`` values."""
    from jax.sharding import AxisType

    return tuple(getattr(AxisType, t.capitalize()) for t in mesh.axis_types)


def abstract_mesh(mesh: MeshSpec) -> Any:
    """An ``AbstractMesh``: enough to trace and lower, with no devices behind it."""
    from jax.sharding import AbstractMesh

    return AbstractMesh(mesh.shape, mesh.axes, axis_types=axis_types(mesh))


def concrete_mesh(mesh: MeshSpec, devices: Sequence[Any]) -> Any:
    """The same mesh over ``devices`` (the first ``mesh.size`` of them): :func:`on_devices`."""
    return on_devices(abstract_mesh(mesh), devices)


def on_devices(amesh: Any, devices: Sequence[Any]) -> Any:
    """``amesh`` (an AbstractMesh) over the first ``amesh.size`` of ``devices``: the concrete
    mesh with its axis names, sizes and types, as ``jax.make_mesh`` lays it out (which orders
    TPU devices by their physical topology, and others as given). Every concrete mesh of a run
    is built here, and the compile's device assignment is this mesh's device order
    (``compile.execution_devices``): one order for the lowering's context, the export's
    shardings, the executable and the reference."""
    import jax

    return jax.make_mesh(
        tuple(amesh.axis_sizes),
        tuple(amesh.axis_names),
        axis_types=tuple(amesh.axis_types),
        devices=list(devices)[: amesh.size],
    )


@contextlib.contextmanager
def tracing_on(amesh: Any, *, unplaced: bool = False) -> Iterator[None]:
    """``amesh`` in context while a program is traced and lowered (``jax.set_mesh`` without
    devices): get_abstract_mesh, bare PartitionSpecs, shard_map without ``mesh=``.

    ``unplaced``: no input or output of the jit carries a sharding on ``amesh`` (a program
    with no arguments), so only the context can say which devices it runs on. jax.jit records
    a context AbstractMesh as its device context only when an axis is explicit (jax 0.10.2
    ``pjit.get_ctx_mesh``: "make top-level use_abstract_mesh work with Auto mode too" is its
    TODO), and lowers such a program for one device, where a shard_map does not compile
    ("xla.sdy.LocalToGlobalShape for Host"). Here jax.jit records ``amesh`` whatever its axis
    types, as it records a concrete mesh in ``jax.set_mesh``: the program is lowered for the
    mesh's devices, as ``with jax.set_mesh(mesh): jax.jit(f).lower()`` is."""
    from jax.sharding import AxisType

    if unplaced:
        compat_jax.need_context_mesh()
    with compat_jax.use_abstract_mesh(amesh):
        if not unplaced or AxisType.Explicit in amesh.axis_types:
            yield
            return
        with compat_jax.auto_context_mesh():
            yield


def bound_context(live: Any, devices: Sequence[Any]) -> Any:
    """``live`` (a jax Lowered made under :func:`tracing_on`) with its context mesh bound to
    ``devices``, as if it had been lowered under ``jax.set_mesh`` of the concrete mesh.

    JAX names a compiled output by the context mesh when neither an input nor an output
    sharding says which mesh it is on (a program with no arguments; jax 0.10.2
    ``pxla.maybe_recover_user_shardings``): an AbstractMesh there makes output arrays that
    cannot be read ("is_fully_addressable is not implemented for AbstractMesh"). jax 0.10 has no
    public way to bind it: the copy replaces ``compile_args["context_mesh"]`` of the private
    ``MeshComputation`` and never touches ``live`` itself.

    Unchanged unless that context is a non-empty AbstractMesh, and then ``_executable`` (the
    compile cache the copy resets) is read too. Where jax lays its lowerings out otherwise, a
    program with arguments (their shardings name its mesh) is compiled as it is, and one
    without is refused in one line (compiled as it is, its outputs could not be read)."""
    return compat_jax.lowered_with_context_mesh(live, lambda amesh: on_devices(amesh, devices))


def has_arrays(*trees: Any) -> bool:
    """Whether ``trees`` hold an array or ShapeDtypeStruct (static values aside)."""
    import jax

    return any(hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in jax.tree.leaves(trees))


def named(tree: Any, mesh: Any) -> Any:
    """Matched :class:`Spec` leaves to ``NamedSharding`` objects on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.entries)), tree)


def output_shardings(value: Any, out_info: Any, out_tree: Any, mesh: MeshSpec, amesh: Any) -> Any:
    """``lower.out_shardings`` matched to the traced outputs, as a pytree like the outputs."""
    import jax

    plain = _plain(out_info)
    top, names = (
        (plain, [f"output[{i}]" for i in range(len(plain))])
        if isinstance(plain, tuple)
        else ((plain,), ["output"])
    )
    matched = match_specs(value, top, key="lower.out_shardings", names=names, mesh=mesh.sizes)
    flat = jax.tree.leaves(matched if isinstance(plain, tuple) else matched[0])
    return jax.tree_util.tree_unflatten(out_tree, jax.tree.leaves(named(flat, amesh)))


def update_shardings(
    updates: Any,
    args: Sequence[Any],
    shardings: Sequence[Any],
    positions: Sequence[int],
    tops: Sequence[str],
) -> Any:
    """The shardings of the NNX updates a program returns (``updates``: the traced outputs'
    ``{node path: {keys: new value}}``), each the input sharding of the same Variable: the
    leaf at the same path of the traced arguments ``args[i]`` (``shardings``: one per traced
    position in ``positions``, a pytree prefix of that argument). A Variable of no traced
    positional argument (a keyword argument's) gets None: the compiler chooses."""
    import jax
    from jaxaot.config.tree_paths import leaf_paths

    by_path: dict[str, Any] = {}
    for sharding, i in zip(shardings, positions, strict=True):
        full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), sharding, args[i])
        paths = leaf_paths(args[i], tops[i])
        by_path.update(zip((p for p, _ in paths), jax.tree.leaves(full), strict=True))
    chosen = [by_path.get(p) for p, _ in leaf_paths(updates, "")]
    return jax.tree.unflatten(jax.tree.structure(updates), chosen)


def _plain(tree: Any) -> Any:
    """Outputs as dicts, lists, tuples and :class:`Leaf` (the matcher's vocabulary)."""
    import jax
    from jaxaot.config.argspec import short_name

    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        shape = tuple(tree.shape)
        return Leaf(shape, f"{short_name(str(tree.dtype))}[{','.join(map(str, shape))}]")
    children = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)[0]
    return tuple(_plain(c) for c in children)


@dataclass(frozen=True)
class PerReplica:
    """A per-replica program made global, with what stage_out hands on for it."""

    fn: Callable[..., Any]
    reference: Callable[..., Any]
    bound: BoundArgs  # array specs with the leading replica axis
    jit_options: dict[str, Any]


def stacked(bound: BoundArgs, replicas: int) -> BoundArgs:
    """The per-replica specs with a leading replica axis: the global program's arguments."""

    def stack(_path: str, leaf: Any) -> Any:
        return replace(leaf, shape=(replicas, *leaf.shape)) if isinstance(leaf, ArraySpec) else leaf

    return replace(
        bound,
        args=tuple(
            a if bound.is_static(i) else map_tree(stack, a) for i, a in enumerate(bound.args)
        ),
    )


def per_replica(
    fn: Callable[..., Any], mesh: MeshSpec, bound: BoundArgs, static_kwargs: dict[str, Any]
) -> PerReplica:
    """Wrap ``fn`` (one replica's program) as a global program over ``mesh``'s replicas."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    amesh = abstract_mesh(mesh)
    replica = P(mesh.axes)
    flags = [
        map_tree(lambda _p, leaf: isinstance(leaf, ArraySpec), a)
        for i, a in enumerate(bound.args)
        if not bound.is_static(i)
    ]

    def merge(args: Sequence[Any], local: Sequence[Any]) -> list[Any]:
        it = iter(local)
        return [a if bound.is_static(i) else next(it) for i, a in enumerate(args)]

    def dynamic(args: Sequence[Any]) -> list[Any]:
        return [a for i, a in enumerate(args) if not bound.is_static(i)]

    def program(*args: Any) -> Any:
        def body(*local: Any) -> Any:
            rows = [
                jax.tree.map(lambda x, s: x[0] if s else x, v, f)
                for v, f in zip(local, flags, strict=True)
            ]
            out = fn(*merge(args, rows), **static_kwargs)
            return jax.tree.map(lambda o: jnp.asarray(o)[None], out)

        specs = tuple(jax.tree.map(lambda s: replica if s else P(), f) for f in flags)
        mapped = jax.shard_map(body, mesh=amesh, in_specs=specs, out_specs=replica, check_vma=False)
        return mapped(*dynamic(args))

    def reference(*args: Any) -> Any:
        def one(*local: Any) -> Any:
            return fn(*merge(args, local), **static_kwargs)

        axes = tuple(jax.tree.map(lambda s: 0 if s else None, f) for f in flags)
        mapped = one
        # axis_size: a program without arguments has nothing to read the size from.
        for name, size in reversed(mesh.sizes.items()):
            mapped = jax.vmap(mapped, in_axes=axes, axis_name=name, axis_size=size)
        grid = [
            jax.tree.map(lambda x, s: x.reshape(mesh.shape + x.shape[1:]) if s else x, v, f)
            for v, f in zip(dynamic(args), flags, strict=True)
        ]
        out = mapped(*grid)
        return jax.tree.map(lambda o: o.reshape((mesh.size, *o.shape[len(mesh.shape) :])), out)

    split, shared = NamedSharding(amesh, replica), NamedSharding(amesh, P())
    in_shardings = tuple(map_tree(lambda _p, s: split if s else shared, f) for f in flags)
    options: dict[str, Any] = {"in_shardings": in_shardings, "out_shardings": split}
    if bound.static_argnums:
        options["static_argnums"] = bound.static_argnums
    return PerReplica(
        fn=program, reference=reference, bound=stacked(bound, mesh.size), jit_options=options
    )


def unbound_axis_error(exc: NameError, mesh: MeshSpec | None) -> ConfigError | None:
    """JAX's unbound-axis NameError as a config error naming the axis and the bound names."""
    m = _UNBOUND.search(str(exc))
    if m is None:
        return None
    axis = m.group(1)
    if mesh is None or not mesh.per_replica:
        return ConfigError(
            f"stage_out.axis_env: the program uses a collective over axis {axis!r}, but no axis "
            f"names are bound; expected e.g. stage_out.axis_env=[[{axis},4]]"
        )
    return ConfigError(
        f"stage_out.axis_env: the program uses a collective over axis {axis!r}, but axis_env "
        f"binds only {list(mesh.axes)}; expected [{axis}, <size>] in stage_out.axis_env"
    )


def replica_reference(fn: Callable[..., Any], staged: Any) -> Callable[..., Any]:
    """The vmap reference of a per-replica program resumed from a checkpoint (no live one)."""
    from jaxaot.config.argspec import to_static_value

    mesh = MeshSpec.from_json(staged.replicas)
    kwargs = {k: to_static_value(v, f"program.kwargs.{k}") for k, v in staged.bound.kwargs.items()}
    return per_replica(fn, mesh, staged.bound, kwargs).reference


__all__ = [
    "PerReplica",
    "abstract_mesh",
    "bound_context",
    "concrete_mesh",
    "has_arrays",
    "named",
    "on_devices",
    "output_shardings",
    "per_replica",
    "replica_reference",
    "stacked",
    "tracing_on",
    "unbound_axis_error",
    "update_shardings",
]
