"""Short ``repr`` texts for records that hold arrays, modules and executables.

A dataclass's generated ``repr`` prints every field in full: a run's result came to 19-29 KB
(the arguments' specs, the exported module's avals, the outputs' values). These helpers give
the few facts worth reading: array leaves as ``f32[8,256]``, trees as their first leaves
and a count, long texts cut with their length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TREE_WIDTH = 100


def short_name(dtype: str) -> str:
    """JAX's short dtype spelling (``float32`` -> ``f32``), as jaxaot.config.argspec writes it."""
    return (
        dtype.replace("float", "f").replace("uint", "u").replace("int", "i").replace("complex", "c")
    )


def array_text(x: Any) -> str | None:
    """``f32[8,256]`` for anything with a shape and a dtype (arrays, specs); else None."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return None
    try:
        dims = ",".join(str(d) for d in shape)
    except TypeError:
        return None
    return f"{short_name(str(getattr(dtype, 'name', dtype)))}[{dims}]"


def leaf_count(tree: Any) -> int:
    if isinstance(tree, Mapping):
        return sum(leaf_count(v) for v in tree.values())
    if isinstance(tree, list | tuple) and array_text(tree) is None:
        return sum(leaf_count(v) for v in tree)
    return 1


def _text(tree: Any) -> str:
    shown = array_text(tree)
    if shown is not None:
        return shown
    if isinstance(tree, Mapping):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, list | tuple):
        inner = ", ".join(_text(v) for v in tree)
        return f"[{inner}]" if isinstance(tree, list) else f"({inner})"
    return cut(repr(tree), 40)


def tree_text(tree: Any, width: int = TREE_WIDTH) -> str:
    """A pytree of arrays as its leaves' types, cut to ``width`` with the leaf count."""
    text = _text(tree)
    if len(text) <= width:
        return text
    return f"{text[: width - 1]}… ({leaf_count(tree)} leaves)"


def cut(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters (then its full length is said)."""
    line = " ".join(text.split())
    return line if len(line) <= width else f"{line[: width - 1]}… ({len(line)} chars)"


__all__ = ["array_text", "cut", "leaf_count", "short_name", "tree_text"]
