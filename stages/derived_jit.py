"""Calling an ``_init_``'s function the way jax.jit passes a pytree: its array leaves traced,
the rest (Python numbers, functions, objects) static, as ``equinox.filter_eval_shape`` keeps them.
Abstractly (``jax.eval_shape``) for stage_out, for real under ``jax.jit(out_shardings=...)`` for
execute; and the checks on the values made (the executable's shardings for them, host memory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxaot.config.argspec import human_size, memory_bytes
from jaxaot.errors import ArgSpecError


def is_array(x: Any) -> bool:
    import jax
    import numpy as np

    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def pure_leaves(tree: Any) -> tuple[list[Any], list[int], Callable[[Sequence[Any]], Any]]:
    """(leaves, indices of the array leaves, ``rebuild(arrays)``) of ``tree`` as jax.jit may
    pass it: library objects made plain by ``jaxaot.stages.adapt.purify`` where it is there
    (NNX graph nodes as their state, shared Variables once), else flattened as a pytree. The
    other leaves (Python numbers, functions, objects) stay static in the rebuilt tree."""
    import jax
    from jaxaot.stages import adapt as adapt_module

    purify = getattr(adapt_module, "purify", None)
    rebuild_pure: Callable[[Any], Any] = lambda t: t  # noqa: E731
    if purify is not None:
        tree, rebuild_pure = purify(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dyn = [i for i, x in enumerate(leaves) if is_array(x)]

    def rebuild(arrays: Sequence[Any]) -> Any:
        full = list(leaves)
        for i, a in zip(dyn, arrays, strict=True):
            full[i] = a
        return rebuild_pure(jax.tree_util.tree_unflatten(treedef, full))

    return leaves, dyn, rebuild


def _filtered(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[Callable[..., list[Any]], list[Any], dict[str, Any]]:
    """``fn`` as a function of the array leaves of ``(args, kwargs)`` returning the array leaves
    of its result (in :func:`pure_leaves`'s order), those leaves, and a box that holds ``rebuild``
    (the result put together again with its static leaves) once it has run."""
    leaves, dyn, rebuild_in = pure_leaves((tuple(args), dict(kwargs)))
    box: dict[str, Any] = {}

    def inner(*arrays: Any) -> list[Any]:
        a, k = rebuild_in(arrays)
        out_leaves, out_dyn, box["rebuild"] = pure_leaves(fn(*a, **k))
        return [out_leaves[i] for i in out_dyn]

    return inner, [leaves[i] for i in dyn], box


def eval_shape(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``jax.eval_shape`` of ``fn(*args, **kwargs)``, non-array leaves static (in and out)."""
    return eval_shape_leaves(fn, args, kwargs)[0]


def eval_shape_leaves(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[Any, list[Any]]:
    """:func:`eval_shape`, and the result's array leaves in the order :func:`materialize`'s
    jit returns them."""
    import jax

    inner, arrays, box = _filtered(fn, args, kwargs)
    out = jax.eval_shape(inner, *arrays)
    return box["rebuild"](out), out


def materialize(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    shardings: list[Any] | None,
) -> Any:
    """``fn(*args, **kwargs)`` under ``jax.jit`` with ``shardings`` (one per array leaf of the
    result, in order) as its out_shardings: each leaf is made on its devices, never whole on one
    first. None: jit's own placement."""
    import jax

    inner, arrays, box = _filtered(fn, args, kwargs)
    jitted = jax.jit(inner, out_shardings=shardings) if shardings is not None else jax.jit(inner)
    out = jitted(*arrays)
    return box["rebuild"](out)


def leaf_shardings(abstract_args: Any, shardings: Any) -> dict[int, Any]:
    """id(abstract leaf) -> the executable's input sharding for it: ``abstract_args`` and
    ``shardings`` are the same pytree (the adapted traced arguments and ``input_shardings``)."""
    import jax

    leaves = jax.tree_util.tree_leaves(abstract_args)
    found = jax.tree_util.tree_leaves(shardings)
    if len(leaves) != len(found):
        return {}
    return {id(a): s for a, s in zip(leaves, found, strict=True)}


def out_shardings(by_id: Mapping[int, Any], pure_leaves: Sequence[Any] | None) -> list[Any] | None:
    """The shardings of an ``_init_``'s array leaves (in order) from :func:`leaf_shardings`;
    None when any leaf is not an input of the executable as it is (then jit places them, and
    the call puts them where the executable wants them)."""
    if pure_leaves is None:
        return None
    found = [by_id.get(id(leaf)) for leaf in pure_leaves]
    return None if any(s is None for s in found) else found


def total_bytes(tree: Any) -> int:
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if is_array(leaf) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def check_fit(values: Mapping[str, Any], platform: str, memory: int | None = None) -> None:
    """Refuse derived values that cannot all be made in this machine's memory to execute on
    ``platform`` ``cpu`` (their sizes are known only once evaluated abstractly). An
    accelerator's values are made on its devices, sharded: the compile's memory analysis says
    whether they fit there."""
    if platform != "cpu":
        return
    memory = memory_bytes() if memory is None else memory
    if memory is None:
        return
    sizes = sorted(((total_bytes(v), p) for p, v in values.items()), reverse=True)
    total = sum(n for n, _ in sizes)
    if not sizes or total <= memory:
        return
    biggest, path = sizes[0]
    raise ArgSpecError(
        f"{path} is {human_size(biggest)} (derived values total {human_size(total)}), more than "
        f"this machine's {human_size(memory)} of memory: executing needs them made; expected "
        "a smaller model, or stop_after=compile (compiling needs no argument memory)"
    )


__all__ = [
    "check_fit",
    "eval_shape",
    "eval_shape_leaves",
    "is_array",
    "leaf_shardings",
    "materialize",
    "out_shardings",
    "pure_leaves",
    "total_bytes",
]
