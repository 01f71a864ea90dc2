"""Programs with a static argument before the traced ones, for tests/test_static_first.py
(targets ``static_first_programs:<name>``; ``tests/`` is on ``sys.path`` in-process)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first(s: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``jnp.einsum`` with its subscripts (static) first."""
    return jnp.einsum(s, x, y)


def _last(x: jax.Array, y: jax.Array, s: str) -> jax.Array:
    return jnp.einsum(s, x, y)


# :func:`first` with the static argument last, under the same name: the same module and
# calling convention, so the same compile (store entry), with other argument positions.
last = _last
last.__name__ = last.__qualname__ = "first"


def predict(w: jax.Array, x: jax.Array, n: int) -> jax.Array:
    """``n`` layers: ``n`` is used in Python (``range``), so it must be static."""
    for _ in range(n):
        x = jnp.tanh(x @ w)
    return x


def branch(x: jax.Array, flag: bool) -> jax.Array:
    return x + 1 if flag else x - 1


def scaled(x: jax.Array, *, times: int) -> jax.Array:
    return jnp.concatenate([x for _ in range(times)])


def mismatched(x: jax.Array, n: int) -> jax.Array:
    """A trace error of another kind (shapes), with a literal argument beside it."""
    return x @ jnp.ones((x.shape[0] + n, 2))


def activated(kind: str, x: jax.Array, n: int) -> jax.Array:
    """A static argument and a literal used in Python (``range``) after it."""
    act = getattr(jnp, kind)
    for _ in range(n):
        x = act(x)
    return x
