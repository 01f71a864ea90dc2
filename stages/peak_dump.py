"""What is live at the peak of a topology compile, from XLA's dump of it.

jaxlib 0.10.2 gives a deviceless TPU compile no buffer assignment
(``memory_analysis().serialized_buffer_assignment_proto`` is empty); XLA's dump of the compile
has it (``*after_optimizations-buffer-assignment.txt``), also for a program XLA refuses for HBM:
XLA writes it before it checks the limit. Every topology compile dumps into a folder of its own
(:func:`folder_for`), read by :mod:`jaxaot.stages.memory_breakdown` and removed; the compile key
never sees the dump options.

The executable records its compile options, the dump folder included (jaxlib 0.10.2), so the
folder is named by what is compiled, not at random: the same compile serializes to the same
bytes in every run on a host (``executable.bin`` equal with the store on and off).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxaot.errors import DoesNotFit, one_line
from jaxaot.stages.contract import StageContext
from jaxaot.util.fsio import flock_file, sha256_bytes

log = logging.getLogger("jaxaot")

ROOT = "jaxaot-peak"  # under the temporary directory, one folder per user (root())
# A compile's breakdown (or None) by its executable, from the compile job until run() writes it.
_FOUND: weakref.WeakKeyDictionary[Any, dict[str, Any] | None] = weakref.WeakKeyDictionary()


def folder_for(
    module_sha256: str, topology: str, num_slices: int, live: bool, options: dict[str, Any]
) -> Path:
    """The dump folder of one compile: named by the module, the target and the options."""
    what: list[Any] = [module_sha256, topology, num_slices, live]
    what += [[k, repr(options[k])] for k in sorted(options)]
    name = sha256_bytes(json.dumps(what).encode())[:24]
    return root() / name


def root() -> Path:
    """This user's dump folders (another user's on a shared host are not writable here); the
    same path run to run, since the executable records it."""
    user = os.getuid() if hasattr(os, "getuid") else getpass.getuser()
    return Path(tempfile.gettempdir()) / f"{ROOT}-{user}"


def options(folder: Path) -> dict[str, Any]:
    """The compile options that dump the buffer assignment into ``folder``."""
    from jaxaot.stages import memory_breakdown

    return memory_breakdown.dump_options(folder)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """``folder``, emptied, to one compile at a time (processes of a sweep may compile the same
    program; one lock file per 256th of the names), and removed after."""
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Where no lock can be had (no fcntl, a file system without locks) the compile goes on
    # unlocked: the folder is still this compile's.
    with flock_file(folder.parent / "locks" / f"{folder.name[:2]}.lock"):
        shutil.rmtree(folder, ignore_errors=True)
        try:
            yield
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def read(folder: Path, compiled: Any, top: int) -> dict[str, Any] | None:
    """memory_breakdown.json's content from the dump in ``folder`` (``compiled``: the
    executable, or for a refused program the lowering, which names its arguments; the HLO is
    the dump's own optimized module text);
    None where there is none or it cannot be read (logged: the compile and its verdict stand
    without it)."""
    from jaxaot.stages import memory_breakdown

    hlo = sorted(folder.glob("*after_optimizations.txt"))
    try:
        text = hlo[-1].read_text(errors="replace") if hlo else ""
        return memory_breakdown.from_dump(folder, text, compiled, top)
    except Exception as exc:
        log.warning("[compile] no memory breakdown from XLA's dump: %s", one_line(exc))
        log.debug("the dump could not be read", exc_info=True)
        return None


def compile_reading(
    folder: Path, base: dict[str, Any], compile_with: Callable[[dict[str, Any]], Any], top: int
) -> Any:
    """``compile_with(base + the options that dump into folder)``, its breakdown read and kept for
    :func:`record`. Where XLA wrote no dump, JAX served an identical compile of this process
    from its own cache (one lowering, compiled again with the same options: a sweep's job with
    the store off): the same compile runs again into a folder of its own, only for the dump;
    the executable stays the one served."""
    from jaxaot.stages import memory_breakdown

    with locked(folder):
        compiled = compile_with(base | options(folder))
        if memory_breakdown.dump_file(folder) is not None:
            keep(compiled, read(folder, compiled, top))
            return compiled
    again = folder.with_name(f"{folder.name}-{uuid.uuid4().hex[:12]}")
    with locked(again):
        compile_with(base | options(again))
        keep(compiled, read(again, compiled, top))
    return compiled


def keep(compiled: Any, breakdown: dict[str, Any] | None) -> None:
    """Hold ``breakdown`` for :func:`record` (the compile may run ahead, on another thread)."""
    _FOUND[compiled] = breakdown


def record(ctx: StageContext, compiled: Any) -> None:
    """memory_breakdown.json and its metrics for the executable's compile, unless the
    executable's own buffer assignment gave one already (``write_analysis``)."""
    from jaxaot.stages import memory_breakdown

    found = _FOUND.pop(compiled, None)
    if found is not None and memory_breakdown.ARTIFACT not in ctx.artifacts:
        memory_breakdown.write(ctx, found)


def attach(refused: DoesNotFit, breakdown: dict[str, Any] | None) -> None:
    """A refused program's breakdown on its verdict: the stage's metrics (the top buffers in
    the summary and the report) and ``refused.breakdown``."""
    from jaxaot.stages import memory_breakdown

    refused.breakdown = breakdown
    if breakdown:
        refused.metrics.update(memory_breakdown.metrics(breakdown))


__all__ = [
    "ROOT",
    "attach",
    "compile_reading",
    "folder_for",
    "keep",
    "locked",
    "options",
    "read",
    "record",
]
