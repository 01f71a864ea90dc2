"""Equinox modules in arguments: arrays traced, everything else static.

``eqx.filter_jit`` traces the JAX and NumPy arrays of its arguments and closes over the rest
(Python numbers, functions, strings). ``eqx.is_array`` is False for a ``jax.ShapeDtypeStruct``,
so partitioning an abstract module (from ``eqx.filter_eval_shape``) with it would make every
weight static; jaxaot treats a ShapeDtypeStruct as the array it stands for.
"""

from __future__ import annotations

import sys
from typing import Any


def is_module(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)
