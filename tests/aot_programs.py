"""Tiny programs the pipeline tests compile (targets ``aot_programs:<name>``).

Not a test module: ``tests/`` is on ``sys.path`` in-process (pytest's rootdir conftest), and
the CLI tests add it to ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def tree_fn(params: dict[str, Any], x: jax.Array, n: int, *, scale: Any) -> dict[str, Any]:
    """A pytree in, a pytree out, a static int ``n`` and a traced keyword."""
    y = (params["w"] @ x) * n * scale
    return {"y": y + params["b"], "total": jnp.sum(x)}


def boom(x: jax.Array) -> jax.Array:
    raise ValueError("boom while tracing")


NOT_A_FUNCTION = 3


def scaled(x: jax.Array, *, z: jax.Array) -> jax.Array:
    """A keyword argument whose buffer can be donated to the output."""
    return 2 * x + z


def noisy(x: jax.Array) -> jax.Array:
    """A host callback (jax.debug.print), which jax.export cannot serialize."""
    jax.debug.print("x = {x}", x=x)
    return 2 * x


def var_keywords(x: jax.Array, **extra: jax.Array) -> jax.Array:
    """Keyword arguments through ``**kwargs``: donate_argnames may still name them."""
    return 2 * x + sum(extra.values())


def preempted(x: jax.Array) -> jax.Array:
    """What a job system's preemption looks like from inside a run (the SLURM launcher's
    checkpoint hook, then submitit's SystemExit)."""
    from jaxaot.util import exits

    exits.note_preempted("preempted by a test")
    raise SystemExit(-1)
