"""Dtype names and sizes: the spellings an array type accepts, bits per element, exact byte
sizes, and the largest array XLA can represent."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from jaxaot.errors import ArgSpecError

# Canonical dtype names (numpy / ml_dtypes spelling) that JAX supports.
DTYPES: tuple[str, ...] = (
    "bool",
    "int2",
    "int4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint2",
    "uint4",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float4_e2m1fn",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


def short_name(dtype: str) -> str:
    """JAX's short spelling of a dtype name (``float32`` -> ``f32``, ``bfloat16`` -> ``bf16``)."""
    return (
        dtype.replace("float", "f").replace("uint", "u").replace("int", "i").replace("complex", "c")
    )


_ALIASES: dict[str, str] = {short_name(d): d for d in DTYPES} | {d: d for d in DTYPES}
_ALIASES |= {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64"}
SIXTY_FOUR_BIT = frozenset({"int64", "uint64", "float64", "complex128"})

# The largest element count and byte size XLA can represent: shapes are int64 and a larger
# array aborts the process (SIGABRT in XLA's shape checks) instead of raising.
MAX_ARRAY_BYTES = 2**63 - 1


def canonical_dtype(name: str, where: str) -> str:
    """The canonical name of a dtype spelled long (``float32``), short (``f32``) or as XLA
    prints it (``pred``, ``s32``); an unknown one is refused naming ``where``."""
    try:
        return _ALIASES[str(name).strip().lower()]
    except KeyError:
        raise ArgSpecError(
            f"{where}: unknown dtype {name!r}; expected one of "
            f"{', '.join(short_name(d) for d in DTYPES)} (or the long numpy names)"
        ) from None


def dtype_bits(dtype: str) -> int:
    """Bits per element of a canonical dtype name (``bool`` and ``float8_*`` take 8)."""
    if dtype == "bool" or dtype.startswith("float8"):
        return 8
    if dtype.startswith("float4"):
        return 4
    m = re.search(r"(\d+)$", dtype)
    assert m is not None, dtype
    return int(m.group(1))


def nbytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (sub-byte types rounded up), exactly."""
    return (math.prod(shape) * dtype_bits(dtype) + 7) // 8
