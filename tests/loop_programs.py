"""Programs with loops and their unrolled copies, for tests/test_loop_costs.py (targets
``loop_programs:<name>``; ``tests/`` is on ``sys.path`` in-process and on the CLI tests'
``PYTHONPATH``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxaot.examples import transformer


def transformer_unrolled(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """:func:`jaxaot.examples.transformer.forward` with a Python loop over the stacked layers
    instead of ``lax.scan``: the same computation, no while loop."""
    x = jnp.take(params["embed"], tokens, axis=0)
    for i in range(params["layers"]["w1"].shape[0]):
        x, _ = transformer._block(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]))
    return transformer._rms_norm(x, params["ln_f"]) @ params["unembed"]


def _layer(x: jax.Array, wb: tuple[jax.Array, jax.Array]) -> jax.Array:
    w, b = wb
    return jnp.tanh(x @ w + b)


def deep_scan(w: jax.Array, b: jax.Array, x: jax.Array) -> jax.Array:
    """``len(w)`` dense layers applied by ``lax.scan``."""
    return jax.lax.scan(lambda h, wb: (_layer(h, wb), None), x, (w, b))[0]


def deep_unrolled(w: jax.Array, b: jax.Array, x: jax.Array) -> jax.Array:
    """:func:`deep_scan` with a Python loop."""
    for i in range(w.shape[0]):
        x = _layer(x, (w[i], b[i]))
    return x


def nested_scan(w: jax.Array, x: jax.Array) -> jax.Array:
    """A scan over ``w``'s layers, each applying its layer 3 times by an inner scan."""

    def outer(h: jax.Array, wi: jax.Array) -> tuple[jax.Array, None]:
        inner = jax.lax.scan(lambda g, _: (jnp.tanh(g @ wi), None), h, None, length=3)[0]
        return inner, None

    return jax.lax.scan(outer, x, w)[0]


def nested_unrolled(w: jax.Array, x: jax.Array) -> jax.Array:
    for i in range(w.shape[0]):
        for _ in range(3):
            x = jnp.tanh(x @ w[i])
    return x


def fori(w: jax.Array, x: jax.Array) -> jax.Array:
    """A ``fori_loop`` with static bounds 1..6 (5 trips) over ``w``'s layers."""
    return jax.lax.fori_loop(1, 6, lambda i, h: jnp.tanh(h @ w[i]), x)


def fori_unrolled(w: jax.Array, x: jax.Array) -> jax.Array:
    for i in range(1, 6):
        x = jnp.tanh(x @ w[i])
    return x


def until_small(w: jax.Array, x: jax.Array) -> jax.Array:
    """A ``while_loop`` whose trip count depends on the data."""
    return jax.lax.while_loop(lambda h: jnp.max(jnp.abs(h)) > 0.5, lambda h: 0.5 * (h @ w[0]), x)
