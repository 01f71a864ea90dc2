"""Flax NNX graph nodes (Modules, Optimizers, Rngs) as arguments: split outside, merged inside.

A Flax 0.12 NNX Module is also a JAX pytree, but flattening it as one (NNX's "tree mode")
copies a Variable shared by two attributes or two arguments into two leaves that no longer
alias after the call. jaxaot splits in graph mode, as ``nnx.jit`` does by default: every NNX
argument is split inside one ``nnx.split_context`` (a Variable shared by two arguments is stored
once, and the later graphdef refers to it), and merged inside the traced function in one
``nnx.merge_context``, so the function sees the same object graph it was given.

The state of a node becomes a plain nested dict of its Variables' values (``l1/kernel``, not
``l1/kernel/value``), the form jax.export serializes and path shardings name. After the call the
nodes are split again and every Variable whose value is no longer the traced input (an
optimizer step, a batch-norm statistic, an RNG count) is returned: the update is part of the
compiled program, as with ``nnx.jit``. Variables left alone are not returned (``nnx.jit``
returns them too, which costs an output buffer per parameter in a forward pass).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from jaxaot.config.tree_paths import key_text

Keys = tuple[str, ...]


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def is_graph_node(x: Any) -> bool:
    """An NNX Module, Optimizer, Rngs or other graph node (a bare Variable is not)."""
    nnx = _nnx()
    if nnx is None:
        return False
    from flax.nnx import graphlib

    return graphlib.is_graph_node(x) and not isinstance(x, nnx.Variable)


def is_variable(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Variable)


def variable_axes(var: Any) -> tuple[str | None, ...] | None:
    """Flax 0.12 keeps a Variable's logical axis names in its ``out_sharding`` metadata
    (``sharding_names`` and ``sharding`` are deprecated aliases of it)."""
    names = var.get_metadata().get("out_sharding")
    if names is None:
        return None
    return tuple(None if n is None else str(n) for n in names)


def state_keys(keypath: tuple[Any, ...]) -> Keys:
    """A State leaf's jax key path without the Variable's own ``value`` attribute."""
    import jax

    tu = jax.tree_util
    return tuple(
        key_text(k) for k in keypath if not (isinstance(k, tu.GetAttrKey) and k.name == "value")
    )


@dataclass
class Split:
    """One NNX argument, split: what the traced function needs to merge it back."""

    path: str
    graphdef: Any
    treedef: Any  # the State's structure, Variable types and metadata included
    slots: list[tuple[Keys, bool, Any]]  # per State leaf: (keys, traced?, static value)
    pure: dict[str, Any]
    axes: dict[str, tuple[str | None, ...] | None] = field(default_factory=dict)
    statics: list[tuple[str, Any]] = field(default_factory=list)


def split(ctx: Any, node: Any, path: str, traced: Any) -> Split:
    """Split ``node`` in the split context ``ctx``; ``traced(leaf)`` says which leaves are
    traced (the others stay static, closed over)."""
    import jax
    from flax import nnx

    graphdef, state = ctx.split(node)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    pure: dict[str, Any] = {}
    slots: list[tuple[Keys, bool, Any]] = []
    statics: list[tuple[str, Any]] = []
    for keypath, leaf in leaves:
        keys = state_keys(keypath)
        if traced(leaf):
            _put(pure, keys, leaf)
            slots.append((keys, True, None))
        else:
            slots.append((keys, False, leaf))
            statics.append(("/".join((path, *keys)), leaf))
    axes = {}
    for parts, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.Variable):
            axes["/".join((path, *map(str, parts)))] = variable_axes(var)
    return Split(path, graphdef, treedef, slots, pure, axes, statics)


def merge(ctx: Any, sp: Split, pure: Any) -> Any:
    """The node again, from the pure state ``pure`` (traced values inside the function)."""
    leaves = [_get(pure, keys) if traced else value for keys, traced, value in sp.slots]
    return ctx.merge(sp.graphdef, sp.treedef.unflatten(leaves))


def updates(ctx: Any, node: Any, before: Any) -> dict[str, Any]:
    """The Variables of ``node`` (split again in ``ctx``) whose values are not the traced inputs
    ``before`` (the pure state the function was given): a nested dict of the new values."""
    import jax

    _, state = ctx.split(node)
    out: dict[str, Any] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = state_keys(keypath)
        try:
            old = _get(before, keys)
        except (KeyError, TypeError):
            old = None
        if leaf is not old:
            _put(out, keys, leaf)
    return out


def _put(tree: dict[str, Any], keys: Keys, value: Any) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _get(tree: Any, keys: Keys) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


def lazy_sharding() -> Any:
    """A context for calling a user's init: Flax 0.12 shards a Variable with ``out_sharding``
    metadata at creation (``eager_sharding``), which needs a mesh whose axes are the logical
    names; inside this context the names stay metadata (jaxaot's ``logical_axes``) and jaxaot's
    own shardings place the values."""
    import contextlib

    nnx = _nnx()
    return nnx.use_eager_sharding(False) if nnx is not None else contextlib.nullcontext()
