"""A program whose optimized HLO and memory differ between XLA's effort levels on TPU
(tests/test_effort.py): importable as a program target without pytest's conftest."""

from __future__ import annotations

from typing import Any


def layers(x: Any, w: Any) -> Any:
    """Three residual tanh layers and a sum: at O0/O1 XLA keeps a temporary O2/O3 fuses away
    (libtpu 0.0.42, v5e)."""
    import jax.numpy as jnp

    for _ in range(3):
        x = jnp.tanh(x @ w) * 2 + x
    return x.sum()
