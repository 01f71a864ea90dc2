"""Programs for tests/test_aot_args.py (keyword arguments on a mesh, symbolic
dimensions with shardings). Not a test module: importable as ``aot_args_programs:<name>``."""

from __future__ import annotations

from typing import Any

import jax


def scaled(x: jax.Array, *, a: jax.Array, b: jax.Array) -> jax.Array:
    """Traced keyword arguments alongside a positional one."""
    return x * a + b


def keyed(x: jax.Array, *, p: dict[str, jax.Array], mode: str = "sum") -> jax.Array:
    """A traced dict keyword argument and a static keyword argument."""
    out = x * p["w"] + p["b"]
    return out.sum(axis=-1) if mode == "sum" else out


def double(x: jax.Array) -> jax.Array:
    return x * 2


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    return x + y


def nested(x: jax.Array, *, p: dict[str, dict[str, jax.Array] | jax.Array]) -> tuple[Any, Any]:
    """A donated nested keyword argument of which only some leaves can hold an output."""
    inner = p["inner"]
    assert isinstance(inner, dict)
    return x * p["w"] + inner["c"], inner["d"].sum()
