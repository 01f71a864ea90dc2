"""The transformer of :mod:`jaxaot.examples.transformer` as a large model is trained: each
block rematerialized (``jax.checkpoint``) in the backward pass.

Same parameters, same loss, same SGD step; only what the step keeps alive differs. Without
remat the backward pass holds every layer's attention scores and MLP activations at once
(``L x [B, heads, T, T]`` and more), which for an 8B-class model at sequence length 2048 is
hundreds of GiB per device; with it, one block's worth plus each layer's input. This is the
program ``experiment=decoder_8b`` compiles for TPU pod slices (``conf/experiment/decoder_8b.yaml``).
"""

from __future__ import annotations

from typing import Any

import jax
from jaxaot.examples import transformer
from jaxaot.examples.transformer import Params


def forward(params: Params, tokens: jax.Array) -> jax.Array:
    """Logits ``[B, T, vocab]``; each block is recomputed in the backward pass."""
    return transformer.forward(params, tokens, remat=True)


def loss(params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32; ``targets`` are int32 ``[B, T]``."""
    return transformer.loss(params, tokens, targets, remat=True)


def train_step(
    params: Params, tokens: jax.Array, targets: jax.Array, lr: float | Any = 1e-2
) -> tuple[Params, jax.Array]:
    """One plain SGD step with rematerialized blocks; returns ``(new_params, loss)``."""
    return transformer.train_step(params, tokens, targets, lr, remat=True)


__all__ = ["forward", "loss", "train_step"]
