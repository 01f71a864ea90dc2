"""The lower stage's shardings on a mesh: ``lower.in_shardings``/``out_shardings`` resolved for the
positional and keyword arguments (keyword arguments' shardings ride on their ShapeDtypeStructs,
since jax.jit takes no in_shardings with them; resolved, and symbolic splits checked, by
``jax_inputs.resolved_with_keywords``), and ``path_shardings.json``.
"""

from __future__ import annotations

import functools
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.mesh import MeshSpec, logical_rules
from jaxaot.config.path_shardings import (
    Resolution,
    is_pattern_form,
    resolve,
    under_flax_rules,
)
from jaxaot.config.sharding import Spec
from jaxaot.config.tree_paths import leaf_paths, top_names
from jaxaot.stages.contract import StageContext
from jaxaot.stages.jax_inputs import carrying, resolved_with_keywords
from jaxaot.stages.jax_mesh import named, output_shardings, update_shardings
from jaxaot.stages.stage_out import StagedOut


def sharded(
    ctx: StageContext, staged: StagedOut, mesh: MeshSpec, amesh: Any, opts: dict[str, Any]
) -> tuple[Any, dict[str, Any], tuple[Any, ...], dict[str, Any]]:
    """The program, jit options and arguments with ``lower.in_shardings``/``out_shardings`` on
    ``mesh``.

    The static keyword arguments are bound into the function. jax.jit takes no keyword
    arguments alongside in_shardings ("pjit does not support kwargs when in_shardings is
    specified", jax 0.10.2), so with traced keyword arguments every input's sharding rides on
    its ShapeDtypeStruct instead (``jax.jit(f).trace(x_sds, a=a_sds)``, which lowers to the same
    module): a keyword argument's leaves are named by the keyword in the mapping form
    (``{a: [data]}``), the positional list covers the positional arguments alone, and a keyword
    leaf no spec names is replicated, as a positional one is. Path patterns and logical-axis
    rules are resolved on ``staged.args``/``staged.kwargs``, the abstract arguments jax.jit
    traces; what they decided is written to ``path_shardings.json``.
    """
    cfg, sh = ctx.opts, ctx.facts.shardings
    bound = staged.bound
    assert staged.fn is not None  # lowering again always traces the program (see the runner)
    static_kw = {k: v for k, v in staged.kwargs.items() if bound.is_static(k)}
    traced_kw = {k: v for k, v in staged.kwargs.items() if not bound.is_static(k)}
    fn = functools.partial(staged.fn, **static_kw) if static_kw else staged.fn
    # flax's own logical constraints (nn.with_logical_constraint, LogicallyPartitioned) see
    # lower.logical_axis_rules while the program is traced.
    fn = under_flax_rules(fn, logical_rules(sh, mesh))
    dropped = ("static_argnames",) if traced_kw else ("static_argnames", "donate_argnames")
    opts = {k: v for k, v in opts.items() if k not in dropped}
    names = staged.signature.get("parameters")
    found = resolved_with_keywords(
        sh, bound, mesh, staged.args, traced_kw, names, staged.logical_axes
    )
    specs = found.specs
    args: tuple[Any, ...] = found.args
    kwargs: dict[str, Any] = {}
    if traced_kw:
        by_kw = dict(zip(traced_kw, found.keyword, strict=True))
        args, kwargs = carrying(bound, args, found.kwargs, found.positional, by_kw)
    else:
        opts["in_shardings"] = found.positional
    outs = None
    if cfg.out_shardings is not None:
        traced = staged.traced
        assert traced is not None, "out_shardings need the traced program"
        # With NNX arguments the traced function returns (the user's output, the Variables it
        # updated): lower.out_shardings describe the user's output; each update keeps the
        # sharding its Variable came in with (a parameter stays laid out as it was).
        out_info, out_tree = traced.out_info, compat_jax.traced_out_tree(traced)
        if staged.returns_updates:
            out_info, out_tree = traced.out_info[0], out_tree.children()[0]
        if is_pattern_form(cfg.out_shardings):
            trees, outs = resolve(
                [("output", out_info)],
                cfg.out_shardings,
                key="lower.out_shardings",
                mesh=mesh.sizes,
                logical=logical_rules(sh, mesh),
                others=_input_leaves(staged, specs, names, list(traced_kw)),
            )
            user = named(trees[0], amesh)
        else:
            user = output_shardings(cfg.out_shardings, out_info, out_tree, mesh, amesh)
        opts["out_shardings"] = user
        if staged.returns_updates:
            positions = [i for i in range(len(staged.args)) if not bound.is_static(i)]
            updates = update_shardings(
                traced.out_info[1],
                staged.args,
                found.positional,
                positions,
                top_names(len(staged.args), names),
            )
            opts["out_shardings"] = (user, updates)
    if found.resolution is not None or outs is not None:
        _record_paths(ctx, found.resolution, outs)
    return fn, opts, args, kwargs


def _input_leaves(
    staged: StagedOut, specs: tuple[Any, ...], names: list[str] | None, keywords: list[str]
) -> dict[str, tuple[tuple[Any, ...], Spec]]:
    """Every traced input leaf's shape and spec by path (and ``args[i]`` path), for ``like``
    in ``out_shardings``; a positional-form spec standing for a subtree is given to each leaf.
    ``specs`` has one tree per traced positional argument, then one per traced keyword
    argument in ``keywords`` (named by its keyword)."""
    import jax

    out: dict[str, tuple[tuple[Any, ...], Spec]] = {}
    traced = [i for i in range(len(staged.args)) if not staged.bound.is_static(i)]
    tops = top_names(len(staged.args), names)
    inputs: list[tuple[Any, tuple[str, ...]]] = [
        (staged.args[i], (tops[i], f"args[{i}]")) for i in traced
    ]
    inputs += [(staged.kwargs[k], (k,)) for k in keywords]
    for (arg, paths), spec_tree in zip(inputs, specs, strict=True):
        full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), spec_tree, arg)
        flat = jax.tree.leaves(full)
        for top in dict.fromkeys(paths):
            for (path, leaf), spec in zip(leaf_paths(arg, top), flat, strict=True):
                out[path] = (tuple(getattr(leaf, "shape", ())), spec)
    return out


def _record_paths(ctx: StageContext, ins: Resolution | None, outs: Resolution | None) -> None:
    """``path_shardings.json`` (every leaf's spec and what decided it) and one warning line for
    the leaves no rule decided and one for the fallbacks."""
    record: dict[str, Any] = {}
    for side, res in (("inputs", ins), ("outputs", outs)):
        if res is None:
            continue
        record[side] = res.table()
        record[f"unmatched_{side}"] = res.unmatched
        record[f"notes_{side}"] = res.notes
        key = "lower.in_shardings" if side == "inputs" else "lower.out_shardings"
        if res.unmatched:
            shown = ", ".join(res.unmatched[:3])
            more = f" (+{len(res.unmatched) - 3} more)" if len(res.unmatched) > 3 else ""
            n = len(res.unmatched)
            ctx.warn(
                f"{key}: {n} {'leaf matches' if n == 1 else 'leaves match'} no pattern and "
                f"{'has' if n == 1 else 'have'} no logical axes, so replicated: {shown}{more} "
                "(lower/path_shardings.json)"
            )
        if res.notes:
            more = f" (+{len(res.notes) - 1} more)" if len(res.notes) > 1 else ""
            ctx.warn(f"{key}: {res.notes[0]}{more} (lower/path_shardings.json)")
    ctx.write_json("path_shardings.json", record)


__all__ = [
    "sharded",
]
