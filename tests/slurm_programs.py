"""Programs for the SLURM tests (targets ``slurm_programs:<name>``; tests/ is on the jobs'
PYTHONPATH there).

Not a test module.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax

# Unrolled steps: tracing and lowering take well under a second, XLA:CPU's compile a few
# seconds (~4 s on one busy core), which is the window the preemption test signals the job in.
SLOW_STEPS = 1000


def slow_compile(x: jax.Array) -> jax.Array:
    """Cheap to trace, lower and run; slow to compile (a long unrolled elementwise chain).

    Each step uses ``x`` once: a step that used it twice would let XLA's fusion recompute the
    chain exponentially (the executable then runs for minutes).
    """

    def step(i: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x * 1.0001 + 0.5)[::-1]

    return lax.fori_loop(0, SLOW_STEPS, step, x, unroll=True)


def sleepy(x: jax.Array) -> jax.Array:
    """Sleeps 20 s while tracing (no CPU): a job that is still running when it is cancelled."""
    time.sleep(20)
    return 2 * x
