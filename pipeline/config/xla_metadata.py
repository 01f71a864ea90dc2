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
from typing import TYPE_CHECKING, Any

from jaxaot.config.trust import DEFAULT_POLICY, ImportPolicy, check_name, policy_of
from jaxaot.errors import ConfigError

if TYPE_CHECKING:
    from jaxaot.schema import JaxaotConfig

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


def scoped_metadata(cfg: JaxaotConfig) -> list[Scoped]:
    """``lower.scoped_metadata`` parsed and checked."""
    raw = cfg.lower.scoped_metadata
    if isinstance(raw, str) or not isinstance(raw, Sequence):
        raise ConfigError(
            f"lower.scoped_metadata: expected a list of {{target, ...}}, found {raw!r}"
        )
    out = []
    policy = policy_of(cfg)
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


def check_metadata(cfg: JaxaotConfig) -> None:
    _attributes(cfg.lower.xla_metadata, "lower.xla_metadata")
    policy = policy_of(cfg)
    for i, scoped in enumerate(scoped_metadata(cfg)):
        check_name(scoped.target, f"lower.scoped_metadata[{i}].target", policy)


__all__ = ["SCOPED_KEYS", "Scoped", "check_metadata", "scoped_metadata"]
