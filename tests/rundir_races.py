"""What each spawned process of tests/test_rundir.py's races runs: importing this module (as a
spawned child does, to find its target) imports only jaxaot's run-dir resolver, not the test
module, its conftest or pytest's plugins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxaot.errors import ConfigError
from jaxaot.rundir.dirs import claim, unique_dir


def race_unique_dir(base: str, barrier: Any, queue: Any) -> None:
    """Wait for every racer, then ask for a new directory at ``base``; put what it got."""
    barrier.wait()
    queue.put(unique_dir(base))


def race_claim(run_dir: str, n: int, barrier: Any, queue: Any) -> None:
    """Wait for every racer, then claim ``run_dir`` with manifest ``{"n": n}``; put ``n`` when
    the claim won, None when it was refused."""
    barrier.wait()
    try:
        claim(Path(run_dir), {"n": n}, key="run_dir")
        queue.put(n)
    except ConfigError:
        queue.put(None)
