"""A multi-layer perceptron over a list-of-dicts parameter pytree.

The parameters are a Python list of ``{"w": [din, dout], "b": [dout]}`` dicts, so the
program exercises nested list and mapping argument specs in a program config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

Params = Sequence[Mapping[str, jax.Array]]


def mlp(params: Params, x: jax.Array) -> jax.Array:
    """Apply each ``x @ w + b`` layer in turn, with gelu between layers and none after the last."""
    *hidden, last = params
    for layer in hidden:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def mlp_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error between ``mlp(params, x)`` and the targets ``y``."""
    return jnp.mean(jnp.square(mlp(params, x) - y))
