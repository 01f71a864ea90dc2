"""Programs for tests/test_roofline.py (targets ``roofline_programs:<name>``; ``tests/`` is on
``sys.path`` in-process)."""

from __future__ import annotations

import jax


def scaled_loop(x: jax.Array) -> jax.Array:
    """2000 elementwise passes over ``x``: every byte XLA counts is re-read from the caches."""
    return jax.lax.fori_loop(0, 2000, lambda i, y: y * 1.0001 + 1, x)
