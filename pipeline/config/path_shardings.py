"""Shardings by pytree path: ``lower.in_shardings`` / ``out_shardings`` as a mapping of path
pattern -> spec, and ``lower.logical_axis_rules``.

Patterns are matched against the leaf paths of :mod:`jaxaot.config.tree_paths`
(``params/layers/wq``, ``opt_state/0/mu/layers/wq``, ``state/params/Dense_0/kernel``) of the
arguments jax.jit traces, so they reach leaves inside tuples, NamedTuples and registered
containers (optax states, flax ``TrainState``, Equinox modules)::

    lower:
      logical_axis_rules: [[embed, fsdp], [mlp, model], [batch, [data, fsdp]]]
      in_shardings:
        'params/**/kernel': [embed, mlp]     # logical names, mapped by the rules
        'params/embed': [model, fsdp]        # mesh axes
        'opt_state/**': like params          # mu/nu as params; count (no counterpart) replicated
        'tokens': [batch, null]

- A pattern is ``/``-separated components: ``*`` matches one component, ``**`` zero or more,
  a ``*`` inside a component any run of its characters (``Dense_*``); anything else is
  literal (``args[0]`` names the first positional argument, whatever its parameter name). A
  pattern that names an inner node applies to every leaf under it (``params`` = ``params/**``).
- The first pattern in config order that matches a leaf decides its spec: ``null``
  (replicated), a spec (a list with one entry per leading dimension: ``null``, a mesh axis, a
  logical axis name, or a list of mesh axes), or ``like <path>``: the spec of the leaf under
  ``<path>`` whose path relative to it is the longest suffix of this leaf's path. A leaf with no
  counterpart of the same shape is replicated (optax's ``count``) and noted.
- A leaf no pattern matches takes its library metadata (``logical_axes``: flax linen
  partition boxes, NNX sharding metadata) when it has some, else it is replicated and listed
  (``Resolution.unmatched``; a rank-0 leaf is replicated unlisted: a scalar has nothing to
  split): an explicit pattern beats metadata. Metadata is used with the
  mapping form or a null ``in_shardings`` (a positional list decides every leaf).
- A name in a spec or in metadata is a logical name when the rules name it (the rules win over
  a mesh axis of the same name), else a mesh axis; in metadata, a name that is neither is
  replicated on its dimension (flax: a name no rule maps), so ``nn.with_partitioning`` boxes
  that name mesh axes shard as ``nn.get_partition_spec`` says, without rules.
- Logical names map to mesh axes as ``flax.linen.logical_to_mesh_axes`` does (flax 0.12.8):
  the rules are tried in order; a rule applies to a dimension not yet assigned when none of its
  mesh axes is used by another dimension of the same array, else the next rule for that name is
  tried; a name no rule places is replicated on that dimension. One addition: a rule whose mesh
  axes do not divide the dimension is skipped like a used one (flax leaves that to jax.jit,
  which refuses the sharding); each such fallback is noted.
- Errors, one line naming the key and pattern: a name that is neither a mesh axis nor a
  logical name of the rules, a spec with more entries than the leaf's rank, mesh axes that do
  not divide a dimension, a pattern that matches no leaf (a typo would otherwise replicate
  silently), a ``like`` path with no leaves, a ``like`` that reaches the leaf itself.

While the lower stage traces the program, flax's ``logical_axis_rules`` context holds the same
rules (:func:`under_flax_rules`), so the model's own ``nn.with_logical_constraint`` and
``LogicallyPartitioned`` boxes map names as its arguments were.

The checks that need no shapes run before JAX (:func:`parse_rules`,
:func:`parse_logical_rules`); :func:`resolve_leaves` needs the leaves' paths and shapes, and
:func:`resolve` walks pytrees (importing JAX then).
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.config.sharding import REPLICATED, Spec, SpecEntry, _yaml
from jaxaot.errors import ConfigError

LIKE = "like "
RULES_KEY = "lower.logical_axis_rules"


@dataclass(frozen=True)
class LogicalRules:
    """``lower.logical_axis_rules`` as ``((logical name, mesh axes or None), ...)``, in order."""

    rules: tuple[tuple[str, tuple[str, ...] | None], ...] = ()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.rules)


def _names(value: Any) -> tuple[str, ...] | None:
    """A mesh-axis value of a rule or spec entry: null, a name, or a non-empty list of names."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError


def parse_logical_rules(value: Any, mesh_axes: Sequence[str]) -> LogicalRules:
    """``[[logical, mesh axis | [mesh axes] | null], ...]``, each mesh axis one of ``mesh_axes``."""
    if value is None:
        return LogicalRules()
    if isinstance(value, str | Mapping) or not isinstance(value, Sequence):
        raise ConfigError(
            f"{RULES_KEY}: expected a list of [logical name, mesh axes] pairs (e.g. [[embed, "
            f"fsdp], [batch, [data, fsdp]]]), found {_yaml(value)}"
        )
    out: list[tuple[str, tuple[str, ...] | None]] = []
    for i, pair in enumerate(value):
        ok = isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
        if not ok or not isinstance(pair[0], str) or not pair[0]:
            raise ConfigError(
                f"{RULES_KEY}[{i}]: expected [logical name, mesh axis or [mesh axes] or null], "
                f"found {_yaml(pair)}"
            )
        try:
            axes = _names(pair[1])
        except ValueError:
            raise ConfigError(
                f"{RULES_KEY}[{i}]: expected a mesh axis, a list of mesh axes or null for "
                f"{pair[0]!r}, found {_yaml(pair[1])}"
            ) from None
        for a in axes or ():
            if a not in mesh_axes:
                raise ConfigError(
                    f"{RULES_KEY}[{i}]: {pair[0]!r} maps to mesh axis {a!r}, which is not in "
                    f"the mesh; expected one of {list(mesh_axes)} (mesh.axes)"
                )
        if axes is not None and len(set(axes)) != len(axes):
            raise ConfigError(f"{RULES_KEY}[{i}]: mesh axes {list(axes)} repeat a name")
        out.append((pair[0], axes))
    return LogicalRules(tuple(out))


@dataclass(frozen=True)
class Rule:
    """One ``pattern: spec`` entry of a mapping-form ``in_shardings``/``out_shardings``."""

    key: str  # the config key, for messages
    pattern: str
    parts: tuple[str, ...]
    entries: tuple[SpecEntry, ...] | None  # None: replicated (unless ``like``)
    like: str | None = None

    @property
    def where(self) -> str:
        return f"{self.key}[{self.pattern!r}]"


def is_pattern_form(value: Any) -> bool:
    """Whether a ``lower.in_shardings``/``out_shardings`` value is the mapping form (a list or a
    single spec is the positional form of :mod:`jaxaot.config.sharding`)."""
    return isinstance(value, Mapping)


def pattern_parts(pattern: Any, key: str) -> tuple[str, ...]:
    """A path pattern's ``/``-separated components, checked (one line naming ``key``)."""
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{key}: expected path patterns as keys, found {pattern!r}")
    parts = tuple(pattern.split("/"))
    for p in parts:
        if not p or ("**" in p and p != "**"):
            raise ConfigError(
                f"{key}[{pattern!r}]: expected /-separated components, each a name, * (one "
                "component), ** (any number) or a name with * in it (Dense_*), found "
                f"{p!r} in {pattern!r}"
            )
    return parts


def _spec_value(value: Any, where: str, mesh_axes: Sequence[str], logical: LogicalRules) -> Any:
    """The entries of a spec value, its names checked (a mesh axis or a logical name)."""
    raw = [value] if isinstance(value, str) else value
    if isinstance(raw, Mapping) or not isinstance(raw, Sequence):
        raise ConfigError(
            f"{where}: expected null, 'like <argument path>' or a spec (a list of null, axis "
            f"names or lists of mesh axes, one per dimension), found {_yaml(value)}"
        )
    entries: list[SpecEntry] = []
    used: set[str] = set()
    for entry in raw:
        try:
            names = _names(entry)
        except ValueError:
            raise ConfigError(
                f"{where}: spec {_yaml(value)} has entry {_yaml(entry)}; expected null, an "
                "axis name or a list of mesh axes"
            ) from None
        for name in names or ():
            if name in logical.names:
                if len(names or ()) > 1:
                    raise ConfigError(
                        f"{where}: spec {_yaml(value)} puts logical axis {name!r} in a list; "
                        "expected a logical name alone on its dimension (a list holds mesh axes)"
                    )
            elif name not in mesh_axes:
                known = sorted(logical.names)
                raise ConfigError(
                    f"{where}: spec {_yaml(value)} names {name!r}, which is neither a mesh axis "
                    f"{list(mesh_axes)} (mesh.axes) nor a logical name of {RULES_KEY}"
                    + (f" {known}" if known else " (none set)")
                )
            if name in used:
                raise ConfigError(
                    f"{where}: spec {_yaml(value)} uses {name!r} twice; expected each axis on "
                    "at most one dimension"
                )
            used.add(name)
        entries.append(entry if entry is None or isinstance(entry, str) else tuple(entry))
    return tuple(entries)


def parse_rules(
    value: Mapping[Any, Any], key: str, mesh_axes: Sequence[str], logical: LogicalRules
) -> list[Rule]:
    """The mapping form's rules, in config order, with every name checked (before JAX)."""
    rules = []
    for pattern, spec in value.items():
        parts = pattern_parts(pattern, key)
        where = f"{key}[{pattern!r}]"
        if spec is None:
            rules.append(Rule(key, pattern, parts, None))
        elif isinstance(spec, str) and spec.startswith(LIKE):
            target = spec[len(LIKE) :].strip()
            if not target or "*" in target or any(not p for p in target.split("/")):
                raise ConfigError(
                    f"{where}: expected 'like <argument path>' (e.g. like params, like "
                    f"state/params), found {spec!r}"
                )
            rules.append(Rule(key, pattern, parts, None, like=target))
        else:
            rules.append(Rule(key, pattern, parts, _spec_value(spec, where, mesh_axes, logical)))
    return rules


def _component(pattern: str, name: str) -> bool:
    if "*" not in pattern:
        return pattern == name
    return re.fullmatch(".*".join(re.escape(p) for p in pattern.split("*")), name) is not None


def matches(parts: Sequence[str], comps: Sequence[str], i: int = 0, j: int = 0) -> bool:
    """Whether pattern ``parts`` matches the path ``comps`` or one of its ancestors."""
    while i < len(parts):
        p = parts[i]
        if p == "**":
            return any(matches(parts, comps, i + 1, k) for k in range(j, len(comps) + 1))
        if j == len(comps) or not _component(p, comps[j]):
            return False
        i, j = i + 1, j + 1
    return True


_UNASSIGNED = object()


@dataclass(frozen=True)
class PathLeaf:
    """A leaf to shard: its path, shape and (for a positional argument) its ``args[i]`` path."""

    path: str
    shape: tuple[Any, ...]
    alias: str | None = None


@dataclass
class Resolution:
    """Every leaf's spec, how it was decided, and what no rule decided."""

    specs: dict[str, Spec] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)  # replicated: no pattern, no metadata
    notes: list[str] = field(default_factory=list)  # fallbacks worth a look

    def table(self) -> list[dict[str, Any]]:
        return [
            {
                "path": p,
                "shape": [d if isinstance(d, int) else str(d) for d in self.shapes[p]],
                "spec": str(s),
                "by": self.sources[p],
            }
            for p, s in self.specs.items()
        ]


def merged(resolutions: Sequence[Resolution]) -> Resolution | None:
    """One Resolution holding every leaf of ``resolutions`` (of disjoint leaves: the positional
    arguments' and the keyword arguments'), in order; None when there is none."""
    if not resolutions:
        return None
    if len(resolutions) == 1:
        return resolutions[0]
    out = Resolution()
    for res in resolutions:
        out.specs |= res.specs
        out.sources |= res.sources
        out.shapes |= res.shapes
        out.unmatched += res.unmatched
        out.notes += res.notes
    return out


def divides_over(size: Any, axes: Sequence[str], mesh: Mapping[str, int]) -> bool:
    """Whether mesh axes ``axes`` together split a dimension of ``size`` evenly (see
    :func:`divides`); ``mesh``: axis sizes by name."""
    parts = 1
    for a in axes:
        parts *= mesh[a]
    return divides(size, parts)


def divides(size: Any, parts: int) -> bool:
    """Whether ``parts`` devices split a dimension evenly, as JAX decides it (jax 0.10.2,
    ``sharding._common_shard_shape``: ``divmod(size, parts)`` with remainder 0): an int, or a
    symbolic dimension (jax.export's) whose remainder is the constant 0 for every value of its
    variables under the run's constraints (``2*b`` by 2 yes, ``b`` by 2 no)."""
    if isinstance(size, int):
        return size % parts == 0
    return divmod(size, parts)[1] == 0  # a polynomial division that is not exact: a mod term


class _Resolver:
    def __init__(
        self,
        leaves: Sequence[PathLeaf],
        rules: Sequence[Rule],
        mesh: Mapping[str, int],
        logical: LogicalRules,
        logical_axes: Mapping[str, Sequence[str | None] | None],
        others: Mapping[str, tuple[tuple[Any, ...], Spec]],
    ) -> None:
        self.leaves = {leaf.path: leaf for leaf in leaves}
        self.rules, self.mesh, self.logical = rules, dict(mesh), logical
        self.logical_axes = logical_axes
        self.others = others
        self.out = Resolution()
        self.visiting: list[str] = []
        self.used: set[int] = set()
        self.rel_maps: dict[str, dict[str, str]] = {}
        self.alias_of = {leaf.alias: leaf.path for leaf in leaves if leaf.alias}

    def run(self) -> Resolution:
        for path in self.leaves:
            self.spec_of(path)
        specs = {p: self.out.specs[p] for p in self.leaves}  # leaf order
        self.out.specs = specs
        self.out.sources = {p: self.out.sources[p] for p in self.leaves}
        self.out.shapes = {p: self.leaves[p].shape for p in self.leaves}
        unmatched = set(self.out.unmatched)  # in leaf order ('like' resolves some early)
        self.out.unmatched = [p for p in self.leaves if p in unmatched]
        return self.out

    def first_rule(self, leaf: PathLeaf) -> Rule | None:
        comps = leaf.path.split("/")
        alias = leaf.alias.split("/") if leaf.alias else None
        for i, rule in enumerate(self.rules):
            if matches(rule.parts, comps) or (alias is not None and matches(rule.parts, alias)):
                self.used.add(i)
                return rule
        return None

    def spec_of(self, path: str) -> Spec:
        if path in self.out.specs:
            return self.out.specs[path]
        leaf = self.leaves[path]
        if path in self.visiting:
            chain = " -> ".join([*self.visiting[self.visiting.index(path) :], path])
            raise ConfigError(f"lower shardings: 'like' rules go round in a circle: {chain}")
        self.visiting.append(path)
        rule = self.first_rule(leaf)
        names = self.logical_axes.get(path)
        if rule is not None and rule.like is not None:
            spec, source = self.like(leaf, rule)
        elif rule is not None:
            spec = self.place(rule.entries or (), leaf, rule.where, None)
            source = repr(rule.pattern)
        elif names is not None:
            where = f"{path}: library metadata {_yaml(list(names))}"
            if len(set(n for n in names if n is not None)) != len([n for n in names if n]):
                raise ConfigError(f"{where} names a logical axis twice (flax refuses it too)")
            spec = self.place(tuple(_meta_entry(n) for n in names), leaf, where, names)
            source = f"metadata {_yaml(list(names))}"
        elif not leaf.shape:  # a scalar (optax's count, nnx.Optimizer's step): nothing to split
            spec, source = REPLICATED, "a scalar: replicated"
        else:
            spec, source = REPLICATED, "no rule: replicated"
            self.out.unmatched.append(path)
        self.visiting.pop()
        self.out.specs[path], self.out.sources[path] = spec, source
        return spec

    def rel_map(self, target: str) -> dict[str, str]:
        """Paths under ``target`` (relative to it) -> their full path, over this resolution's
        leaves (by path and by ``args[i]`` alias) and the already resolved ``others``."""
        if target not in self.rel_maps:
            rel: dict[str, str] = {}
            pool = [*self.leaves, *self.alias_of, *self.others]
            for p in pool:
                if p == target or p.startswith(target + "/"):
                    rel.setdefault(p[len(target) + 1 :], self.alias_of.get(p, p))
            self.rel_maps[target] = rel
        return self.rel_maps[target]

    def like(self, leaf: PathLeaf, rule: Rule) -> tuple[Spec, str]:
        assert rule.like is not None
        rel = self.rel_map(rule.like)
        if not rel:
            tops = sorted({p.split("/")[0] for p in [*self.leaves, *self.others]})
            raise ConfigError(
                f"{rule.where}: like {rule.like}: no leaf is at or under {rule.like!r}; expected "
                f"a path of the traced arguments (top level: {', '.join(tops)})"
            )
        comps = leaf.path.split("/")
        other = None
        for k in range(len(comps) + 1):  # longest suffix first; "" is the target leaf itself
            found = rel.get("/".join(comps[k:]))
            if found is not None:
                other = found
                break
        if other is None:
            return REPLICATED, f"{rule.pattern!r}: like {rule.like}: no counterpart, replicated"
        if other == leaf.path:
            raise ConfigError(
                f"{rule.where}: {leaf.path} matches 'like {rule.like}', which is this leaf "
                f"itself; expected an earlier pattern that decides {leaf.path}"
            )
        if other in self.leaves:
            shape, spec = self.leaves[other].shape, self.spec_of(other)
        else:
            shape, spec = self.others[other]
        if [str(d) for d in shape] != [str(d) for d in leaf.shape]:
            if leaf.shape:
                self.out.notes.append(
                    f"{leaf.path}: {rule.where} like {rule.like}: counterpart {other} has shape "
                    f"{list(shape)}, this leaf {list(leaf.shape)}; replicated"
                )
            return REPLICATED, f"{rule.pattern!r}: like {other} (other shape): replicated"
        return spec, f"{rule.pattern!r}: like {other}"

    def place(
        self,
        entries: Sequence[SpecEntry],
        leaf: PathLeaf,
        where: str,
        metadata: Sequence[str | None] | None,
    ) -> Spec:
        """Mesh axes for one leaf: explicit mesh axes as given, logical names by the rules."""
        shape = leaf.shape
        if len(entries) > len(shape):
            raise ConfigError(
                f"{where}: spec {_yaml(list(entries))} has {len(entries)} entries but "
                f"{leaf.path} has rank {len(shape)} (shape {list(shape)}); expected at most "
                f"{len(shape)} (one per dimension)"
            )
        result: list[Any] = []
        logical_dims: list[str | None] = []
        for dim, entry in enumerate(entries):
            grouped = metadata is not None and isinstance(entry, tuple)
            if grouped and not all(a in self.mesh for a in entry or ()):
                entry = None  # a group of names that are not all mesh axes: the rules map names
            logical = isinstance(entry, str) and entry in self.logical.names
            if logical or (
                metadata is not None and isinstance(entry, str) and entry not in self.mesh
            ):
                result.append(_UNASSIGNED)  # placed by the rules; no rule: replicated
                logical_dims.append(entry if isinstance(entry, str) else None)
                continue
            logical_dims.append(None)
            axes = (entry,) if isinstance(entry, str) else entry or ()
            for a in axes:
                if a not in self.mesh:  # only reachable from a Python-API value
                    raise ConfigError(f"{where}: mesh axis {a!r} is not in the mesh {self.mesh}")
            if not divides_over(shape[dim], axes, self.mesh):
                parts = 1
                for a in axes:
                    parts *= self.mesh[a]
                raise ConfigError(
                    f"{where}: dimension {dim} of {leaf.path} has size {shape[dim]}, which mesh "
                    f"axes {list(axes)} (together {parts} devices) do not divide; expected a "
                    "multiple: change the spec, the shape or mesh.shape"
                )
            result.append(entry)
        if any(n is not None for n in logical_dims):
            self.assign(result, logical_dims, leaf)
        while result and result[-1] is None:
            result.pop()
        return Spec(tuple(result))

    def assign(self, result: list[Any], dims: list[str | None], leaf: PathLeaf) -> None:
        """flax.linen's logical_to_mesh_axes over ``result`` (in place), skipping rules whose
        mesh axes do not divide the dimension."""
        skipped: dict[int, list[str]] = {}
        for name, axes in self.logical.rules:
            if name not in dims:
                continue
            pos = dims.index(name)
            if result[pos] is not _UNASSIGNED:
                continue
            taken = {a for e in result if e is not _UNASSIGNED for a in _entry_axes(e)}
            if taken & set(axes or ()):
                continue  # flax: the next rule for this name, if any
            if axes is not None and not divides_over(leaf.shape[pos], axes, self.mesh):
                skipped.setdefault(pos, []).append(_yaml(list(axes)))
                continue
            result[pos] = None if axes is None else axes[0] if len(axes) == 1 else axes
        for pos, entry in enumerate(result):
            if entry is _UNASSIGNED:
                result[pos] = None
                if pos in skipped:
                    self.out.notes.append(
                        f"{leaf.path}: dimension {pos} ({dims[pos]}, size {leaf.shape[pos]}) "
                        f"replicated: mesh axes {', '.join(skipped[pos])} do not divide it"
                    )


def _meta_entry(entry: Any) -> SpecEntry:
    """One dimension of library metadata: a name, a group of names, or None (also for
    ``PartitionSpec.UNCONSTRAINED``, which a sharding cannot say)."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, Sequence) and entry and all(isinstance(e, str) for e in entry):
        return entry[0] if len(entry) == 1 else tuple(entry)
    return None


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def resolve_leaves(
    leaves: Sequence[PathLeaf],
    value: Mapping[Any, Any] | None,
    *,
    key: str,
    mesh: Mapping[str, int],
    logical: LogicalRules = LogicalRules(),
    logical_axes: Mapping[str, Sequence[str | None] | None] | None = None,
    others: Mapping[str, tuple[tuple[Any, ...], Spec]] | None = None,
) -> Resolution:
    """Every leaf's spec under the mapping ``value`` (None: metadata alone), the rules and the
    library metadata. ``others`` are leaves resolved before (the inputs, for ``out_shardings``)
    that ``like`` may name. Raises :class:`ConfigError` naming the key and pattern."""
    rules = parse_rules(value or {}, key, list(mesh), logical)
    resolver = _Resolver(leaves, rules, mesh, logical, logical_axes or {}, others or {})
    out = resolver.run()
    unused = [r for i, r in enumerate(rules) if i not in resolver.used]
    for rule in unused:
        if not any(matches(rule.parts, p.split("/")) for p in _all_paths(leaves)):
            raise no_match_error(rule.where, key, leaves)
        out.notes.append(f"{rule.where}: every leaf it matches is decided by an earlier pattern")
    return out


def flax_rules_context(logical: LogicalRules) -> contextlib.AbstractContextManager[Any]:
    """flax's ``logical_axis_rules`` context with these rules while the program is traced, so
    its own ``nn.with_logical_constraint`` and ``LogicallyPartitioned`` boxes map logical names
    as the arguments were (flax maps them without the divisibility fallback). Nothing when
    there are no rules or the program has not loaded flax."""
    if not logical.rules or "flax" not in sys.modules:
        return contextlib.nullcontext()
    try:
        from flax.core.spmd import logical_axis_rules
    except ImportError:  # a flax without the linen rules
        return contextlib.nullcontext()
    rules = tuple((n, a if a is None or len(a) > 1 else a[0]) for n, a in logical.rules)
    return logical_axis_rules(rules)


_UNDER_RULES: weakref.WeakKeyDictionary[Any, dict[LogicalRules, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def under_flax_rules(fn: Callable[..., Any], logical: LogicalRules) -> Callable[..., Any]:
    """``fn`` traced inside :func:`flax_rules_context`: one wrapper per (function, rules), so
    JAX's trace cache (which knows nothing of flax's rules) never hands a trace made under
    other rules back. ``fn`` itself when the context would be empty."""
    if not logical.rules or "flax" not in sys.modules:
        return fn
    known = _UNDER_RULES.setdefault(fn, {})
    if logical not in known:

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with flax_rules_context(logical):
                return fn(*args, **kwargs)

        known[logical] = traced
    return known[logical]


def _all_paths(leaves: Sequence[PathLeaf]) -> list[str]:
    return [p for leaf in leaves for p in (leaf.path, leaf.alias) if p]


def path_leaves(
    tops: Sequence[tuple[str, Any]], aliases: Sequence[str | None] | None = None
) -> tuple[list[tuple[list[str], Any]], list[PathLeaf]]:
    """Every leaf of ``tops`` (``[(top-level name, tree)]``) as a :class:`PathLeaf` (with its
    ``args[i]`` path when ``aliases`` names one), in flatten order, and per top its leaf paths
    and treedef (to build a tree like it from values by path)."""
    import jax
    from jaxaot.config.tree_paths import join

    flats: list[tuple[list[str], Any]] = []
    leaves: list[PathLeaf] = []
    for i, (top, tree) in enumerate(tops):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        alias = aliases[i] if aliases is not None else None
        paths = [join(top, keys) for keys, _ in flat]
        flats.append((paths, treedef))
        for (keys, leaf), path in zip(flat, paths, strict=True):
            shape = tuple(getattr(leaf, "shape", ()))
            leaves.append(PathLeaf(path, shape, join(alias, keys) if alias else None))
    return flats, leaves


def first_match(patterns: Sequence[tuple[str, ...]], leaf: PathLeaf) -> int | None:
    """The index of the first pattern (its parts) matching ``leaf`` by path or ``args[i]`` path."""
    comps = leaf.path.split("/")
    alias = leaf.alias.split("/") if leaf.alias else None
    for i, parts in enumerate(patterns):
        if matches(parts, comps) or (alias is not None and matches(parts, alias)):
            return i
    return None


def check_keyword_patterns(value: Any, n_args: int, keywords: Mapping[str, Any]) -> None:
    """The mapping form resolved over the positional arguments and then the traced keyword
    arguments (``keywords``: keyword -> abstract value), the ``j``-th of which is also reachable
    as ``args[n_args + j]``: refuse a pattern that decides a keyword argument's leaf only through
    that position (``args[1]`` naming keyword ``a``), since keyword arguments are named by
    keyword, as JAX's key paths name them."""
    if not is_pattern_form(value):
        return
    key = "lower.in_shardings"
    patterns = [pattern_parts(p, key) for p in value]
    names = list(value)
    aliases = [f"args[{n_args + j}]" for j in range(len(keywords))]
    for leaf in path_leaves(list(keywords.items()), aliases)[1]:
        via = first_match(patterns, leaf)
        if via is not None and via != first_match(patterns, PathLeaf(leaf.path, leaf.shape)):
            raise ConfigError(
                f"{key}[{names[via]!r}]: matches keyword argument leaf {leaf.path} only as "
                f"{leaf.alias}, but program.args has {n_args} positional argument(s); expected a "
                f"pattern naming keyword arguments by keyword (e.g. '{leaf.path}')"
            )


def no_match_error(where: str, key: str, leaves: Sequence[PathLeaf]) -> ConfigError:
    """A pattern that matches no leaf: one line naming it and some leaf paths to choose from."""
    what = "outputs" if "out_" in key else "arguments"
    shown = ", ".join(leaf.path for leaf in leaves[:4])
    more = f", ... ({len(leaves)} in all)" if len(leaves) > 4 else ""
    return ConfigError(
        f"{where}: matches no leaf of the {what}; expected a pattern over their "
        f"leaf paths ({shown}{more}), or remove it"
    )


def resolve(
    tops: Sequence[tuple[str, Any]],
    value: Mapping[Any, Any] | None,
    *,
    key: str,
    mesh: Mapping[str, int],
    logical: LogicalRules = LogicalRules(),
    logical_axes: Mapping[str, Sequence[str | None] | None] | None = None,
    aliases: Sequence[str | None] | None = None,
    others: Mapping[str, tuple[tuple[Any, ...], Spec]] | None = None,
) -> tuple[list[Any], Resolution]:
    """Specs for pytrees: ``tops`` is ``[(top-level name, tree)]`` (the abstract arguments jax.jit
    traces, or its outputs); ``aliases`` the ``args[i]`` name of each (or None). Returns one
    :class:`Spec` tree per top, shaped like its tree, and the :class:`Resolution`."""
    import jax

    flats, leaves = path_leaves(tops, aliases)
    res = resolve_leaves(
        leaves,
        value,
        key=key,
        mesh=mesh,
        logical=logical,
        logical_axes=logical_axes,
        others=others,
    )
    trees = [
        jax.tree_util.tree_unflatten(treedef, [res.specs[p] for p in paths])
        for paths, treedef in flats
    ]
    return trees, res


__all__ = [
    "LIKE",
    "LogicalRules",
    "PathLeaf",
    "Resolution",
    "Rule",
    "check_keyword_patterns",
    "divides",
    "divides_over",
    "first_match",
    "flax_rules_context",
    "is_pattern_form",
    "matches",
    "merged",
    "no_match_error",
    "parse_logical_rules",
    "parse_rules",
    "path_leaves",
    "pattern_parts",
    "resolve",
    "resolve_leaves",
    "under_flax_rules",
]
