"""Stage 2, lower: the traced program to StableHLO, HLO and a portable ``jax.export`` blob.

Reads ``lower`` options (platforms, donation, keep_unused, shardings on ``mesh``, XLA metadata);
writes ``module.stablehlo.mlir``, ``module.hlo.txt``, ``exported.bin`` (the resumable form:
compile needs no Python code of the program once it has this), ``lowered.json`` (platforms,
module digest, donate_argnums and donate_argnames as lowered, device count, mesh, and where
they apply disabled_checks, placement and the output namedtuple classes a resume registers)
and ``cost_analysis.json`` where the lowering offers one. Shardings on a mesh are
``lower_shardings``'s, platform names and donation across platforms ``export_rules``'s. A
program with symbolic dimensions is lowered and exported once, polymorphic: the compile stage
makes it concrete at its ``compile.shapes``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, cast

from jaxaot.compat import jax as compat_jax
from jaxaot.config.mesh import MeshSpec
from jaxaot.config.sections import PLATFORMS, check_indices
from jaxaot.config.xla_metadata import check_metadata, scoped_metadata
from jaxaot.errors import ConfigError, StageError, StoreError, one_line
from jaxaot.rundir.metrics import LowerMetrics
from jaxaot.stages import module_text
from jaxaot.stages.concrete_export import has_symbolic
from jaxaot.stages.contract import CheckFacts, Entry, Presentation, StageContext, Upstream
from jaxaot.stages.cost_figures import costs_of
from jaxaot.stages.export_rules import (
    check_disabled,
    check_platforms,
    custom_call_hint,
    donating,
    donation_keys,
    safety_checks,
)
from jaxaot.stages.jax_mesh import abstract_mesh, has_arrays, tracing_on
from jaxaot.stages.jax_metadata import with_metadata
from jaxaot.stages.jax_placement import placed
from jaxaot.stages.lower_shardings import sharded
from jaxaot.stages.output_types import import_pytree_classes, register_output_types
from jaxaot.stages.stage_out import StagedOut
from jaxaot.util import heap, memo
from jaxaot.util.canonical import canonical_stablehlo
from jaxaot.util.humanize import human_count
from jaxaot.util.reprs import tree_text

if TYPE_CHECKING:
    import jax


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
    # Text artifacts print constants of more elements elided; None keeps them all.
    elide_constants_over: int | None = 1024


_PARTITIONS = re.compile(r"mhlo\.num_partitions = (\d+)")
_REPLICAS = re.compile(r"mhlo\.num_replicas = (\d+)")


def _module_devices(stablehlo: str) -> int:
    """Devices a module runs on (partitions x replicas), read from its attributes."""
    parts, reps = _PARTITIONS.search(stablehlo), _REPLICAS.search(stablehlo)
    return (int(parts[1]) if parts else 1) * (int(reps[1]) if reps else 1)


@dataclass(frozen=True, repr=False)
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
    # polymorphic export made concrete at compile.shapes by the compile stage:
    # jaxaot.stages.concrete_export), "loaded" (from a checkpoint: the export alone, no
    # program code).
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

    def __repr__(self) -> str:
        exp = self.exported
        inputs = tree_text(list(exp.in_avals)) if exp is not None else "no export"
        name = exp.fun_name if exp is not None else "?"
        return (
            f"Lowered(fun={name}, platforms={self.platforms}, state={self.state!r}, "
            f"module_sha256={self.module_sha256[:12]!r}, inputs={inputs}, "
            f"donate_argnums={self.donate_argnums})"
        )


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
    names = _donated_keywords(staged)
    if names:
        opts["donate_argnames"] = names
    if ctx.opts.keep_unused:
        opts["keep_unused"] = True
    return opts


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
    elide_over = ctx.opts.elide_constants_over  # checked by config.validate
    debug = bool(ctx.opts.debug_info)  # locations kept in the texts
    texts = memo.derived(
        same, f"texts:{elide_over}:{debug}", lambda: _derive_texts(lowered, elide_over, debug)
    )
    if texts.warning:
        ctx.warn(texts.warning)
    return texts


def run(ctx: StageContext[LowerConfig], staged: StagedOut) -> Lowered:
    import jax

    low, facts = ctx.opts, ctx.facts
    platforms, notes = check_platforms(tuple(low.platforms or (facts.platform,)))
    for note in notes:
        ctx.warn(note)
    opts = _jit_options(ctx, staged)
    assert staged.fn is not None, "lowering needs the traced program (a resumed stage_out has none)"
    fn, kwargs, mesh_json = staged.fn, staged.kwargs, staged.replicas
    args = staged.args
    mesh = facts.mesh
    mesh_context: Any = contextlib.nullcontext()
    amesh = None
    if mesh is not None and not mesh.per_replica:
        amesh = abstract_mesh(mesh)
        fn, opts, args, kwargs = sharded(ctx, staged, mesh, amesh, opts)
        mesh_json = mesh.to_json()
    # lower.{in,out}_memory_kinds and lower.{in,out}_layouts on the shardings just made.
    placement = placed(low, facts, staged, fn, opts, tuple(args), kwargs, platforms, amesh)
    fn, opts, args, kwargs = placement.fn, placement.opts, placement.args, placement.kwargs
    if amesh is not None and facts.mesh_context:
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
    scoped = scoped_metadata(low.scoped_metadata, facts.policy)
    heap_tuning = contextlib.ExitStack()
    with (
        mesh_context,
        with_metadata(dict(low.xla_metadata), scoped) as annotated,
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
                f"lower.platforms={list(platforms)} with {donation_keys(low)}: {one_line(exc)}; "
                "donate nothing, or lower the platforms without donation in a run of their own"
            ) from None
        # The texts and the export copy every embedded constant a dozen times: with big ones,
        # freed buffers are kept for reuse until the stage ends.
        heap_tuning.enter_context(heap.reusing_big_buffers(_embeds_big_constants(lowered)))
        # JAX hands back its cached lowering object for a program it lowered before in this
        # process (a sweep's later jobs): its texts and cost analysis are computed once.
        same = compat_jax.lowering_of(lowered)
        texts = _texts(ctx, lowered, same)
        stablehlo, module_sha = texts.stablehlo, texts.module_sha256
        # For platforms none of which implement donation JAX drops it (its warning says so):
        # the module donates nothing, and neither does a compile of its export.
        donate = _flat_donations(staged) if donating(platforms) else ()
        donate_names = _donated_keywords(staged) if donating(platforms) else ()
        early = {"mesh": mesh_json, "nr_devices": _module_devices(stablehlo)} if mesh_json else {}
        unplaced = amesh is not None and facts.mesh_context and not has_arrays(args, kwargs)
        if unplaced and mesh is not None and early["nr_devices"] != mesh.size:
            # tracing_on's context did not reach jax.jit: refused rather than compiled wrong.
            raise compat_jax.jax_internal(
                "jax._src.pjit.get_ctx_mesh (its result no longer decides the devices of a "
                f"jit without arguments: lowered for {early['nr_devices']})",
                f"lower a program without arguments for the mesh's {mesh.size} devices",
                RuntimeError("module devices differ from the mesh"),
            )
        disabled = safety_checks(low.disabled_checks)
        polymorphic = has_symbolic(staged.args, kwargs)
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
                pytree_types = register_output_types(exported)
                # vjp_order: the export carries that many orders of derivatives.
                exported_bytes = _serialize(exported, low.vjp_order)
        except Exception as exc:  # e.g. host callbacks (jax.debug.print) have no serialized form
            exported, pytree_types = None, []
            ctx.warn(
                "no exported.bin: jax.export cannot serialize this program "
                f"({' '.join(str(exc).split())[:200]}); it compiles and runs here, but a later "
                f"run cannot resume from this lowering{custom_call_hint(exc)}"
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
    return record


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
    51 MB constant ten times over; the builder's output does not depend on where
    it started (alignment counts from the buffer's end). Derivatives (``vjp_order`` > 0) carry
    modules of their own: jax's own call."""
    try:
        import flatbuffers
    except ImportError:
        build = None
    else:
        build = compat_jax.export_serializer()
    if build is None or vjp_order:
        return exported.serialize(vjp_order=vjp_order)
    builder = flatbuffers.Builder(len(exported.mlir_module_serialized) + (1 << 16))
    builder.Finish(build(builder, exported, vjp_order))
    return memoryview(builder.Bytes)[builder.Head() :]  # Output() without its copy


def _embeds_big_constants(lowered: Any) -> bool:
    """Whether the module's captured constants are big enough to lower with the heap tuned."""
    return heap.worth_it(sum(c.nbytes for c in module_text.large_constants(lowered, 1024)))


ARTIFACTS = (
    "module.stablehlo.mlir",
    "module.hlo.txt",
    "exported.bin",
    "cost_analysis.json",
    "lowered.json",
    "path_shardings.json",
)


def load(ctx: StageContext, read: Callable[[str], bytes], entry: Entry | None = None) -> Lowered:
    """A Lowered record from a checkpoint's files (hash-verified by ``read``); no program code.
    An export near or past JAX's window for reading exports is a warning (compat_jax)."""
    import time

    import jax

    if entry is not None:
        note = compat_jax.export_age_note(entry.created, entry.compat.get("jax"), time.time())
        if note:
            ctx.warn(f"{entry.label}: {note}")
    meta = json.loads(read("lowered.json"))
    try:
        blob = read("exported.bin")
    except KeyError:
        raise StoreError(
            "resume_from: that run's lowering has no exported.bin (jax.export could not "
            "serialize the program; see its lower warnings); start at lower instead"
        ) from None
    import_pytree_classes(list(meta.get("namedtuples", [])), ctx.facts.policy)
    exported = jax.export.deserialize(bytearray(blob))
    for name in ARTIFACTS:
        try:
            ctx.write(name, read(name))
        except (KeyError, FileNotFoundError):
            continue  # optional: HLO text / cost analysis are absent for some lowerings
    ctx.metrics.update(platforms=list(meta["platforms"]))
    return Lowered(
        exported=exported,
        lowered=None,
        platforms=tuple(meta["platforms"]),
        module_sha256=meta["module_sha256"],
        donate_argnums=tuple(meta["donate_argnums"]),
        meta=meta,
        state="loaded",
        donate_argnames=tuple(meta.get("donate_argnames", ())),
    )


def check(low: LowerConfig, facts: CheckFacts) -> None:
    """lower's options, before JAX: donation, platform and safety-check spellings, metadata,
    text options (placement against the mesh and the topology: check_relations)."""
    check_indices("lower.donate_argnums", low.donate_argnums)
    check_disabled(low.disabled_checks)
    for p in low.platforms or ():
        # JAX's set of platforms is open (plugins add theirs): any name is lowered for, with a
        # warning for a near-miss of a known one when lowering (check_platforms); here only
        # the spelling.
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
    check_metadata(low.xla_metadata, low.scoped_metadata, facts.policy)


def summarize(m: LowerMetrics) -> str:
    """The summary line: platforms, mesh, pre-compile FLOPs."""
    parts = [f"platforms {','.join(m.platforms)}"]
    if m.mesh:
        parts.append(f"mesh {m.mesh} ({m.devices} devices)")
    if m.flops is not None:
        parts.append(f"{human_count(m.flops, 'FLOP')} (pre-compile)")
    if m.disabled_checks:
        parts.append(f"export checks off: {', '.join(m.disabled_checks)}")
    return "; ".join(parts)


class LowerStage:
    """Stage 2: a Stage, Loadable (a checkpoint's export, without program code)."""

    name: str = "lower"
    Options: type[LowerConfig] = LowerConfig
    Record: type[Lowered] = Lowered
    inputs: tuple[str, ...] = ("stage_out",)
    live_inputs: tuple[str, ...] = (
        "stage_out",
    )  # lowering again needs the traced program, not its record
    sections: tuple[str, ...] = ("lower", "mesh")
    artifacts: tuple[str, ...] = ARTIFACTS
    show: Presentation[LowerMetrics] = Presentation(
        verb="lowering", noun="lowering", figures=LowerMetrics.from_metrics, summarize=summarize
    )
    again: str = "computed again"
    recomputed_differs: Mapping[str, str] = MappingProxyType({})
    check = staticmethod(check)

    def run(self, ctx: StageContext[LowerConfig], up: Upstream) -> Lowered:
        return run(ctx, up["stage_out"])

    def load(self, ctx: StageContext[LowerConfig], up: Upstream, entry: Entry) -> Lowered:
        return load(ctx, entry.read, entry)


LOWER = LowerStage()


__all__ = [
    "ARTIFACTS",
    "LOWER",
    "Lowered",
    "canonical_stablehlo",
    "load",
    "run",
]
