"""Naming what a config imports and builds: a callable by import path through the run's import
policy (pipeline/config/trust.py), a ``_pytree_`` class, a traced leaf's abstract value, and a
value in brief for messages. Shared by stage_out, inputs and the derived values below them."""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

from jaxaot.config.argspec import ArraySpec, Given, Literal
from jaxaot.config.trust import DEFAULT_POLICY, ImportPolicy, check_name, check_resolved
from jaxaot.errors import TargetError
from jaxaot.util.console import cwd_importable


def resolve_target(
    target: str, key: str = "program.target", policy: ImportPolicy = DEFAULT_POLICY
) -> Callable[..., Any]:
    """``"package.module:attr.path"`` -> the callable, or a TargetError naming what is missing.

    ``policy`` (pipeline/config/trust.py) is checked on the string before anything is imported, and
    on every module the path goes through and the callable it ends at.
    """
    obj = resolve_object(target, key, policy)
    if not callable(obj):
        attr_path = target.partition(":")[2]
        raise TargetError(
            f"{key}={target!r}: {attr_path!r} is a {type(obj).__name__}, not a callable"
        )
    return obj


def resolve_object(
    target: str, key: str = "program.target", policy: ImportPolicy = DEFAULT_POLICY
) -> Any:
    """``"package.module:attr.path"`` -> the object there, callable or not (a ``_get_``),
    through the same import policy checks as :func:`resolve_target`."""
    module_name, _, attr_path = target.partition(":")
    where = f"{key}={target!r}"
    if not module_name or not attr_path:
        raise TargetError(f"{where}: expected 'package.module:function'")
    cwd_importable()  # ./mypkg resolves as under `python -m`, and is judged as such
    check_name(target, key, policy)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise TargetError(
            f"{where}: cannot import module {module_name!r} ({exc}); is its package installed, "
            "on PYTHONPATH or in the current directory?"
        ) from None
    except Exception as exc:
        raise TargetError(
            f"{where}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    modules = [obj]
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            owner = module_name + "".join("." + p for p in attr_path.split(".")[:i])
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:12]
            raise TargetError(
                f"{where}: {owner!r} has no attribute {part!r} (it has: {', '.join(public)}"
                f"{', ...' if len(public) == 12 else ''})"
            )
        obj = getattr(obj, part)
        if isinstance(obj, types.ModuleType):
            modules.append(obj)
    check_resolved(target, key, policy, modules, obj)
    return obj


def class_resolver(policy: ImportPolicy = DEFAULT_POLICY) -> Callable[[str, str], Any]:
    """``resolve(name, key)``: the class a ``_pytree_`` tag names, imported through the trust
    policy (pipeline/config/trust.py) as ``program.target`` is."""

    @functools.cache
    def resolve(name: str, key: str) -> Any:
        cls = resolve_target(name, key, policy)
        if not isinstance(cls, type):
            raise TargetError(f"{key}={name!r}: expected a class, found a {type(cls).__name__}")
        return cls

    return resolve


def abstract_value(spec: ArraySpec | Literal, scope: Any = None) -> Any:
    """What ``jit(...).trace`` gets for a traced leaf: a ShapeDtypeStruct or a Python scalar.
    Symbolic dimensions become jax.export's, in ``scope`` (one per run: shared variables)."""
    import jax

    if isinstance(spec, ArraySpec):
        shape: Any = spec.shape
        if spec.symbolic:
            shape = jax.export.symbolic_shape(",".join(map(str, spec.shape)), scope=scope)
        if spec.sharding is not None:  # a ShapeDtypeStruct given from Python (jaxaot.api)
            return jax.ShapeDtypeStruct(
                shape, spec.dtype, weak_type=spec.weak_type, sharding=spec.sharding
            )
        return jax.ShapeDtypeStruct(shape, spec.dtype, weak_type=spec.weak_type)
    if isinstance(spec, Given):
        v = spec.value
        return jax.ShapeDtypeStruct(v.shape, v.dtype, weak_type=bool(getattr(v, "weak_type", 0)))
    return spec.value


def type_str(shape: tuple[int, ...], dtype: Any) -> str:
    from jaxaot.config.argspec import short_name

    return f"{short_name(str(dtype))}[{','.join(map(str, shape))}]"


def describe(value: Any) -> str:
    """One argument as a user wrote it, briefly: ``f32[64,256]``, ``{b, w}``, ``[3 items]``.
    Types are checked, never attributes (a library object such as ``nnx.Rngs`` answers any
    attribute name), and it never raises: at worst the type's name."""
    try:
        return _describe(value)
    except Exception:
        return f"<{type(value).__name__}>"


def _describe(value: Any) -> str:
    import jax
    import numpy as np

    if isinstance(value, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return type_str(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        keys = ", ".join(map(str, list(value)[:4])) + (", ..." if len(value) > 4 else "")
        return f"{{{keys}}}"
    if isinstance(value, list | tuple):
        return f"[{len(value)} item{'s' if len(value) != 1 else ''}]"
    text = " ".join(repr(value).split())
    return text if len(text) <= 24 else text[:23] + "…"


__all__ = [
    "abstract_value",
    "class_resolver",
    "describe",
    "resolve_object",
    "resolve_target",
    "type_str",
]
