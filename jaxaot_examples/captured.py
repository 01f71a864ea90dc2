"""A program that closes over a large constant: the weights are not an argument.

Users close over weights all the time (a loaded checkpoint in a global, a table built with
numpy). JAX embeds such a constant in the module as a dense literal, so every text form of the
program carries it; this example (a 3584 x 3584 f32 weight, 51 MB) is what keeps jaxaot's
lowering artifacts and compile key honest about them without paying for their size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def weight(n: int = 3584, seed: int = 0) -> np.ndarray:
    """A fixed ``[n, n]`` f32 matrix, built once per process (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, n), dtype=np.float32) / np.float32(np.sqrt(n))).astype(
        np.float32
    )


def project(x: jax.typing.ArrayLike) -> jax.Array:
    """``tanh(x @ W)`` with ``W`` a captured ``[d, d]`` constant (``d`` = ``x``'s last axis)."""
    x = jnp.asarray(x)
    return jnp.tanh(x @ jnp.asarray(weight(int(x.shape[-1]))))
