"""Programs for tests/test_aot_mesh.py (a mesh's lifecycle: abstract lowerings compiled later,
programs without arguments on a mesh, programs that build their own mesh).

Not a test module: importable as ``aot_mesh_programs:<name>`` (``tests/`` is on sys.path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """A data-parallel product: rows of ``x`` split over the mesh."""
    return jnp.tanh(x @ w)


def argless() -> jax.Array:
    """No arguments: each device writes its own index (shard_map over the context mesh)."""
    return jax.shard_map(
        lambda: jnp.ones(4) * jax.lax.axis_index("data"), in_specs=(), out_specs=P("data")
    )()


def argless_psum() -> jax.Array:
    """No arguments, one collective over a per-replica axis (stage_out.axis_env)."""
    return jax.lax.psum(jnp.ones(3), "i") * (jax.lax.axis_index("i") + 1)


def own_mesh(x: jax.Array) -> jax.Array:
    """Builds its own 2-device mesh (axis ``m``, auto: jax.make_mesh makes explicit axes by
    default, whose shard_map refuses an unsharded input) and calls shard_map on it."""
    mesh = jax.make_mesh((2,), ("m",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    return jax.shard_map(lambda a: a * 2 + 1, mesh=mesh, in_specs=P("m"), out_specs=P("m"))(x)


def own_mesh_data(x: jax.Array) -> jax.Array:
    """Builds its own 2-device mesh with the configured axis name (``data``)."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    return jax.shard_map(
        lambda a: jax.lax.psum(a, "data") * a, mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )(x)
