"""The hand-written baseline: what a user would type without jaxaot.

Trace, lower, compile, read the cost analysis, then run (1 warmup + 5 timed calls) on random
inputs — the same work the pipeline's default run does, minus checkpoints and reports.
Usage: python bench/baseline_jit.py axpy|transformer|transformer_train
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _transformer() -> tuple[object, tuple[object, ...]]:
    from jaxaot.examples.transformer import forward

    f32 = jnp.float32
    L, D, H, Dh, F, V = 2, 128, 4, 32, 512, 256
    params = {
        "embed": jax.ShapeDtypeStruct((V, D), f32),
        "layers": {
            "ln1": jax.ShapeDtypeStruct((L, D), f32),
            "wq": jax.ShapeDtypeStruct((L, D, H, Dh), f32),
            "wk": jax.ShapeDtypeStruct((L, D, H, Dh), f32),
            "wv": jax.ShapeDtypeStruct((L, D, H, Dh), f32),
            "wo": jax.ShapeDtypeStruct((L, H, Dh, D), f32),
            "ln2": jax.ShapeDtypeStruct((L, D), f32),
            "w1": jax.ShapeDtypeStruct((L, D, F), f32),
            "w2": jax.ShapeDtypeStruct((L, F, D), f32),
        },
        "ln_f": jax.ShapeDtypeStruct((D,), f32),
        "unembed": jax.ShapeDtypeStruct((D, V), f32),
    }
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    return forward, (params, tokens)


def _transformer_train() -> tuple[object, tuple[object, ...]]:
    from jaxaot.examples.transformer import train_step

    _, (params, tokens) = _transformer()
    return train_step, (params, tokens, tokens, 0.01)


def _axpy() -> tuple[object, tuple[object, ...]]:
    from jaxaot.examples.axpy import axpy

    return axpy, (3, 4)


def _concrete(x: object, rng: np.random.Generator) -> object:
    if isinstance(x, jax.ShapeDtypeStruct):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 256, x.shape), x.dtype)
        return jnp.asarray(rng.normal(0, 0.02, x.shape), x.dtype)
    return x


def main(name: str) -> None:
    programs = {"axpy": _axpy, "transformer": _transformer, "transformer_train": _transformer_train}
    fn, specs = programs[name]()
    compiled = jax.jit(fn).trace(*specs).lower().compile()  # type: ignore[arg-type]
    flops = compiled.cost_analysis()["flops"]
    rng = np.random.default_rng(0)
    args = jax.tree_util.tree_map(lambda x: _concrete(x, rng), specs)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    print(f"{name}: {flops:.0f} FLOP, median {sorted(times)[2] * 1e3:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
