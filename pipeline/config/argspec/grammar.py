"""The grammar of a leaf: an array type (``f32[b,512]~weak``), a spec mapping, a ``.npy`` path,
a literal, a tagged container (``_pytree_``) or a derived value, parsed into the forms of
leaf_types.py."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxaot.config import derived, dim_expr
from jaxaot.config.argspec.dtypes import canonical_dtype
from jaxaot.config.argspec.leaf_types import (
    PYTREE_ARGS,
    PYTREE_KEY,
    ArraySpec,
    Literal,
    PytreeNode,
    check_size,
    from_python,
)
from jaxaot.errors import ArgSpecError

INITS: tuple[str, ...] = ("normal", "uniform", "zeros", "ones", "arange", "file")
SPEC_KEYS = frozenset({"shape", "dtype", "init", "scale", "low", "high", "seed", "weak_type"})

# ``dtype[dims]`` and an optional ``~suffix``; the dims are parsed by dim_expr, the suffix is
# one of SUFFIXES (anything else is refused by name rather than read as a string).
_TYPE_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*\[([^\[\]]*)\]\s*(~\s*[A-Za-z0-9_]*)?\s*$")
# The suffixes of an array type: whether it is weakly typed.
SUFFIXES: dict[str, bool] = {"weak": True, "strong": False}


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
    return check_size(spec, where)


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
    return check_size(array, where)


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
