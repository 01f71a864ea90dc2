"""Process-level JAX set-up that must happen before a backend starts, and backend facts.

Device counts and x64 are process-global in JAX. jaxaot sets them per run: for the CPU
backend the virtual device count (``jax_num_cpu_devices``) can only change before the backend
initializes, so when a later run in the same process (a sweep job under the basic launcher)
needs another count, the backends are cleared and started again.
"""

from __future__ import annotations

import logging
from typing import Any

from . import memo
from .errors import BackendError

log = logging.getLogger("jaxaot")

_PLATFORM_OF_BACKEND = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


def platform_of(backend: str) -> str:
    """The lowering platform for a compile backend (``gpu`` lowers for ``cuda``)."""
    return _PLATFORM_OF_BACKEND[backend]


def configure(*, backend: str, num_devices: int | None, x64: bool) -> None:
    """Apply process-wide JAX settings for one run; call before any JAX computation."""
    import jax
    from jax.extend import backend as jex_backend

    from .cuda_targets import quiet_plugin_discovery

    quiet_plugin_discovery()  # the CUDA plugin on a host without a GPU (jaxaot[cuda-aot])
    if bool(jax.config.jax_enable_x64) != x64:  # type: ignore[attr-defined]
        jax.config.update("jax_enable_x64", x64)
    if backend != "cpu" or num_devices is None:
        return
    current = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined]
    if current == num_devices:
        return
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
        # Already initialized with another count (an earlier run in this process).
        jex_backend.clear_backends()
        memo.clear()  # executables of the old client, and lowerings JAX no longer caches
        jax.config.update("jax_num_cpu_devices", num_devices)
    log.debug("using %d virtual CPU devices", num_devices)


def devices(backend: str) -> list[Any]:
    """The devices of ``backend``, or a BackendError that says how to lower for it instead."""
    import contextlib

    import jax

    from .accelerators import quiet_libtpu

    # With libtpu installed (jaxaot[tpu]) a host without TPUs gets its start-up noise on
    # stderr when the tpu backend is tried (issue 15).
    quiet = quiet_libtpu() if backend == "tpu" else contextlib.nullcontext()
    try:
        with quiet:
            return list(jax.devices(backend))
    except RuntimeError as exc:
        present = sorted({d.platform for d in jax.devices()})
        raise BackendError(
            f"compile.backend={backend!r}: no {backend} backend on this machine (present: "
            f"{', '.join(present)}); to prepare a program for it, lower only: "
            f"lower.platforms=[{platform_of(backend)}] stop_after=lower, then resume on the "
            f"target machine with start_at=compile ({str(exc).splitlines()[0]})"
        ) from None


def target_info(topology: str, num_slices: int = 1) -> dict[str, Any]:
    """:func:`backend_info` for ``compile.topology``: libtpu's compile-only devices of that
    topology, with the topology name, slice count and libtpu version (issue 15)."""
    import jax

    from .accelerators import resolve, topology_info

    info = topology_info(resolve(topology, num_slices))
    return info | {"jax": jax.__version__, "jaxlib": _jaxlib_version()}


def backend_info(backend: str) -> dict[str, Any]:
    """Platform, version, device kind and count: what a compiled artifact depends on."""
    import jax
    from jax.extend import backend as jex_backend

    devs = devices(backend)
    client = jex_backend.get_backend(backend)
    return {
        "platform": client.platform,
        "platform_version": client.platform_version,
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
    }


def _jaxlib_version() -> str:
    import jaxlib

    return str(getattr(jaxlib, "__version__", "unknown"))


def versions() -> dict[str, str]:
    import platform

    import hydra
    import jax
    import numpy
    import omegaconf

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "numpy": numpy.__version__,
        "hydra": hydra.__version__,
        "omegaconf": omegaconf.__version__,
    }


__all__ = ["backend_info", "configure", "devices", "platform_of", "target_info", "versions"]
