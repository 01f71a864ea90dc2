"""Programs for tests/test_aot_api.py (what JAX's AOT API can say, from config).

Not a test module: importable as ``aot_api_programs:<name>`` (``tests/`` is on sys.path).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def pick(mode: str, y: jax.Array) -> jax.Array:
    """A static string chosen by name or position."""
    return y * 2 if mode == "double" else y + 1


def sgd(params: dict[str, jax.Array], grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A dict argument passed by keyword, donated by position."""
    return {k: params[k] - 0.1 * grads[k] for k in params}


class Point(NamedTuple):
    x: jax.Array
    y: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    w: jax.Array
    b: jax.Array
    steps: int = dataclasses.field(default=2, metadata={"static": True})


class Pair:
    """A user class registered with jax.tree_util (not a dataclass, not a NamedTuple)."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), "pair"), lambda _, c: Pair(*c))


def norms(p: Point, s: State, t: tuple[jax.Array, jax.Array]) -> dict[str, Any]:
    """Namedtuple, registered dataclass and tuple in; a namedtuple and a user class out."""
    return {
        "point": Point(p.x + p.y, p.x * p.y),
        "pair": Pair(s.w * s.steps + s.b, t[0].sum() + t[1]),
    }


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """Weak-type promotion: a weakly typed x takes y's dtype."""
    return x + y


def with_mesh(x: jax.Array) -> jax.Array:
    """Needs the configured mesh in context: the abstract mesh, a bare PartitionSpec, and
    shard_map without a mesh argument."""
    mesh = jax.sharding.get_abstract_mesh()
    y = jax.lax.with_sharding_constraint(x * 2, P("data"))
    z = jax.shard_map(
        lambda a: a + jax.lax.axis_index("data").astype(a.dtype),
        in_specs=P("data"),
        out_specs=P("data"),
    )(y)
    return z + mesh.size


def resharded(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """With explicit axes: one output keeps the input's sharding, one is resharded."""
    y = x * 2
    return y, jax.sharding.reshard(jnp.sin(y), P())


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return a @ b


def cast(x: jax.Array, dtype: str) -> jax.Array:
    return (x * 1.5).astype(dtype)


def rows(x: jax.Array) -> jax.Array:
    """For symbolic shapes: a reduction over the (polymorphic) leading axis."""
    return jnp.sin(x).sum(axis=0) + x.shape[0]
