"""The fit verdict of a topology compile, decided in one place (:func:`verdict`).

Whatever says what a program needs per device (XLA's memory analysis of a compile it
accepted, or XLA's own refusal, ``RESOURCE_EXHAUSTED``, of one it did not), the verdict is made
here, and the run's status, exit code, manifest, summary and report all read it:

- **device memory**: needed <= available, where available = the device's capacity less a
  reserve (``compile.hbm_reserve``: bytes, or a fraction of the capacity). The capacity is what
  a program can have at most: on TPU, XLA's own per-device limit (the table's usable HBM, which
  already excludes what the runtime keeps); on NVIDIA GPUs, the device memory. The platform's
  default reserve is 0 on TPU, and on GPUs the 25% JAX's GPU client leaves unallocated by
  default (``XLA_PYTHON_CLIENT_MEM_FRACTION=0.75``: set ``compile.hbm_reserve=0.1`` for a job
  that runs with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.9``).
- **host memory**: buffers XLA placed in host memory (``pinned_host``/``unpinned_host``
  arguments and outputs, activations a ``jax.checkpoint`` policy offloads) counted apart from
  the device's, against the host memory per device (``compile.host_memory_bytes``, or the
  target table's host RAM per host / devices per host).
- a program XLA **refused** never fits: it needs what XLA says it needed, at least the limit
  plus the amount XLA says it was exceeded by, and at least one byte more than available (XLA
  prints sizes rounded: ``Used 15.75G of 15.75G hbm`` is a refusal).

fits = the device fits and the host fits; the message says which did not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxaot.errors import ConfigError, DoesNotFit
from jaxaot.targets.tpu import Target, resolve
from jaxaot.util.humanize import parse_size

# XLA's wording (libtpu 0.0.42): "Ran out of memory on HBM, the total memory required for HLO
# temporaries (34.53G) exceeds available HBM (15.75G)." (sizes in GiB, printed as "G").
_HBM_REJECT = re.compile(r"\(([\d.]+)([KMGT]?)\)\s*exceeds available HBM\s*\(([\d.]+)([KMGT]?)\)")
# and, from its memory-space assignment: "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: ...
# Ran out of memory in memory space hbm. Used 16.44G of 15.75G hbm. Exceeded hbm capacity by
# 709.08M."
_HBM_OOM = re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm")
_EXCEEDED = re.compile(r"Exceeded hbm capacity by ([\d.]+)([KMGT]?)")
_UNIT = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


@dataclass(frozen=True)
class Rejection:
    """The figures of XLA's ``RESOURCE_EXHAUSTED`` refusal, as printed (rounded)."""

    needed: int
    available: int
    exceeded_by: int | None  # "Exceeded hbm capacity by 709.08M", where XLA says it
    text: str  # the refusal, one line

    def to_json(self) -> dict[str, Any]:
        return {
            "needed": self.needed,
            "available": self.available,
            "exceeded_by": self.exceeded_by,
        }


def _size(number: str, unit: str) -> int:
    return int(float(number) * _UNIT[unit])


def parse_rejection(exc: BaseException) -> Rejection | None:
    """XLA's refusal of a program for HBM, or None for any other error."""
    text = " ".join(str(exc).split())
    m = _HBM_REJECT.search(text) or _HBM_OOM.search(text)
    if "RESOURCE_EXHAUSTED" not in text or m is None:
        return None
    over = _EXCEEDED.search(text)
    return Rejection(
        needed=_size(m[1], m[2]),
        available=_size(m[3], m[4]),
        exceeded_by=_size(over[1], over[2]) if over else None,
        text=text,
    )


def capacity_bytes(target: Target) -> int:
    """The most device memory a program can have on ``target``, before any reserve."""
    gen = target.generation
    return gen.hbm_bytes if gen.platform == "cuda" else gen.hbm_usable_bytes


def reserve_bytes(target: Target, setting: Any = None) -> tuple[int, str]:
    """(bytes kept back per device, where that figure comes from) for ``compile.hbm_reserve``
    (``setting``: bytes, a fraction of the capacity, or None for the platform's default)."""
    cap = capacity_bytes(target)
    if setting is None:
        # GPUs: the table's usable memory is what JAX's GPU client takes by default (75%,
        # XLA_PYTHON_CLIENT_MEM_FRACTION=0.75); TPUs: XLA's limit, with nothing more kept back.
        reserve = cap - target.generation.hbm_usable_bytes
        if target.generation.platform == "cuda":
            return reserve, "platform default: JAX's GPU client takes 75% of the GPU's memory"
        return reserve, "platform default: none beyond XLA's own limit"
    if isinstance(setting, float) and setting < 1:
        return round(cap * setting), f"compile.hbm_reserve={setting}"
    # bytes (1e9 reads as 10**9 too), or a size such as "2GiB"
    return parse_size(setting if isinstance(setting, str) else int(setting)), (
        f"compile.hbm_reserve={setting}"
    )


def host_capacity_bytes(target: Target, setting: int | None = None) -> int | None:
    """Host memory per device: ``compile.host_memory_bytes``, or the table's host RAM per host
    over the devices of a host (None where the table has no figure)."""
    if setting is not None:
        return int(setting)
    gen = target.generation
    return gen.host_memory_bytes // gen.chips_per_host if gen.host_memory_bytes else None


def needed_bytes(memory: Mapping[str, int]) -> int:
    """Device memory one device holds while the step runs: arguments, outputs, temporaries and
    code, less the outputs that alias (donated) arguments. XLA's own compile-time check (which
    it words "HLO temporaries", though it counts arguments too) rejects most programs past the
    HBM first; this is the same sum from its memory analysis, to report headroom."""
    return _held(memory, "")


def host_needed_bytes(memory: Mapping[str, int]) -> int:
    """Host memory one device's program holds: the same sum over XLA's ``host_*`` figures."""
    return _held(memory, "host_")


def _held(memory: Mapping[str, int], prefix: str) -> int:
    plus = ("argument", "output", "temp", "generated_code")
    held = sum(memory.get(f"{prefix}{k}_size_in_bytes", 0) for k in plus)
    return held - memory.get(f"{prefix}alias_size_in_bytes", 0)


def verdict(
    target: Target,
    cfg: Any = None,
    *,
    memory: Mapping[str, int] | None = None,
    rejection: Rejection | None = None,
) -> dict[str, Any]:
    """THE fit verdict: from XLA's memory analysis (``memory``) of an accepted compile, or from
    its ``rejection``. ``cfg`` is the compile section (its ``hbm_reserve`` and
    ``host_memory_bytes``; None: the platform's defaults)."""
    if (memory is None) == (rejection is None):
        raise ValueError("verdict: give exactly one of memory (accepted) or rejection (refused)")
    reserve, reserve_source = reserve_bytes(target, getattr(cfg, "hbm_reserve", None))
    available = capacity_bytes(target) - reserve
    host_available = host_capacity_bytes(target, getattr(cfg, "host_memory_bytes", None))
    host_needed: int | None = None
    if rejection is not None:
        # XLA's limit is available + reserve; what it printed is rounded, in either direction.
        over = rejection.available + (rejection.exceeded_by or 0)
        needed = max(rejection.needed, over, available + 1)
        hbm_fits, host_fits = False, None
    else:
        assert memory is not None
        needed, host_needed = needed_bytes(memory), host_needed_bytes(memory)
        hbm_fits = needed <= available
        if host_needed == 0:
            host_fits = True
        else:  # None: no figure to check against (a table row without host memory)
            host_fits = None if host_available is None else host_needed <= host_available
    fits = hbm_fits and host_fits is not False
    fit: dict[str, Any] = {
        "topology": target.topology,
        "generation": target.generation.name,
        "devices": target.devices,
        "fits": fits,
        "hbm_fits": hbm_fits,
        "hbm_bytes_needed": needed,
        "hbm_bytes_available": available,
        "hbm_reserve_bytes": reserve,
        "hbm_reserve": reserve_source,
        "headroom_bytes": available - needed,
        "headroom_fraction": round((available - needed) / available, 6) if available else None,
        "host_bytes_needed": host_needed,
        "host_bytes_available": host_available,
        "host_fits": host_fits,
        # memory_analysis (argument+output+temp+code-alias) or xla (refused)
        "source": "xla" if rejection is not None else "memory_analysis",
    }
    if rejection is not None:
        fit["xla"] = rejection.to_json()
    return fit


def figures(needed: float, available: float, unit: int = 1024**3) -> tuple[str, str]:
    """``needed`` and ``available`` in ``unit`` with as many decimals as it takes for the two
    printed numbers to compare as the bytes do (15.75 vs 15.75 only when equal): from one
    decimal for needed and two for available."""
    for extra in range(8):
        a, b = f"{needed / unit:.{1 + extra}f}", f"{available / unit:.{2 + extra}f}"
        if (float(a) > float(b)) == (needed > available) and (float(a) == float(b)) == (
            needed == available
        ):
            return a, b
    return str(needed), str(available)


def unit_of(n: float) -> tuple[int, str]:
    """The binary unit ``n`` reads best in: (bytes per unit, name)."""
    for scale, name in ((1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "B"


def pair_figures(needed: float, available: float) -> tuple[str, str]:
    """Needed and available with their units, as the verdict prints them: in the unit of
    ``available`` with the decimals that keep their order, or a need of a smaller unit in its
    own (``8.7 MiB`` beside ``15.75 GiB``: far from the limit)."""
    scale, name = unit_of(max(available, 1))
    own, own_name = unit_of(needed)
    if own != scale:  # far apart (a need far below the limit, or far above a small one)
        need = f"{needed} B" if own == 1 else f"{needed / own:.1f} {own_name}"
        have = f"{available} B" if scale == 1 else f"{available / scale:.2f} {name}"
        return need, have
    a, b = figures(needed, available, scale)
    return f"{a} {name}", f"{b} {name}"


def pair_text(needed: float, available: float) -> str:
    """``15.8 GiB of 15.75 GiB``: :func:`pair_figures` in one line."""
    need, have = pair_figures(needed, available)
    return f"{need} of {have}"


def message(fit: Mapping[str, Any]) -> str:
    """The one line a verdict that does not fit ends the run with: what did not fit."""
    where = f"({fit['generation']}, {fit['topology']})"
    hbm = f"needs {pair_text(fit['hbm_bytes_needed'], fit['hbm_bytes_available'])} per device"
    host = (
        f"{pair_text(fit['host_bytes_needed'], fit['host_bytes_available'] or 0)} of host memory"
        if fit.get("host_fits") is False
        else ""
    )
    if not fit["hbm_fits"] and host:
        return f"does not fit: {hbm}, and {host} {where}"
    if host:
        return f"does not fit in host memory: needs {host} per device {where}"
    return f"does not fit: {hbm} {where}"


def metrics(fit: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict's report/summary columns."""
    return {k: fit.get(k) for k in FIT_METRICS}


# The verdict's flat columns (stage metrics, report columns).
FIT_METRICS: tuple[str, ...] = (
    "fits",
    "hbm_fits",
    "hbm_bytes_needed",
    "hbm_bytes_available",
    "headroom_bytes",
    "hbm_reserve_bytes",
    "host_bytes_needed",
    "host_bytes_available",
    "host_fits",
)


def does_not_fit(fit: dict[str, Any], extra: Mapping[str, Any] | None = None) -> DoesNotFit:
    """The :class:`DoesNotFit` of a verdict that does not fit (``extra``: more stage metrics)."""
    return DoesNotFit(
        message(fit), fit, {"topology": fit["topology"], **metrics(fit), **(extra or {})}
    )


# Below this a whole-number reserve is taken for a unit left out (hbm_reserve=2 meant as 2 GiB).
_SMALLEST_RESERVE = 1 << 20


def _check_reserve(reserve: Any) -> None:
    """``compile.hbm_reserve``: a fraction, a byte count (0, or at least 1 MiB) or a size string."""
    expected = (
        "a fraction of the device's memory (0 <= f < 1, e.g. 0.1), a size (e.g. 2GiB, 512MB), "
        "bytes per device (0 or >= 1048576), or null for the platform's own"
    )
    if isinstance(reserve, str):
        try:
            parse_size(reserve)
        except ConfigError:
            raise ConfigError(
                f"compile.hbm_reserve: expected {expected}, found {reserve!r}"
            ) from None
        return
    whole = isinstance(reserve, int) and not isinstance(reserve, bool) and reserve >= 0
    whole = whole or (isinstance(reserve, float) and reserve >= 1 and reserve.is_integer())
    if not whole and not (isinstance(reserve, float) and 0 <= reserve < 1):
        raise ConfigError(f"compile.hbm_reserve: expected {expected}, found {reserve!r}")
    if whole and 0 < reserve < _SMALLEST_RESERVE:
        n = int(reserve)
        fraction = f" or compile.hbm_reserve={n / 100:g} ({n}%)" if n < 100 else ""
        raise ConfigError(
            f"compile.hbm_reserve={n} keeps back {n} byte(s) per device, surely not what was "
            f"meant; expected {expected}. Fix: compile.hbm_reserve={n}GiB{fraction}"
        )


def check_memory_keys(comp: Any) -> None:
    """``compile.hbm_reserve``, ``compile.host_memory_bytes`` and ``compile.memory_top`` (the
    compile section ``comp``), before JAX: one line naming the key for a bad value."""
    top = comp.memory_top
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ConfigError(
            f"compile.memory_top: expected the number of buffers to list, an int >= 1, found "
            f"{top!r}; e.g. compile.memory_top=10"
        )
    reserve, host = comp.hbm_reserve, comp.host_memory_bytes
    if reserve is not None:
        _check_reserve(reserve)
    if host is not None and (isinstance(host, bool) or not isinstance(host, int) or host < 1):
        raise ConfigError(
            f"compile.host_memory_bytes: expected host memory per device in bytes (an int >= 1, "
            f"e.g. 48000000000), or null for the target's table, found {host!r}"
        )
    if not comp.topology:
        for key, value in (("hbm_reserve", reserve), ("host_memory_bytes", host)):
            if value is not None:
                raise ConfigError(
                    f"compile.{key}={value} needs compile.topology (the fit verdict is a "
                    f"topology compile's), found none; e.g. compile.topology=v5e:4x4"
                )
        return
    target = resolve(comp.topology, comp.num_slices)
    kept, _ = reserve_bytes(target, reserve)
    if kept >= capacity_bytes(target):
        raise ConfigError(
            f"compile.hbm_reserve={reserve}: keeps back {kept} bytes of the "
            f"{capacity_bytes(target)} a {target.generation.name} device has; expected less"
        )


__all__ = [
    "FIT_METRICS",
    "Rejection",
    "capacity_bytes",
    "check_memory_keys",
    "does_not_fit",
    "figures",
    "host_capacity_bytes",
    "host_needed_bytes",
    "message",
    "metrics",
    "needed_bytes",
    "pair_figures",
    "pair_text",
    "parse_rejection",
    "reserve_bytes",
    "verdict",
]
