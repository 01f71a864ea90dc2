"""Argument specs: the leaves of ``program.args`` / ``program.kwargs``, parsed without JAX.

A leaf is one of
- an array type written the way JAX prints it: ``f32[128,512]``, ``bf16[2,8]``, ``i32[]``;
- a mapping ``{shape, dtype, init, scale, low, high, seed}`` (``init`` may be a ``.npy`` path);
- a ``.npy`` path (shape and dtype read from the file's header);
- a literal (number, bool, string, or a list/dict of them at a static position).

A dimension may be symbolic (shape polymorphism): ``f32[b,512]``, ``f32[2*b,c]``, constrained
by ``stage_out.shape_constraints`` (``["b >= 16"]``); the program lowers to one polymorphic
``jax.export`` artifact, and ``compile.shapes`` (``{b: 32}``) gives the sizes it is compiled and
executed at. A dimension is checked against the grammar ``jax.export.symbolic_shape`` reads
(pipeline/config/dim_expr.py: names, integers, ``+ - *``, ``^``, ``floordiv/mod/max/min(a, b)``)
here, so that a typo is refused naming the argument.

An array type may end in ``~weak`` (``f32[]~weak``; in a mapping ``weak_type: true``): the
argument is weakly typed, as a Python scalar is, so it takes the other operand's dtype in
promotion. ``~strong`` (``weak_type: false``) says the default: the dtype as written.

Leaves may sit in nested lists and dicts (pytrees), and in any other pytree container named by
import path with a tagged mapping (:class:`PytreeNode`)::

    {_pytree_: tuple, _args_: [f32[2], f32[3]]}        # (a, b)
    {_pytree_: mypkg.mod:Point, x: f32[4], y: f32[4]}  # Point(x=..., y=...)

The class (a NamedTuple, a dataclass registered with ``jax.tree_util``, any registered class)
is built as ``cls(*_args_, **fields)``; its import path goes through the trust policy
(pipeline/config/trust.py) like ``program.target``. As in JAX, static-ness comes from
``static_argnums``/``static_argnames``, never from the type: a literal at a non-static position
is traced as a weakly typed scalar and executed with its value.

A value may also be derived from the program's own code (``_init_``, ``_call_``, ``_ref_``,
``_key_``, ``_get_``: pipeline/config/derived.py), and from Python a ``jax.ShapeDtypeStruct``
stands for an array spec of its shape and dtype, an array for itself (:class:`Given`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.config import derived, dim_expr
from jaxaot.config.derived import DERIVED_TYPES
from jaxaot.errors import ArgSpecError, ConfigError

if TYPE_CHECKING:
    from jaxaot.schema import JaxaotConfig

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
INITS: tuple[str, ...] = ("normal", "uniform", "zeros", "ones", "arange", "file")
SPEC_KEYS = frozenset({"shape", "dtype", "init", "scale", "low", "high", "seed", "weak_type"})
# The tagged mapping of a pytree container (PytreeNode) and its positional children.
PYTREE_KEY = "_pytree_"
PYTREE_ARGS = "_args_"

# The largest element count and byte size XLA can represent: shapes are int64 and a larger
# array aborts the process (SIGABRT in XLA's shape checks) instead of raising (issue 12).
MAX_ARRAY_BYTES = 2**63 - 1

# ``dtype[dims]`` and an optional ``~suffix``; the dims are parsed by dim_expr, the suffix is
# one of SUFFIXES (anything else is refused by name rather than read as a string).
_TYPE_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*\[([^\[\]]*)\]\s*(~\s*[A-Za-z0-9_]*)?\s*$")
# The suffixes of an array type: whether it is weakly typed.
SUFFIXES: dict[str, bool] = {"weak": True, "strong": False}
# Something written like an array type (``name[dims]``) inside a longer override value, for
# quoting it before Hydra parses the line. Any name, not only known dtypes: an unknown dtype or a
# malformed shape should reach parse_type (which names it) rather than fail Hydra's grammar.
_TYPE_IN_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\[[^\[\]{}'\"=]*\](?:~[A-Za-z0-9_]*)?")
# Characters after which a value (a list item, a dict value) can start in Hydra's grammar.
_VALUE_START = frozenset("[,:{( \t")


def canonical_dtype(name: str, where: str) -> str:
    try:
        return _ALIASES[str(name).strip().lower()]
    except KeyError:
        raise ArgSpecError(
            f"{where}: unknown dtype {name!r}; expected one of "
            f"{', '.join(short_name(d) for d in DTYPES)} (or the long numpy names)"
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
        return _check_size(replace(self, shape=shape), f"{where} at compile.shapes")


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
    return _check_size(spec, where)


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


def _parse_node(value: Mapping[str, Any], where: str) -> PytreeNode:
    cls = value[PYTREE_KEY]
    if not isinstance(cls, str) or not (cls == "tuple" or ":" in cls):
        raise ArgSpecError(
            f"{where}.{PYTREE_KEY}: expected 'tuple' or a class as 'package.module:Class', "
            f"found {cls!r}"
        )
    raw_args = value.get(PYTREE_ARGS, [])
    if isinstance(raw_args, str | bytes) or not isinstance(raw_args, Sequence):
        raise ArgSpecError(
            f"{where}.{PYTREE_ARGS}: expected a list of children, found {raw_args!r}"
        )
    fields = tuple(
        (str(k), parse_leaf_or_tree(v, f"{where}.{k}"))
        for k, v in value.items()
        if k not in (PYTREE_KEY, PYTREE_ARGS)
    )
    if cls == "tuple" and fields:
        raise ArgSpecError(
            f"{where}: a tuple takes its items in {PYTREE_ARGS}: [...], found keys "
            f"{[k for k, _ in fields]}"
        )
    args = tuple(
        parse_leaf_or_tree(v, f"{where}.{PYTREE_ARGS}[{i}]") for i, v in enumerate(raw_args)
    )
    return PytreeNode(cls, args, fields)


def build(tree: Any, leaf: Any, resolve: Any) -> Any:
    """Python objects from a parsed tree: ``leaf(path, spec)`` for each leaf, and each
    PytreeNode constructed with the class ``resolve(name, path)`` returns."""

    # Leaves are visited with dict keys and container fields sorted, whatever order the config
    # listed them in: a resumed run reads its config back from the manifest (sorted JSON), and
    # seeded inputs are drawn in visiting order, so both runs must visit alike.
    def go(node: Any, where: str) -> Any:
        if isinstance(node, dict):
            done = {k: go(node[k], f"{where}.{k}") for k in sorted(node)}
            return {k: done[k] for k in node}
        if isinstance(node, list):
            return [go(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, PytreeNode):
            args = [go(a, p) for p, a in node.children(where)[: len(node.args)]]
            made = {k: go(v, f"{where}.{k}") for k, v in sorted(node.fields, key=lambda f: f[0])}
            fields = {k: made[k] for k, _ in node.fields}
            if node.cls == "tuple":
                return tuple(args)
            cls = resolve(node.cls, f"{where}.{PYTREE_KEY}")
            try:
                return cls(*args, **fields)
            except TypeError as exc:
                raise ArgSpecError(
                    f"{where}: cannot build {node.cls} from {PYTREE_ARGS}={len(args)} item(s) "
                    f"and fields {sorted(fields)} ({exc})"
                ) from None
        return leaf(where, node)

    return go(tree, "")


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


def human_size(n: int) -> str:
    for unit, scale in (
        ("EiB", 2**60),
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


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


def _dim(text: str, where: str, written: str) -> int | str:
    """One dimension of the array type ``written``: an int, or a symbolic expression (its text
    with blanks normalized, as jax.export.symbolic_shape is given it)."""
    if text.isdigit():
        return int(text)
    try:
        tree = dim_expr.parse(text)
    except dim_expr.DimSyntaxError as exc:
        raise ArgSpecError(
            f"{where}: cannot parse the dimension {text!r} of {written}: {exc}; expected "
            f"{dim_expr.GRAMMAR}"
        ) from None
    if dim_expr.variables(tree):
        return " ".join(text.split())
    size = dim_expr.evaluate(tree, {})  # JAX folds an expression of integers alike
    if size < 0:
        raise ArgSpecError(
            f"{where}: the dimension {text!r} of {written} is {size}; expected a size >= 0"
        )
    return size


def _check_size(spec: ArraySpec, where: str) -> ArraySpec:
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


def _npy_header(path: str, where: str) -> tuple[tuple[int, ...], str]:
    import numpy as np

    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    except FileNotFoundError:
        raise ArgSpecError(f"{where}: .npy file {path!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ArgSpecError(f"{where}: {path!r} is not a readable .npy file ({exc})") from None
    if dtype.hasobject:  # numpy would need to unpickle it (allow_pickle): never done here
        raise ArgSpecError(
            f"{where}: {path!r} holds Python objects (dtype {dtype}), which jaxaot never loads "
            "(no unpickling); expected a numeric array"
        )
    return tuple(int(d) for d in shape), canonical_dtype(dtype.name, f"{where}: {path!r}")


def parse_type(text: str, where: str) -> ArraySpec | None:
    """``f32[128,512]`` -> ArraySpec; None if ``text`` is not written as an array type."""
    m = _TYPE_RE.match(text)
    if not m:
        return None
    dtype = canonical_dtype(m.group(1), where)
    dims = [d.strip() for d in dim_expr.split_dims(m.group(2))] if m.group(2).strip() else []
    if "" in dims:
        raise ArgSpecError(
            f"{where}: cannot parse array type {text!r}: empty dimension; expected sizes "
            "separated by commas (f32[4,8]; f32[] for a scalar)"
        )
    suffix = "".join((m.group(3) or "").split())[1:] if m.group(3) else None
    if suffix is not None and suffix not in SUFFIXES:
        raise ArgSpecError(
            f"{where}: unknown suffix '~{suffix}' in {text!r}; expected ~weak (weakly typed, as "
            "a Python scalar) or ~strong (the default: the dtype as written), or none"
        )
    spec = ArraySpec(
        shape=tuple(_dim(d, where, repr(text.strip())) for d in dims),
        dtype=dtype,
        weak_type=SUFFIXES.get(suffix or "strong", False),
    )
    return _check_size(spec, where)


def _parse_mapping(spec: Mapping[str, Any], where: str) -> ArraySpec:
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ArgSpecError(
            f"{where}: unknown array-spec key(s) {sorted(unknown)}; expected {sorted(SPEC_KEYS)}"
        )
    init = str(spec.get("init", "normal"))
    path = None
    if init.endswith(".npy"):
        path, init = init, "file"
    elif init not in INITS or init == "file":
        raise ArgSpecError(
            f"{where}.init: expected one of {', '.join(INITS[:-1])} or a .npy path, found {init!r}"
        )
    if path is not None:
        npy_shape, dtype = _npy_header(path, f"{where}.init")
        shape: tuple[Any, ...] = npy_shape
        if "shape" in spec and tuple(spec["shape"]) != shape:
            raise ArgSpecError(
                f"{where}.shape: {list(spec['shape'])} differs from {path!r}'s shape {list(shape)}"
            )
        if "dtype" in spec:
            dtype = canonical_dtype(spec["dtype"], f"{where}.dtype")
    else:
        if "shape" not in spec:
            raise ArgSpecError(f"{where}: array spec needs 'shape' (a list of ints)")
        raw = spec["shape"]
        if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
            raise ArgSpecError(f"{where}.shape: expected a list of ints, found {raw!r}")
        if not all(
            (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or isinstance(d, str)
            for d in raw
        ):
            raise ArgSpecError(f"{where}.shape: expected non-negative ints, found {list(raw)}")
        shape = tuple(
            d if isinstance(d, int) else _dim(d, f"{where}.shape", f"shape {list(raw)}")
            for d in raw
        )
        dtype = canonical_dtype(spec.get("dtype", "float32"), f"{where}.dtype")
    for key in ("scale", "low", "high"):
        v = spec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ArgSpecError(f"{where}.{key}: expected a number, found {v!r}")
    weak = spec.get("weak_type", False)
    if not isinstance(weak, bool):
        raise ArgSpecError(f"{where}.weak_type: expected true or false, found {weak!r}")
    seed = spec.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ArgSpecError(f"{where}.seed: expected an int >= 0, found {seed!r}")
    array = ArraySpec(
        shape=shape,
        dtype=dtype,
        init=init,
        scale=float(spec.get("scale", 1.0)),
        low=None if spec.get("low") is None else float(spec["low"]),
        high=None if spec.get("high") is None else float(spec["high"]),
        seed=seed,
        path=path,
        weak_type=weak,
    )
    return _check_size(array, where)


def is_spec_mapping(value: Mapping[str, Any]) -> bool:
    """A mapping is an array spec (not a dict of arguments) if all its keys are spec keys.

    One with a ``shape`` that is a list of ints is a spec too, whatever its other keys, so that
    a misspelt key (``dtyp: bf16``) is reported as such instead of as a string argument.
    """
    if not value:
        return False
    if set(value) <= SPEC_KEYS and bool({"shape", "init"} & set(value)):
        return True
    shape = value.get("shape")
    return isinstance(shape, list | tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    )


# How the manifest (JSON, ``default=str``) writes a ShapeDtypeStruct or an array given from Python.
_PYTHON_OBJECT_TEXT = ("ShapeDtypeStruct(", "Array(", "array(")


def parse_leaf_or_tree(value: Any, where: str) -> Any:
    """Parse a config value into a pytree of ArraySpec / Literal leaves, named containers
    (PytreeNode) and derived nodes (jaxaot.config.derived)."""
    if isinstance(value, Mapping):
        derived.check_tag_keys(value, where)
        if derived.is_tagged(value):
            return derived.parse_derived(value, where, parse_leaf_or_tree)
        if PYTREE_KEY in value:
            return _parse_node(value, where)
        if is_spec_mapping(value):
            return _parse_mapping(value, where)
        return {str(k): parse_leaf_or_tree(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [parse_leaf_or_tree(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str) and value.startswith(_PYTHON_OBJECT_TEXT):
        raise ArgSpecError(
            f"{where}: {value[:48]!r} is the text a manifest records for a Python object given "
            "to jaxaot.compose's config (a ShapeDtypeStruct or an array), which cannot be read "
            "back; give the object again from Python and start at stage_out"
        )
    if isinstance(value, str):
        spec = parse_type(value, where)
        if spec is not None:
            return spec
        if value.endswith(".npy"):
            shape, dtype = _npy_header(value, where)
            return ArraySpec(shape=shape, dtype=dtype, init="file", path=value)
        if "[" in value and value.split("[", 1)[0].isidentifier():
            # Looks like an array type with an unknown dtype: say so rather than pass a string.
            canonical_dtype(value.split("[", 1)[0], where)
            raise ArgSpecError(f"{where}: cannot parse array type {value!r}")
    if value is None or isinstance(value, bool | int | float | str):
        return Literal(value)
    given = from_python(value, where)
    if given is not None:
        return given
    raise ArgSpecError(f"{where}: unsupported value {value!r} of type {type(value).__name__}")


def leaves(tree: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs in pytree order (dict keys sorted, as JAX flattens them). A derived
    node (``_init_``, ``_call_``, ``_ref_``, ``_key_``) is one leaf: its value's structure is
    known only once it is evaluated (:func:`specs` reaches the array specs inside it)."""
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from leaves(tree[k], f"{where}.{k}" if where else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{where}[{i}]")
    elif isinstance(tree, PytreeNode):
        for path, child in tree.children(where):
            yield from leaves(child, path)
    else:
        yield where, tree


def map_tree(fn: Any, tree: Any, where: str = "") -> Any:
    """Apply ``fn(path, leaf)`` to each leaf, keeping lists and dicts."""
    if isinstance(tree, dict):
        return {k: map_tree(fn, v, f"{where}.{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_tree(fn, v, f"{where}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, (PytreeNode, *DERIVED_TYPES)):
        node: Any = tree  # DERIVED_TYPES is a tuple of classes mypy sees as object
        return node.with_children([map_tree(fn, c, p) for p, c in node.children(where)])
    return fn(where, tree)


def specs(tree: Any, where: str = "") -> Iterator[tuple[str, ArraySpec]]:
    """Every array spec in a tree, those inside derived nodes (an ``_init_``'s arguments) too."""
    for path, node in derived.walk(tree, where):
        if isinstance(node, ArraySpec):
            yield path, node


def to_static_value(tree: Any, where: str) -> Any:
    """A static argument's Python value: literals only; lists become tuples (hashable)."""
    if isinstance(tree, ArraySpec):
        raise ArgSpecError(
            f"{where} is marked static but is an array spec ({tree.type_str}); static arguments "
            "must be values: give a literal, or remove it from static_argnums/static_argnames"
        )
    if isinstance(tree, Literal):
        return tree.value
    if isinstance(tree, list):
        return tuple(to_static_value(v, f"{where}[{i}]") for i, v in enumerate(tree))
    if isinstance(tree, PytreeNode) and tree.cls == "tuple":
        return tuple(to_static_value(v, p) for p, v in tree.children(where))
    if isinstance(tree, Given):
        raise ArgSpecError(
            f"{where} is marked static but is an array ({tree.type_str}); static arguments "
            "must be hashable values: remove it from static_argnums/static_argnames"
        )
    if isinstance(tree, DERIVED_TYPES):
        raise ArgSpecError(
            f"{where} is marked static but is a derived value ({derived.describe(tree)}); "
            "static arguments are literals: pass it at a traced position (a _call_ object "
            "there is closed over and fingerprinted), or remove it from "
            "static_argnums/static_argnames"
        )
    raise ArgSpecError(
        f"{where} is marked static but is a dict; static arguments must be hashable values "
        "(numbers, strings, bools or lists of them)"
    )


@dataclass(frozen=True)
class BoundArgs:
    """Parsed arguments, with each position and keyword marked static or traced."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    needs_x64: bool = field(default=False)

    def is_static(self, position: int | str) -> bool:
        if isinstance(position, int):
            return position in self.static_argnums
        return position in self.static_argnames

    def traced_args(self) -> list[tuple[str, Any]]:
        """(config path, tree) of every non-static argument, positional first."""
        out = [(f"program.args[{i}]", a) for i, a in enumerate(self.args) if not self.is_static(i)]
        out += [(f"program.kwargs.{k}", v) for k, v in self.kwargs.items() if not self.is_static(k)]
        return out


def _check_traced(tree: Any, where: str, key: str) -> None:
    for path, leaf in leaves(tree, where):
        if isinstance(leaf, Literal) and not isinstance(leaf.value, bool | int | float):
            raise ArgSpecError(
                f"{path}: {leaf.value!r} is a {type(leaf.value).__name__} at a non-static "
                f"position; JAX can only trace arrays and numbers: add it to {key}"
            )


def bind(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    static_argnums: Sequence[int] = (),
    static_argnames: Sequence[str] = (),
    donate_argnums: Sequence[int] = (),
    donate_argnames: Sequence[str] = (),
    names_of_positions: Sequence[str] | None = None,
) -> BoundArgs:
    """Parse specs and check static/donated positions against them.

    ``names_of_positions`` (the callable's parameter names, when known) maps the four options
    through the signature as ``jax.jit`` does: a name in ``static_argnames``/``donate_argnames``
    may be passed by position, and a position in ``static_argnums``/``donate_argnums`` may be
    passed by keyword. Without it (before the target is imported) what only the signature can
    resolve is left for the bind that has it (stage_out).
    """
    parsed_args = tuple(parse_leaf_or_tree(a, f"program.args[{i}]") for i, a in enumerate(args))
    parsed_kwargs = {
        str(k): parse_leaf_or_tree(v, f"program.kwargs.{k}") for k, v in kwargs.items()
    }
    n = len(parsed_args)
    names = list(names_of_positions or ())
    known = names_of_positions is not None
    s_nums: set[int] = set()
    s_names = set(static_argnames)
    d_nums: set[int] = set()
    d_names = set(donate_argnames)
    # A position past program.args names a parameter passed by keyword (jax.jit maps it
    # through the signature); unknown until the target's signature is.
    unresolved = False
    for key, nums, num_set, name_set in (
        ("stage_out.static_argnums", static_argnums, s_nums, s_names),
        ("lower.donate_argnums", donate_argnums, d_nums, d_names),
    ):
        for i in nums:
            if i < n:
                num_set.add(i)
            elif i < len(names) and names[i] in parsed_kwargs:
                name_set.add(names[i])
            elif not known and parsed_kwargs:
                unresolved = True
            else:
                by_kw = (
                    f"; parameter {i} ({names[i]!r}) is not in program.kwargs either"
                    if i < len(names)
                    else ""
                )
                raise ConfigError(
                    f"{key}: position {i} is out of range; program.args has "
                    f"{n} positional argument(s) (positions 0..{n - 1}){by_kw}"
                )
    for name in static_argnames:
        if name in names and names.index(name) < n:
            s_nums.add(names.index(name))
        elif name not in parsed_kwargs and known and name not in names:
            raise ConfigError(
                f"stage_out.static_argnames: {name!r} is neither a parameter of the target nor "
                f"a key of program.kwargs (parameters: {', '.join(names) or 'none'})"
            )
        elif name not in parsed_kwargs and not known:
            unresolved = True
    for name in donate_argnames:
        if name in names and names.index(name) < n:
            d_nums.add(names.index(name))
        elif name not in parsed_kwargs and known:
            # Neither passed by position nor a program.kwargs key (which may reach **kwargs):
            # jax.jit would donate nothing for it, silently.
            passed = [*names[:n], *parsed_kwargs]
            raise ConfigError(
                f"lower.donate_argnames: {name!r} names no argument passed to the target "
                f"(positional parameters: {', '.join(names) or 'none'}; program.args passes {n} "
                f"positionally; program.kwargs keys: {', '.join(parsed_kwargs) or 'none'}); "
                f"expected one of {', '.join(passed) or 'no names'}, or remove it"
            )
    for i in sorted(s_nums):
        if names and i < len(names):
            s_names.add(names[i])
    for i in sorted(d_nums):
        if names and i < len(names):
            d_names.add(names[i])
    for i in sorted(d_nums):
        if i in s_nums:
            raise ConfigError(
                f"lower.donate_argnums: argument {i} is static (stage_out.static_argnums); only "
                "traced array arguments can be donated"
            )
    for name in d_names:
        if name in s_names:
            raise ConfigError(
                f"lower.donate_argnames: {name!r} is static (stage_out.static_argnames); only "
                "traced array arguments can be donated"
            )
    derived.check_refs(
        [(f"program.args[{i}]", a) for i, a in enumerate(parsed_args)]
        + [(f"program.kwargs.{k}", v) for k, v in parsed_kwargs.items()]
    )
    for i in sorted(s_nums):
        to_static_value(parsed_args[i], f"program.args[{i}]")
    for k in s_names & set(parsed_kwargs):
        to_static_value(parsed_kwargs[k], f"program.kwargs.{k}")
    bound = BoundArgs(
        args=parsed_args,
        kwargs=parsed_kwargs,
        static_argnums=tuple(sorted(s_nums)),
        static_argnames=tuple(sorted(s_names)),
        donate_argnums=tuple(sorted(d_nums)),
        donate_argnames=tuple(sorted(d_names)),
    )
    for path, tree in bound.traced_args():
        if unresolved:  # a value may be static by an option only the signature resolves
            continue
        positional = path.startswith("program.args")
        _check_traced(tree, path, f"stage_out.static_argn{'ums' if positional else 'ames'}")
    needs_x64 = any(
        leaf.dtype in SIXTY_FOUR_BIT for _, tree in bound.traced_args() for _, leaf in specs(tree)
    ) or any(
        isinstance(leaf, Given) and leaf.dtype in SIXTY_FOUR_BIT
        for _, tree in bound.traced_args()
        for _, leaf in leaves(tree)
    )
    return BoundArgs(**{**bound.__dict__, "needs_x64": needs_x64})


def concrete_bound(bound: BoundArgs, sizes: Mapping[str, int]) -> BoundArgs:
    """``bound`` with every symbolic dimension evaluated with ``sizes`` (``compile.shapes``)."""
    if not sizes:
        return bound

    def fix(path: str, leaf: Any) -> Any:
        return leaf.concrete(sizes, path) if isinstance(leaf, ArraySpec) else leaf

    args = tuple(map_tree(fix, a, f"program.args[{i}]") for i, a in enumerate(bound.args))
    kwargs = {k: map_tree(fix, v, f"program.kwargs.{k}") for k, v in bound.kwargs.items()}
    return replace(bound, args=args, kwargs=kwargs)


def bind_config(cfg: JaxaotConfig, names_of_positions: Sequence[str] | None = None) -> BoundArgs:
    """:func:`bind` with the program, static and donation options of a typed config."""
    return bind(
        cfg.program.args,
        cfg.program.kwargs,
        static_argnums=cfg.stage_out.static_argnums,
        static_argnames=cfg.stage_out.static_argnames,
        donate_argnums=cfg.lower.donate_argnums,
        donate_argnames=cfg.lower.donate_argnames,
        names_of_positions=names_of_positions,
    )


def memory_bytes() -> int | None:
    """Memory this process may use: the machine's, or a smaller cgroup (container) limit."""
    limits: list[int] = []
    with contextlib.suppress(AttributeError, ValueError, OSError):
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(OSError):
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():  # "max" when unlimited
            limits.append(int(text))
    return min(limits) if limits else None


def check_inputs_fit(bound: BoundArgs, memory: int | None = None) -> None:
    """Refuse, before any JAX work, inputs that cannot all be allocated to execute the program.

    The traced array arguments are built in host memory before execute runs: together they
    must fit in ``memory`` (default :func:`memory_bytes`). Compiling alone needs none of them.
    """
    memory = memory_bytes() if memory is None else memory
    if memory is None:
        return
    sizes = sorted(
        (
            (nbytes(leaf.shape, leaf.dtype), path)
            for top, tree in bound.traced_args()
            for path, leaf in specs(tree, top)
            if not leaf.symbolic
        ),
        reverse=True,
    )
    total = sum(n for n, _ in sizes)
    if total <= memory:
        return
    biggest, path = sizes[0]
    what = (
        f"{path} alone is {human_size(biggest)}"
        if biggest > memory
        else (
            f"the arguments total {human_size(total)} (the largest, {path}, {human_size(biggest)})"
        )
    )
    raise ArgSpecError(
        f"{what}, more than this machine's {human_size(memory)} of memory: executing needs the "
        "inputs in memory; expected smaller shapes, or stop_after=compile (compiling needs no "
        "input memory)"
    )


def quote_array_types(override: str) -> str:
    """Quote JAX-style array types in a command-line override so Hydra's grammar accepts them.

    Hydra reads ``[`` as the start of a list, so ``program.args=[f32[128,512]]`` would not
    parse; ``program.args=['f32[128,512]']`` does. Text already inside quotes and ``${...}``
    interpolations are left alone.
    """
    if "=" not in override or "[" not in override:
        return override
    key, _, value = override.partition("=")
    out, i, quote = [], 0, ""
    while i < len(value):
        ch = value[i]
        if quote:
            out.append(ch)
            if ch == "\\" and i + 1 < len(value):
                out.append(value[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
            i += 1
            continue
        if ch in "'\"":
            quote = ch
            out.append(ch)
            i += 1
            continue
        if value.startswith("${", i):
            end = _interpolation_end(value, i)
            out.append(value[i:end])
            i = end
            continue
        m = _TYPE_IN_TEXT_RE.match(value, i)
        if m and (i == 0 or value[i - 1] in _VALUE_START):
            out.append("'" + m.group(0) + "'")
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return key + "=" + "".join(out)


def _interpolation_end(text: str, start: int) -> int:
    """Index just past the ``}`` closing the ``${`` at ``start`` (or the end of ``text``)."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


__all__ = [
    "DTYPES",
    "ArraySpec",
    "BoundArgs",
    "Given",
    "Literal",
    "PytreeNode",
    "bind",
    "bind_config",
    "build",
    "canonical_dtype",
    "check_inputs_fit",
    "concrete_bound",
    "dtype_bits",
    "eval_dim",
    "leaves",
    "map_tree",
    "memory_bytes",
    "nbytes",
    "parse_leaf_or_tree",
    "parse_type",
    "quote_array_types",
    "short_name",
    "specs",
    "symbols",
    "to_static_value",
]
