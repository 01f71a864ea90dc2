"""Sharding specs from config: PartitionSpec-like lists matched to argument and output trees.

A *spec* is written the way ``jax.sharding.PartitionSpec`` reads, as YAML: one entry per array
dimension, each ``null`` (not sharded), a mesh axis name, or a list of axis names (the
dimension is split over all of them)::

    [data, null]            # P('data', None)
    [[data, model], null]   # P(('data', 'model'), None)
    null                    # replicated: P()

``lower.in_shardings`` / ``lower.out_shardings`` hold specs in one of three forms:

- one entry per (traced positional) argument / per output: ``[[data, null], null]``;
- a tree shaped like the arguments, where a dict may leave keys out (those leaves are
  replicated) and any subtree may be one spec for every array under it:
  ``[{layers: {w1: [null, null, model]}}, [data, null]]``;
- a single spec for every array: ``[data]``.

A list whose length equals the number of children at that point of the tree is read per
child unless it contains a bare axis name. When a list could be read both ways and the two
readings differ, the value is rejected as ambiguous, with both spellings in the message.

Nothing here imports JAX: a matched spec is a :class:`Spec` of plain entries (``None``, an axis
name or a tuple of them; trailing ``None`` dropped), so it can be checked against shapes
before tracing and turned into a ``PartitionSpec`` by the lower stage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxaot.errors import ConfigError

SpecEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Spec:
    """A checked PartitionSpec as plain data: one entry per leading dimension."""

    entries: tuple[SpecEntry, ...] = ()

    def __str__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self.entries) + ")"


REPLICATED = Spec()


@dataclass(frozen=True)
class Leaf:
    """An array the spec is matched against: its shape and how to print its type.

    ``subtree``: a value whose arrays the config does not spell out (an ``_init_``, a ``_ref_``):
    a spec for it stands for every array under it (a pytree prefix) and is checked against
    those arrays once they are known (:func:`check_subtree`)."""

    shape: tuple[int, ...]
    type_str: str
    subtree: bool = False


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return repr(value)


def _is_axis_group(entry: Any) -> bool:
    return (
        isinstance(entry, Sequence)
        and not isinstance(entry, str)
        and bool(entry)
        and all(isinstance(a, str) for a in entry)
    )


def is_spec_like(value: Any) -> bool:
    """A list whose entries are all ``null``, axis names or non-empty lists of axis names."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        return False
    return all(e is None or isinstance(e, str) or _is_axis_group(e) for e in value)


def check_axis_names(value: Any, key: str, axes: Sequence[str], where: str = "") -> None:
    """Every string in ``value`` is an axis name; check them without shapes (pre-trace)."""
    here = f"{key}{where}"
    if value is None:
        return
    if isinstance(value, str):
        if value not in axes:
            raise ConfigError(
                f"{here}: mesh axis {value!r} is not in the mesh; expected one of "
                f"{list(axes)} (mesh.axes)"
            )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_axis_names(v, key, axes, f"{where}.{k}")
    elif isinstance(value, Sequence):
        for i, v in enumerate(value):
            check_axis_names(v, key, axes, f"{where}[{i}]")
    else:
        raise ConfigError(
            f"{here}: expected null, a mesh axis name, a list or a dict, found {value!r}"
        )


class _Match:
    """One matching pass: the config key, the mesh sizes and where the leaves came from."""

    def __init__(self, key: str, mesh: Mapping[str, int]) -> None:
        self.key = key
        self.mesh = dict(mesh)

    def leaf(self, value: Any, leaf: Leaf, path: str) -> Spec:
        where = f"{self.key}: {path} ({leaf.type_str})"
        if value is None:
            return REPLICATED
        raw = [value] if isinstance(value, str) else value
        if not is_spec_like(raw) and not (isinstance(raw, Sequence) and not raw):
            raise ConfigError(
                f"{where}: expected a spec (a list of null, axis names or lists of axis "
                f"names, one per dimension), found {_yaml(value)}"
            )
        spec: list[SpecEntry] = [e if e is None or isinstance(e, str) else tuple(e) for e in raw]
        if leaf.subtree:
            self.axes(value, spec, where)
            while spec and spec[-1] is None:
                spec.pop()
            return Spec(tuple(spec))
        if len(spec) > len(leaf.shape):
            raise ConfigError(
                f"{where}: spec {_yaml(value)} has {len(spec)} entries but the array has rank "
                f"{len(leaf.shape)}; expected at most {len(leaf.shape)} (one per dimension)"
            )
        self.axes(value, spec, where)
        for dim, entry in enumerate(spec):
            names = (entry,) if isinstance(entry, str) else entry or ()
            parts = math.prod(self.mesh[n] for n in names)
            if not isinstance(leaf.shape[dim], int):
                # A symbolic dimension (``2*b``): JAX decides it with its own arithmetic under
                # the run's shape constraints, when the abstract arguments have them
                # (stages/jax_inputs.py, check_symbolic_splits).
                continue
            if leaf.shape[dim] % parts:
                raise ConfigError(
                    f"{where}: dimension {dim} has size {leaf.shape[dim]}, which mesh axes "
                    f"{list(names)} (together {parts} devices) do not divide; expected a "
                    "multiple: change the spec, the shape or mesh.shape"
                )
        while spec and spec[-1] is None:
            spec.pop()
        return Spec(tuple(spec))

    def axes(self, value: Any, spec: Sequence[SpecEntry], where: str) -> None:
        """Every mesh axis a spec names is in the mesh, and on one dimension at most."""
        seen: set[str] = set()
        for entry in spec:
            for name in (entry,) if isinstance(entry, str) else entry or ():
                if name not in self.mesh:
                    raise ConfigError(
                        f"{where}: spec {_yaml(value)} names mesh axis {name!r}; expected one "
                        f"of {list(self.mesh)} (mesh.axes)"
                    )
                if name in seen:
                    raise ConfigError(
                        f"{where}: spec {_yaml(value)} uses mesh axis {name!r} twice; expected "
                        "each axis on at most one dimension"
                    )
                seen.add(name)

    def tree(self, value: Any, node: Any, path: str, names: Sequence[str] | None = None) -> Any:
        if isinstance(node, Leaf):
            return self.leaf(value, node, path)
        if value is None or isinstance(value, str):
            return self.broadcast(value, node, path, names)
        if isinstance(node, Mapping):
            if isinstance(value, Mapping):
                unknown = sorted(set(map(str, value)) - set(node))
                if unknown:
                    raise ConfigError(
                        f"{self.key}: {path} has no key(s) {unknown}; expected a subset of "
                        f"{sorted(node)}"
                    )
                return {k: self.tree(value.get(k), v, f"{path}.{k}") for k, v in node.items()}
            return self.broadcast(value, node, path)
        children = list(node)
        kinds = names or [f"{path}[{i}]" for i in range(len(children))]
        if isinstance(value, Mapping) or not isinstance(value, Sequence):
            raise ConfigError(
                f"{self.key}: {path or 'the arguments'} is a sequence of {len(children)}; "
                f"expected a list (one entry each) or one spec, found {_yaml(value)}"
            )
        per_child = len(value) == len(children) and not any(isinstance(v, str) for v in value)
        single = is_spec_like(value)
        if not per_child and not single:
            raise ConfigError(
                f"{self.key}: {path or 'value'} {_yaml(value)}: expected one entry for each of "
                f"{len(children)} ({', '.join(kinds)}) or a single spec, found a list of "
                f"{len(value)}"
            )
        if per_child and single:
            return self._either(value, node, path, kinds)
        if per_child:
            return type(node)(
                self.tree(v, c, k) for v, c, k in zip(value, children, kinds, strict=True)
            )
        try:
            return self.broadcast(value, node, path, names)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (read as one spec for every array: {len(value)} entries for "
                f"{len(children)} ({', '.join(kinds)}))"
            ) from None

    def broadcast(
        self, value: Any, node: Any, path: str, names: Sequence[str] | None = None
    ) -> Any:
        """One spec for every array under ``node``."""
        if isinstance(node, Leaf):
            return self.leaf(value, node, path)
        if isinstance(node, Mapping):
            return {k: self.broadcast(value, v, f"{path}.{k}") for k, v in node.items()}
        kinds = names or [f"{path}[{i}]" for i in range(len(node))]
        return type(node)(self.broadcast(value, c, k) for c, k in zip(node, kinds, strict=True))

    def _either(self, value: Any, node: Any, path: str, kinds: Sequence[str]) -> Any:
        """Both readings parse: use the one that fits, refuse when both fit and differ."""
        per, single, errors = None, None, []
        try:
            per = type(node)(self.tree(v, c, k) for v, c, k in zip(value, node, kinds, strict=True))
        except ConfigError as exc:
            errors.append(str(exc))
        try:
            single = self.broadcast(value, node, path, kinds)
        except ConfigError as exc:
            errors.append(str(exc))
        if per is not None and single is not None and _meaning(per) != _meaning(single):
            spelled = ", ".join(_yaml(value) for _ in kinds)
            if len(kinds) == 1:  # no entry can be [null]: the mapping form names the one entry
                key = kinds[0] if kinds[0].isidentifier() else "<its parameter name>"
                first = f"the mapping form {{{key}: {_yaml(value[0])}}} for the first"
            else:
                first = "give an entry as [null] for the first"
            raise ConfigError(
                f"{self.key}: {_yaml(value)} is ambiguous for {len(kinds)} "
                f"{'entry' if len(kinds) == 1 else 'entries'} ({', '.join(kinds)}): one spec "
                f"each, or one spec {_yaml(value)} for all; write [{spelled}] for the second, "
                f"or {first}"
            )
        if per is not None:
            return per
        if single is not None:
            return single
        raise ConfigError(errors[0])


def _meaning(tree: Any) -> Any:
    """Matched specs compared as ``PartitionSpec`` compares them: a group of one axis is that
    axis (``P(('data',)) == P('data')``, jax 0.10.2)."""
    if isinstance(tree, Spec):
        return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in tree.entries)
    if isinstance(tree, Mapping):
        return {k: _meaning(v) for k, v in tree.items()}
    return tuple(_meaning(v) for v in tree)


def match_specs(
    value: Any, tree: Sequence[Any], *, key: str, names: Sequence[str], mesh: Mapping[str, int]
) -> tuple[Any, ...]:
    """Specs for every leaf of ``tree`` (a tuple of argument or output trees).

    ``names`` label the top-level entries in messages (``program.args[1]``, ``output[0]``);
    ``mesh`` maps axis names to sizes. Raises :class:`ConfigError` naming the path.
    """
    matched = _Match(key, mesh).tree(value, tuple(tree), "", names)
    return tuple(matched)


def check_subtree(
    spec: Spec, arrays: Sequence[tuple[str, Leaf]], *, key: str, mesh: Mapping[str, int]
) -> None:
    """A spec given for a subtree (:attr:`Leaf.subtree`) against each of its arrays (``path``,
    shape): rank and divisibility, as for an array the config spells out."""
    value = [list(e) if isinstance(e, tuple) else e for e in spec.entries]
    match = _Match(key, mesh)
    for path, leaf in arrays:
        match.leaf(value, leaf, path)


__all__ = [
    "REPLICATED",
    "Leaf",
    "Spec",
    "SpecEntry",
    "check_axis_names",
    "check_subtree",
    "is_spec_like",
    "match_specs",
]
