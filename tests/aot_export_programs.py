"""Programs for tests/test_aot_export.py (platform names, donation across platforms, jax.export
safety checks).

Not a test module: importable as ``aot_export_programs:<name>`` (``tests/`` is on sys.path).
"""

from __future__ import annotations

import jax
from jax.lax import linalg


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """Two same-shaped inputs, one output: the first can be donated into it."""
    return x + y


def singular_values(x: jax.Array) -> jax.Array:
    """SVD by QR iteration: on CPU the custom call ``lapack_sgesvd_ffi``, which jax.export
    (jax 0.10.2) does not list as stable, so it refuses to serialize it unless told."""
    return linalg.svd(x, full_matrices=False, compute_uv=False, algorithm=linalg.SvdAlgorithm.QR)


def shifted(x: jax.Array, *, a: jax.Array) -> jax.Array:
    """A traced keyword argument the same shape as the output: it can be donated into it."""
    return x + a
