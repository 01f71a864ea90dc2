"""Concrete inputs for execute: arrays built from specs with a seed, or the user's files.

Host-side NumPy only. Each array leaf gets its own generator seeded from
``(execute.seed, leaf index)`` (or the spec's own ``seed``), leaves numbered in JAX's
flattening order (dict keys sorted), so adding an argument does not
change the values of the others and two runs with the same seed get the same inputs.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import (
    SIXTY_FOUR_BIT,
    ArraySpec,
    BoundArgs,
    Given,
    Literal,
    PytreeNode,
    build,
    canonical_dtype,
    parse_leaf_or_tree,
    short_name,
)
from jaxaot.errors import ArgSpecError, ConfigError

if TYPE_CHECKING:
    import numpy as np


def np_dtype(name: str) -> np.dtype[Any]:
    import ml_dtypes
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def load_error(exc: BaseException) -> str:
    """numpy's reason a file did not load, in one line, never its advice to unpickle: an
    array file is loaded with ``allow_pickle=False`` and stays so."""
    text = " ".join(str(exc).split())
    if "pickle" in text.lower():
        return (
            "it holds pickled Python objects (an object array, or no numpy format at all), "
            "which jaxaot never loads"
        )
    return text[:300] or type(exc).__name__


def materialize(spec: ArraySpec, rng: np.random.Generator, where: str) -> np.ndarray:
    import numpy as np

    dtype = np_dtype(spec.dtype)
    if spec.init == "file":
        assert spec.path is not None
        try:
            arr = np.load(spec.path, allow_pickle=False)
        except FileNotFoundError:
            raise ArgSpecError(f"{where}: .npy file {spec.path!r} does not exist") from None
        except (OSError, ValueError, EOFError) as exc:
            raise ArgSpecError(
                f"{where}: {spec.path!r} is not a readable .npy file ({load_error(exc)}); "
                "expected an array written by numpy.save"
            ) from None
        if not isinstance(arr, np.ndarray):  # a zip (.npz) named .npy
            arr.close()
            raise ArgSpecError(
                f"{where}: {spec.path!r} is a .npz archive, not a .npy file; expected one array "
                "written by numpy.save"
            )
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
    import numpy as np

    if isinstance(tree, dict):
        # Leaves are numbered in JAX's flattening order (sorted keys), never in the order a
        # config happened to list them: a resumed run reads its config back from the manifest
        # (sorted JSON) and must draw exactly the inputs the original run drew.
        built = {k: _build(tree[k], seed, counter, f"{where}.{k}") for k in sorted(tree)}
        return {k: built[k] for k in tree}
    if isinstance(tree, list):
        return [_build(v, seed, counter, f"{where}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, Literal):
        return tree.value
    if isinstance(tree, Given):  # an array given from Python (jaxaot.api), executed as it is
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


def _checked(spec: Any, given: Any, where: str, declared: str, found: list[str]) -> Any:
    """``given`` (parsed) checked against ``spec``, numbers made the declared type: each given
    array has the declared dtype and shape (JAX would silently narrow a float64 file to the
    float32 an x64-off executable takes, so a mismatch is refused). Array type mismatches are
    added to ``found`` (:func:`refuse_mismatches` names them all, as JAX lists every one)."""
    if isinstance(spec, dict):
        return {
            k: _checked(spec[k], given[k], f"{where}.{k}", f"{declared}.{k}", found) for k in spec
        }
    if isinstance(spec, list):
        return [
            _checked(s, g, f"{where}[{i}]", f"{declared}[{i}]", found)
            for i, (s, g) in enumerate(zip(spec, given, strict=True))
        ]
    if isinstance(given, Literal) and isinstance(given.value, str):
        hint = (
            "an archive names every argument: give it alone, execute.inputs=<file>.npz"
            if given.value.endswith(".npz")
            else "expected a .npy path or a number"
        )
        raise ConfigError(f"{where}: {given.value!r} is a string; {hint}")
    if isinstance(spec, ArraySpec) and isinstance(given, ArraySpec):
        what = f"{where}: {given.path!r}" if given.path else where
        _same_type(spec, given.shape, given.dtype, what, declared, found)
    elif isinstance(spec, ArraySpec) and isinstance(given, Literal):
        return Literal(_number_as(spec, given.value, where, declared))
    elif isinstance(spec, Literal) and isinstance(given, Literal):
        return Literal(_number_like(spec.value, given.value, where, declared))
    return given


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the bool {value!r}"
    return f"{'an int' if isinstance(value, int) else 'a float'} scalar {value!r}"


def _number_as(spec: ArraySpec, value: Any, where: str, declared: str) -> Any:
    """A number given for an array argument: only for a scalar (``f32[]``), as that dtype
    (a float rounded to it as JAX rounds a Python float; never a float into an int or bool,
    an int out of range, or a finite number that overflows the dtype)."""
    import numpy as np

    fix = (
        f"give a .npy file holding {spec.type_str} (numpy.save), or an .npz archive of every "
        "input (execute.inputs=<file>.npz)"
    )
    if spec.shape != ():
        raise ConfigError(
            f"{where}: expected {spec.type_str} (as {declared} declares), found {_kind(value)}; "
            f"{fix}"
        )
    import ml_dtypes

    dtype = np_dtype(spec.dtype)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if spec.dtype == "bool":
        fits = isinstance(value, bool)
    elif spec.dtype.startswith(("int", "uint")):
        info = ml_dtypes.iinfo(dtype)
        fits = number and isinstance(value, int) and info.min <= value <= info.max
    else:  # floating and complex
        fits = number
    if fits:
        with np.errstate(over="ignore"):
            arr = np.asarray(value, dtype=dtype)
        if not (number and math.isfinite(value) and not np.all(np.isfinite(arr))):
            return arr  # not a finite number that overflowed the dtype (1e39 as f32)
    raise ConfigError(
        f"{where}: expected {spec.type_str} (as {declared} declares), found {_kind(value)}, "
        f"which is no {spec.dtype} value; give a number of that type, or {fix}"
    )


def _number_like(want: Any, value: Any, where: str, declared: str) -> Any:
    """A number given where the program traced a literal (a weakly typed scalar of the
    literal's Python type): the same type, or an int where a float was traced."""
    if not isinstance(want, bool | int | float) or not isinstance(value, bool | int | float):
        return value
    if isinstance(want, bool) != isinstance(value, bool) or (
        isinstance(want, int) and isinstance(value, float)
    ):
        traced = type(want).__name__
        a = "an" if traced == "int" else "a"
        raise ConfigError(
            f"{where}: expected {a} {traced} ({declared} is {want!r}, traced as a weakly typed "
            f"{traced} scalar), found {_kind(value)}; give {a} {traced}, or change {declared}"
        )
    return float(value) if isinstance(want, float) else value


def _same_type(
    spec: ArraySpec,
    shape: tuple[int, ...],
    dtype: str,
    what: str,
    declared: str,
    found: list[str],
) -> None:
    """A given array's type against its spec; a mismatch is added to ``found`` as
    ``<what> holds <type>, expected <type> (as <declared> declares...): <fix>``."""
    if (tuple(shape), dtype) == (spec.shape, spec.dtype):
        return
    held = ArraySpec(shape=tuple(shape), dtype=dtype).type_str
    if dtype in SIXTY_FOUR_BIT and spec.dtype not in SIXTY_FOUR_BIT and tuple(shape) == spec.shape:
        fix = f"declare {short_name(dtype)} in {declared} to run in 64-bit (x64), or save it as {spec.dtype}"
    else:
        fix = f"save it as {spec.type_str}, or change {declared}"
    found.append(
        f"{what} holds {held}, expected {spec.type_str} (as {declared} declares; inputs are "
        f"never converted): {fix}"
    )


def refuse_mismatches(found: list[str]) -> None:
    """One error line naming every input whose type differs from its declaration, as JAX's
    "Argument types differ ..." lists every mismatched argument (jax 0.10.2), not only the
    first; nothing when ``found`` is empty."""
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError(
            f"execute.inputs: {len(found)} inputs differ from the types declared for them: "
            + "; ".join(found)
        )


def _arg_paths(tree: Any, path: str, declared: str) -> Iterator[tuple[str, str, Any]]:
    """(signature path, config path, spec leaf): ``args[0]['w']``, as stage_out/signature.json."""
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _arg_paths(tree[k], f"{path}[{k!r}]", f"{declared}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _arg_paths(v, f"{path}[{i}]", f"{declared}[{i}]")
    else:
        yield path, declared, tree


def _replace_leaves(tree: Any, values: Iterator[Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _replace_leaves(tree[k], values) for k in sorted(tree)}
    if isinstance(tree, list):
        return [_replace_leaves(v, values) for v in tree]
    return next(values)


def npz_inputs(bound: BoundArgs, path: str) -> tuple[list[Any], dict[str, Any]]:
    """``execute.inputs=<file>.npz``: one array per traced input, keyed by its signature path.

    The keys are the ``path`` fields of ``stage_out/signature.json`` (``args[0]``,
    ``args[1]['w']``, ``kwargs['z']``); a traced literal may be left out (its value is used).
    """
    import numpy as np

    where = f"execute.inputs={path!r}"
    fix = "expected a .npz archive of arrays, as numpy.savez writes"
    if not os.path.exists(path):
        raise ConfigError(f"{where}: no such file; {fix}")
    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle
        raise ConfigError(f"{where}: not a .npz archive (not a zip file); {fix}")
    arrays: dict[str, Any] = {}
    name = ""
    try:
        with np.load(path, allow_pickle=False) as archive:
            for name in archive.files:
                arrays[name] = archive[name]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        member = f" (array {name!r})" if name else ""
        raise ConfigError(f"{where}: unreadable{member}: {load_error(exc)}; {fix}") from None
    trees = [
        (f"args[{i}]", f"program.args[{i}]", a)
        for i, a in enumerate(bound.args)
        if not bound.is_static(i)
    ]
    trees += [
        (f"kwargs[{k!r}]", f"program.kwargs.{k}", v)
        for k, v in bound.kwargs.items()
        if not bound.is_static(k)
    ]
    expected: list[str] = []
    built: list[Any] = []
    mismatches: list[str] = []
    for root, declared, tree in trees:
        leaves = []
        for key, decl, spec in _arg_paths(tree, root, declared):
            expected.append(key)
            if key not in arrays:
                if isinstance(spec, Literal):
                    leaves.append(spec.value)
                    continue
                raise ConfigError(
                    f"{where}: no array {key!r} (expected keys: {', '.join(expected_keys(bound))})"
                )
            arr = arrays[key]
            if isinstance(spec, ArraySpec):
                _same_type(
                    spec,
                    tuple(arr.shape),
                    canonical_dtype(arr.dtype.name, where),
                    f"{where}[{key!r}]",
                    decl,
                    mismatches,
                )
            weak = isinstance(spec, ArraySpec) and spec.weak_type
            leaves.append(weakly_typed(arr) if weak else arr)
        built.append(_replace_leaves(tree, iter(leaves)))
    refuse_mismatches(mismatches)
    extra = sorted(set(arrays) - set(expected))
    if extra:
        raise ConfigError(
            f"{where}: unexpected array(s) {extra}; expected keys: {', '.join(expected)}"
        )
    n_pos = sum(1 for i in range(len(bound.args)) if not bound.is_static(i))
    names = [k for k in bound.kwargs if not bound.is_static(k)]
    return built[:n_pos], dict(zip(names, built[n_pos:], strict=True))


def expected_keys(bound: BoundArgs) -> list[str]:
    """The keys an ``execute.inputs`` archive holds, in signature order."""
    keys = [
        key
        for i, a in enumerate(bound.args)
        if not bound.is_static(i)
        for key, _, _ in _arg_paths(a, f"args[{i}]", "")
    ]
    keys += [
        key
        for k, v in bound.kwargs.items()
        if not bound.is_static(k)
        for key, _, _ in _arg_paths(v, f"kwargs[{k!r}]", "")
    ]
    return keys


def pytree_classes_of(bound: BoundArgs) -> list[tuple[str, str]]:
    """(config key, class) of the named containers among the traced arguments (tuples too)."""
    found: list[tuple[str, str]] = []

    def walk(tree: Any, where: str) -> None:
        if isinstance(tree, PytreeNode):
            found.append((f"{where}._pytree_", tree.cls))
        elif isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{where}.{k}")
        elif isinstance(tree, list):
            for i, v in enumerate(tree):
                walk(v, f"{where}[{i}]")

    for path, tree in bound.traced_args():
        walk(tree, path)
    return found


def user_inputs(bound: BoundArgs, inputs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Parse ``execute.inputs``: a list for the non-static positional arguments, or
    ``{args: [...], kwargs: {...}}``, each leaf a ``.npy`` path or a literal; or one ``.npz``
    archive keyed by argument path (:func:`npz_inputs`). Every array must have the type its
    spec declares."""
    from jaxaot.config.derived import uses_derived

    if uses_derived(bound):
        raise ConfigError(
            "execute.inputs: the arguments hold derived values (_init_, _call_, _ref_, _key_), "
            "which execute makes itself; expected execute.inputs=null"
        )
    for key, _ in pytree_classes_of(bound):
        raise ConfigError(
            f"execute.inputs: {key.rsplit('.', 1)[0]} is a named pytree container (_pytree_), "
            "which execute.inputs cannot fill (yet); expected execute.inputs=null (inputs built "
            "from the specs and execute.seed)"
        )
    if isinstance(inputs, str) and inputs.endswith(".npz"):
        return npz_inputs(bound, inputs)
    positions = [i for i in range(len(bound.args)) if not bound.is_static(i)]
    traced_pos = [bound.args[i] for i in positions]
    traced_kw = {k: v for k, v in bound.kwargs.items() if not bound.is_static(k)}
    if isinstance(inputs, dict) and set(inputs) <= {"args", "kwargs"}:
        pos, kw = inputs.get("args", []), inputs.get("kwargs", {})
    elif isinstance(inputs, list):
        pos, kw = inputs, {}
    else:
        raise ConfigError(
            "execute.inputs: expected a list (one entry per non-static positional argument), "
            f"{{args: [...], kwargs: {{...}}}} or a .npz archive, found {inputs!r}"
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
    mismatches: list[str] = []
    parsed_pos = [
        _checked(spec, given, f"execute.inputs[{i}]", f"program.args[{positions[i]}]", mismatches)
        for i, (spec, given) in enumerate(zip(traced_pos, parsed_pos, strict=True))
    ]
    parsed_kw = {
        k: _checked(
            traced_kw[k], given, f"execute.inputs.kwargs.{k}", f"program.kwargs.{k}", mismatches
        )
        for k, given in parsed_kw.items()
    }
    refuse_mismatches(mismatches)
    counter = [0]
    return (
        [
            _weaken(s, _build(p, 0, counter, f"execute.inputs[{i}]"))
            for i, (s, p) in enumerate(zip(traced_pos, parsed_pos, strict=True))
        ],
        {
            k: _weaken(traced_kw[k], _build(v, 0, counter, f"execute.inputs.kwargs.{k}"))
            for k, v in parsed_kw.items()
        },
    )


def _weaken(spec: Any, value: Any) -> Any:
    """Given arrays where the spec is weakly typed (``~weak``) become weakly typed, as built
    ones are (:func:`spec_inputs`)."""
    import numpy as np

    if isinstance(spec, dict) and isinstance(value, dict):
        return {k: _weaken(spec[k], v) for k, v in value.items()}
    if isinstance(spec, list) and isinstance(value, list):
        return [_weaken(s, v) for s, v in zip(spec, value, strict=True)]
    if isinstance(spec, ArraySpec) and spec.weak_type and isinstance(value, np.ndarray):
        return weakly_typed(value)
    return value


def weakly_typed(arr: np.ndarray) -> Any:
    """``arr`` as a weakly typed JAX array, the form a Python scalar takes (``f32[]~weak``):
    JAX's reference run then promotes it as the traced program did. JAX has no public
    constructor for a weakly typed array of any shape (jax 0.10)."""
    return compat_jax.weakly_typed(arr)


def spec_inputs(
    bound: BoundArgs, seed: int, resolve: Any = None
) -> tuple[list[Any], dict[str, Any]]:
    """Host arrays for every non-static argument, from the specs (literals as given); named
    pytree containers (``_pytree_``) built with the class ``resolve(name, key)`` gives."""
    counter = [0]

    def leaf(where: str, spec: Any) -> Any:
        value = _build(spec, seed, counter, where)
        return weakly_typed(value) if isinstance(spec, ArraySpec) and spec.weak_type else value

    if resolve is None:  # the default policy (execute passes the run's)
        from jaxaot.stages.resolving import class_resolver

        resolve = class_resolver()

    def one(tree: Any, where: str) -> Any:
        return build(tree, lambda p, s: leaf(where + p, s), resolve)

    args = [
        one(a, f"program.args[{i}]") for i, a in enumerate(bound.args) if not bound.is_static(i)
    ]
    kwargs = {
        k: one(v, f"program.kwargs.{k}") for k, v in bound.kwargs.items() if not bound.is_static(k)
    }
    return args, kwargs


__all__ = ["expected_keys", "materialize", "np_dtype", "npz_inputs", "spec_inputs", "user_inputs"]
