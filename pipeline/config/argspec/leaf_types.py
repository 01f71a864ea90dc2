"""The parsed forms of an argument tree's parts: :class:`ArraySpec` (an abstract array and how
execute fills it), :class:`Literal`, :class:`Given` (an array given from Python),
:class:`PytreeNode` (a named container), and the symbolic dimensions an array spec may have."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from jaxaot.config import dim_expr
from jaxaot.config.argspec.dtypes import MAX_ARRAY_BYTES, canonical_dtype, nbytes, short_name
from jaxaot.errors import ArgSpecError, ConfigError

# The tagged mapping of a pytree container (PytreeNode) and its positional children.
PYTREE_KEY = "_pytree_"
PYTREE_ARGS = "_args_"

# Names in a dimension that are no variables: dim_expr's operations, and the one more that
# JAX prints (jax 0.10 writes some constraints' dimensions with non_negative(...)).
_NOT_VARIABLES = frozenset(dim_expr.OPERATIONS) | {"non_negative"}


def symbols(dim: str) -> list[str]:
    """The dimension variables of a symbolic dimension (``2*b + c`` -> ``[b, c]``), as written
    here or as JAX prints one (``floordiv(b, 2)`` -> ``[b]``)."""
    found = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", dim)
    return [v for i, v in enumerate(found) if v not in _NOT_VARIABLES and v not in found[:i]]


def eval_dim(dim: str, sizes: Mapping[str, int], where: str) -> int:
    """The value of a symbolic dimension given its variables' sizes (``compile.shapes``)."""
    missing = [v for v in symbols(dim) if v not in sizes]
    if missing:
        raise ConfigError(
            f"compile.shapes: {where} has the symbolic dimension {dim!r}; expected a size for "
            f"{', '.join(repr(m) for m in missing)} (e.g. compile.shapes={{{missing[0]}: 32}})"
        )
    try:
        return dim_expr.evaluate(dim_expr.parse(dim), sizes)
    except (dim_expr.DimSyntaxError, ZeroDivisionError) as exc:
        raise ArgSpecError(
            f"{where}: cannot evaluate the symbolic dimension {dim!r} ({exc})"
        ) from None


@dataclass(frozen=True)
class ArraySpec:
    """An abstract array argument and how execute fills it."""

    shape: tuple[Any, ...]  # ints; a str is a symbolic dimension (``b``, ``2*b``)
    dtype: str
    init: str = "normal"
    scale: float = 1.0
    low: float | None = None
    high: float | None = None
    seed: int | None = None
    path: str | None = None
    weak_type: bool = False
    # A jax.ShapeDtypeStruct's sharding, when one given from Python carries it (jaxaot.api).
    sharding: Any = field(default=None, compare=False)

    @property
    def type_str(self) -> str:
        weak = "~weak" if self.weak_type else ""
        return f"{short_name(self.dtype)}[{','.join(map(str, self.shape))}]{weak}"

    def __str__(self) -> str:
        return self.type_str

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)

    def concrete(self, sizes: Mapping[str, int], where: str) -> ArraySpec:
        """This spec with its symbolic dimensions evaluated with ``sizes`` (``compile.shapes``)."""
        if not self.symbolic:
            return self
        shape = tuple(d if isinstance(d, int) else eval_dim(d, sizes, where) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ConfigError(
                f"compile.shapes: {where} is {self.type_str}, which is "
                f"[{','.join(map(str, shape))}] at these sizes; expected sizes >= 0"
            )
        return check_size(replace(self, shape=shape), f"{where} at compile.shapes")


@dataclass(frozen=True)
class Literal:
    """A concrete value: a static argument, or a weakly typed scalar when traced."""

    value: Any


@dataclass(frozen=True, eq=False)
class Given:
    """An array given from Python as it is (jaxaot.api): traced as its shape and dtype,
    executed with its very values."""

    value: Any

    @property
    def dtype(self) -> str:
        return str(self.value.dtype)

    @property
    def type_str(self) -> str:
        return f"{short_name(self.dtype)}[{','.join(map(str, self.value.shape))}]"


def from_python(value: Any, where: str) -> ArraySpec | Given | None:
    """A ``jax.ShapeDtypeStruct`` -> the array spec it stands for (its sharding kept); an
    array (NumPy or JAX) -> :class:`Given`; anything else -> None."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")) or isinstance(value, str):
        return None
    kind = type(value).__name__
    if kind != "ShapeDtypeStruct":
        return Given(value)
    shape = tuple(value.shape)
    if not all(isinstance(d, int) for d in shape):
        raise ArgSpecError(
            f"{where}: a ShapeDtypeStruct with symbolic dimensions {shape}; write it as an "
            "array type (f32[b,512]) with stage_out.shape_constraints instead"
        )
    spec = ArraySpec(
        shape=shape,
        dtype=canonical_dtype(str(value.dtype), where),
        weak_type=bool(getattr(value, "weak_type", False)),
        sharding=getattr(value, "sharding", None),
    )
    return check_size(spec, where)


@dataclass(frozen=True)
class PytreeNode:
    """A pytree container other than list and dict, named by import path (``"tuple"`` for a
    tuple): built as ``cls(*args, **fields)`` once its children are built."""

    cls: str
    args: tuple[Any, ...] = ()
    fields: tuple[tuple[str, Any], ...] = ()

    def children(self, where: str) -> list[tuple[str, Any]]:
        """(config path, subtree) of each child, positional ones first."""
        return [(f"{where}.{PYTREE_ARGS}[{i}]", a) for i, a in enumerate(self.args)] + [
            (f"{where}.{k}", v) for k, v in self.fields
        ]

    def with_children(self, new: list[Any]) -> PytreeNode:
        n = len(self.args)
        return PytreeNode(
            self.cls,
            tuple(new[:n]),
            tuple((k, v) for (k, _), v in zip(self.fields, new[n:], strict=True)),
        )


def check_size(spec: ArraySpec, where: str) -> ArraySpec:
    """Refuse an array whose element count or byte size overflows XLA's int64 shapes."""
    if spec.symbolic:
        return spec  # checked when the sizes are known (compile.shapes)
    elements = math.prod(spec.shape)
    if elements > MAX_ARRAY_BYTES or nbytes(spec.shape, spec.dtype) > MAX_ARRAY_BYTES:
        raise ArgSpecError(
            f"{where}: {spec.type_str} has {elements:.3g} elements "
            f"({nbytes(spec.shape, spec.dtype):.3g} bytes); XLA sizes arrays in int64, so "
            f"expected at most {MAX_ARRAY_BYTES} bytes (2**63 - 1): use a smaller shape"
        )
    return spec
