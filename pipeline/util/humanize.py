"""Numbers for people: sizes, counts, durations, and XLA's "unknown" sentinels."""

from __future__ import annotations

import re
from typing import Any

from jaxaot.errors import ConfigError

NOT_AVAILABLE = "n/a"


def measured(n: float | None) -> float | None:
    """A cost or memory figure, or None for XLA's "unknown" sentinels (``flops: -2``, any
    negative value): counts, sizes and rates are never negative."""
    return None if n is None or n < 0 else n


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    if n < 0:
        return NOT_AVAILABLE
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def signed_bytes(n: float | None) -> str:
    """A size that may be negative (a headroom where the program does not fit): ``-4.0 GiB``."""
    if isinstance(n, int | float) and n < 0:
        return "-" + human_bytes(-n)
    return human_bytes(n)


def json_number(value: Any) -> float | int | None:
    """``value`` when it is a JSON number (an int or float, not a bool), else None: a figure
    read from a file, whose type is not trusted."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def human_count(n: float | None, unit: str = "") -> str:
    if n is None:
        return "-"
    if n < 0:  # XLA's sentinel for a figure it could not compute
        return f"{unit} {NOT_AVAILABLE}".strip()
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".strip()


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """``"2GB"`` -> 2_000_000_000; units B, KB, MB, GB, TB (1000) and KiB, MiB, GiB, TiB (1024)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"invalid size {text!r}: expected a number with an optional unit "
            "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, e.g. '2GB' or '512MiB'"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


__all__ = [
    "NOT_AVAILABLE",
    "human_bytes",
    "human_count",
    "human_seconds",
    "json_number",
    "measured",
    "parse_size",
    "signed_bytes",
]
