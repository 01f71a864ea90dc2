"""Custom calls a serialized executable needs, made callable before it is deserialized.

jaxlib registers its LAPACK FFI handlers when jax is imported, but loads the LAPACK kernels
they call only when a program using them is *lowered* in the process
(``jaxlib.lapack.prepare_lapack_call`` -> ``_lapack.initialize()``). An executable with
``lapack_*`` custom calls deserialized in a process that lowered nothing (``resume_from=...
start_at=execute``, or ``start_at=compile`` with a store hit) then calls null kernels: SIGSEGV,
no message. The GPU "hybrid" kernels (``cuhybrid_*``, ``hiphybrid_*``) are
initialized lazily the same way.

:func:`prepare` reads the custom-call targets from the executable's optimized HLO (written by
the same compile, hash-verified with it), runs the initializers those targets need, and refuses
with :class:`ColdLoadError` a cold load of a target nobody here can vouch for (neither jaxlib's
nor one of JAX's export-stable targets nor one of XLA's own): the caller then compiles from
``exported.bin`` instead, with a warning, rather than call into a handler that may be missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import ColdLoadError
from jaxaot.stages.jaxenv import platform_of

_TARGET = re.compile(rb'custom_call_target="([^"]+)"')

# XLA's own custom calls (partitioner markers, host offloading, dynamic shapes, oneDNN/cuBLAS
# rewrites, which start with "__"): XLA implements them, nothing is registered from Python.
_XLA_BUILTIN = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "MoveToHost",
        "MoveToDevice",
        "SliceToDynamic",
        "PadToStatic",
        "AllocateBuffer",
        "LayoutConstraint",
        "PinToDevice",
        "annotate_device_placement",
        "dce_sink",
        "TopK",
        "cu_threefry2x32_ffi",
    }
)


def targets_of(hlo_text: bytes | str | None) -> frozenset[str]:
    """The custom-call targets named in an (optimized) HLO text."""
    if not hlo_text:
        return frozenset()
    data = hlo_text.encode() if isinstance(hlo_text, str) else hlo_text
    if b"custom_call_target" not in data:  # the common case, and fast on big modules
        return frozenset()
    return frozenset(m.decode() for m in _TARGET.findall(data))


# (target prefix, platforms, initializer): what jaxlib initializes lazily at lowering time.
_LAZY: tuple[tuple[str, tuple[str, ...], Callable[[], None]], ...] = (
    ("lapack_", ("cpu",), compat_jax.init_lapack),
    ("cuhybrid_", ("cuda", "gpu"), compat_jax.init_hybrid_kernels),
    ("hiphybrid_", ("rocm", "gpu"), compat_jax.init_hybrid_kernels),
)


def _vouched() -> frozenset[str]:
    """Targets that are registered whenever jax is imported (jaxlib's) or that JAX promises to
    keep working across processes and versions (jax.export's stable set)."""
    names: set[str] = set(_XLA_BUILTIN)
    names |= compat_jax.stable_custom_call_targets()  # empty where the list moved
    names |= compat_jax.registered_custom_call_targets()
    return frozenset(names)


_VOUCHED: frozenset[str] | None = None


def prepare(hlo_text: bytes | str | None, backend: str, lowered: Any, source: str) -> None:
    """Initialize what the executable's custom calls need, before it is deserialized.

    A cold load (``lowered.state`` "loaded" or "concrete": the module came from an export, nothing was
    lowered in this process) of a target that the program's own code would have registered (a
    user's FFI library) raises :class:`ColdLoadError` naming it.
    """
    global _VOUCHED
    targets = targets_of(hlo_text)
    if not targets:
        return
    platform, cold = platform_of(backend), lowered.state in ("loaded", "concrete")
    for prefix, platforms, init in _LAZY:
        if platform in platforms and any(t.startswith(prefix) for t in targets):
            init()
    if not cold:
        return
    if _VOUCHED is None:
        _VOUCHED = _vouched()
    unknown = sorted(t for t in targets if t not in _VOUCHED and not t.startswith("__"))
    if unknown:
        raise ColdLoadError(
            f"{source}: the executable calls custom call target(s) {unknown} that this process "
            "did not register (nothing was lowered here); not loading it cold"
        )


__all__ = ["prepare", "targets_of"]
