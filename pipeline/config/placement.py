"""Memory kinds and layouts by pytree path: ``lower.in_memory_kinds`` / ``out_memory_kinds`` and
``lower.in_layouts`` / ``out_layouts``.

Each key takes one value for every leaf, or a mapping of leaf-path pattern -> value, matched
as ``lower.in_shardings``' mapping form matches (:mod:`jaxaot.config.path_shardings`: ``*``,
``**``, ``args[0]``; the first pattern in config order that matches a leaf decides it; a
pattern that matches no leaf is an error)::

    lower:
      in_memory_kinds: {'opt_state/**': pinned_host, 'params/**': pinned_host}
      out_memory_kinds: {'output/1/**': pinned_host}   # the updated optimizer state
      in_layouts: {'x': auto}                          # the compiler chooses x's layout
      out_layouts: [1, 0]                              # every output column-major

- A memory kind is ``device``, ``pinned_host`` or ``unpinned_host`` (``null``: the default,
  device memory); the target's devices must have it (``device.addressable_memories()``, the
  compile-only devices of ``compile.topology`` too), checked when lowering. A TPU target
  (``compile.topology``, ``compile.backend=tpu``) refuses ``unpinned_host`` before JAX: its
  devices list it, but XLA fails on it there (:data:`TPU_REFUSED_KINDS`); use ``pinned_host``.
- A layout is ``auto`` (XLA chooses; ``Format(Layout.AUTO)``), ``default`` or ``null`` (no
  Format: the platform's default) or a list of dimensions, major to minor
  (``Layout(major_to_minor=...)``), one per dimension of the leaf. jax 0.10.2 compares a
  concrete layout with the devices' default while lowering, so a major-to-minor list needs
  the devices there: one device of ``compile.backend``, or on a mesh its first ``mesh.size``
  devices (the leaf's sharding on that concrete mesh, as JAX's layout tests write
  ``Format(Layout(...), NamedSharding(mesh, spec))``); not ``mesh.abstract=true`` nor
  ``compile.topology``, which lower without devices.

Outputs are named ``output/...`` as in ``lower.out_shardings``. The checks that need no shapes
run before JAX (:func:`check`); :func:`resolve_placement` needs the leaves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jaxaot.config.path_shardings import PathLeaf, first_match, no_match_error, pattern_parts
from jaxaot.config.sharding import _yaml
from jaxaot.errors import ConfigError

if TYPE_CHECKING:
    from jaxaot.config.mesh import ReplicaAxes
    from jaxaot.config.sections import MeshConfig

MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
AUTO, DEFAULT = "auto", "default"
KEYS = ("in_memory_kinds", "out_memory_kinds", "in_layouts", "out_layouts")

# A leaf's layout: AUTO, or the dimensions major to minor; None is the default (no Format).
LayoutValue = str | tuple[int, ...] | None


@dataclass(frozen=True)
class Placement:
    """Where one leaf lives and how it is laid out: a memory kind (None: the default) and a
    layout (``"auto"``, a major-to-minor tuple, or None: the default)."""

    memory_kind: str | None = None
    layout: LayoutValue = None
    # The key (and pattern) that chose the memory kind, for messages.
    kind_from: str = field(default="", compare=False)

    @property
    def empty(self) -> bool:
        return self.memory_kind is None and self.layout is None

    def to_json(self) -> dict[str, Any]:
        layout = list(self.layout) if isinstance(self.layout, tuple) else self.layout
        return {"memory_kind": self.memory_kind, "layout": layout}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Placement:
        layout = data.get("layout")
        return Placement(
            data.get("memory_kind"), tuple(layout) if isinstance(layout, list) else layout
        )


def _kind(value: Any, where: str) -> str | None:
    if value is None or value in MEMORY_KINDS:
        return value
    kinds = ", ".join(MEMORY_KINDS)
    if "[" in where:  # a pattern's value: one kind
        raise ConfigError(
            f"{where}: expected a memory kind ({kinds}) or null, found {_yaml(value)}"
        )
    raise ConfigError(
        f"{where}: expected a memory kind ({kinds}) for every leaf, a mapping "
        f"{{leaf-path pattern: kind}} (e.g. {where}={{params/**: pinned_host}}) or null, "
        f"found {_yaml(value)}"
    )


# Memory kinds a TPU target refuses although its devices list them (jax 0.10.2, libtpu
# 0.0.x deviceless v5e): unpinned_host outputs fail in XLA ("FAILED_PRECONDITION: Unimplemented
# DMA from hbm to hbm") and unpinned_host arguments can fail with an INTERNAL shape mismatch.
TPU_REFUSED_KINDS = ("unpinned_host",)


def refuse_on_tpu(where: str, kind: str | None, target: str) -> None:
    """A memory kind XLA fails on for TPU (:data:`TPU_REFUSED_KINDS`), refused before JAX."""
    if kind in TPU_REFUSED_KINDS:
        raise ConfigError(
            f"{where}: {kind} on a TPU target ({target}) fails in XLA (jax 0.10.2: "
            "'Unimplemented DMA from hbm to hbm' or a shape mismatch), although TPU devices "
            "list it; expected pinned_host (or device) there: use pinned_host"
        )


def _layout(value: Any, where: str) -> LayoutValue:
    if value is None or value == DEFAULT:
        return None
    if value == AUTO:
        return AUTO
    ok = (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(d, int) and not isinstance(d, bool) for d in value)
    )
    if not ok:
        raise ConfigError(
            f"{where}: expected auto, default, null or a list of dimensions major to minor "
            f"(e.g. [1, 0]), found {_yaml(value)}"
        )
    dims = tuple(value)
    if sorted(dims) != list(range(len(dims))):
        raise ConfigError(
            f"{where}: layout {list(dims)} is not an order of the dimensions 0..{len(dims) - 1}; "
            "expected each dimension once, major to minor (e.g. [1, 0])"
        )
    return dims


@dataclass(frozen=True)
class Rules:
    """One key's value parsed: a value for every leaf (``patterns`` empty) or pattern rules."""

    key: str
    every: Any = None  # the single value, when not the mapping form
    patterns: tuple[tuple[str, tuple[str, ...], Any], ...] = ()  # (pattern, parts, value)

    @property
    def set(self) -> bool:
        return bool(self.patterns) or self.every is not None


def parse(value: Any, key: str) -> Rules:
    """``lower.<key>``'s value, every kind or layout checked (before JAX)."""
    one = _kind if "memory_kinds" in key else _layout
    if value is None:
        return Rules(key)
    if isinstance(value, Mapping):
        rules = []
        for pattern, v in value.items():
            parts = pattern_parts(pattern, key)
            rules.append((pattern, parts, one(v, f"{key}[{pattern!r}]")))
        return Rules(key, patterns=tuple(rules))
    return Rules(key, every=one(value, key))


class TargetOptions(Protocol):
    """The compile options that say whether a run compiles for TPU (the compile section has
    them)."""

    @property
    def topology(self) -> str | None: ...
    @property
    def backend(self) -> str: ...


def check_placement(
    low: Any, mesh: MeshConfig, stage_out: ReplicaAxes, comp: TargetOptions
) -> None:
    """The four keys of the lower section ``low``, before JAX: their values, and what this
    run can place (on the mesh of ``mesh`` and ``stage_out.axis_env``, for ``comp``'s target).
    A major-to-minor layout needs the devices while lowering (jax 0.10.2 compares it with
    their default layout), which ``mesh.abstract=true`` and ``compile.topology`` (lowered off
    their devices) do not give; a per-replica program (``stage_out.axis_env``) has its own
    shardings."""
    from jaxaot.config.mesh import mesh_spec

    rules = {name: parse(getattr(low, name), f"lower.{name}") for name in KEYS}
    if not any(r.set for r in rules.values()):
        return
    spec = mesh_spec(mesh, stage_out)
    if spec is not None and spec.per_replica:
        first = next(r.key for r in rules.values() if r.set)
        raise ConfigError(
            f"{first}: a per-replica program (stage_out.axis_env) places its arguments itself; "
            "expected a mesh (mesh.shape, mesh.axes) instead of axis_env, or null"
        )
    target = _tpu_target(comp)
    if target is not None:
        for name in ("in_memory_kinds", "out_memory_kinds"):
            r = rules[name]
            refuse_on_tpu(r.key, r.every, target)
            for pat, _, v in r.patterns:
                refuse_on_tpu(f"{r.key}[{pat!r}]", v, target)
    for name in ("in_layouts", "out_layouts"):
        r = rules[name]
        concrete = [(r.key, r.every)] if isinstance(r.every, tuple) else []
        concrete += [(f"{r.key}[{pat!r}]", v) for pat, _, v in r.patterns if isinstance(v, tuple)]
        abstract = spec is not None and spec.abstract
        if concrete and (abstract or comp.topology):
            where, value = concrete[0]
            what = f"compile.topology={comp.topology}" if comp.topology else "mesh.abstract=true"
            raise ConfigError(
                f"{where}: layout {list(value)} needs the devices while lowering (jax 0.10.2 "
                f"compares it with their default layout), which {what} lowers without; "
                "expected auto or default there, or a mesh of this host's devices "
                "(mesh.abstract=false) and no topology"
            )


def _tpu_target(comp: TargetOptions) -> str | None:
    """``compile.topology=...`` or ``compile.backend=tpu`` when the run compiles for TPU."""
    if comp.topology:
        return f"compile.topology={comp.topology}"
    if str(comp.backend or "").lower() == "tpu":
        return "compile.backend=tpu"
    return None


def _decide(rules: Rules, leaves: Sequence[PathLeaf]) -> dict[str, tuple[Any, str]]:
    """Each leaf's value and where it came from (the key, or the key and pattern)."""
    if not rules.patterns:
        return {leaf.path: (rules.every, rules.key) for leaf in leaves}
    parts = [p for _, p, _ in rules.patterns]
    out: dict[str, tuple[Any, str]] = {}
    used: set[int] = set()
    for leaf in leaves:
        i = first_match(parts, leaf)
        if i is None:
            out[leaf.path] = (None, rules.key)
            continue
        used.add(i)
        pattern, _, value = rules.patterns[i]
        out[leaf.path] = (value, f"{rules.key}[{pattern!r}]")
    for i, (pattern, _, _) in enumerate(rules.patterns):
        if i not in used:
            raise no_match_error(f"{rules.key}[{pattern!r}]", rules.key, leaves)
    return out


def resolve_placement(
    leaves: Sequence[PathLeaf], kinds: Any, layouts: Any, side: str
) -> dict[str, Placement]:
    """Every leaf's :class:`Placement` from ``lower.<side>_memory_kinds`` and
    ``lower.<side>_layouts`` (``side``: ``in`` or ``out``), a layout's length checked against
    the leaf's rank. Empty when neither key is set."""
    kind_rules = parse(kinds, f"lower.{side}_memory_kinds")
    layout_rules = parse(layouts, f"lower.{side}_layouts")
    if not kind_rules.set and not layout_rules.set:
        return {}
    by_kind, by_layout = _decide(kind_rules, leaves), _decide(layout_rules, leaves)
    out: dict[str, Placement] = {}
    for leaf in leaves:
        layout, where = by_layout[leaf.path]
        if isinstance(layout, tuple) and len(layout) != len(leaf.shape):
            raise ConfigError(
                f"{where}: layout {list(layout)} has {len(layout)} dimensions but {leaf.path} has "
                f"rank {len(leaf.shape)} (shape {list(leaf.shape)}); expected one entry per "
                "dimension, or a pattern that does not match it"
            )
        kind, kind_from = by_kind[leaf.path]
        out[leaf.path] = Placement(kind, layout, kind_from)
    return out


def check_kinds(
    placements: Mapping[str, Placement], accepted: Sequence[str], device_kind: str
) -> None:
    """Every memory kind chosen is one the target's devices have (``accepted``), and none a
    TPU refuses (:data:`TPU_REFUSED_KINDS`; ``device_kind`` names TPU devices "TPU ...")."""
    for path, p in placements.items():
        if p.memory_kind is not None and p.memory_kind not in accepted:
            raise ConfigError(
                f"{p.kind_from}: {path} is to be in {p.memory_kind!r}, which "
                f"{device_kind} devices do not have; expected one of {', '.join(accepted)}"
            )
        if device_kind.upper().startswith("TPU"):
            refuse_on_tpu(p.kind_from, p.memory_kind, f"{device_kind} devices")


__all__ = [
    "AUTO",
    "DEFAULT",
    "KEYS",
    "MEMORY_KINDS",
    "TPU_REFUSED_KINDS",
    "Placement",
    "Rules",
    "TargetOptions",
    "check_kinds",
    "check_placement",
    "parse",
    "refuse_on_tpu",
    "resolve_placement",
]
