"""Concrete inputs for execute: arrays built from specs with a seed, or the user's files.

Host-side NumPy only. Each array leaf gets its own generator seeded from
``(execute.seed, leaf index)`` (or the spec's own ``seed``), so adding an argument does not
change the values of the others and two runs with the same seed get the same inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.argspec import ArraySpec, BoundArgs, Literal, parse_leaf_or_tree
from pipeline.errors import ArgSpecError, ConfigError


def np_dtype(name: str) -> np.dtype[Any]:
    import ml_dtypes

    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def materialize(spec: ArraySpec, rng: np.random.Generator, where: str) -> np.ndarray:
    dtype = np_dtype(spec.dtype)
    if spec.init == "file":
        assert spec.path is not None
        arr = np.load(spec.path, allow_pickle=False)
        if tuple(arr.shape) != spec.shape:
            raise ArgSpecError(
                f"{where}: {spec.path!r} has shape {list(arr.shape)}, expected {list(spec.shape)}"
            )
        return arr.astype(dtype, copy=False)
    if spec.init == "zeros":
        return np.zeros(spec.shape, dtype)
    if spec.init == "ones":
        return np.ones(spec.shape, dtype)
    if spec.init == "arange":
        return (
            np.arange(int(np.prod(spec.shape)), dtype=np.float64).reshape(spec.shape).astype(dtype)
        )
    kind = dtype.kind
    if spec.init == "uniform":
        low = spec.low if spec.low is not None else 0.0
        high = spec.high if spec.high is not None else (spec.scale if kind in "fc" else 2.0)
        if high <= low:
            raise ArgSpecError(f"{where}: uniform needs low < high, found low={low}, high={high}")
        if kind in "iu":
            return rng.integers(int(low), int(high), size=spec.shape).astype(dtype)
        if kind == "b":
            return rng.random(spec.shape) < 0.5
        return rng.uniform(low, high, size=spec.shape).astype(dtype)
    # normal
    if kind == "b":
        return rng.random(spec.shape) < 0.5
    if kind in "iu":
        return np.rint(rng.normal(0.0, spec.scale, size=spec.shape)).astype(dtype)
    values = rng.normal(0.0, spec.scale, size=spec.shape)
    if kind == "c":
        values = values + 1j * rng.normal(0.0, spec.scale, size=spec.shape)
    return values.astype(dtype)


def _build(tree: Any, seed: int, counter: list[int], where: str) -> Any:
    if isinstance(tree, dict):
        return {k: _build(tree[k], seed, counter, f"{where}.{k}") for k in tree}
    if isinstance(tree, list):
        return [_build(v, seed, counter, f"{where}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, Literal):
        return tree.value
    counter[0] += 1
    rng = np.random.default_rng([seed, counter[0]] if tree.seed is None else [tree.seed])
    return materialize(tree, rng, where)


def _same_structure(spec: Any, given: Any, where: str) -> None:
    if isinstance(spec, dict):
        if not isinstance(given, dict) or set(given) != set(spec):
            found = sorted(given) if isinstance(given, dict) else type(given).__name__
            raise ConfigError(f"{where}: expected a dict with keys {sorted(spec)}, found {found}")
        for k in spec:
            _same_structure(spec[k], given[k], f"{where}.{k}")
    elif isinstance(spec, list):
        if not isinstance(given, list) or len(given) != len(spec):
            raise ConfigError(f"{where}: expected a list of {len(spec)}, found {given!r}")
        for i, (s, g) in enumerate(zip(spec, given, strict=True)):
            _same_structure(s, g, f"{where}[{i}]")
    elif isinstance(given, dict | list):
        raise ConfigError(f"{where}: expected one array (.npy path) or literal, found {given!r}")


def user_inputs(bound: BoundArgs, inputs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Parse ``execute.inputs``: a list for the non-static positional arguments, or
    ``{args: [...], kwargs: {...}}``; each leaf a ``.npy`` path or a literal."""
    traced_pos = [a for i, a in enumerate(bound.args) if not bound.is_static(i)]
    traced_kw = {k: v for k, v in bound.kwargs.items() if not bound.is_static(k)}
    if isinstance(inputs, dict) and set(inputs) <= {"args", "kwargs"}:
        pos, kw = inputs.get("args", []), inputs.get("kwargs", {})
    elif isinstance(inputs, list):
        pos, kw = inputs, {}
    else:
        raise ConfigError(
            "execute.inputs: expected a list (one entry per non-static positional argument) or "
            f"{{args: [...], kwargs: {{...}}}}, found {inputs!r}"
        )
    if len(pos) != len(traced_pos):
        raise ConfigError(
            f"execute.inputs: expected {len(traced_pos)} entries (the non-static positional "
            f"arguments), found {len(pos)}"
        )
    _same_structure(traced_pos, pos, "execute.inputs")
    _same_structure(traced_kw, kw, "execute.inputs.kwargs")
    parsed_pos = [parse_leaf_or_tree(p, f"execute.inputs[{i}]") for i, p in enumerate(pos)]
    parsed_kw = {k: parse_leaf_or_tree(v, f"execute.inputs.kwargs.{k}") for k, v in kw.items()}
    counter = [0]
    return (
        [_build(p, 0, counter, f"execute.inputs[{i}]") for i, p in enumerate(parsed_pos)],
        {k: _build(v, 0, counter, f"execute.inputs.kwargs.{k}") for k, v in parsed_kw.items()},
    )


def spec_inputs(bound: BoundArgs, seed: int) -> tuple[list[Any], dict[str, Any]]:
    """Host arrays for every non-static argument, from the specs (literals as given)."""
    counter = [0]
    args = [
        _build(a, seed, counter, f"program.args[{i}]")
        for i, a in enumerate(bound.args)
        if not bound.is_static(i)
    ]
    kwargs = {
        k: _build(v, seed, counter, f"program.kwargs.{k}")
        for k, v in bound.kwargs.items()
        if not bound.is_static(k)
    }
    return args, kwargs


__all__ = ["materialize", "np_dtype", "spec_inputs", "user_inputs"]
