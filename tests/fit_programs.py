"""Programs for tests/test_fit_search.py (importable as ``fit_programs:<name>`` with tests/ on
the path, or ``tests.fit_programs:<name>`` from the repository root), and task functions for
the probe process's own tests.

``head`` needs what its argument is; ``scale`` twice that; ``twice`` more and more work: bf16[n, 1048576] is 2 MiB per n, so on v5e's 15.75 GiB
n <= 7168 fits. ``crash_from`` kills its own process with SIGSEGV while tracing once n reaches
12288, as a compiler that segfaults on large shapes does.
"""

from __future__ import annotations

import os
import signal
from typing import Any

CRASH_FROM = 12288


def head(x: Any) -> Any:
    """No temporaries: what it needs is its argument."""
    return x[:8]


def scale(x: Any) -> Any:
    """Its argument and an output as large: 2x the argument, little work per byte."""
    return x * 2


def twice(x: Any) -> Any:
    """Its argument and a doubled copy of it: more memory per n than ``head``, more work."""
    import jax.numpy as jnp

    return jnp.concatenate([x, x + x], axis=0)[::7]


def crash_from(x: Any) -> Any:
    """``head``, but a native crash (SIGSEGV) while tracing when n >= CRASH_FROM."""
    if x.shape[0] >= CRASH_FROM:
        os.kill(os.getpid(), signal.SIGSEGV)
    return x[:8]


def segv_task(cfg: Any) -> int:
    """A task function that dies of SIGSEGV."""
    os.kill(os.getpid(), signal.SIGSEGV)
    return 0


def sleeping_task(cfg: Any) -> int:
    """A task function that takes a minute (a hung compile)."""
    import time

    time.sleep(60)
    return 0


def raising_task(cfg: Any) -> int:
    """A task function that raises."""
    raise ValueError(f"no good: {cfg.get('value')}")


def returning_task(cfg: Any) -> int:
    """A task function that returns what its config says, in the child process."""
    return int(cfg["value"]) + os.getpid() * 0
