"""Walking and building a parsed argument tree: its leaves in pytree order, a map over them,
the array specs inside, a static argument's value, and the Python objects it stands for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jaxaot.config import derived
from jaxaot.config.argspec.leaf_types import (
    PYTREE_ARGS,
    PYTREE_KEY,
    ArraySpec,
    Given,
    Literal,
    PytreeNode,
)
from jaxaot.config.derived import DERIVED_TYPES
from jaxaot.errors import ArgSpecError


def build(tree: Any, leaf: Any, resolve: Any) -> Any:
    """Python objects from a parsed tree: ``leaf(path, spec)`` for each leaf, and each
    PytreeNode constructed with the class ``resolve(name, path)`` returns."""

    # Leaves are visited with dict keys and container fields sorted, whatever order the config
    # listed them in: a resumed run reads its config back from the manifest (sorted JSON), and
    # seeded inputs are drawn in visiting order, so both runs must visit alike.
    def go(node: Any, where: str) -> Any:
        if isinstance(node, dict):
            done = {k: go(node[k], f"{where}.{k}") for k in sorted(node)}
            return {k: done[k] for k in node}
        if isinstance(node, list):
            return [go(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, PytreeNode):
            args = [go(a, p) for p, a in node.children(where)[: len(node.args)]]
            made = {k: go(v, f"{where}.{k}") for k, v in sorted(node.fields, key=lambda f: f[0])}
            fields = {k: made[k] for k, _ in node.fields}
            if node.cls == "tuple":
                return tuple(args)
            cls = resolve(node.cls, f"{where}.{PYTREE_KEY}")
            try:
                return cls(*args, **fields)
            except TypeError as exc:
                raise ArgSpecError(
                    f"{where}: cannot build {node.cls} from {PYTREE_ARGS}={len(args)} item(s) "
                    f"and fields {sorted(fields)} ({exc})"
                ) from None
        return leaf(where, node)

    return go(tree, "")


def leaves(tree: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs in pytree order (dict keys sorted, as JAX flattens them). A derived
    node (``_init_``, ``_call_``, ``_ref_``, ``_key_``) is one leaf: its value's structure is
    known only once it is evaluated (:func:`specs` reaches the array specs inside it)."""
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from leaves(tree[k], f"{where}.{k}" if where else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{where}[{i}]")
    elif isinstance(tree, PytreeNode):
        for path, child in tree.children(where):
            yield from leaves(child, path)
    else:
        yield where, tree


def map_tree(fn: Any, tree: Any, where: str = "") -> Any:
    """Apply ``fn(path, leaf)`` to each leaf, keeping lists and dicts."""
    if isinstance(tree, dict):
        return {k: map_tree(fn, v, f"{where}.{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_tree(fn, v, f"{where}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, (PytreeNode, *DERIVED_TYPES)):
        node: Any = tree  # DERIVED_TYPES is a tuple of classes mypy sees as object
        return node.with_children([map_tree(fn, c, p) for p, c in node.children(where)])
    return fn(where, tree)


def specs(tree: Any, where: str = "") -> Iterator[tuple[str, ArraySpec]]:
    """Every array spec in a tree, those inside derived nodes (an ``_init_``'s arguments) too."""
    for path, node in derived.walk(tree, where):
        if isinstance(node, ArraySpec):
            yield path, node


def to_static_value(tree: Any, where: str) -> Any:
    """A static argument's Python value: literals only; lists become tuples (hashable)."""
    if isinstance(tree, ArraySpec):
        raise ArgSpecError(
            f"{where} is marked static but is an array spec ({tree.type_str}); static arguments "
            "must be values: give a literal, or remove it from static_argnums/static_argnames"
        )
    if isinstance(tree, Literal):
        return tree.value
    if isinstance(tree, list):
        return tuple(to_static_value(v, f"{where}[{i}]") for i, v in enumerate(tree))
    if isinstance(tree, PytreeNode) and tree.cls == "tuple":
        return tuple(to_static_value(v, p) for p, v in tree.children(where))
    if isinstance(tree, Given):
        raise ArgSpecError(
            f"{where} is marked static but is an array ({tree.type_str}); static arguments "
            "must be hashable values: remove it from static_argnums/static_argnames"
        )
    if isinstance(tree, DERIVED_TYPES):
        raise ArgSpecError(
            f"{where} is marked static but is a derived value ({derived.describe(tree)}); "
            "static arguments are literals: pass it at a traced position (a _call_ object "
            "there is closed over and fingerprinted), or remove it from "
            "static_argnums/static_argnames"
        )
    raise ArgSpecError(
        f"{where} is marked static but is a dict; static arguments must be hashable values "
        "(numbers, strings, bools or lists of them)"
    )
