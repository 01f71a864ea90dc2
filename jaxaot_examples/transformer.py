"""A decoder-only transformer in plain ``jax.numpy``/``lax``, with no model library.

Parameters (every hyperparameter, the number of heads included, is read from the shapes)::

    {"embed": [vocab, d_model],
     "layers": {"ln1": [L, d_model],
                "wq": [L, d_model, n_heads, d_head], "wk": ..., "wv": ...,
                "wo": [L, n_heads, d_head, d_model],
                "ln2": [L, d_model],
                "w1": [L, d_model, d_ff], "w2": [L, d_ff, d_model]},
     "ln_f": [d_model],
     "unembed": [d_model, vocab]}

The layers are stacked along a leading ``L`` axis and applied with ``jax.lax.scan``, so the
lowered module holds one loop body however deep the model is. RMSNorm scales ``1 + scale``,
so the pipeline's ``zeros`` and ``normal`` initialisers both give a usable model. Attention
softmax, norms and the loss run in float32 and cast back, so bfloat16 parameters work too.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]

_EPS = 1e-6


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm over the last axis, computed in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + _EPS)
    return (y * (1 + scale.astype(jnp.float32))).astype(x.dtype)


def _attention(x: jax.Array, layer: Params) -> jax.Array:
    """Causal multi-head self-attention of ``x`` ``[B, T, d_model]``."""
    q = jnp.einsum("btd,dhk->bthk", x, layer["wq"])
    k = jnp.einsum("btd,dhk->bthk", x, layer["wk"])
    v = jnp.einsum("btd,dhk->bthk", x, layer["wv"])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
    return jnp.einsum("bqhk,hkd->bqd", out, layer["wo"])


def _block(x: jax.Array, layer: Params) -> tuple[jax.Array, None]:
    """One pre-norm residual block; the ``lax.scan`` body (carry ``x``, no per-step output)."""
    x = x + _attention(_rms_norm(x, layer["ln1"]), layer)
    h = jax.nn.gelu(_rms_norm(x, layer["ln2"]) @ layer["w1"])
    return x + h @ layer["w2"], None


def forward(params: Params, tokens: jax.Array, *, remat: bool = False) -> jax.Array:
    """Logits ``[B, T, vocab]`` (in the parameter dtype) for int32 ``tokens`` ``[B, T]``;
    ``remat`` recomputes each block in the backward pass (:mod:`jaxaot.examples.decoder`)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    block = (
        jax.checkpoint(_block, policy=jax.checkpoint_policies.nothing_saveable) if remat else _block
    )
    x, _ = jax.lax.scan(block, x, params["layers"])
    return _rms_norm(x, params["ln_f"]) @ params["unembed"]


def loss(
    params: Params, tokens: jax.Array, targets: jax.Array, *, remat: bool = False
) -> jax.Array:
    """Mean next-token cross-entropy in float32; ``targets`` are int32 ``[B, T]``."""
    logits = forward(params, tokens, remat=remat)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)
    return -jnp.mean(picked)


def train_step(
    params: Params,
    tokens: jax.Array,
    targets: jax.Array,
    lr: float | jax.Array = 1e-2,
    *,
    remat: bool = False,
) -> tuple[Params, jax.Array]:
    """One plain SGD step; returns ``(new_params, loss)`` with every leaf's dtype kept."""
    value, grads = jax.value_and_grad(functools.partial(loss, remat=remat))(params, tokens, targets)
    new_params = jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)
    return new_params, value
