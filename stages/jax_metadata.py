"""XLA metadata while the lower stage traces: program-wide and per sub-function attributes.

``set_xla_metadata`` attaches frontend attributes to every op traced inside it; they reach
the StableHLO (``mhlo.frontend_attributes``), the HLO and the optimized HLO. A scoped entry
replaces its target function, for the length of the trace, with one that runs under those
attributes. JAX versions that have ``must_fuse_call`` and ``fuse_limit`` (0.11+) get those
instead of the raw ``MUST_FUSE`` / ``FUSE_LIMIT`` attributes, found by feature detection.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from jaxaot.config.xla_metadata import Scoped
from jaxaot.stages.stage_out import resolve_target


def _annotated(fn: Callable[..., Any], scoped: Scoped) -> Callable[..., Any]:
    from jax.experimental import xla_metadata as xm

    must_fuse_call = getattr(xm, "must_fuse_call", None)
    fuse_limit = getattr(xm, "fuse_limit", None)
    attrs = dict(scoped.attributes)
    inner = fn
    if scoped.must_fuse is not None:
        if must_fuse_call is not None:
            inner = must_fuse_call(scoped.must_fuse)(fn)
        else:
            attrs["MUST_FUSE"] = scoped.must_fuse
    if scoped.fuse_limit and fuse_limit is None:
        attrs["FUSE_LIMIT"] = True

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            if attrs:
                stack.enter_context(xm.set_xla_metadata(**attrs))
            if scoped.fuse_limit and fuse_limit is not None:
                stack.enter_context(fuse_limit())
            return inner(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def _patched(scoped: Scoped, key: str) -> Iterator[None]:
    """Swap the target for its annotated version wherever a module holds it by that name."""
    original = resolve_target(scoped.target, key, scoped.policy)
    module_name, _, attr_path = scoped.target.partition(":")
    *owners, name = attr_path.split(".")
    owner: Any = importlib.import_module(module_name)
    for part in owners:
        owner = getattr(owner, part)
    holders = [owner] + [
        m
        for m in list(sys.modules.values())
        if m is not owner and getattr(m, name, None) is original
    ]
    replacement = _annotated(original, scoped)
    for holder in holders:
        setattr(holder, name, replacement)
    try:
        yield
    finally:
        for holder in holders:
            setattr(holder, name, original)


@contextlib.contextmanager
def with_metadata(attributes: dict[str, Any], scoped: list[Scoped]) -> Iterator[bool]:
    """Trace inside this to attach the metadata; yields whether there is any."""
    if not attributes and not scoped:
        yield False
        return
    import jax
    from jax.experimental.xla_metadata import set_xla_metadata

    # Sub-jaxprs (lax.scan bodies, nested jits) are cached by function identity, so a body
    # traced earlier without the annotations would be reused as is: start from clean caches,
    # and leave clean ones so later traces do not pick the annotated bodies up.
    if scoped:
        jax.clear_caches()
    try:
        with contextlib.ExitStack() as stack:
            for i, entry in enumerate(scoped):
                stack.enter_context(_patched(entry, f"lower.scoped_metadata[{i}].target"))
            if attributes:
                stack.enter_context(set_xla_metadata(**attributes))
            yield True
    finally:
        if scoped:
            jax.clear_caches()


__all__ = ["with_metadata"]
