"""Let the C heap keep big freed buffers for reuse (glibc), once a program needs it.

A program that closes over a large array has it embedded in its module, and lowering copies
it a dozen times over: the module's bytecode for XLA, XLA's HLO and its proto, jax.export's
second lowering, its copy and its portable artifact, the flatbuffer. glibc serves every
allocation over its mmap threshold (at most 32 MiB) with fresh pages from the kernel and
unmaps them at free, so each copy of a 51 MB constant first faults in 51 MB of zeroed pages:
measured, about a third of the lower stage. Raising the mmap and trim thresholds lets such
buffers come from the heap and be reused. Nothing a program computes changes; the process
just keeps freed memory (up to a few copies of the constants) while lowering, and returns it
after: used for constants of :data:`WORTH_BYTES` to :data:`MAX_BYTES`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers up to this size come from the heap, and this much freed memory may stay with it.
LIMIT = 1 << 30
# Programs whose embedded constants come to less than this are left alone: glibc's own
# adaptive threshold already reuses buffers up to 32 MiB.
WORTH_BYTES = 32 << 20
# ... and so are those with more than this: the heap keeps a few freed copies of the constants
# (peak memory +~3x their size, measured +~150 MB for 51 MB), which bigger ones cannot afford.
MAX_BYTES = 256 << 20

# glibc's own values, put back afterwards: the adaptive mmap threshold's ceiling, and the
# default trim threshold.
_MMAP_DEFAULT = 32 << 20
_TRIM_DEFAULT = 128 << 10

_active = False  # tuned now, by an enclosing reusing_big_buffers()


def _libc() -> Any:
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        return ctypes.CDLL("libc.so.6")
    except (ValueError, OSError, AttributeError):  # not Linux, or another C library
        return None


def _set(libc: Any, mmap: int, trim: int) -> bool:
    try:
        mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, mmap) == 1
        return bool(mmap_set and libc.mallopt(_M_TRIM_THRESHOLD, trim) == 1)
    except AttributeError:
        return False


def worth_it(constant_bytes: int) -> bool:
    """Whether a module embedding this many bytes of constants lowers with the heap tuned."""
    return WORTH_BYTES <= constant_bytes <= MAX_BYTES


@contextlib.contextmanager
def reusing_big_buffers(enabled: bool = True) -> Iterator[bool]:
    """Inside, glibc keeps freed buffers up to :data:`LIMIT` for reuse; on leaving, its own
    thresholds are back and the kept memory is returned (``malloc_trim``), so later stages'
    peak memory is what it was. Yields whether the heap is tuned (False: not asked, or not
    glibc: macOS, musl)."""
    global _active
    if _active or not enabled:
        yield _active
        return
    libc = _libc()
    _active = libc is not None and _set(libc, LIMIT, LIMIT)
    try:
        yield _active
    finally:
        if _active:
            _active = False
            _set(libc, _MMAP_DEFAULT, _TRIM_DEFAULT)
            with contextlib.suppress(AttributeError):
                libc.malloc_trim(0)


__all__ = ["LIMIT", "MAX_BYTES", "WORTH_BYTES", "reusing_big_buffers", "worth_it"]
