"""Example JAX programs that ship with jaxaot.

Each module holds plain JAX functions that a ``conf/program/*.yaml`` names by import path
(``jaxaot.examples.axpy:axpy``); they double as fixtures for the engine's tests, so they
cover the shapes of work the pipeline must handle: scalars, pytrees of weights, ``lax.scan``,
gradients, mixed precision and named-axis collectives.
"""

from __future__ import annotations

from jaxaot.examples.axpy import axpy
from jaxaot.examples.collectives import mean_max, psum_minus, ring_shift, row_col_all
from jaxaot.examples.mlp import mlp, mlp_loss
from jaxaot.examples.transformer import forward, loss, train_step

__all__ = [
    "axpy",
    "forward",
    "loss",
    "mean_max",
    "mlp",
    "mlp_loss",
    "psum_minus",
    "ring_shift",
    "row_col_all",
    "train_step",
]
