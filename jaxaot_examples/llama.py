"""A Llama-style decoder written with Flax NNX, as a Flax user writes one: ``nnx.Embed``,
``nnx.RMSNorm``, ``nnx.Linear``, rotary position embeddings, grouped-query attention, a SwiGLU
MLP, and the blocks created with ``nnx.vmap`` and applied with ``nnx.scan`` (Flax's "scan over
layers" idiom, so the lowered module holds one block however deep the model is).

Every parameter carries logical axis names (``nnx.with_partitioning``), MaxText's vocabulary:
``vocab``, ``embed``, ``heads``, ``kv_heads``, ``mlp`` and ``layers`` (the stacked axis, added by
``nnx.vmap``'s ``transform_metadata``). ``lower.logical_axis_rules`` maps them onto mesh axes.

The model is written the default way: Flax 0.12 shards a variable created with such names at
creation ("eager sharding", on by default), which needs a mesh and rules in context. jaxaot
builds it inside ``nnx.use_eager_sharding(False)`` (``jaxaot.models.nnx.lazy_sharding``), where
the names stay metadata for its ``lower.logical_axis_rules``; in Python, do the same (or set a
mesh and ``nn.logical_axis_rules``) to create it outside jaxaot.

The programs: :func:`forward` (logits) and :func:`train_step` (AdamW through
``nnx.Optimizer``: loss, gradients and the in-place update of model and optimizer), plain
functions of NNX objects, the way ``nnx.jit`` takes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

LAYERS = "layers"  # logical name of the stacked-layers axis


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters; dtypes by name (``"bfloat16"``) so the config prints and compares as text."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    param_dtype: str = "float32"  # what the parameters are stored in
    dtype: str = "float32"  # what the matmuls run in
    remat: bool = False  # recompute each block in the backward pass (jax.checkpoint)

    @classmethod
    def toy(cls, **overrides: Any) -> LlamaConfig:
        """~0.1 M parameters: 2 layers, d_model 64, 4 query heads over 2 key/value heads."""
        base = cls(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128)
        return dataclasses.replace(base, **overrides)

    @classmethod
    def llama3_8b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 3 8B's shapes (8.03 B parameters), bfloat16, each block rematerialized."""
        base = cls(
            vocab=128_256,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_head=128,
            d_ff=14_336,
            param_dtype="bfloat16",
            dtype="bfloat16",
            remat=True,
        )
        return dataclasses.replace(base, **overrides)

    def num_params(self) -> int:
        attn = self.d_model * self.d_head * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * self.d_model * self.d_ff + 2 * self.d_model
        return self.n_layers * block + 2 * self.vocab * self.d_model + self.d_model


def _init(base: Any, *names: str | None) -> Any:
    return nnx.with_partitioning(base, names)


def _dense(
    cfg: LlamaConfig, din: int, dout: int, names: tuple[str, str], rngs: nnx.Rngs
) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=False,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=_init(nnx.initializers.lecun_normal(), *names),
        rngs=rngs,
    )


def _norm(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        cfg.d_model,
        epsilon=cfg.norm_eps,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        scale_init=_init(nnx.initializers.ones_init(), "embed"),
        rngs=rngs,
    )


def rope(positions: jax.Array, d_head: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` ``[T, d_head // 2]`` of the rotary embedding at ``positions`` (float32)."""
    freqs = theta ** (-jnp.arange(0, d_head, 2, dtype=jnp.float32) / d_head)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[B, T, heads, d_head]`` by position (the rotate-half form Llama uses)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query attention: ``n_heads`` queries share ``n_kv_heads`` keys/values."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.n_heads, self.n_kv_heads, self.d_head = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        d, q, kv = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        self.wq = _dense(cfg, d, q, ("embed", "heads"), rngs)
        self.wk = _dense(cfg, d, kv, ("embed", "kv_heads"), rngs)
        self.wv = _dense(cfg, d, kv, ("embed", "kv_heads"), rngs)
        self.wo = _dense(cfg, q, d, ("heads", "embed"), rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        groups = self.n_heads // self.n_kv_heads
        q = apply_rope(self.wq(x).reshape(b, t, self.n_heads, self.d_head), cos, sin)
        k = apply_rope(self.wk(x).reshape(b, t, self.n_kv_heads, self.d_head), cos, sin)
        v = self.wv(x).reshape(b, t, self.n_kv_heads, self.d_head)
        q = q.reshape(b, t, self.n_kv_heads, groups, self.d_head)
        scores = jnp.einsum("btngk,bsnk->bngts", q, k).astype(jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(self.d_head))
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bngts,bsnk->btngk", probs, v)
        return self.wo(out.reshape(b, t, self.n_heads * self.d_head))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.gate = _dense(cfg, cfg.d_model, cfg.d_ff, ("embed", "mlp"), rngs)
        self.up = _dense(cfg, cfg.d_model, cfg.d_ff, ("embed", "mlp"), rngs)
        self.down = _dense(cfg, cfg.d_ff, cfg.d_model, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm residual block: attention, then the MLP."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        cfg = self.config = config
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.d_model,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=_init(nnx.initializers.normal(1.0), "vocab", "embed"),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def create_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.layers = create_blocks(rngs)
        self.norm = _norm(cfg, rngs)
        self.lm_head = _dense(cfg, cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        cos, sin = rope(jnp.arange(tokens.shape[1]), cfg.d_head, cfg.rope_theta)
        apply = nnx.remat(Block.__call__) if cfg.remat else Block.__call__

        @nnx.scan(
            in_axes=(nnx.Carry, 0, None, None),
            out_axes=nnx.Carry,
            transform_metadata={nnx.PARTITION_NAME: LAYERS},
        )
        def blocks(x: jax.Array, block: Block, cos: jax.Array, sin: jax.Array) -> jax.Array:
            return apply(block, x, cos, sin)

        x = blocks(self.embed(tokens), self.layers, cos, sin)
        return self.lm_head(self.norm(x))


def forward(model: Llama, tokens: jax.Array) -> jax.Array:
    """Logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]``."""
    return model(tokens)


def loss(model: Llama, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, in float32."""
    logits = model(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(
    model: Llama, optimizer: nnx.Optimizer, tokens: jax.Array, targets: jax.Array
) -> jax.Array:
    """One optimizer step on ``(tokens, targets)``; updates ``model`` and ``optimizer`` in
    place (as under ``nnx.jit``) and returns the loss before the step."""
    value, grads = nnx.value_and_grad(loss)(model, tokens, targets)
    optimizer.update(model, grads)
    return value


__all__ = [
    "MLP",
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "apply_rope",
    "forward",
    "loss",
    "rope",
    "train_step",
]
