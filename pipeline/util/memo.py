"""Per-process memos that let a sweep's later jobs skip work JAX has already done.

JAX caches traces and lowerings per process: the same function traced with the same arguments
in the same context gives back the very same ``ClosedJaxpr`` and lowering objects. Whatever is
computed purely from such an object (its text, its HLO, its cost analysis) is kept here for as
long as JAX keeps the object, keyed weakly by it, so there is no key to get wrong: a changed
program, option or context is a different object.

Deserialized executables are kept by the sha256 of their (verified) bytes and the devices
they are bound to, per backend client: restarting the backends (a different device count)
gives a new client, and the executables of the old one are dropped with it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_DERIVED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_EXECUTABLES: weakref.WeakKeyDictionary[Any, OrderedDict[Hashable, Any]] = (
    weakref.WeakKeyDictionary()
)
_MAX_EXECUTABLES = 8  # per backend client
_STATS = {"derived_hits": 0, "executable_hits": 0}


def derived(obj: Any, name: str, compute: Callable[[], T]) -> T:
    """``compute()``, once per (``obj``, ``name``) while ``obj`` lives.

    ``obj`` must be an object JAX caches and never mutates (a lowering, a closed jaxpr), and
    ``compute`` a pure function of it. Objects that cannot be weakly referenced are not memoized.
    """
    try:
        slot = _DERIVED.setdefault(obj, {})
    except TypeError:
        return compute()
    if name in slot:
        _STATS["derived_hits"] += 1
        return slot[name]
    value = slot[name] = compute()
    return value


def executable(client: Any, key: Hashable, load: Callable[[], T]) -> T:
    """The executable ``load()`` deserializes for ``key`` on ``client``, loaded once."""
    try:
        cache = _EXECUTABLES.setdefault(client, OrderedDict())
    except TypeError:
        return load()
    if key in cache:
        cache.move_to_end(key)
        _STATS["executable_hits"] += 1
        return cache[key]
    value = cache[key] = load()
    while len(cache) > _MAX_EXECUTABLES:
        cache.popitem(last=False)
    return value


def stats() -> dict[str, int]:
    """Memo hits in this process (for tests and benchmarks)."""
    return dict(_STATS)


def clear() -> None:
    _DERIVED.clear()
    _EXECUTABLES.clear()
    _STATS.update(derived_hits=0, executable_hits=0)


__all__ = ["clear", "derived", "executable", "stats"]
