"""Arrays too big for XLA, refused once the program is traced and before XLA sees it.

XLA sizes an array in int64. A shape whose byte size passes 2**63 - 1 fails XLA's shape check
(``ShapeUtil::MakeValidatedShape``: "overflow in static extent product") inside a call that
cannot report it, and the process aborts (SIGABRT at compile, jaxlib 0.10: "Bad StatusOr
access"), leaving the run's manifest ``running``. Array arguments are refused when their specs
are parsed (``argspec._check_size``); an array the program builds itself, such as
``jnp.zeros(shape)`` with ``shape`` a static argument, is known only once traced:
:func:`check_traced` walks every value of the jaxpr, sub-jaxprs included. It judges shapes
only, so static data that is no shape (a tuple of large hash constants) is never refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import (
    MAX_ARRAY_BYTES,
    BoundArgs,
    Literal,
    canonical_dtype,
    leaves,
    short_name,
)
from jaxaot.errors import ArgSpecError, ConfigError


def _type_str(shape: tuple[int, ...], dtype: Any) -> str:
    try:
        name = short_name(canonical_dtype(str(getattr(dtype, "name", dtype)), "-"))
    except ConfigError:
        name = str(dtype)
    return f"{name}[{','.join(map(str, shape))}]"


def too_big(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether XLA cannot size an array of ``shape`` with ``itemsize`` bytes an element (its
    byte size, or its element count, passes int64)."""
    elements = math.prod(shape)
    return elements > MAX_ARRAY_BYTES or elements * max(1, itemsize) > MAX_ARRAY_BYTES


# No element is wider than 16 bytes (complex128): a smaller element count always fits.
_SURELY_FITS = MAX_ARRAY_BYTES // 16


def _values(closed: Any) -> Iterator[tuple[Any, Any]]:
    """(aval, equation or None) of each value of a jaxpr and its sub-jaxprs (each jaxpr once)
    that may be too big: those of fewer than :data:`_SURELY_FITS` elements are skipped, fast
    (a jaxpr of thousands of equations is walked in milliseconds)."""
    seen: set[int] = set()
    todo = [getattr(closed, "jaxpr", closed)]
    while todo:
        jaxpr = todo.pop()
        if id(jaxpr) in seen:
            continue
        seen.add(id(jaxpr))
        for var in (*jaxpr.invars, *jaxpr.constvars):
            if not _fits(var.aval):
                yield var.aval, None
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                if not _fits(var.aval):
                    yield var.aval, eqn
            if eqn.params:
                todo.extend(compat_jax.jaxprs_in_params(eqn.params))


def _fits(aval: Any) -> bool:
    try:
        return bool(math.prod(getattr(aval, "shape", ())) <= _SURELY_FITS)
    except Exception:  # a symbolic dimension: sized at compile.shapes, judged there
        return True


def _static_source(bound: BoundArgs, shape: tuple[int, ...]) -> tuple[str, Any] | None:
    """(config path, value) of the static argument whose value is ``shape``, or whose ints are
    among its dimensions (``jnp.zeros((n, n))`` with ``n`` static), if one is."""
    statics = [(f"program.args[{i}]", bound.args[i]) for i in bound.static_argnums]
    statics += [(f"program.kwargs.{k}", v) for k, v in bound.kwargs.items() if bound.is_static(k)]
    big = {d for d in shape if d > 1}
    for want_exact in (True, False):
        for top, tree in statics:
            found = [(p, leaf.value) for p, leaf in leaves(tree, top) if isinstance(leaf, Literal)]
            ints = [v for _, v in found if isinstance(v, int) and not isinstance(v, bool)]
            if want_exact and ints and len(ints) == len(found) and tuple(ints) == shape:
                return top, tuple(ints)
            if not want_exact:
                for p, v in found:
                    if isinstance(v, int) and not isinstance(v, bool) and v in big:
                        return p, v
    return None


def _where(eqn: Any) -> str:
    if eqn is None:
        return ""
    try:
        summary = compat_jax.source_summary(eqn.source_info)
    except Exception:
        summary = ""
    at = f" at {summary}" if summary else ""  # no user frame when the target is JAX's own
    return f" ({eqn.primitive}{at})"


def check_traced(closed_jaxpr: Any, bound: BoundArgs, target: str) -> None:
    """Refuse, in one line, a traced program with a value XLA cannot size (see the module doc):
    naming the static argument that gives its shape where one does."""
    for aval, eqn in _values(closed_jaxpr):
        shape = getattr(aval, "shape", None)
        if not shape or not all(isinstance(d, int) for d in shape):
            continue  # scalars, tokens, symbolic dimensions (sized at compile.shapes)
        itemsize = int(getattr(getattr(aval, "dtype", None), "itemsize", 1) or 1)
        if not too_big(tuple(shape), itemsize):
            continue
        shape = tuple(shape)
        elements = math.prod(shape)
        what = (
            f"{_type_str(shape, aval.dtype)} ({elements:.3g} elements, "
            f"{elements * itemsize:.3g} bytes){_where(eqn)}"
        )
        limit = (
            "XLA sizes arrays in int64 and aborts the process on a larger one, so expected at "
            f"most {MAX_ARRAY_BYTES} bytes (2**63 - 1)"
        )
        source = _static_source(bound, shape)
        if source is not None:
            path, value = source
            raise ArgSpecError(
                f"{path}: the static value {value!r} makes {target} build {what}; {limit}: use "
                "a smaller shape"
            )
        raise ArgSpecError(
            f"stage_out: {target} builds {what}; {limit}: use smaller shapes in the program "
            "or its arguments"
        )


__all__ = ["check_traced", "too_big"]
