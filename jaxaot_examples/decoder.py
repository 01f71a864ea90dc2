"""The transformer of :mod:`jaxaot_examples.transformer` as a large model is trained: each
block rematerialized (``jax.checkpoint``) in the backward pass.

Same parameters, same loss, same SGD step; only what the step keeps alive differs. Without
remat the backward pass holds every layer's attention scores and MLP activations at once
(``L x [B, heads, T, T]`` and more), which for an 8B-class model at sequence length 2048 is
hundreds of GiB per device; with it, one block's worth plus each layer's input. This is the
program ``experiment=decoder_8b`` compiles for TPU pod slices (issue 15).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .transformer import Params, _block, _rms_norm


def forward(params: Params, tokens: jax.Array) -> jax.Array:
    """Logits ``[B, T, vocab]``; each block is recomputed in the backward pass."""
    x = jnp.take(params["embed"], tokens, axis=0)
    block = jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable)
    x, _ = jax.lax.scan(block, x, params["layers"])
    return _rms_norm(x, params["ln_f"]) @ params["unembed"]


def loss(params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32; ``targets`` are int32 ``[B, T]``."""
    logp = jax.nn.log_softmax(forward(params, tokens).astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)
    return -jnp.mean(picked)


def train_step(
    params: Params, tokens: jax.Array, targets: jax.Array, lr: float | Any = 1e-2
) -> tuple[Params, jax.Array]:
    """One plain SGD step with rematerialized blocks; returns ``(new_params, loss)``."""
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    new_params = jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)
    return new_params, value


__all__ = ["forward", "loss", "train_step"]
