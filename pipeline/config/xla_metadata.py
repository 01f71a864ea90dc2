"""XLA metadata from config: frontend attributes for the whole program or for named sub-functions.

``lower.xla_metadata: {key: value}`` attaches ``key="value"`` to every op the program emits.
``lower.scoped_metadata`` names sub-functions by import path and annotates only their ops::

    - {target: jaxaot.examples.transformer:_attention, must_fuse: "1"}   # MUST_FUSE group
    - {target: jaxaot.examples.transformer:_rms_norm, fuse_limit: true}  # FUSE_LIMIT boundary
    - {target: pkg.mod:fn, attributes: {team: kernels}}                  # any attributes

Values are scalars (XLA stores them as strings). Parsed here without JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.config.trust import DEFAULT_POLICY, ImportPolicy, check_name
from jaxaot.errors import ConfigError

SCOPED_KEYS = frozenset({"target", "attributes", "must_fuse", "fuse_limit"})


@dataclass(frozen=True)
class Scoped:
    """Attributes for the ops one sub-function emits."""

    target: str
    attributes: dict[str, Any] = field(default_factory=dict)
    must_fuse: str | None = None
    fuse_limit: bool = False
    # The import rules of the config it came from (trust.*): lowering resolves the target.
    policy: ImportPolicy = field(default=DEFAULT_POLICY, repr=False, compare=False)


def _attributes(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping of attribute: value, found {value!r}")
    for k, v in value.items():
        if not isinstance(v, str | int | float | bool):
            raise ConfigError(f"{key}.{k}: expected a string, number or bool, found {v!r}")
    return {str(k): v for k, v in value.items()}


def scoped_metadata(raw: Any, policy: ImportPolicy) -> list[Scoped]:
    """``lower.scoped_metadata`` (``raw``) parsed and checked; each target is imported under
    ``policy``."""
    if isinstance(raw, str) or not isinstance(raw, Sequence):
        raise ConfigError(
            f"lower.scoped_metadata: expected a list of {{target, ...}}, found {raw!r}"
        )
    out = []
    for i, entry in enumerate(raw):
        key = f"lower.scoped_metadata[{i}]"
        if not isinstance(entry, Mapping) or "target" not in entry:
            raise ConfigError(f"{key}: expected {{target: pkg.mod:fn, ...}}, found {entry!r}")
        unknown = set(map(str, entry)) - SCOPED_KEYS
        if unknown:
            raise ConfigError(
                f"{key}: unknown key(s) {sorted(unknown)}; expected {sorted(SCOPED_KEYS)}"
            )
        target = entry["target"]
        if not isinstance(target, str) or ":" not in target:
            raise ConfigError(f"{key}.target: expected 'package.module:function', found {target!r}")
        must_fuse, fuse_limit = entry.get("must_fuse"), entry.get("fuse_limit", False)
        if must_fuse is not None and not isinstance(must_fuse, str | int):
            raise ConfigError(f"{key}.must_fuse: expected a group identifier, found {must_fuse!r}")
        if not isinstance(fuse_limit, bool):
            raise ConfigError(f"{key}.fuse_limit: expected true or false, found {fuse_limit!r}")
        attrs = _attributes(entry.get("attributes") or {}, f"{key}.attributes")
        if not attrs and must_fuse is None and not fuse_limit:
            raise ConfigError(f"{key}: expected attributes, must_fuse or fuse_limit: true")
        out.append(
            Scoped(target, attrs, None if must_fuse is None else str(must_fuse), fuse_limit, policy)
        )
    return out


def check_metadata(xla_metadata: Any, scoped: Any, policy: ImportPolicy) -> None:
    """``lower.xla_metadata`` and ``lower.scoped_metadata`` before JAX: their shapes, and each
    scoped target's name against the import ``policy``."""
    _attributes(xla_metadata, "lower.xla_metadata")
    for i, one in enumerate(scoped_metadata(scoped, policy)):
        check_name(one.target, f"lower.scoped_metadata[{i}].target", policy)


__all__ = ["SCOPED_KEYS", "Scoped", "check_metadata", "scoped_metadata"]
