"""``execute.roofline=true``: the run against its device's roofline (issue 18, item 5).

Arithmetic intensity (XLA's FLOPs per byte accessed, from the compile's cost analysis with
while loops counted per trip: :mod:`jaxaot.stages.loop_costs`),
achieved FLOP/s and bytes/s (from the timed calls) and where that sits under the roof:
``min(peak FLOP/s, intensity x peak bytes/s)``. The peaks of a device that is here are
*calibrated*: measured on it (a large matmul for FLOP/s, a large elementwise pass for bytes/s),
once per process and device; a TPU topology's come from the published table
(``jaxaot.targets.tpu``, in the compile stage's estimate).
"""

from __future__ import annotations

import functools
import time
from typing import Any

# Calibration sizes: big enough to leave the caches and fill the cores, small enough to take
# well under a second on a laptop CPU (a 2048^3 matmul is 17 GFLOP; 64 MiB in, 64 MiB out).
MATMUL_N = 2048
STREAM_ELEMENTS = 16 * 1024 * 1024
ROUNDS = 5


@functools.cache
def calibrate(platform: str, device_kind: str, device_count: int) -> dict[str, Any]:
    """Peak FLOP/s and bytes/s measured on the default device (best of :data:`ROUNDS`)."""
    import jax
    import jax.numpy as jnp

    def best(fn: Any, *args: Any) -> float:
        jax.block_until_ready(fn(*args))  # compile and warm up
        times = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return min(times)

    a = jnp.ones((MATMUL_N, MATMUL_N), jnp.float32)
    matmul_s = best(jax.jit(lambda x: x @ x), a)
    x = jnp.ones((STREAM_ELEMENTS,), jnp.float32)
    stream_s = best(jax.jit(lambda v: v * 2.0 + 1.0), x)
    return {
        "source": f"calibrated here: {MATMUL_N}^3 f32 matmul, {STREAM_ELEMENTS * 4 >> 20} MiB "
        "elementwise pass, best of 5",
        "platform": platform,
        "device_kind": device_kind,
        "device_count": device_count,
        "peak_flops": 2.0 * MATMUL_N**3 / matmul_s,
        "peak_bytes_per_s": 2.0 * STREAM_ELEMENTS * 4 / stream_s,
    }


def analyse(
    cost: dict[str, float] | None, median_s: float, peaks: dict[str, Any]
) -> dict[str, Any]:
    """Where a run sits under the roof; figures XLA could not give (its -2) stay None."""
    flops = (cost or {}).get("flops")
    moved = (cost or {}).get("bytes accessed")
    flops = flops if flops is not None and flops > 0 else None
    moved = moved if moved is not None and moved > 0 else None
    peak_f, peak_b = peaks["peak_flops"], peaks["peak_bytes_per_s"]
    out: dict[str, Any] = {
        **peaks,
        "ridge_flops_per_byte": peak_f / peak_b,
        "flops": flops,
        "bytes_accessed": moved,
        # XLA's own figures (loop bodies counted once); the ones above count loops per trip.
        "flops_xla": (cost or {}).get("flops_xla"),
        "bytes_accessed_xla": (cost or {}).get("bytes accessed_xla"),
        "median_s": median_s,
        "achieved_flops_per_s": flops / median_s if flops else None,
        "achieved_bytes_per_s": moved / median_s if moved else None,
        "intensity": flops / moved if flops and moved else None,
    }
    if out["intensity"] is not None:
        roof = min(peak_f, out["intensity"] * peak_b)
        out["roof_flops_per_s"] = roof
        out["fraction_of_roof"] = out["achieved_flops_per_s"] / roof
        out["bound"] = "compute" if out["intensity"] >= out["ridge_flops_per_byte"] else "memory"
    return out


__all__ = ["analyse", "calibrate"]
