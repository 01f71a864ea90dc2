"""Programs for tests/test_path_shardings.py (targets ``path_sharding_programs:<name>``).

Not a test module: importable as ``path_sharding_programs:<name>`` (``tests/`` is on sys.path).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

OPTIMIZER = optax.adamw(1e-3)


class Batch(NamedTuple):
    tokens: jax.Array  # [batch, d_model]
    targets: jax.Array  # [batch, d_out]


def loss(params: dict[str, Any], batch: Batch) -> jax.Array:
    h = jnp.tanh(batch.tokens @ params["layers"]["w1"] + params["layers"]["b1"])
    return jnp.mean((h @ params["out"] - batch.targets) ** 2)


def train_step(params: dict[str, Any], opt_state: Any, batch: Batch) -> tuple[Any, Any, Any]:
    """One AdamW step: new params, new optimizer state, the loss."""
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


class Block(nn.Module):
    """A linen MLP whose kernels carry logical axis names (nn.with_logical_partitioning, as
    MaxText's layers do) and whose hidden activation is constrained by logical names."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def part(names: tuple[str, ...]) -> Any:
            return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

        h = nn.Dense(
            32,
            kernel_init=part(("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )(x)
        h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
        h = nn.Dense(16, kernel_init=part(("mlp", "embed")))(h)
        return nn.Dense(24, kernel_init=part(("embed", "vocab")))(h)


def init_block(key: jax.Array) -> Any:
    """The block's variables, partition boxes included (what model.init returns)."""
    return Block().init(key, jnp.zeros((4, 16)))


def forward(variables: Any, x: jax.Array) -> jax.Array:
    return Block().apply(variables, x)
