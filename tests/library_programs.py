"""Models and programs for tests/test_library_args.py: Flax and Equinox written the default way."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


class Tiny(nnx.Module):
    """One dense layer whose kernel carries logical names, Flax 0.12's default way (eager
    sharding on: created outside a mesh, it raises)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.dense = nnx.Linear(16, 8, kernel_init=init, rngs=rngs)


def forward(model: Tiny, x: jax.Array) -> jax.Array:
    return model.dense(x)


def failing(rngs: Any) -> Any:
    raise ValueError("this init fails")


class AnyAttribute:
    """Answers every attribute name (as ``nnx.Rngs`` does with its streams)."""

    def __getattr__(self, name: str) -> Any:
        return AnyAttribute()

    def __repr__(self) -> str:
        return "AnyAttribute()"


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def total(tree: Any) -> jax.Array:
    """The sum of every array leaf of ``tree``."""
    return sum((x.sum() for x in jax.tree.leaves(tree)), start=jax.numpy.zeros((), "float32"))


def scale_step(model: Tiny, x: jax.Array) -> jax.Array:
    """The layer's output; doubles its kernel in place (an NNX update)."""
    y = model.dense(x)
    model.dense.kernel[...] = model.dense.kernel[...] * 2
    return y
