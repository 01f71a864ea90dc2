"""Library objects in arguments, made plain for jax.jit: the seam between built arguments and
the traced function (see the module docstring of each adapter in jaxaot.models).

``adapt(fn, args, kwargs, names)`` returns the function and arguments jax.jit traces: every
argument replaced by a pytree of arrays only, in the same positions and keywords, and the
static data closed over in ``fn`` with a fingerprint that keys it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Unfingerprintable:
    """Static data with no stable fingerprint: the run works, but is neither stored nor resumable."""

    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.why}"


@dataclass(frozen=True)
class Adapted:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    fingerprint: str = ""  # stable text of the static data closed over ("" when none)
    static_leaves: list[tuple[str, str]] = field(default_factory=list)
    logical_axes: dict[str, tuple[str | None, ...] | None] = field(default_factory=dict)
    unfingerprintable: Unfingerprintable | None = None


def adapt(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    names: Sequence[str] | None = None,
) -> Adapted:
    """The identity for arguments that are already pytrees of arrays and numbers."""
    return Adapted(fn=fn, args=tuple(args), kwargs=dict(kwargs))
