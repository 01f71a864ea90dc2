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


def slow_compile_killed_saving(x: jax.Array) -> jax.Array:
    """:func:`slow_compile`, whose first attempt leaves what a job killed while submitit saved
    its result leaves (SLURM's SIGKILL can land there after ``scontrol requeue``): submitit's
    temporary result file, made by submitit's own ``temporary_save_path``, never renamed."""
    import os

    import submitit
    from submitit.core.utils import temporary_save_path

    if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
        saving = temporary_save_path(submitit.JobEnvironment().paths.result_pickle)
        saving.__enter__().touch()  # and never leaves the block, as a killed job does not
    return slow_compile(x)


def sleepy(x: jax.Array) -> jax.Array:
    """Sleeps 20 s while tracing (no CPU): a job that is still running when it is cancelled."""
    time.sleep(20)
    return 2 * x
