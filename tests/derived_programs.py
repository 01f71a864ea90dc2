"""Init functions and programs for tests/test_derived_args.py (arguments derived from an init)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxaot.errors import ConfigError

# How often each Python function below ran (a trace counts: eval_shape and jit call it once).
CALLS: dict[str, int] = {}
# The shardings each jaxaot_materialize hook was given.
SHARDINGS: list[Any] = []


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def init(key: jax.Array, din: int = 3, dout: int = 4) -> dict[str, jax.Array]:
    """Parameters of one dense layer."""
    _count("init")
    kw, kb = jax.random.split(key)
    return {"w": jax.random.normal(kw, (din, dout)), "b": jax.random.normal(kb, (dout,)) * 0.1}


def init_2d(key: jax.Array, n: int = 8) -> dict[str, jax.Array]:
    """Two matrices (every leaf 2-D: one sharding spec fits them all)."""
    _count("init_2d")
    k1, k2 = jax.random.split(key)
    return {"a": jax.random.normal(k1, (n, 2 * n)), "c": jax.random.normal(k2, (2 * n, n))}


def forward(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ params["w"] + params["b"]


def matmuls(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return (x @ params["a"]) @ params["c"]


class MomentumState(NamedTuple):
    count: jax.Array
    mu: Any


class Momentum:
    """An optax-like optimizer: a host object with ``init`` and ``update``."""

    def __init__(self, learning_rate: float, beta: float = 0.9) -> None:
        _count("Momentum")
        self.learning_rate, self.beta = learning_rate, beta

    def init(self, params: Any) -> MomentumState:
        _count("Momentum.init")
        return MomentumState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(self, grads: Any, state: MomentumState) -> tuple[Any, MomentumState]:
        mu = jax.tree.map(lambda m, g: self.beta * m + g, state.mu, grads)
        return jax.tree.map(lambda m: -self.learning_rate * m, mu), MomentumState(
            state.count + 1, mu
        )


def train_step(
    params: dict[str, jax.Array], opt_state: MomentumState, x: jax.Array
) -> tuple[Any, MomentumState, jax.Array]:
    tx = Momentum.__new__(Momentum)  # the same arithmetic, without counting a construction
    tx.learning_rate, tx.beta = 0.1, 0.9
    loss, grads = jax.value_and_grad(lambda p: jnp.sum(forward(p, x) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss


def noisy(key: jax.Array, x: jax.Array) -> jax.Array:
    return x + jax.random.normal(key, x.shape)


def huge(n: int) -> jax.Array:
    """``n`` float32 zeros (4 GiB for n = 2**30)."""
    _count("huge")
    out = jnp.zeros((n,), jnp.float32)
    if not isinstance(out, jax.core.Tracer):
        CALLS["huge_concrete"] = CALLS.get("huge_concrete", 0) + 1
    return out


def total(x: jax.Array) -> jax.Array:
    return jnp.sum(x)


def broken(din: int) -> None:
    raise ValueError(f"no layer of width {din}")


def refusing(step: int) -> None:
    """An init that refuses its input with jaxaot's own error (as jaxaot.models' hooks do)."""
    raise ConfigError(f"step {step}: no such checkpoint step")


class Refusing:
    """A _call_ target that refuses its input with jaxaot's own error."""

    def __init__(self, step: int) -> None:
        raise ConfigError(f"step {step}: no such checkpoint step")


class Hooked:
    """A callable with both hooks: what stage_out and execute call instead of it."""

    def __call__(self, n: int) -> jax.Array:
        raise AssertionError("the hooks are called instead")

    def jaxaot_abstract(self, n: int) -> jax.ShapeDtypeStruct:
        _count("abstract_hook")
        return jax.ShapeDtypeStruct((n,), jnp.float32)

    def jaxaot_materialize(self, shardings: Any, n: int) -> jax.Array:
        _count("materialize_hook")
        SHARDINGS.append(shardings)
        out = jnp.arange(n, dtype=jnp.float32)
        return jax.device_put(out, shardings[0]) if shardings else out


hooked = Hooked()
