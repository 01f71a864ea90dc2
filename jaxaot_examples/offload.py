"""A training step that can keep activations, parameters and optimizer state in host memory.

The MLP's layers are stacked and applied by ``lax.scan``; each layer is a ``jax.checkpoint``
with the policy ``remat`` names (:data:`POLICIES`): ``offload`` saves each layer's
pre-activation (``checkpoint_name(..., "act")``) to pinned host memory for the backward pass
(``save_and_offload_only_these_names``, MaxText's ``offload`` remat policy), ``save`` keeps it
on the device, ``recompute`` saves nothing and recomputes it.

``train_step`` is written for device memory, as a model usually is: with
``lower.in_memory_kinds={params/**: pinned_host, opt_state/**: pinned_host}`` the parameters
and the momentum (the optimizer state) live in host memory between steps, and jaxaot moves them
to device memory at the step's entry (and ``lower.out_memory_kinds`` puts the updated ones it
returns back on the host). Plain JAX needs the move written in the program:
``moved_train_step`` is the same step so written (``jax.device_put(..., jax.memory.Space.Device)``;
under jaxaot it moves values already in device memory, which copies nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Params = Mapping[str, jax.Array]

POLICIES: dict[str, Any] = {
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["act"],
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "save": jax.checkpoint_policies.save_only_these_names("act"),
    "recompute": jax.checkpoint_policies.nothing_saveable,
}


def _layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
    pre = checkpoint_name(h @ w, "act")
    return jnp.sin(pre) + h, None


def loss(params: Params, x: jax.Array, y: jax.Array, remat: str = "offload") -> jax.Array:
    """Mean squared error of the residual sin-MLP (``params["layers"]``: [L, d, d]) then a
    [d, d_out] readout, each layer checkpointed with the policy ``remat``."""
    if remat not in POLICIES:
        raise ValueError(f"remat: expected one of {', '.join(POLICIES)}, found {remat!r}")
    layer = jax.checkpoint(_layer, policy=POLICIES[remat])
    h, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean(jnp.square(h @ params["out"] - y))


def train_step(
    params: Params,
    opt_state: Params,
    x: jax.Array,
    y: jax.Array,
    lr: float = 0.01,
    remat: str = "offload",
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """One SGD-with-momentum step: (loss, new params, new momentum)."""
    value, grads = jax.value_and_grad(loss)(params, x, y, remat)
    mu = jax.tree.map(lambda m, g: 0.9 * m + g, dict(opt_state), dict(grads))
    new = jax.tree.map(lambda p, m: p - lr * m, dict(params), mu)
    return value, new, mu


def moved_train_step(
    params: Params,
    opt_state: Params,
    x: jax.Array,
    y: jax.Array,
    lr: float = 0.01,
    remat: str = "offload",
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """``train_step`` with the parameters and momentum moved to device memory first, as plain
    ``jax.jit`` needs it when they are passed in host memory."""
    params = jax.device_put(params, jax.memory.Space.Device)
    opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
    return train_step(params, opt_state, x, y, lr, remat)
