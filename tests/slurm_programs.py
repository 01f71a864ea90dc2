"""Programs for the SLURM tests (targets ``slurm_programs:<name>``; tests/ is on the jobs'
PYTHONPATH there).

Not a test module.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax

# Unrolled steps: tracing and lowering take about a second, XLA:CPU's compile several: the
# window the preemption tests signal the job in (the signal lands 0.2-0.9 s after lower ends).
# Measured with jax 0.10 on 2 vCPUs: 400 steps 4.4 s alone, 10-15 s in the SLURM jobs with 4
# busy loops besides. XLA's compile time grows faster than the step count: 1000 steps took
# 29 s alone and 55-62 s in those jobs, most of the requeue test's time limit.
SLOW_STEPS = 400


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
