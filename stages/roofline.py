"""``execute.roofline=true``: the run against its device's roofline.

Arithmetic intensity (XLA's FLOPs per byte accessed, from the compile's cost analysis with
while loops counted per trip: :mod:`jaxaot.stages.loop_costs`),
achieved FLOP/s and bytes/s (from the timed calls) and where that sits under the roof:
``min(peak FLOP/s, intensity x peak bytes/s)``. The peaks of a device that is here are
*calibrated*: measured on it (f32 matmuls for FLOP/s, in-place streaming passes at sizes from
the caches to main memory for bytes/s, best of a few calls each) and cached per machine in
``$XDG_CACHE_HOME/jaxaot/roofline/<key>.json`` (:func:`calibration_key`: host, CPU, device
kind and count, jax/jaxlib, the XLA flags), so only the first run on a machine pays for them.
A TPU topology's come from the published table (``jaxaot.targets.tpu``, in the compile
stage's estimate).

A measured rate is one the device reaches, so a calibration can only be too low (a machine busy
while it ran, a program faster than its kernels): a run above its roof recalibrates (the cached
peaks only ever rise), and one still above is reported at 100% with a warning
(:data:`ABOVE_PEAK`), never as more than the roof. A peak that a recalibration measured again
without raising it is *settled* (the cache file's ``settled``): no later run recalibrates for it.

The bandwidth roof holds for working sets of the sizes streamed (``STREAM_SIZES``, 1 MiB and
up). A memory-bound program whose working set (XLA's argument + output + temp bytes, less the
outputs aliasing arguments) is smaller runs from the caches nearer the cores, which no
calibrated stream measured: above its roof it is reported at 100% with :data:`CACHE_RESIDENT`
instead, and nothing is measured again (no calibration at these sizes would bound it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform as _platform
import socket
import time
import warnings
from pathlib import Path
from typing import Any

from jaxaot.util.fsio import atomic_write_json, key_of
from jaxaot.util.humanize import human_bytes, human_count
from jaxaot.util.store_root import make_private_dirs, user_cache_dir

log = logging.getLogger("jaxaot.roofline")

# Bumped when the measurement changes, so that no cached calibration of another method is used.
CALIBRATION_VERSION = 2
# Matmul sizes, tried in order until one call takes MATMUL_MIN_S (a faster device gets a
# bigger one, so that the call is not dominated by its dispatch).
MATMUL_SIZES = (1024, 2048, 4096)
MATMUL_MIN_S = 0.005
# Streaming passes (x * 2 + 1, in place: the output buffer is the donated input, so no call
# pays for faulting in fresh pages): f32 elements, 1 MiB, 8 MiB and 64 MiB; the peak is the
# best of them, as XLA's "bytes accessed" counts every byte, from a cache or not.
STREAM_SIZES = (1 << 18, 1 << 21, 1 << 24)
# Timed calls per measurement: as many as fit in MEASURE_S, within these bounds.
MIN_ROUNDS, MAX_ROUNDS, MEASURE_S = 3, 20, 0.05
# A recalibration raising a peak by no more than this fraction leaves it settled (timing noise).
RAISE_NOISE = 0.05
# XLA_FLAGS that only say where XLA writes files change no code: left out of the key.
_OUTPUT_ONLY_FLAGS = ("--xla_dump",)
ABOVE_PEAK = (
    "roofline: achieved {achieved} is {ratio:.0%} of the roof {roof}: above the calibrated peak "
    "({peaks}): calibration too low (a machine busy while calibrating?); reported as 100% of "
    "roof. The next run above it calibrates again and keeps the higher peaks ({path})"
)
SETTLED_ABOVE_PEAK = (
    "roofline: achieved {achieved} is {ratio:.0%} of the roof {roof}: above the calibrated peak "
    "({peaks}), which a recalibration on this machine did not raise: the program is faster "
    "than the calibration kernels; reported as 100% of roof ({path})"
)
CACHE_RESIDENT = (
    "roofline: working set {working_set} is cache-resident (bandwidth calibrated on streams of "
    "{smallest} and up): the memory roof {roof} does not bound it; achieved {achieved} is "
    "{ratio:.0%} of that roof, reported as 100%"
)

_memo: dict[str, dict[str, Any]] = {}


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return _platform.processor() or _platform.machine()


def _codegen_flags() -> list[str]:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return sorted(f for f in flags if not f.startswith(_OUTPUT_ONLY_FLAGS))


def calibration_key(platform: str, device_kind: str, device_count: int) -> dict[str, Any]:
    """What a calibration holds for: the machine, the device and how many there are, the JAX
    build and the XLA flags (every one but where dumps go)."""
    import jax
    import jaxlib

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 0
    return {
        "version": CALIBRATION_VERSION,
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpus": cpus,
        "platform": platform,
        "device_kind": device_kind,
        "device_count": device_count,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": _codegen_flags(),
    }


def cache_path(key: dict[str, Any]) -> Path:
    """Where the calibration for ``key`` is cached."""
    return user_cache_dir() / "roofline" / f"{key_of(key)[:16]}.json"


def _read_cached(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached peaks at ``path`` if they are for ``key`` and usable, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    for name in ("peak_flops", "peak_bytes_per_s"):
        value = data.get(name)
        if not isinstance(value, (int, float)) or not value > 0:
            return None
    return data


def smallest_stream_bytes() -> int:
    """The smallest working set the bandwidth peak was measured on (one in-place f32 stream)."""
    return min(STREAM_SIZES) * 4


def _best_seconds(call: Any) -> float:
    """The fastest of a few calls of ``call()`` (which blocks), after one untimed call."""
    call()
    times: list[float] = []
    t_end = time.perf_counter() + MEASURE_S
    while len(times) < MAX_ROUNDS and (len(times) < MIN_ROUNDS or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(backend: str | None = None) -> dict[str, Any]:
    """Peak FLOP/s and bytes/s measured now on the first device of ``backend``."""
    import jax
    import numpy as np

    # Inputs built by numpy and copied over: jnp.zeros would compile a kernel for each size.
    dev = jax.devices(backend)[0]
    matmul = jax.jit(lambda a, b: a @ b)
    flops: dict[str, float] = {}
    for n in MATMUL_SIZES:
        a = jax.device_put(np.full((n, n), 0.5, np.float32), dev)
        s = _best_seconds(lambda a=a: jax.block_until_ready(matmul(a, a)))
        flops[str(n)] = 2.0 * n**3 / s
        if s >= MATMUL_MIN_S:
            break
    stream = jax.jit(lambda v: v * 2.0 + 1.0, donate_argnums=0)
    bandwidth: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a backend that cannot donate copies; still a pass
        for n in STREAM_SIZES:
            box = [jax.device_put(np.zeros((n,), np.float32), dev)]

            def one(box: list[Any] = box) -> None:
                box[0] = jax.block_until_ready(stream(box[0]))

            bandwidth[f"{n * 4 >> 20} MiB"] = 2.0 * n * 4 / _best_seconds(one)
    return {
        "peak_flops": max(flops.values()),
        "peak_bytes_per_s": max(bandwidth.values()),
        "flops_by_matmul": flops,
        "bytes_per_s_by_size": bandwidth,
    }


def calibrate(
    platform: str,
    device_kind: str,
    device_count: int,
    backend: str | None = None,
    *,
    recalibrate: bool = False,
) -> dict[str, Any]:
    """The peaks of ``backend``'s devices: from this process's memo or the per-machine cache,
    else measured (:func:`measure`) and cached. ``recalibrate`` measures again and keeps, per
    peak, the higher of the new and the cached figure."""
    key = calibration_key(platform, device_kind, device_count)
    digest = key_of(key)
    path = cache_path(key)
    cached = _read_cached(path, key)
    if not recalibrate:
        if digest in _memo:
            return _memo[digest]
        if cached is not None:
            _memo[digest] = {**cached, "calibration_s": 0.0, "cached": True}
            return _memo[digest]
    t0 = time.perf_counter()
    peaks = measure(backend)
    took = time.perf_counter() - t0
    settled: list[str] = []
    if cached is not None:
        for name in ("peak_flops", "peak_bytes_per_s"):
            if peaks[name] <= cached[name] * (1 + RAISE_NOISE):
                settled.append(name)  # measured again, not raised: timing noise at most
            peaks[name] = max(peaks[name], cached[name])
    record = {
        "source": f"calibrated here: f32 matmul ({', '.join(peaks['flops_by_matmul'])}), "
        f"in-place streaming ({', '.join(peaks['bytes_per_s_by_size'])}), best of a few calls",
        "platform": platform,
        "device_kind": device_kind,
        "device_count": device_count,
        **peaks,
        "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "measure_s": round(took, 4),
        "settled": settled,
        "cache_file": str(path),
        "key": key,
    }
    try:
        make_private_dirs(path.parent)
        atomic_write_json(path, record)
    except OSError as exc:  # an unwritable cache costs the next run a calibration, nothing else
        log.warning("roofline: calibration not cached (%s)", exc)
    _memo[digest] = {**record, "calibration_s": round(took, 4), "cached": False}
    return _memo[digest]


def _rate(value: float, unit: str) -> str:
    return f"{human_bytes(value)}/s" if unit == "B" else human_count(value, unit)


def working_set_bytes(memory: dict[str, Any] | None) -> int | None:
    """The bytes a call touches at once: XLA's argument + output + temp sizes, less the outputs
    that alias arguments (donated buffers counted once); None when XLA gave none of them."""
    memory = memory or {}
    parts = [
        memory.get(k)
        for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    ]
    if not any(isinstance(p, int | float) and p >= 0 for p in parts):
        return None
    alias = memory.get("alias_size_in_bytes")
    total = sum(p for p in parts if isinstance(p, int | float) and p > 0)
    return int(total - (alias if isinstance(alias, int | float) and alias > 0 else 0))


def bounding_peak(roof: dict[str, Any]) -> str | None:
    """The peak that sets ``roof``'s roof: ``peak_flops`` (compute-bound) or
    ``peak_bytes_per_s`` (memory-bound); None without an intensity."""
    if "bound" not in roof:
        return None
    return "peak_flops" if roof["bound"] == "compute" else "peak_bytes_per_s"


def analyse(
    cost: dict[str, float] | None,
    median_s: float,
    peaks: dict[str, Any],
    working_set: int | None = None,
) -> dict[str, Any]:
    """Where a run sits under the roof; figures XLA could not give (its -2) stay None. A run
    above its roof has ``fraction_of_roof`` 1.0, the measured ratio in
    ``measured_fraction_of_roof`` and ``above_calibrated_peak`` with the warning's text: a
    memory-bound one whose ``working_set`` (bytes, :func:`working_set_bytes`) is below the
    smallest stream calibrated is ``cache_resident`` (:data:`CACHE_RESIDENT`); one whose
    bounding peak a recalibration did not raise (``peaks["settled"]``) says so
    (:data:`SETTLED_ABOVE_PEAK`); any other, :data:`ABOVE_PEAK`."""
    flops = (cost or {}).get("flops")
    moved = (cost or {}).get("bytes accessed")
    flops = flops if flops is not None and flops > 0 else None
    moved = moved if moved is not None and moved > 0 else None
    peak_f, peak_b = peaks["peak_flops"], peaks["peak_bytes_per_s"]
    out: dict[str, Any] = {
        **{k: v for k, v in peaks.items() if k != "key"},
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
        "working_set_bytes": working_set,
        "smallest_stream_bytes": smallest_stream_bytes(),
    }
    if out["intensity"] is not None:
        roof = min(peak_f, out["intensity"] * peak_b)
        ratio = out["achieved_flops_per_s"] / roof
        out["roof_flops_per_s"] = roof
        out["measured_fraction_of_roof"] = ratio
        out["fraction_of_roof"] = min(ratio, 1.0)
        out["bound"] = "compute" if out["intensity"] >= out["ridge_flops_per_byte"] else "memory"
        out["cache_resident"] = (
            out["bound"] == "memory"
            and working_set is not None
            and working_set < out["smallest_stream_bytes"]
        )
        if ratio > 1.0:
            achieved, shown = _rate(out["achieved_flops_per_s"], "FLOP/s"), _rate(roof, "FLOP/s")
            if out["cache_resident"]:
                out["above_calibrated_peak"] = CACHE_RESIDENT.format(
                    working_set=human_bytes(working_set or 0),
                    smallest=human_bytes(out["smallest_stream_bytes"]),
                    roof=shown,
                    achieved=achieved,
                    ratio=ratio,
                )
            else:
                text = (
                    SETTLED_ABOVE_PEAK
                    if bounding_peak(out) in peaks.get("settled", ())
                    else ABOVE_PEAK
                )
                out["above_calibrated_peak"] = text.format(
                    achieved=achieved,
                    ratio=ratio,
                    roof=shown,
                    peaks=f"{_rate(peak_f, 'FLOP/s')}, {_rate(peak_b, 'B')}",
                    path=peaks.get("cache_file", "the calibration cache"),
                )
    return out


__all__ = [
    "ABOVE_PEAK",
    "CACHE_RESIDENT",
    "SETTLED_ABOVE_PEAK",
    "analyse",
    "bounding_peak",
    "cache_path",
    "calibrate",
    "calibration_key",
    "measure",
    "smallest_stream_bytes",
    "working_set_bytes",
]
