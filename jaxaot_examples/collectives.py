"""Per-replica programs that use named-axis collectives.

``psum_minus`` and ``row_col_all`` are the two examples from the old ``jax.xla_computation``
documentation. None of these functions binds its axes: the pipeline lowers them under
``jax.shard_map`` over a mesh whose axes are named ``"i"`` (and ``"j"``), and each lowered
collective carries the ``replica_groups`` (or ``source_target_pairs``) that the mesh implies.
"""

from __future__ import annotations

import jax


def psum_minus(x: jax.Array) -> jax.Array:
    """Subtract the sum over axis ``"i"`` from each replica's value."""
    return x - jax.lax.psum(x, "i")


def row_col_all(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sum over ``"i"``, over ``"j"`` and over both: three differently grouped all-reduces."""
    return jax.lax.psum(x, "i"), jax.lax.psum(x, "j"), jax.lax.psum(x, ("i", "j"))


def ring_shift(x: jax.Array) -> jax.Array:
    """Send each replica's value to its successor along axis ``"i"``, wrapping around."""
    n = jax.lax.axis_size("i")
    return jax.lax.ppermute(x, "i", perm=[(k, (k + 1) % n) for k in range(n)])


def mean_max(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean over ``"i"``, max over ``"j"`` and this replica's index along ``"i"``."""
    return jax.lax.pmean(x, "i"), jax.lax.pmax(x, "j"), jax.lax.axis_index("i")
