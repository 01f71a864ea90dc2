"""The host CPU XLA:CPU compiles for, as /proc/cpuinfo names it.

XLA:CPU targets the host's CPU (LLVM's host CPU name and features, e.g. znver3 with
+avx2,+fma in the executable), so an executable from another CPU can use instructions this one
lacks or round differently (FMA). The compile key (:mod:`jaxaot.stages.xla_inputs`) and the run
manifest's ``environment.host_cpu`` hold this identity; ``jaxaot-store export-jax-cache``
compares them with it (JAX's own key has no host CPU)."""

from __future__ import annotations

import functools
from typing import Any

_CPU_FIELDS = (
    "vendor_id",
    "cpu family",
    "model",
    "flags",
    "CPU implementer",
    "CPU architecture",
    "CPU variant",
    "CPU part",
    "Features",
    "isa",
)


@functools.cache
def host_cpu() -> dict[str, Any]:
    """The CPU's identity and feature list: the machine, and the first processor's fields of
    /proc/cpuinfo that name the CPU and its features (feature lists sorted) where there is
    one, else the machine and :func:`platform.processor`."""
    import platform

    info: dict[str, Any] = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            first = fh.read().split("\n\n", 1)[0]
    except OSError:
        return info | {"processor": platform.processor()}
    for line in first.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in _CPU_FIELDS:
            words = value.split()
            info[name] = " ".join(sorted(words) if name in ("flags", "Features") else words)
    return info


__all__ = ["host_cpu"]
