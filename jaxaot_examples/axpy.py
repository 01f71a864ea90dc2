"""The smallest useful program: ``f`` from JAX's ahead-of-time lowering walkthrough.

It is the pipeline's smoke test: with ``args: [3, 4]`` it lowers to one
``stablehlo.multiply`` by the constant 2 and one ``stablehlo.add``, and returns 10.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def axpy(x: jax.typing.ArrayLike, y: jax.typing.ArrayLike) -> jax.Array:
    """Return ``2 * x + y``."""
    return jnp.asarray(2 * x + y)
