"""Memory: how much this process may use, and the check that a run's inputs fit in it before
any JAX work."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from jaxaot.config.argspec.binding import BoundArgs
from jaxaot.config.argspec.dtypes import nbytes
from jaxaot.config.argspec.trees import specs
from jaxaot.errors import ArgSpecError


def human_size(n: int) -> str:
    """A byte count in binary units (``1.5 GiB``), as the errors and the argument table write it."""
    for unit, scale in (
        ("EiB", 2**60),
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def memory_bytes() -> int | None:
    """Memory this process may use: the machine's, or a smaller cgroup (container) limit."""
    limits: list[int] = []
    with contextlib.suppress(AttributeError, ValueError, OSError):
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(OSError):
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():  # "max" when unlimited
            limits.append(int(text))
    return min(limits) if limits else None


def check_inputs_fit(bound: BoundArgs, memory: int | None = None) -> None:
    """Refuse, before any JAX work, inputs that cannot all be allocated to execute the program.

    The traced array arguments are built in host memory before execute runs: together they
    must fit in ``memory`` (default :func:`memory_bytes`). Compiling alone needs none of them.
    """
    memory = memory_bytes() if memory is None else memory
    if memory is None:
        return
    sizes = sorted(
        (
            (nbytes(leaf.shape, leaf.dtype), path)
            for top, tree in bound.traced_args()
            for path, leaf in specs(tree, top)
            if not leaf.symbolic
        ),
        reverse=True,
    )
    total = sum(n for n, _ in sizes)
    if total <= memory:
        return
    biggest, path = sizes[0]
    what = (
        f"{path} alone is {human_size(biggest)}"
        if biggest > memory
        else (
            f"the arguments total {human_size(total)} (the largest, {path}, {human_size(biggest)})"
        )
    )
    raise ArgSpecError(
        f"{what}, more than this machine's {human_size(memory)} of memory: executing needs the "
        "inputs in memory; expected smaller shapes, or stop_after=compile (compiling needs no "
        "input memory)"
    )
