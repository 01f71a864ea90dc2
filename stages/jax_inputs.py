"""The arguments as jax.jit gets them on a mesh: ``lower.in_shardings`` resolved for the
positional and the traced keyword arguments (path patterns, logical-axis rules, an argument's own
sharding), symbolic splits checked as JAX checks them, and the shardings carried on the
arguments' ShapeDtypeStructs where jax.jit takes no ``in_shardings`` (keyword arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from jaxaot.config.argspec import BoundArgs, symbols
from jaxaot.config.mesh import ArgShardings, MeshSpec, Shardings
from jaxaot.errors import ConfigError
from jaxaot.stages.jax_mesh import abstract_mesh, named


@dataclass(frozen=True)
class Inputs:
    """The input shardings a run lowers with and the arguments it traces."""

    specs: tuple[Any, ...]  # :class:`Spec` trees, one per traced positional argument
    shardings: tuple[Any, ...]  # NamedShardings on the abstract mesh, one tree per argument
    resolution: Any  # jaxaot.config.path_shardings.Resolution, or None (positional form)
    args: tuple[Any, ...]  # every argument; a ShapeDtypeStruct's own sharding replaced


def _own(leaf: Any) -> Any:
    import jax

    if isinstance(leaf, jax.ShapeDtypeStruct):
        return getattr(leaf, "sharding", None)
    return None


def _typed(leaf: Any, sharding: Any) -> Any:
    import jax

    if _own(leaf) is None:
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type, sharding=sharding)


def resolved_inputs(
    given: ArgShardings,
    bound: BoundArgs,
    mesh: MeshSpec,
    args: Sequence[Any],
    names: Sequence[str] | None = None,
    logical_axes: Any = None,
) -> Inputs:
    """``lower.in_shardings`` resolved on the abstract arguments, as jax.jit gets them.

    A ShapeDtypeStruct carrying its own sharding (given from Python, an orbax checkpoint's
    saved shardings) keeps it where no rule decides its leaf (no ``lower.in_shardings``, or a
    leaf no pattern or logical axis matches), as jax.jit keeps an argument's own sharding;
    where a rule decides, the rule's wins. Either way such an argument is traced carrying the
    sharding chosen, on the abstract mesh (jax.jit refuses an argument whose sharding differs
    from its in_shardings, jax 0.10.2: "Memory kinds passed to jax.jit does not match"). An own sharding over another
    mesh than the run's cannot be used on it: the rule's (replicated) stands."""
    import jax
    from jax.sharding import NamedSharding
    from jaxaot.config.mesh import input_specs
    from jaxaot.config.tree_paths import leaf_paths, top_names

    amesh = abstract_mesh(mesh)
    specs, res = input_specs(given, bound, mesh, args, names, logical_axes)
    shardings = tuple(named(specs, amesh))
    traced = [i for i in range(len(args)) if not bound.is_static(i)]
    if not any(_own(x) is not None for i in traced for x in jax.tree.leaves(args[i])):
        return Inputs(tuple(specs), shardings, res, tuple(args))
    undecided_all = given.in_shardings is None and res is None
    unmatched = set(res.unmatched) if res is not None else set()
    tops = top_names(len(args), names)
    out, new_args = list(shardings), list(args)
    for k, i in enumerate(traced):
        arg = args[i]
        full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), shardings[k], arg)
        chosen, typed = [], []
        for (path, leaf), sh in zip(leaf_paths(arg, tops[i]), jax.tree.leaves(full), strict=True):
            own = _own(leaf)
            if (
                isinstance(own, NamedSharding)
                and (undecided_all or path in unmatched)
                and tuple(own.mesh.axis_names) == tuple(amesh.axis_names)
                and tuple(own.mesh.axis_sizes) == tuple(amesh.axis_sizes)
            ):
                sh = NamedSharding(amesh, own.spec)
            chosen.append(sh)
            typed.append(_typed(leaf, sh))
        out[k] = jax.tree.unflatten(jax.tree.structure(arg), chosen)
        new_args[i] = jax.tree.unflatten(jax.tree.structure(arg), typed)
    return Inputs(tuple(specs), tuple(out), res, tuple(new_args))


@dataclass(frozen=True)
class AllInputs:
    """Every traced input's sharding as the lowering gets it: the positional arguments', then
    the traced keyword arguments' (by keyword, in ``keywords`` order)."""

    positional: tuple[Any, ...]  # a Sharding or a prefix tree of them per traced positional
    keyword: tuple[Any, ...]  # the same per traced keyword argument
    specs: tuple[Any, ...]  # Spec trees, positional then keyword
    args: tuple[Any, ...]  # every positional argument, own shardings replaced
    kwargs: dict[str, Any]  # the traced keyword arguments, own shardings replaced
    resolution: Any  # path_shardings Resolution of every leaf rules decided, or None


def resolved_with_keywords(
    sh: ArgShardings,
    bound: BoundArgs,
    mesh: MeshSpec,
    args: Sequence[Any],
    traced_kw: dict[str, Any],
    names: Sequence[str] | None = None,
    logical_axes: Any = None,
) -> AllInputs:
    """``lower.in_shardings`` resolved for the positional AND the traced keyword arguments
    (jax.jit takes no in_shardings with keyword arguments: their shardings ride on their
    ShapeDtypeStructs). Path patterns (or null) decide every input together, a keyword
    argument's leaves named by its keyword (``{a: [data]}``); the positional list covers the
    positional arguments, and the keyword arguments are resolved as under a null
    ``lower.in_shardings`` (replicated, or their library metadata or own sharding).

    The one rule of the lower stage, stage_out's explicit-axes argument types and its
    arguments table: a symbolic dimension a sharding splits is refused here, in one line,
    unless provably divisible (:func:`check_symbolic_splits`)."""
    from jaxaot.config.mesh import uses_paths
    from jaxaot.config.path_shardings import check_keyword_patterns, merged
    from jaxaot.config.tree_paths import top_names

    n = len(args)
    if not traced_kw:
        inputs = resolved_inputs(sh, bound, mesh, args, names, logical_axes)
        found = AllInputs(inputs.shardings, (), inputs.specs, inputs.args, {}, inputs.resolution)
    elif sh.in_shardings is None or uses_paths(sh):
        check_keyword_patterns(sh.in_shardings, n, traced_kw)
        kw_bound = tuple(bound.kwargs[k] for k in traced_kw)
        every = replace(bound, args=(*bound.args, *kw_bound))
        tops = [*top_names(n, names), *traced_kw]
        both = resolved_inputs(sh, every, mesh, (*args, *traced_kw.values()), tops, logical_axes)
        n_pos = len(both.specs) - len(traced_kw)
        found = AllInputs(
            both.shardings[:n_pos],
            both.shardings[n_pos:],
            both.specs,
            both.args[:n],
            dict(zip(traced_kw, both.args[n:], strict=True)),
            both.resolution,
        )
    else:
        pos = resolved_inputs(sh, bound, mesh, args, names, logical_axes)
        unset = Shardings(in_shardings=None, logical_axis_rules=sh.logical_axis_rules)
        kw_bound = tuple(bound.kwargs[k] for k in traced_kw)
        alone = replace(bound, args=kw_bound, static_argnums=())
        kw = resolved_inputs(
            unset, alone, mesh, tuple(traced_kw.values()), list(traced_kw), logical_axes
        )
        found = AllInputs(
            pos.shardings,
            kw.shardings,
            (*pos.specs, *kw.specs),
            pos.args,
            dict(zip(traced_kw, kw.args, strict=True)),
            merged([r for r in (pos.resolution, kw.resolution) if r is not None]),
        )
    check_symbolic_splits(bound, found, mesh)
    return found


def check_symbolic_splits(bound: BoundArgs, found: AllInputs, mesh: MeshSpec) -> None:
    """Each symbolic dimension a sharding splits is divisible by its devices for every value of
    its variables, as JAX requires when it traces (jax 0.10.2 raises IndivisibleError for
    ``f32[b,4]`` on ``P('data')``, and accepts ``f32[2*b,4]``): one line naming the argument.
    Concrete sizes are checked against the config before JAX (jaxaot.config.sharding)."""
    import math

    import jax
    from jaxaot.config.path_shardings import divides_over
    from jaxaot.config.tree_paths import leaf_paths
    from jaxaot.stages.resolving import type_str

    tops = [(f"program.args[{i}]", a) for i, a in enumerate(found.args) if not bound.is_static(i)]
    tops += [(f"program.kwargs.{k}", v) for k, v in found.kwargs.items()]
    for (top, arg), prefix in zip(tops, (*found.positional, *found.keyword), strict=True):
        full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix, arg)
        for (path, leaf), sh in zip(leaf_paths(arg, top), jax.tree.leaves(full), strict=True):
            shape = tuple(getattr(leaf, "shape", ()))
            if all(isinstance(d, int) for d in shape):
                continue
            for dim, entry in enumerate(sh.spec):
                names = (entry,) if isinstance(entry, str) else tuple(entry or ())
                if divides_over(shape[dim], names, mesh.sizes):
                    continue
                parts = math.prod(mesh.sizes[a] for a in names)
                raise ConfigError(
                    f"lower.in_shardings: {path} ({type_str(shape, leaf.dtype)}): dimension "
                    f"{dim} has the symbolic size {shape[dim]}, which mesh axes {list(names)} "
                    f"(together {parts} devices) do not divide for every value of its "
                    f"variables (JAX requires it when tracing); expected a multiple of "
                    f"{parts} (e.g. {parts}*{symbols(str(shape[dim]))[0]}), or the dimension "
                    "unsplit"
                )


def carrying(
    bound: BoundArgs,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    arg_shardings: Sequence[Any],
    kw_shardings: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with each ShapeDtypeStruct carrying its sharding, as jax.jit takes them
    with keyword arguments or explicit mesh axes (one sharding may stand for a subtree):
    ``arg_shardings`` one per traced positional argument, ``kw_shardings`` by keyword; static
    positions, keyword arguments without a sharding and Python scalars as they are."""
    import jax

    def typed(sharding: Any, sub: Any) -> Any:
        return jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=sharding)
                if isinstance(x, jax.ShapeDtypeStruct)
                else x
            ),
            sub,
        )

    def carry(tree: Any, prefix: Any) -> Any:
        return jax.tree.map(typed, prefix, tree)

    it = iter(arg_shardings)
    new_args = tuple(a if bound.is_static(i) else carry(a, next(it)) for i, a in enumerate(args))
    new_kwargs = {
        k: carry(v, kw_shardings[k]) if k in kw_shardings else v for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def jit_inputs(in_tree: Any, in_flat: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    """An export's input shardings (``in_flat``, one per flat input of ``in_tree``) as
    jax.jit takes them: ``in_shardings`` when there are no keyword inputs, else none, each
    sharding riding on its ShapeDtypeStruct (jax 0.10.2: "pjit does not support kwargs when
    in_shardings is specified"). (jit options, the sharding each input's struct carries.)"""
    import jax

    positional, keyword = jax.tree_util.tree_unflatten(in_tree, list(in_flat))
    if keyword:
        return {}, list(in_flat)
    return {"in_shardings": positional}, [None] * len(in_flat)


__all__ = [
    "AllInputs",
    "Inputs",
    "carrying",
    "check_symbolic_splits",
    "jit_inputs",
    "resolved_inputs",
    "resolved_with_keywords",
]
