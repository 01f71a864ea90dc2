"""``Record``: the fields of a registered class that holds static data, in the class's order.

A ``TrainState`` (``apply_fn``, ``tx``) or an Equinox module (its activation, its static
fields) cannot be an argument of a stored program as it is: its pytree structure holds Python
objects that jax.export cannot serialize and that must be the very same objects at trace and
execute time. jaxaot passes a ``Record`` of its traced fields instead: a read-only mapping
whose pytree keys are the field names (leaf paths ``state/params/...``, ``model/layers/0/weight``)
and whose leaves come in the class's own order, so the lowered module takes its arguments in
the order ``jax.jit`` or ``eqx.filter_jit`` of the original object would. Its structure data is
the tuple of names: a Python literal, which the lowering stage registers for jax.export.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax


class Record(Mapping[str, Any]):
    __slots__ = ("_names", "_values")

    def __init__(self, names: Sequence[str], values: Sequence[Any]) -> None:
        if len(names) != len(values):
            raise ValueError(f"Record: {len(names)} names for {len(values)} values")
        self._names = tuple(names)
        self._values = tuple(values)

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[self._names.index(name)]
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={v!r}" for n, v in zip(self._names, self._values, strict=True))
        return f"Record({inner})"


def _flatten_with_keys(r: Record) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    keys = [jax.tree_util.GetAttrKey(n) for n in r._names]
    return list(zip(keys, r._values, strict=True)), r._names


def _flatten(r: Record) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    return r._values, r._names


def _unflatten(names: tuple[str, ...], values: Any) -> Record:
    return Record(names, list(values))


jax.tree_util.register_pytree_with_keys(Record, _flatten_with_keys, _unflatten, _flatten)
