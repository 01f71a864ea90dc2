"""Stage 2, lower: the traced program to StableHLO, HLO and a portable ``jax.export`` blob.

Reads ``lower`` options (platforms, donation, keep_unused, shardings on ``mesh``, XLA metadata);
writes ``module.stablehlo.mlir``, ``module.hlo.txt``, ``exported.bin`` (the resumable form:
compile needs no Python code of the program once it has this), ``lowered.json`` (platforms,
device count, mesh) and ``cost_analysis.json`` where the lowering offers one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast

from jaxaot.config.argspec import symbols
from jaxaot.config.mesh import MeshSpec, logical_rules, mesh_spec
from jaxaot.config.path_shardings import (
    Resolution,
    is_pattern_form,
    resolve,
    under_flax_rules,
)
from jaxaot.config.placement import check_placement
from jaxaot.config.sections import PLATFORMS, check_indices
from jaxaot.config.sharding import Spec
from jaxaot.config.tree_paths import leaf_paths, top_names
from jaxaot.config.xla_metadata import check_metadata, scoped_metadata
from jaxaot.errors import ConfigError, StageError, StoreError, one_line
from jaxaot.stages import module_text
from jaxaot.stages.cost_figures import costs_of
from jaxaot.stages.jax_mesh import (
    abstract_mesh,
    has_arrays,
    jax_internal,
    named,
    output_shardings,
    resolved_with_keywords,
    tracing_on,
    update_shardings,
)
from jaxaot.stages.jax_metadata import with_metadata
from jaxaot.stages.jax_placement import placed
from jaxaot.stages.jaxenv import platform_of
from jaxaot.stages.node import Entry, Keyed, Node, StageContext, Upstream
from jaxaot.stages.stage_out import StagedOut
from jaxaot.util import heap, memo
from jaxaot.util.canonical import canonical_stablehlo
from jaxaot.util.humanize import human_count

if TYPE_CHECKING:
    import jax
    from jaxaot.schema import JaxaotConfig


@dataclass(frozen=True)
class LowerConfig:
    """The ``lower`` section (conf/lower/): platforms, donation, shardings, metadata, texts."""

    platforms: list[str] | None = None
    donate_argnums: list[int] = field(default_factory=list)
    donate_argnames: list[str] = field(default_factory=list)
    keep_unused: bool = False
    # A positional list of specs, or a mapping of leaf-path pattern -> spec
    # (jaxaot.config.path_shardings).
    in_shardings: Any = None
    out_shardings: Any = None
    # [[logical axis name, mesh axis | [mesh axes] | null], ...], tried in order (MaxText's form).
    logical_axis_rules: Any = None
    # Memory kind per argument / output leaf (device | pinned_host | unpinned_host): one kind for
    # every leaf, or a mapping of leaf-path pattern -> kind, as in_shardings' mapping form.
    in_memory_kinds: Any = None
    out_memory_kinds: Any = None
    # Layout per argument / output leaf: auto | default | [major-to-minor dims]: one for every
    # leaf, or a mapping of leaf-path pattern -> layout.
    in_layouts: Any = None
    out_layouts: Any = None
    xla_metadata: dict[str, Any] = field(default_factory=dict)
    scoped_metadata: list[Any] = field(default_factory=list)
    # Keep MLIR locations / HLO source metadata in the text artifacts (keys and snapshots strip them).
    debug_info: bool = False
    # jax.export safety checks to disable: "platform" (call the export on another platform),
    # "custom_call:<target>" (export a custom call not known to be stable); str() of
    # jax.export.DisabledSafetyCheck.
    disabled_checks: list[str] = field(default_factory=list)
    # Serialize exported.bin with this many orders of VJP (jax.export serialize(vjp_order=)).
    vjp_order: int = 0
    # Text artifacts print constants of more elements elided; None keeps them all (issue 19).
    elide_constants_over: int | None = 1024


_PARTITIONS = re.compile(r"mhlo\.num_partitions = (\d+)")
_REPLICAS = re.compile(r"mhlo\.num_replicas = (\d+)")


def _module_devices(stablehlo: str) -> int:
    """Devices a module runs on (partitions x replicas), read from its attributes."""
    parts, reps = _PARTITIONS.search(stablehlo), _REPLICAS.search(stablehlo)
    return (int(parts[1]) if parts else 1) * (int(reps[1]) if reps else 1)


@dataclass(frozen=True)
class Lowered:
    """A lowered program: live JAX objects when lowered here, the export alone when resumed."""

    exported: jax.export.Exported | None  # None before the export (early) or when it failed
    lowered: jax.stages.Lowered | None  # None when loaded from a checkpoint or made concrete
    platforms: tuple[str, ...]
    module_sha256: str  # the module's bytecode without locations: the compile key's program part
    donate_argnums: tuple[int, ...]  # positions among the exported function's arguments
    meta: dict[str, Any]
    # Which of its lives this record is in: "early" (the module exists, the export not yet:
    # what compile-ahead begins on), "live" (lowered in this process), "concrete" (a
    # polymorphic export made concrete for compile.shapes), "loaded" (from a checkpoint: the
    # export alone, no program code).
    state: Literal["early", "live", "concrete", "loaded"] = "live"
    donate_argnames: tuple[str, ...] = ()  # the exported function's donated keyword arguments

    def export(self) -> jax.export.Exported:
        """The export, which every compile of a resumed, multi-platform or topology lowering
        goes through; a StageError when there is none (a program jax.export cannot serialize,
        e.g. host callbacks: lower's warnings say why)."""
        if self.exported is None:
            raise StageError(
                "compile",
                "this lowering has no jax.export (see lower's warnings); lower for one platform "
                "alone and compile in the same run",
            )
        return self.exported


def _flat_donations(staged: StagedOut) -> tuple[int, ...]:
    """Donated positions among the non-static positional arguments (the export's calling order)."""
    traced_positions = [i for i in range(len(staged.args)) if not staged.bound.is_static(i)]
    return tuple(traced_positions.index(i) for i in staged.bound.donate_argnums)


def _donated_keywords(staged: StagedOut) -> tuple[str, ...]:
    """Donated keyword arguments among the traced ones (the export's keyword inputs)."""
    bound = staged.bound
    return tuple(n for n in bound.donate_argnames if n in bound.kwargs and not bound.is_static(n))


def _jit_options(ctx: StageContext, staged: StagedOut) -> dict[str, Any]:
    opts = dict(staged.jit_options)
    bound = staged.bound
    if bound.donate_argnums:
        opts["donate_argnums"] = bound.donate_argnums
    names = tuple(n for n in bound.donate_argnames if n in bound.kwargs)
    if names:
        opts["donate_argnames"] = names
    if ctx.cfg.lower.keep_unused:
        opts["keep_unused"] = True
    return opts


def _sharded(
    ctx: StageContext, staged: StagedOut, mesh: MeshSpec, amesh: Any, opts: dict[str, Any]
) -> tuple[Any, dict[str, Any], tuple[Any, ...], dict[str, Any]]:
    """The program, jit options and arguments with ``lower.in_shardings``/``out_shardings`` on
    ``mesh``.

    The static keyword arguments are bound into the function. jax.jit takes no keyword
    arguments alongside in_shardings ("pjit does not support kwargs when in_shardings is
    specified", jax 0.10.2), so with traced keyword arguments every input's sharding rides on
    its ShapeDtypeStruct instead (``jax.jit(f).trace(x_sds, a=a_sds)``, which lowers to the same
    module): a keyword argument's leaves are named by the keyword in the mapping form
    (``{a: [data]}``), the positional list covers the positional arguments alone, and a keyword
    leaf no spec names is replicated, as a positional one is. Path patterns and logical-axis
    rules are resolved on ``staged.args``/``staged.kwargs``, the abstract arguments jax.jit
    traces; what they decided is written to ``path_shardings.json``.
    """
    cfg = ctx.cfg.lower
    bound = staged.bound
    assert staged.fn is not None  # lowering again always traces the program (see the runner)
    static_kw = {k: v for k, v in staged.kwargs.items() if bound.is_static(k)}
    traced_kw = {k: v for k, v in staged.kwargs.items() if not bound.is_static(k)}
    fn = functools.partial(staged.fn, **static_kw) if static_kw else staged.fn
    # flax's own logical constraints (nn.with_logical_constraint, LogicallyPartitioned) see
    # lower.logical_axis_rules while the program is traced.
    fn = under_flax_rules(fn, logical_rules(ctx.cfg, mesh))
    dropped = ("static_argnames",) if traced_kw else ("static_argnames", "donate_argnames")
    opts = {k: v for k, v in opts.items() if k not in dropped}
    names = staged.signature.get("parameters")
    found = resolved_with_keywords(
        ctx.cfg, bound, mesh, staged.args, traced_kw, names, staged.logical_axes
    )
    specs = found.specs
    shardings = (*found.positional, *found.keyword)
    ins = found.resolutions[0] if found.resolutions else None
    args: tuple[Any, ...] = found.args
    _check_symbolic_splits(
        bound, (*found.args, *found.kwargs.values()), list(traced_kw), shardings, mesh
    )
    kwargs: dict[str, Any] = {}
    if traced_kw:
        args, kwargs = _carrying(bound, args, found.kwargs, found.positional, found.keyword)
    else:
        opts["in_shardings"] = shardings
    outs = None
    if cfg.out_shardings is not None:
        traced = staged.traced
        assert traced is not None, "out_shardings need the traced program"
        # With NNX arguments the traced function returns (the user's output, the Variables it
        # updated): lower.out_shardings describe the user's output; each update keeps the
        # sharding its Variable came in with (a parameter stays laid out as it was).
        out_info, out_tree = traced.out_info, traced.out_tree
        if staged.returns_updates:
            out_info, out_tree = traced.out_info[0], traced.out_tree.children()[0]
        if is_pattern_form(cfg.out_shardings):
            trees, outs = resolve(
                [("output", out_info)],
                cfg.out_shardings,
                key="lower.out_shardings",
                mesh=mesh.sizes,
                logical=logical_rules(ctx.cfg, mesh),
                others=_input_leaves(staged, specs, names, list(traced_kw)),
            )
            user = named(trees[0], amesh)
        else:
            user = output_shardings(cfg.out_shardings, out_info, out_tree, mesh, amesh)
        opts["out_shardings"] = user
        if staged.returns_updates:
            positions = [i for i in range(len(staged.args)) if not bound.is_static(i)]
            updates = update_shardings(
                traced.out_info[1],
                staged.args,
                found.positional,
                positions,
                top_names(len(staged.args), names),
            )
            opts["out_shardings"] = (user, updates)
    if ins is not None or outs is not None:
        _record_paths(ctx, ins, outs)
    return fn, opts, args, kwargs


def _check_symbolic_splits(
    bound: Any,
    every: tuple[Any, ...],
    keywords: list[str],
    shardings: tuple[Any, ...],
    mesh: MeshSpec,
) -> None:
    """Each symbolic dimension a sharding splits is divisible by its devices for every value of
    its variables, as JAX requires when it traces (jax 0.10.2 raises IndivisibleError for
    ``f32[b,4]`` on ``P('data')``, and accepts ``f32[2*b,4]``): one line naming the argument.
    ``every``: the positional arguments, then the traced keyword arguments' values."""
    import math

    import jax
    from jaxaot.config.path_shardings import divides
    from jaxaot.stages.resolving import type_str

    n = len(every) - len(keywords)
    tops = [(f"program.args[{i}]", every[i]) for i in range(n) if not bound.is_static(i)]
    tops += [(f"program.kwargs.{k}", v) for k, v in zip(keywords, every[n:], strict=True)]
    for (top, arg), prefix in zip(tops, shardings, strict=True):
        full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix, arg)
        for (path, leaf), sh in zip(leaf_paths(arg, top), jax.tree.leaves(full), strict=True):
            shape = tuple(getattr(leaf, "shape", ()))
            if all(isinstance(d, int) for d in shape):
                continue  # concrete sizes: checked against the config before JAX
            for dim, entry in enumerate(sh.spec):
                names = (entry,) if isinstance(entry, str) else tuple(entry or ())
                parts = math.prod(mesh.sizes[a] for a in names)
                if not divides(shape[dim], parts):
                    raise ConfigError(
                        f"lower.in_shardings: {path} ({type_str(shape, leaf.dtype)}): dimension "
                        f"{dim} has the symbolic size {shape[dim]}, which mesh axes {list(names)} "
                        f"(together {parts} devices) do not divide for every value of its "
                        f"variables (JAX requires it when tracing); expected a multiple of "
                        f"{parts} (e.g. {parts}*{symbols(str(shape[dim]))[0]}), or the dimension "
                        "unsplit"
                    )


def _carrying(
    bound: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    arg_shardings: tuple[Any, ...],
    kw_shardings: tuple[Any, ...],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The traced arguments with each ShapeDtypeStruct carrying its sharding (one sharding may
    stand for a subtree); static positions and Python scalars as they are."""
    import jax

    def carry(tree: Any, prefix: Any) -> Any:
        def typed(sharding: Any, sub: Any) -> Any:
            return jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=sharding)
                    if isinstance(x, jax.ShapeDtypeStruct)
                    else x
                ),
                sub,
            )

        return jax.tree.map(typed, prefix, tree)

    it = iter(arg_shardings)
    new_args = tuple(a if bound.is_static(i) else carry(a, next(it)) for i, a in enumerate(args))
    new_kwargs = {k: carry(v, sh) for (k, v), sh in zip(kwargs.items(), kw_shardings, strict=True)}
    return new_args, new_kwargs


def _input_leaves(
    staged: StagedOut, specs: tuple[Any, ...], names: list[str] | None, keywords: list[str]
) -> dict[str, tuple[tuple[Any, ...], Spec]]:
    """Every traced input leaf's shape and spec by path (and ``args[i]`` path), for ``like``
    in ``out_shardings``; a positional-form spec standing for a subtree is given to each leaf.
    ``specs`` has one tree per traced positional argument, then one per traced keyword
    argument in ``keywords`` (named by its keyword)."""
    import jax

    out: dict[str, tuple[tuple[Any, ...], Spec]] = {}
    traced = [i for i in range(len(staged.args)) if not staged.bound.is_static(i)]
    tops = top_names(len(staged.args), names)
    inputs: list[tuple[Any, tuple[str, ...]]] = [
        (staged.args[i], (tops[i], f"args[{i}]")) for i in traced
    ]
    inputs += [(staged.kwargs[k], (k,)) for k in keywords]
    for (arg, paths), spec_tree in zip(inputs, specs, strict=True):
        full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), spec_tree, arg)
        flat = jax.tree.leaves(full)
        for top in dict.fromkeys(paths):
            for (path, leaf), spec in zip(leaf_paths(arg, top), flat, strict=True):
                out[path] = (tuple(getattr(leaf, "shape", ())), spec)
    return out


def _record_paths(ctx: StageContext, ins: Resolution | None, outs: Resolution | None) -> None:
    """``path_shardings.json`` (every leaf's spec and what decided it) and one warning line for
    the leaves no rule decided and one for the fallbacks."""
    record: dict[str, Any] = {}
    for side, res in (("inputs", ins), ("outputs", outs)):
        if res is None:
            continue
        record[side] = res.table()
        record[f"unmatched_{side}"] = res.unmatched
        record[f"notes_{side}"] = res.notes
        key = "lower.in_shardings" if side == "inputs" else "lower.out_shardings"
        if res.unmatched:
            shown = ", ".join(res.unmatched[:3])
            more = f" (+{len(res.unmatched) - 3} more)" if len(res.unmatched) > 3 else ""
            n = len(res.unmatched)
            ctx.warn(
                f"{key}: {n} {'leaf matches' if n == 1 else 'leaves match'} no pattern and "
                f"{'has' if n == 1 else 'have'} no logical axes, so replicated: {shown}{more} "
                "(lower/path_shardings.json)"
            )
        if res.notes:
            more = f" (+{len(res.notes) - 1} more)" if len(res.notes) > 1 else ""
            ctx.warn(f"{key}: {res.notes[0]}{more} (lower/path_shardings.json)")
    ctx.write_json("path_shardings.json", record)


# Containers jax.export serializes itself.
_BUILTIN_NODES = (tuple, list, dict, type(None))


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _node_classes(treedef: Any) -> list[type]:
    """The NamedTuple and other user pytree classes in a structure (outer first, each once)."""
    import collections

    found: list[type] = []
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None:
            cls = data[0]
            builtin = cls in _BUILTIN_NODES or cls in (
                collections.OrderedDict,
                collections.defaultdict,
            )
            if not builtin and cls not in found:
                found.append(cls)
        stack.extend(reversed(node.children()))
    return found


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _aux_to_bytes(aux: Any) -> bytes:
    # A registered class's aux data (a dataclass's static fields, a user's own): stored as a
    # Python literal, read back with ast.literal_eval, so loading runs no code.
    import ast

    text = repr(aux)
    try:
        same = ast.literal_eval(text) == aux
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ValueError(f"pytree aux data {text[:80]} is not a Python literal")
    return text.encode()


def _aux_from_bytes(data: bytes) -> Any:
    import ast

    return ast.literal_eval(data.decode())


def _register_class(cls: type, name: str) -> None:
    """Let jax.export (de)serialize ``cls`` under ``name``; once per process."""
    from jax._src.export import _export

    if cls in _export.serialization_registry:
        return  # registered before (by us, or by the user under a name of their own)
    stale = _export.deserialization_registry.get(name)
    if stale is not None and stale[0] is not cls:
        # The same module:class imported again (a reloaded module): the new class replaces it.
        del _export.deserialization_registry[name]
        _export.serialization_registry.pop(stale[0], None)
    import jax

    if _is_namedtuple(cls):
        jax.export.register_namedtuple_serialization(cls, serialized_name=name)
    else:
        jax.export.register_pytree_node_serialization(
            cls,
            serialized_name=name,
            serialize_auxdata=_aux_to_bytes,
            deserialize_auxdata=_aux_from_bytes,
        )


def _register_output_types(exported: Any) -> list[str]:
    """Register the NamedTuples and user pytree classes (registered dataclasses, classes of
    ``jax.tree_util.register_pytree_node``) in the export's input and output structures
    (jaxlib's EighResult, SVDResult, QRResult, a user's own), so that ``serialize`` accepts
    them; return their names.

    A class defined inside a function cannot be imported by a later run: left unregistered, so
    the export fails as before (with jax's message) instead of writing an unloadable file.
    """
    names = []
    for cls in _node_classes(exported.in_tree) + _node_classes(exported.out_tree):
        if "<locals>" in cls.__qualname__:
            continue
        name = _class_name(cls)
        _register_class(cls, name)
        names.append(name)
    return names


def _import_pytree_classes(names: list[str], policy: Any) -> None:
    """Import and register the pytree classes a checkpointed export names (lowered.json),
    each under the run's import policy (``trust.*``) like any name a config gives."""
    import importlib

    from jaxaot.config.trust import check_name, check_resolved

    key = "resume_from: lowered.json pytree class"
    for name in names:
        module, _, qualname = name.partition(":")
        check_name(name, key, policy)  # before anything is imported
        try:
            obj: Any = importlib.import_module(module)
            modules = [obj]
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise StoreError(
                f"resume_from: the lowering's arguments or outputs hold a pytree class {name!r} "
                f"that cannot be imported here ({exc}); start at stage_out instead"
            ) from None
        check_resolved(name, key, policy, modules, obj)
        if not isinstance(obj, type):
            raise StoreError(
                f"resume_from: {name!r} named in lowered.json is not a pytree class (found "
                f"{type(obj).__name__}); start at stage_out instead"
            )
        _register_class(obj, name)


def check_platforms(platforms: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """``lower.platforms`` as JAX lowers for them, and a warning for each near-miss of a name
    JAX knows.

    JAX's set of platforms is open (jax 0.10.2: ``lower`` and ``jax.export`` take any name,
    "users can add platforms"; an unknown one is lowered with the default rules only), so a
    name such as ``other`` is exported as given; one close to a known name (``tpuu``, ``CPU``)
    is probably a typo: exported too, with a warning. An alias (``gpu``) is the GPU platform
    present, as JAX's ``canonicalize_platform`` says; with none present it is an error, as in
    JAX. Compiling for a platform the lowering lacks is compile's to refuse (check_platform)."""
    import difflib

    # No public list or canonicalization of platforms in jax 0.10: xla_bridge's private ones.
    try:
        from jax._src import xla_bridge

        aliases = dict(xla_bridge._platform_aliases)  # cuda -> gpu, ...
        known = sorted(xla_bridge.known_platforms())
        canonicalize = xla_bridge.canonicalize_platform
    except (ImportError, AttributeError, TypeError) as exc:
        raise jax_internal(
            "jax._src.xla_bridge's _platform_aliases, known_platforms or canonicalize_platform",
            "read lower.platforms as JAX does",
            exc,
        ) from None
    out: list[str] = []
    notes: list[str] = []
    for p in platforms:
        if p in aliases.values():
            meant = sorted(k for k, v in aliases.items() if v == p)
            try:
                out.append(canonicalize(p))
            except RuntimeError as exc:
                raise ConfigError(
                    f"lower.platforms: {p!r} ({p} is an alias of {', '.join(meant)}) names the "
                    f"{p} platform present, and JAX has none here ({one_line(exc)}); expected "
                    f"one of {', '.join(meant)} (e.g. lower.platforms=[{meant[0]}])"
                ) from None
            continue
        out.append(p)
        if p in known:
            continue
        close = difflib.get_close_matches(p.lower(), known, n=1, cutoff=0.75)
        if close:
            notes.append(
                f"lower.platforms: {p!r} is no platform this JAX knows (did you mean "
                f"{close[0]!r}?); JAX lowers for it with its default rules only, and a compile "
                f"here refuses it unless lower.disabled_checks=[platform]"
            )
    return tuple(out), notes


def safety_checks(names: list[str] | tuple[str, ...]) -> list[jax.export.DisabledSafetyCheck]:
    """``lower.disabled_checks`` as ``jax.export.DisabledSafetyCheck`` (spellings checked by
    :func:`check`)."""
    from jax.export import DisabledSafetyCheck

    return [
        DisabledSafetyCheck.platform()
        if name == "platform"
        else DisabledSafetyCheck.custom_call(name.removeprefix("custom_call:"))
        for name in names
    ]


def _check_disabled(names: Any) -> None:
    for name in names:
        target = name.removeprefix("custom_call:") if isinstance(name, str) else ""
        if name == "platform" or (name != target and target.strip() == target and target):
            continue
        raise ConfigError(
            f"lower.disabled_checks: expected 'platform' or 'custom_call:<target>' (the "
            f"jax.export.DisabledSafetyCheck spellings), found {name!r}; e.g. "
            "lower.disabled_checks=[platform] or '[custom_call:lapack_sgesvd_ffi]'"
        )


_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w.$-]+)\(")


def _custom_call_hint(exc: Exception) -> str:
    """How to export anyway when jax.export refused custom calls it does not know stable."""
    text = str(exc)
    if "custom calls whose targets have no compatibility guarantees" not in text:
        return ""
    targets = list(dict.fromkeys(_CUSTOM_CALL.findall(text)))
    if not targets:
        return ""
    listed = ", ".join(f"custom_call:{t}" for t in targets)
    return f"; to export it anyway (no stability guarantee), lower.disabled_checks='[{listed}]'"


# Platforms JAX implements donation for (jax 0.10.2: mlir._platforms_with_donation, private).
def _donating(platforms: tuple[str, ...]) -> bool:
    try:
        from jax._src.interpreters import mlir

        supported = mlir._platforms_with_donation
        return any(p in supported for p in platforms)
    except (ImportError, AttributeError, TypeError) as exc:
        raise jax_internal(
            "jax._src.interpreters.mlir._platforms_with_donation",
            "record which arguments are donated",
            exc,
        ) from None


def _donation_keys(cfg: JaxaotConfig) -> str:
    low = cfg.lower
    keys = [
        f"lower.{k}={list(getattr(low, k))}"
        for k in ("donate_argnums", "donate_argnames")
        if getattr(low, k)
    ]
    return " and ".join(keys) or "donation"


@dataclass(frozen=True)
class _Texts:
    """What the lower stage derives from one lowering: texts, module digest, cost analysis."""

    stablehlo: str
    module_sha256: str
    hlo: str | None
    hlo_error: str
    cost: dict[str, float] | None
    warning: str | None


def _derive_texts(lowered: Any, elide_over: int | None, debug: bool) -> _Texts:
    stablehlo = module_text.stablehlo_text(lowered, elide_over, debug)
    module_sha = module_text.module_digest(lowered)
    elided = elide_over is not None and module_text.ELIDED in stablehlo
    warning = None
    if elided or elide_over is None:
        found = module_text.large_constants(lowered, elide_over or 1024)
        warning = module_text.warning(found)
    if elided:
        assert elide_over is not None
        stablehlo += module_text.trailer(module_sha, elide_over, "//")
    hlo, hlo_module, error = None, None, ""
    try:
        hlo, hlo_module = module_text.hlo_text(lowered, keep_large=not elided, debug=debug)
        if elided:
            assert elide_over is not None
            hlo += module_text.trailer(module_sha, elide_over, "//")
    except Exception as exc:
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # Loops counted per trip, as the compile stage counts them (XLA counts a body once).
    raw = module_text.cost_analysis(lowered, hlo_module)
    cost = costs_of(lowered, hlo, raw)[0] if raw else None
    return _Texts(stablehlo, module_sha, hlo, error, cost, warning)


def _texts(ctx: StageContext, lowered: Any, same: Any) -> _Texts:
    """The texts and digest of ``lowered``, computed once per JAX lowering object (a sweep's
    later jobs reuse them); large constants elided per ``lower.elide_constants_over``."""
    elide_over = ctx.cfg.lower.elide_constants_over  # checked by config.validate
    debug = bool(ctx.cfg.lower.debug_info)  # locations kept in the texts (issue 17)
    texts = memo.derived(
        same, f"texts:{elide_over}:{debug}", lambda: _derive_texts(lowered, elide_over, debug)
    )
    if texts.warning:
        ctx.warn(texts.warning)
    return texts


def run(ctx: StageContext, staged: StagedOut) -> Lowered:
    import jax

    cfg = ctx.cfg
    platforms, notes = check_platforms(
        tuple(cfg.lower.platforms or (platform_of(cfg.compile.backend),))
    )
    for note in notes:
        ctx.warn(note)
    opts = _jit_options(ctx, staged)
    assert staged.fn is not None, "lowering needs the traced program (a resumed stage_out has none)"
    fn, kwargs, mesh_json = staged.fn, staged.kwargs, staged.replicas
    args = staged.args
    mesh = mesh_spec(cfg)
    mesh_context: Any = contextlib.nullcontext()
    amesh = None
    if mesh is not None and not mesh.per_replica:
        amesh = abstract_mesh(mesh)
        fn, opts, args, kwargs = _sharded(ctx, staged, mesh, amesh, opts)
        mesh_json = mesh.to_json()
    # lower.{in,out}_memory_kinds and lower.{in,out}_layouts on the shardings just made.
    placement = placed(cfg, staged, fn, opts, tuple(args), kwargs, platforms, amesh)
    fn, opts, args, kwargs = placement.fn, placement.opts, placement.args, placement.kwargs
    if amesh is not None and cfg.mesh.context:
        # The program sees the mesh as under jax.set_mesh (bare PartitionSpecs, shard_map
        # without mesh=); a program without arguments is lowered for the mesh's devices.
        # mesh.context=false: the mesh only places arguments and outputs.
        mesh_context = tracing_on(amesh, unplaced=not has_arrays(args, kwargs))
    if placement.replicated_outputs:
        outs = placement.replicated_outputs
        more = f" (+{len(outs) - 3} more)" if len(outs) > 3 else ""
        ctx.warn(
            f"lower.out_memory_kinds/out_layouts: {len(outs)} output leaves placed with no "
            f"lower.out_shardings, so replicated on the mesh: {', '.join(outs[:3])}{more}"
        )
    jitted = jax.jit(fn, **opts)
    scoped = scoped_metadata(cfg)
    heap_tuning = contextlib.ExitStack()
    with (
        mesh_context,
        with_metadata(dict(cfg.lower.xla_metadata), scoped) as annotated,
        heap_tuning,
    ):
        # Reuse stage_out's trace only for the same program, jit options and arguments: with
        # traced keyword arguments the shardings ride on the arguments, not on the options.
        reuse = (
            fn is staged.fn
            and opts == staged.jit_options
            and not annotated
            and _same_inputs((args, kwargs), (staged.args, staged.kwargs))
        )
        traced = staged.traced if reuse and staged.traced else jitted.trace(*args, **kwargs)
        try:
            with ctx.capture_warnings():
                lowered = traced.lower(lowering_platforms=platforms)
        except NotImplementedError as exc:  # JAX's rule: all or none of the platforms donate
            if "should support donation" not in str(exc):
                raise
            raise ConfigError(
                f"lower.platforms={list(platforms)} with {_donation_keys(cfg)}: {one_line(exc)}; "
                "donate nothing, or lower the platforms without donation in a run of their own"
            ) from None
        # The texts and the export copy every embedded constant a dozen times: with big ones,
        # freed buffers are kept for reuse until the stage ends (issue 19).
        heap_tuning.enter_context(heap.reusing_big_buffers(_embeds_big_constants(lowered)))
        # JAX hands back its cached lowering object for a program it lowered before in this
        # process (a sweep's later jobs): its texts and cost analysis are computed once.
        same = getattr(lowered, "_lowering", None)
        texts = _texts(ctx, lowered, same)
        stablehlo, module_sha = texts.stablehlo, texts.module_sha256
        # For platforms none of which implement donation JAX drops it (its warning says so):
        # the module donates nothing, and neither does a compile of its export.
        donate = _flat_donations(staged) if _donating(platforms) else ()
        donate_names = _donated_keywords(staged) if _donating(platforms) else ()
        early = {"mesh": mesh_json, "nr_devices": _module_devices(stablehlo)} if mesh_json else {}
        unplaced = amesh is not None and cfg.mesh.context and not has_arrays(args, kwargs)
        if unplaced and mesh is not None and early["nr_devices"] != mesh.size:
            # tracing_on's context did not reach jax.jit: refused rather than compiled wrong.
            raise jax_internal(
                "jax._src.pjit.get_ctx_mesh (its result no longer decides the devices of a "
                f"jit without arguments: lowered for {early['nr_devices']})",
                f"lower a program without arguments for the mesh's {mesh.size} devices",
                RuntimeError("module devices differ from the mesh"),
            )
        disabled = safety_checks(cfg.lower.disabled_checks)
        polymorphic = _has_symbolic(staged.args, kwargs)
        if ctx.publish_early is not None and not polymorphic:  # compile while we export
            ctx.publish_early(
                Lowered(
                    exported=None,
                    lowered=lowered,
                    platforms=platforms,
                    module_sha256=module_sha,
                    donate_argnums=donate,
                    meta=early,
                    state="early",
                    donate_argnames=donate_names,
                )
            )
        ctx.write("module.stablehlo.mlir", stablehlo)
        # Only making the texts and the export may fail softly; writing them may not (a full
        # disk is the run's error, not a warning).
        if texts.hlo is not None:
            ctx.write("module.hlo.txt", texts.hlo)
        else:  # some multi-platform lowerings have no single HLO form
            ctx.warn(f"no HLO text for platforms {list(platforms)}: {texts.hlo_error}")
        try:  # inside the mesh and metadata contexts: the export traces again
            with ctx.capture_warnings():
                # Placed arguments carry the memory kind jax.jit is given for them.
                # So do the arguments of a program with traced keyword arguments (no
                # in_shardings: every sharding rides on its argument).
                carried = placement.record or "in_shardings" not in opts
                export_args = args if carried else staged.args
                exported = jax.export.export(jitted, platforms=platforms, disabled_checks=disabled)(
                    *export_args, **kwargs
                )
                pytree_types = _register_output_types(exported)
                # vjp_order: the export carries that many orders of derivatives (issue 17).
                exported_bytes = _serialize(exported, cfg.lower.vjp_order)
        except Exception as exc:  # e.g. host callbacks (jax.debug.print) have no serialized form
            exported, pytree_types = None, []
            ctx.warn(
                "no exported.bin: jax.export cannot serialize this program "
                f"({' '.join(str(exc).split())[:200]}); it compiles and runs here, but a later "
                f"run cannot resume from this lowering{_custom_call_hint(exc)}"
            )
        else:
            ctx.write("exported.bin", exported_bytes)
    cost = texts.cost
    if cost:
        ctx.write_json("cost_analysis.json", cost)
        ctx.metrics.update(flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))
    meta: dict[str, Any] = {
        "platforms": list(platforms),
        "module_sha256": module_sha,
        "donate_argnums": list(donate),
        "donate_argnames": list(donate_names),
        "nr_devices": exported.nr_devices if exported is not None else None,
    }
    if pytree_types:  # what a resumed run registers before deserializing exported.bin
        meta["namedtuples"] = pytree_types
    if disabled:  # as exported.bin's disabled_safety_checks say them
        meta["disabled_checks"] = [str(c) for c in disabled]
        ctx.metrics.update(disabled_checks=meta["disabled_checks"])
    if placement.record:  # what lower.*_memory_kinds / *_layouts asked for, per flat leaf
        meta["placement"] = placement.record
    if mesh_json is not None:
        meta |= early
        ctx.metrics.update(
            mesh=MeshSpec.from_json(mesh_json).describe(), devices=early["nr_devices"]
        )
    ctx.write_json("lowered.json", meta)
    ctx.metrics.update(platforms=list(platforms))
    record = Lowered(
        exported=exported,
        lowered=lowered,
        platforms=platforms,
        module_sha256=module_sha,
        donate_argnums=donate,
        meta=meta,
        donate_argnames=donate_names,
    )
    return for_compile(ctx, record) if polymorphic else record


def _same_inputs(these: Any, traced: Any) -> bool:
    """Whether ``these`` (args, kwargs) are the inputs stage_out traced: the same objects, or
    equal ShapeDtypeStructs (shape, dtype, sharding, layout and weak type compared)."""
    import jax

    a, a_tree = jax.tree.flatten(these)
    b, b_tree = jax.tree.flatten(traced)
    return bool(a_tree == cast(Any, b_tree)) and all(
        x is y or (isinstance(x, jax.ShapeDtypeStruct) and x == y)
        for x, y in zip(a, b, strict=True)
    )


def _serialize(exported: Any, vjp_order: int) -> bytearray | memoryview:
    """``exported.serialize(vjp_order)``: the same bytes, with the flatbuffer built at its
    final size at once. jax's starts at 64 KiB and doubles, copying a module that embeds a
    51 MB constant ten times over (issue 19); the builder's output does not depend on where
    it started (alignment counts from the buffer's end). Derivatives (``vjp_order`` > 0) carry
    modules of their own: jax's own call."""
    try:
        import flatbuffers
        from jax._src.export import serialization  # no public sizing in jax 0.10

        build = serialization._serialize_exported
    except (ImportError, AttributeError):
        build = None
    if build is None or vjp_order:
        return exported.serialize(vjp_order=vjp_order)
    builder = flatbuffers.Builder(len(exported.mlir_module_serialized) + (1 << 16))
    builder.Finish(build(builder, exported, vjp_order))
    return memoryview(builder.Bytes)[builder.Head() :]  # Output() without its copy


def _embeds_big_constants(lowered: Any) -> bool:
    """Whether the module's captured constants are big enough to lower with the heap tuned."""
    return heap.worth_it(sum(c.nbytes for c in module_text.large_constants(lowered, 1024)))


def _has_symbolic(*trees: Any) -> bool:
    import jax

    return any(
        not isinstance(d, int)
        for leaf in jax.tree_util.tree_leaves(trees)
        for d in getattr(leaf, "shape", ())
    )


def for_compile(ctx: StageContext, record: Lowered) -> Lowered:
    """A polymorphic lowering made concrete for ``compile.shapes`` (issue 17): the export
    called at those sizes, exported again (JAX checks the shape constraints there). exported.bin
    stays polymorphic: every size compiles from one lowering. Unchanged when nothing compiles
    or the lowering has no symbolic dimensions."""
    import jax
    from jaxaot.config.argspec import symbols
    from jaxaot.config.order import STAGES
    from jaxaot.errors import one_line

    exp = record.exported
    later = STAGES.index(ctx.cfg.stop_after) >= STAGES.index("compile")
    if exp is None or not later or not _has_symbolic(exp.in_avals):
        return record
    sizes = dict(ctx.cfg.compile.shapes)
    used: dict[str, int] = {}
    avals = []
    for aval in exp.in_avals:
        shape = []
        for d in aval.shape:
            if isinstance(d, int):
                shape.append(d)
                continue
            names = symbols(str(d))
            missing = [v for v in names if v not in sizes]
            if missing:
                raise ConfigError(
                    f"compile.shapes: the lowering is polymorphic in {str(d)!r}; expected a size "
                    f"for {', '.join(repr(m) for m in missing)} (e.g. compile.shapes="
                    f"{{{missing[0]}: 32}}), or stop_after=lower"
                )
            used |= {v: sizes[v] for v in names}
            shape.append(int(d._evaluate(sizes)))  # jax 0.10: no public evaluation of a dim
        avals.append((tuple(shape), aval))
    in_flat: list[Any] = [None] * len(avals)
    jit_opts: dict[str, Any] = {}
    mesh_context: Any = contextlib.nullcontext()
    if record.meta.get("mesh") and exp.nr_devices > 1:  # called on the lowering's own mesh
        amesh = abstract_mesh(MeshSpec.from_json(record.meta["mesh"]))
        in_flat = list(exp.in_shardings_jax(amesh))
        outs = jax.tree_util.tree_unflatten(exp.out_tree, exp.out_shardings_jax(amesh))
        jit_opts = {"out_shardings": outs}
        # jax.jit takes no in_shardings with keyword arguments (jax 0.10.2): with keyword
        # inputs each sharding rides on its ShapeDtypeStruct.
        if not jax.tree_util.tree_unflatten(exp.in_tree, in_flat)[1]:
            jit_opts["in_shardings"] = jax.tree_util.tree_unflatten(exp.in_tree, in_flat)[0]
            in_flat = [None] * len(avals)
        if ctx.cfg.mesh.context:
            mesh_context = jax.sharding.use_abstract_mesh(amesh)
    structs = [
        jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)
        for (shape, aval), sharding in zip(avals, in_flat, strict=True)
    ]
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, structs)
    try:
        with mesh_context:
            # The same safety checks off as the export it calls (its custom calls recur).
            concrete = jax.export.export(
                jax.jit(exp.call, **jit_opts),
                platforms=exp.platforms,
                disabled_checks=exp.disabled_safety_checks,
            )(*args, **kwargs)
    except ValueError as exc:  # a shape constraint or a division that does not hold
        raise ConfigError(f"compile.shapes={used}: {one_line(exc)}") from None
    ctx.metrics.update(shapes=used)
    meta = {**record.meta, "shapes": used}
    return replace(record, exported=concrete, lowered=None, meta=meta, state="concrete")


ARTIFACTS = (
    "module.stablehlo.mlir",
    "module.hlo.txt",
    "exported.bin",
    "cost_analysis.json",
    "lowered.json",
    "path_shardings.json",
)


def load(ctx: StageContext, read: Callable[[str], bytes]) -> Lowered:
    """A Lowered record from a checkpoint's files (hash-verified by ``read``); no program code."""
    import jax

    meta = json.loads(read("lowered.json"))
    try:
        blob = read("exported.bin")
    except KeyError:
        raise StoreError(
            "resume_from: that run's lowering has no exported.bin (jax.export could not "
            "serialize the program; see its lower warnings); start at lower instead"
        ) from None
    from jaxaot.config.trust import policy_of

    _import_pytree_classes(list(meta.get("namedtuples", [])), policy_of(ctx.cfg))
    exported = jax.export.deserialize(bytearray(blob))
    for name in ARTIFACTS:
        try:
            ctx.write(name, read(name))
        except (KeyError, FileNotFoundError):
            continue  # optional: HLO text / cost analysis are absent for some lowerings
    ctx.metrics.update(platforms=list(meta["platforms"]))
    return for_compile(
        ctx,
        Lowered(
            exported=exported,
            lowered=None,
            platforms=tuple(meta["platforms"]),
            module_sha256=meta["module_sha256"],
            donate_argnums=tuple(meta["donate_argnums"]),
            meta=meta,
            state="loaded",
            donate_argnames=tuple(meta.get("donate_argnames", ())),
        ),
    )


def check(cfg: JaxaotConfig) -> None:
    """lower's options, before JAX: donation, platform and safety-check spellings, metadata,
    text options."""
    low = cfg.lower
    check_indices("lower.donate_argnums", low.donate_argnums)
    _check_disabled(low.disabled_checks)
    for p in low.platforms or ():
        # Which platforms JAX lowers for is JAX's to say (plugins add theirs): checked against
        # it when lowering (check_platforms); here only the spelling.
        if not isinstance(p, str) or not p.isidentifier():
            raise ConfigError(
                f"lower.platforms: expected platform names (e.g. {', '.join(PLATFORMS)}), "
                f"found {p!r}"
            )
    if low.platforms is not None and not low.platforms:
        raise ConfigError("lower.platforms: expected at least one platform or null, found []")
    if low.vjp_order < 0:
        raise ConfigError(f"lower.vjp_order: expected an int >= 0, found {low.vjp_order}")
    elide = low.elide_constants_over
    if elide is not None and (isinstance(elide, bool) or elide < 0):
        raise ConfigError(
            f"lower.elide_constants_over: expected a number of elements >= 0, or null to keep "
            f"every constant in the texts; found {elide!r}"
        )
    check_metadata(cfg)
    check_placement(cfg)


def summarize(m: Mapping[str, Any]) -> str:
    """The summary line: platforms, mesh, pre-compile FLOPs."""
    parts = [f"platforms {','.join(m.get('platforms', []))}"]
    if m.get("mesh"):
        parts.append(f"mesh {m['mesh']} ({m.get('devices')} devices)")
    if m.get("flops") is not None:
        parts.append(f"{human_count(m['flops'], 'FLOP')} (pre-compile)")
    if m.get("disabled_checks"):
        parts.append(f"export checks off: {', '.join(m['disabled_checks'])}")
    return "; ".join(parts)


def _run_node(ctx: StageContext, up: Upstream, keyed: Keyed | None, started: Any) -> Lowered:
    return run(ctx, up["stage_out"])


def _load_node(ctx: StageContext, up: Upstream, entry: Entry, keyed: Keyed | None) -> Lowered:
    return load(ctx, entry.read)


LOWER = Node(
    name="lower",
    noun="lowering",
    options=LowerConfig,
    record=Lowered,
    inputs=("stage_out",),
    run=_run_node,
    check=check,
    load=_load_node,
    live_inputs=("stage_out",),  # lowering again needs the traced program, not its record
    sections=("lower", "mesh"),
    artifacts=ARTIFACTS,
    verb="lowering",
    summarize=summarize,
)


__all__ = [
    "ARTIFACTS",
    "LOWER",
    "Lowered",
    "canonical_stablehlo",
    "check_platforms",
    "load",
    "run",
    "safety_checks",
]
