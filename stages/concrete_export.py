"""A polymorphic lowering made concrete at ``compile.shapes``, for the compile stage.

lower exports a program with symbolic dimensions once (``exported.bin`` stays polymorphic);
each compile calls that export at its own sizes and exports the call again, where JAX checks
the shape constraints. What compile keys and compiles is that concrete export, whose bytes
depend on the polymorphic export and the sizes alone (:func:`_without_call_sites`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import symbols
from jaxaot.config.mesh import MeshSpec
from jaxaot.errors import ConfigError, one_line
from jaxaot.stages.jax_inputs import jit_inputs
from jaxaot.stages.jax_mesh import abstract_mesh

if TYPE_CHECKING:
    from jaxaot.stages.lower import Lowered

log = logging.getLogger("jaxaot")


def has_symbolic(*trees: Any) -> bool:
    """Whether any leaf of ``trees`` (arrays, ShapeDtypeStructs, avals) has a symbolic
    dimension."""
    import jax

    return any(
        not isinstance(d, int)
        for leaf in jax.tree_util.tree_leaves(trees)
        for d in getattr(leaf, "shape", ())
    )


def _without_call_sites() -> Any:
    """A context in which a trace records no Python locations of its own
    (``jax_traceback_in_locations_limit=0``, thread-local). The call of the export is traced
    in it: the module's locations are then those the export carries (the program's own), not
    the paths and lines of whatever called jaxaot, which the compile key would hash."""
    try:
        return compat_jax.traceback_in_locations_limit(0)
    except (ImportError, AttributeError):
        log.warning(
            "[compile] this jax has no jax._src.config.traceback_in_locations_limit: a "
            "polymorphic program's compile key may depend on where jaxaot was called from "
            "(a store miss, never a wrong hit)"
        )
        return contextlib.nullcontext()


def at_sizes(record: Lowered, sizes: Mapping[str, int], mesh_context: bool) -> Lowered:
    """``record`` made concrete at ``sizes`` (``compile.shapes``): its export called at those
    sizes and exported again, with ``meta["shapes"]`` the sizes used and state "concrete".
    Unchanged when it has no export or no symbolic dimensions. ``mesh_context``
    (``mesh.context``): the call is traced with the lowering's mesh in context."""
    import jax

    exp = record.exported
    if exp is None or not has_symbolic(exp.in_avals):
        return record
    used: dict[str, int] = {}
    avals = []
    for aval in exp.in_avals:
        shape = []
        for d in aval.shape:
            if isinstance(d, int):
                shape.append(d)
                continue
            names = symbols(str(d))
            missing = [v for v in names if v not in sizes]
            if missing:
                raise ConfigError(
                    f"compile.shapes: the lowering is polymorphic in {str(d)!r}; expected a size "
                    f"for {', '.join(repr(m) for m in missing)} (e.g. compile.shapes="
                    f"{{{missing[0]}: 32}}), or stop_after=lower"
                )
            used |= {v: sizes[v] for v in names}
            shape.append(compat_jax.evaluate_dim(d, sizes))
        avals.append((tuple(shape), aval))
    in_flat: list[Any] = [None] * len(avals)
    jit_opts: dict[str, Any] = {}
    in_context: Any = contextlib.nullcontext()
    if record.meta.get("mesh") and exp.nr_devices > 1:  # called on the lowering's own mesh
        amesh = abstract_mesh(MeshSpec.from_json(record.meta["mesh"]))
        in_flat = list(exp.in_shardings_jax(amesh))
        outs = jax.tree_util.tree_unflatten(exp.out_tree, exp.out_shardings_jax(amesh))
        given, in_flat = jit_inputs(exp.in_tree, in_flat)
        jit_opts = {"out_shardings": outs, **given}
        if mesh_context:
            in_context = compat_jax.use_abstract_mesh(amesh)
    structs = [
        jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)
        for (shape, aval), sharding in zip(avals, in_flat, strict=True)
    ]
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, structs)
    try:
        with in_context, _without_call_sites():
            # The same safety checks off as the export it calls (its custom calls recur).
            concrete = jax.export.export(
                jax.jit(exp.call, **jit_opts),
                platforms=exp.platforms,
                disabled_checks=exp.disabled_safety_checks,
            )(*args, **kwargs)
    except ValueError as exc:  # a shape constraint or a division that does not hold
        raise ConfigError(f"compile.shapes={used}: {one_line(exc)}") from None
    meta = {**record.meta, "shapes": used}
    return replace(record, exported=concrete, lowered=None, meta=meta, state="concrete")


__all__ = ["at_sizes", "has_symbolic"]
