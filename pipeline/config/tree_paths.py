"""Leaf paths: one text name for every array of an argument tree.

A leaf path is ``/``-joined: the top-level name (a parameter name, ``args[i]`` when the name is
unknown, a keyword by name), then one component per pytree level, as
``jax.tree_util.tree_flatten_with_path`` reports the keys:

- ``DictKey`` -> the key (``str(key)``: an integer key of an NNX state is ``0``);
- ``GetAttrKey`` -> the attribute name (NamedTuples, dataclasses, flax structs, Equinox modules);
- ``SequenceKey`` / ``FlattenedIndexKey`` -> the index.

So optax's ``adamw`` state of a params dict has ``opt_state/0/mu/layers/wq`` and
``opt_state/0/count``; a flax ``TrainState`` has ``state/params/Dense_0/kernel``.

JAX is imported only when a tree is walked, so the config layer stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

SEP = "/"


def key_text(key: Any) -> str:
    """The path component of one ``jax.tree_util`` key entry."""
    from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    # A container's own key type (rare): its text, without the brackets JAX prints.
    return str(key).strip("[].'\"")


def join(top: str, keys: Sequence[Any]) -> str:
    """``top`` followed by the text of each key entry, ``/``-joined (``top`` may be empty)."""
    parts = [top] if top else []
    parts.extend(key_text(k) for k in keys)
    return SEP.join(parts)


def leaf_paths(
    tree: Any, top: str = "", is_leaf: Callable[[Any], bool] | None = None
) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` for every leaf of ``tree`` in ``jax.tree_util`` flatten order.

    ``None`` subtrees have no leaves (as in JAX); ``is_leaf`` is passed to JAX unchanged.
    """
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(join(top, keys), leaf) for keys, leaf in flat]


def input_path(keys: Sequence[Any]) -> str:
    """The path of a flat input of ``(args, kwargs)`` (its key path from
    ``tree_flatten_with_path``) as jaxaot's files name it: ``args[0]['params']['w']``."""
    import jax

    head = "args" if getattr(keys[0], "idx", 0) == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(keys[1:]))


def top_names(n_args: int, names: Sequence[str] | None) -> list[str]:
    """The top-level names of ``n_args`` positional arguments: the parameter names where known,
    else ``args[i]``."""
    if names is not None and len(names) >= n_args:
        return [str(n) for n in names[:n_args]]
    return [f"args[{i}]" for i in range(n_args)]


def argument_paths(
    args: Sequence[Any], kwargs: dict[str, Any] | None = None, names: Sequence[str] | None = None
) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` for positional ``args`` (named by ``names`` or ``args[i]``) then
    ``kwargs`` (by keyword), the order jax.jit flattens ``(args, kwargs)`` in."""
    out: list[tuple[str, Any]] = []
    for top, arg in zip(top_names(len(args), names), args, strict=True):
        out.extend(leaf_paths(arg, top))
    for name in sorted(kwargs or {}):
        out.extend(leaf_paths((kwargs or {})[name], name))
    return out


__all__ = [
    "SEP",
    "argument_paths",
    "input_path",
    "join",
    "key_text",
    "leaf_paths",
    "top_names",
]
