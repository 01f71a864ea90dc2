"""Stage 3, compile: the lowered program to an XLA executable for ``compile.backend``.

``compile.compiler_options`` go to this one compile (never through the process-global
``XLA_FLAGS``, so sweep jobs in one process do not leak flags into each other). A program lowered
for a mesh runs on the backend's first N devices. Writes ``optimized.hlo.txt``,
``cost_analysis.json``, ``memory_analysis.json``, ``memory_breakdown.json`` (XLA's peak and the
buffers live at it, :mod:`jaxaot.stages.memory_breakdown`), ``executable.bin`` and
``shardings.json`` (each input's and output's compiled sharding).

A lowering with symbolic dimensions compiles at ``compile.shapes``: its export made concrete
there (:mod:`jaxaot.stages.concrete_export`) before the key is computed, whether the lowering
was computed this run or loaded from a checkpoint.

The compile key covers the calling convention of what is compiled, and every executable
loaded from the store or a checkpoint is checked against the convention the run expects before
it is called (:mod:`jaxaot.stages.convention`).
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.mesh import MeshSpec
from jaxaot.config.sections import BACKENDS
from jaxaot.errors import (
    BackendError,
    ConfigError,
    DoesNotFit,
    StageError,
    Unkeyable,
    UnusableExecutable,
    one_line,
)
from jaxaot.rundir.metrics import CompileMetrics
from jaxaot.stages import custom_calls, memory_breakdown, module_text, peak_dump, profile
from jaxaot.stages.compile_options import options_of
from jaxaot.stages.concrete_export import at_sizes
from jaxaot.stages.contract import (
    CheckFacts,
    Entry,
    Plan,
    Presentation,
    RunFacts,
    StageContext,
    Uncached,
    Upstream,
)
from jaxaot.stages.convention import (
    Convention,
    convention_of,
    export_conventions,
    kept_inputs,
    mismatch,
)
from jaxaot.stages.executable import (
    cost_of,
    export_lowering,
    memory_of,
    mesh_metrics,
    relabel_shardings,
    serialize,
    stage_metrics,
    write_analysis,
)
from jaxaot.stages.jax_mesh import bound_context, concrete_mesh
from jaxaot.stages.jaxenv import devices, platform_of
from jaxaot.stages.loop_costs import loops_summary
from jaxaot.stages.lower import Lowered
from jaxaot.stages.topology import topology_summary
from jaxaot.util import memo
from jaxaot.util.fsio import key_of, sha256_bytes
from jaxaot.util.humanize import human_bytes, human_count, human_seconds

log = logging.getLogger("jaxaot")

if TYPE_CHECKING:
    import jax


DEFAULT_DUMP = ("hlo", "buffer_assignment", "memory_usage")  # compile.dump_keep's default

# Platforms whose executables carry no buffer assignment (jaxlib 0.10.2: the serialized
# BufferAssignmentProto is empty for CUDA compiles, on a GPU and deviceless alike, and for TPU):
# their memory_breakdown.json comes from XLA's dump of the compile (stages/peak_dump.py).
BREAKDOWN_FROM_DUMP: frozenset[str] = frozenset({"cuda", "rocm", "tpu"})


@dataclass(frozen=True)
class CompileConfig:
    """The ``compile`` section (conf/compile/): backend, XLA options, devices, topology."""

    backend: str = "cpu"
    compiler_options: dict[str, Any] = field(default_factory=dict)
    num_devices: int | None = None
    # Sizes of the symbolic dimensions of a polymorphic lowering: {b: 32}.
    shapes: dict[str, int] = field(default_factory=dict)
    # The most virtual CPU devices a run may start (jaxaot.config.mesh.devices_to_start).
    max_devices: int = 512
    # A TPU topology to compile for without the hardware (pipeline/targets/tpu.py).
    topology: str | None = None
    num_slices: int = 1
    # XLA's dumps of this compile, into compile/xla_dump/: what to keep, by kind
    # (DUMP_KINDS); never through XLA_FLAGS, never part of the compile key.
    dump: bool = False
    dump_keep: list[str] = field(default_factory=lambda: list(DEFAULT_DUMP))
    # Where the compile time goes: XLA's phases and passes from a jax.profiler trace of the
    # compile, in compiled.json's "breakdown"; not in the compile key.
    breakdown: bool = False
    # XLA's effort levels for this compile (ExecutableBuildOptions): O0..O3, null = JAX's default
    # (jax_optimization_level / jax_memory_fitting_level); passed as compiler options, so keyed.
    optimization_level: str | None = None
    memory_fitting_level: str | None = None
    # The buffers live at the peak listed in memory_breakdown.json (largest first).
    memory_top: int = 10
    # HBM the platform keeps back from a program, per device: a size ("2GiB"), bytes (0 or
    # >= 1 MiB), a fraction of the HBM (0 <= f < 1), or null for the platform's own.
    hbm_reserve: Any = None
    # Host memory per device that host-memory buffers (pinned_host/unpinned_host) are checked
    # against; null = the target's table.
    host_memory_bytes: int | None = None


@dataclass(frozen=True)
class Target:
    """What the compile stage compiles, and what its key and load check are made of.

    ``form`` is ``lowered`` (the program's own lowering, compiled as is) or ``exported``
    (``jax.jit(exported.call)`` lowered for one platform: a resumed run, a multi-platform
    lowering, or a polymorphic one made concrete); for ``compile.topology``,
    ``topology-lowered`` (the program's own lowering on the topology's devices) or
    ``topology`` (through the export). ``module_sha256`` identifies what is compiled, locations
    left out (they run up to whoever called jaxaot): the live lowering's module digest, or the
    export's (``exported.bin``, or its concrete export at compile.shapes; never a side file;
    :mod:`jaxaot.stages.module_text`). The export form's lowering is made only when it is
    compiled (:meth:`lower`): a store hit needs just the hash and the convention.
    """

    form: str
    module_sha256: str
    convention: Convention
    lower: Callable[[], Any]  # -> jax.stages.Lowered, built once
    # The lowering it compiles: the lower stage's, or a polymorphic one's export made concrete
    # at compile.shapes (:func:`_concrete_lowering`).
    lowered: Lowered
    device_assignment: tuple[Any, ...] | None = None
    # The whole compile, where it is not ``lower().compile()``: a topology's; and
    # the same compile dumping into (a folder, with these options): compile.dump.
    compile_job: Callable[[], Any] | None = None
    compile_dumped: Callable[[Path, dict[str, Any]], Any] | None = None


@dataclass(frozen=True, repr=False)
class Compiled:
    """An executable ready to call, with what the compiler said about it."""

    compiled: jax.stages.Compiled | None  # None: a topology's, loaded off its TPU host
    lowered: Lowered
    backend: str
    cost: dict[str, float] | None
    memory: dict[str, int] | None
    # Compiled with options for this run's own dump or trace (compile.dump/breakdown), which
    # the serialized executable records: never stored, a run without them compiles its own.
    run_options: bool = False
    # compile.shapes: the sizes its symbolic dimensions were compiled at (execute runs at them).
    shapes: Mapping[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        cost = self.cost or {}
        flops = cost.get("flops")
        shown = (
            [human_count(flops, "FLOP")] if isinstance(flops, int | float) and flops >= 0 else []
        )
        memory = self.memory or {}
        shown += [
            f"{name} {human_bytes(memory[key])}"
            for name, key in (
                ("arguments", "argument_size_in_bytes"),
                ("outputs", "output_size_in_bytes"),
                ("temp", "temp_size_in_bytes"),
            )
            if isinstance(memory.get(key), int | float)
        ]
        return (
            f"Compiled(backend={self.backend!r}, {', '.join(shown) or 'no cost analysis'}, "
            f"executable={'loaded' if self.compiled is not None else 'none (topology)'}, "
            f"module_sha256={self.lowered.module_sha256[:12]!r})"
        )


def check_platform(lowered: Lowered, backend: str) -> str:
    """The platform to compile for, or a BackendError when the lowering does not cover it.

    An export made with ``lower.disabled_checks=[platform]`` covers every platform: JAX calls
    it anywhere, with the module of its first platform (jax 0.10.2 ``call_exported``). The
    error suggests a ``compile.backend`` only for a lowered platform some backend compiles for
    (``lower.platforms`` may name any platform, ``other`` or ``GPU`` too)."""
    platform = platform_of(backend)
    exp = lowered.exported
    disabled = exp.disabled_safety_checks if exp is not None else ()
    if platform in lowered.platforms or "platform" in map(str, disabled):
        return platform
    first = lowered.platforms[0]
    compilable = [p for p in lowered.platforms if _backend_for(p) is not None]
    if compilable:
        ways = (
            f"compile for one of those (compile.backend={_backend_for(compilable[0])}), add "
            f"{platform!r} to lower.platforms, or lower only here (stop_after=lower) and compile "
            f"on a {'/'.join(compilable)} machine (resume_from=<this run> start_at=compile), or"
        )
    else:
        ways = (
            f"no compile.backend compiles for {'/'.join(lowered.platforms)} (the backends "
            f"compile for {', '.join(sorted(set(map(platform_of, BACKENDS))))}); add "
            f"{platform!r} to lower.platforms, or"
        )
    raise BackendError(
        f"compile.backend={backend!r} needs a lowering for {platform!r}, but lower.platforms "
        f"was {list(lowered.platforms)}; {ways} export it with lower.disabled_checks=[platform] "
        f"to run its {first} module here"
    )


def _backend_for(platform: str) -> str | None:
    """The ``compile.backend`` that compiles for a lowering ``platform`` (its own name where
    that is a backend: ``cuda``, not ``gpu``), None where none does."""
    named = [b for b in BACKENDS if platform_of(b) == platform]
    return platform if platform in named else (named[0] if named else None)


def _nr_devices(lowered: Lowered) -> int:
    if lowered.exported is not None:
        return int(lowered.exported.nr_devices)
    return int(lowered.meta.get("nr_devices") or 1)


def execution_devices(lowered: Lowered, backend: str) -> list[Any]:
    """The devices the program runs on: the first ``nr_devices`` of the backend, in its mesh's
    order (``jax_mesh.on_devices``) when they are the mesh's devices."""
    needed = _nr_devices(lowered)
    present = devices(backend)
    if len(present) < needed:
        mesh = lowered.meta.get("mesh")
        what = f"its mesh {MeshSpec.from_json(mesh).describe()}" if mesh else "its shardings"
        how = f"compile.num_devices={needed}" if backend == "cpu" else f"a machine with {needed}"
        raise BackendError(
            f"compile: the program was lowered for {needed} devices ({what}), but "
            f"compile.backend={backend!r} has {len(present)}; expected {how}, or stop_after=lower "
            "to lower without devices"
        )
    spec = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
    if spec is not None and spec.size == needed:
        return list(concrete_mesh(spec, present[:needed]).devices.flat)
    return present[:needed]


def _export_lowering(lowered: Lowered, backend: str, devs: list[Any]) -> Any:
    """The export lowered for ``backend``'s platform, on the program's mesh; without one, on
    the first device when the lowering placed leaves (layouts, memory kinds: they need one)."""
    mesh = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
    concrete = concrete_mesh(mesh, devs) if mesh is not None and len(devs) == mesh.size else None
    device = devs[0] if mesh is None and lowered.meta.get("placement") else None
    if concrete is not None and not lowered.export().in_avals:
        # No argument says which devices it runs on: the mesh in context does, as
        # ``with jax.set_mesh(mesh): jax.jit(exported.call)()`` (jax 0.10.2 refuses an export
        # for N devices called in a context of one).
        with compat_jax.set_mesh(concrete):
            return export_lowering(lowered, platform_of(backend), concrete, device=device)
    return export_lowering(lowered, platform_of(backend), concrete, device=device)


def _concrete_lowering(comp: CompileConfig, facts: RunFacts, lowered: Lowered) -> Lowered:
    """The lowering this stage compiles: a polymorphic one made concrete at ``compile.shapes``
    (a ConfigError naming a missing size or a constraint that fails), any other as it is."""
    return at_sizes(lowered, comp.shapes, facts.mesh_context)


def prepare(cfg: Any, lowered: Lowered) -> Target:
    """Check the backend, platform and device count, and choose what to compile: the live
    lowering when there is one for exactly this platform, else the export. ``lowered`` is
    concrete (:func:`_concrete_lowering`)."""
    import jax

    if cfg.topology:  # onto libtpu's compile-only devices
        from jaxaot.stages import topology

        plan = topology.start(cfg, lowered)  # checks platforms, the export and libtpu

        def no_lowering() -> Any:
            raise AssertionError("a topology compile is its compile_job")

        if plan.live:  # the live lowering itself: keyed like the lowered form, on the topology
            assert lowered.lowered is not None
            return Target(
                form="topology-lowered",
                module_sha256=lowered.module_sha256,
                convention=convention_of(lowered.lowered),
                lower=no_lowering,
                lowered=lowered,
                compile_job=plan.job,
                compile_dumped=plan.dumped,
            )
        exp = lowered.export()
        return Target(
            form="topology",
            module_sha256=module_text.export_digest(exp),
            convention=export_conventions(lowered)[1],
            lower=no_lowering,
            lowered=lowered,
            compile_job=plan.job,
            compile_dumped=plan.dumped,
        )
    devices(cfg.backend)  # a clear BackendError when the backend is absent
    platform = check_platform(lowered, cfg.backend)
    devs = execution_devices(lowered, cfg.backend)  # enough for the mesh, before compiling
    mesh = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
    sharded = mesh is not None and len(devs) == mesh.size
    # A jax whose compile cannot bind a mesh lowering to devices compiles it through its export.
    bindable = not sharded or compat_jax.compile_takes_devices() or lowered.exported is None
    if lowered.state in ("early", "live") and lowered.platforms == (platform,) and bindable:
        # Bound to the devices it runs on: a program without arguments names its outputs by
        # the mesh in context, as under jax.set_mesh.
        live = bound_context(lowered.lowered, devs) if sharded else lowered.lowered
        return Target(
            form="lowered",
            module_sha256=lowered.module_sha256,
            convention=convention_of(live),
            lower=lambda: live,
            lowered=lowered,
            # Lowered against an AbstractMesh: bound to concrete devices at compile.
            device_assignment=tuple(devs) if sharded else None,
        )
    if lowered.exported is None:
        # jax compiles a multi-platform lowering only through its export, and there is none:
        # a compile started ahead of the export (the runner then compiles in the compile
        # stage), or a program jax.export cannot serialize (host callbacks).
        raise StageError(
            "compile",
            f"a lowering for {list(lowered.platforms)} compiles for {platform!r} only through "
            f"its jax.export, and there is none (see lower's warnings); lower for "
            f"lower.platforms=[{platform}] alone",
        )
    exp = lowered.exported
    # jax.jit(exported.call) keeps every input (the export prunes inside) and donates the
    # leaves of the donated positional and keyword arguments; the runner checks the compiled
    # executable against this before it stores it.
    positions, keywords = jax.tree_util.tree_unflatten(exp.in_tree, range(len(exp.in_avals)))
    donated = sorted(
        [i for a in lowered.donate_argnums for i in jax.tree_util.tree_leaves(positions[a])]
        + [i for k in lowered.donate_argnames for i in jax.tree_util.tree_leaves(keywords[k])]
    )
    convention = replace(export_conventions(lowered)[1], donated=tuple(donated))
    return Target(
        form="exported",
        module_sha256=module_text.export_digest(exp),
        convention=convention,
        lower=functools.cache(lambda: _export_lowering(lowered, cfg.backend, devs)),
        lowered=lowered,
    )


def compile_lowered(target: Target, backend: str, options: dict[str, Any]) -> Any:
    """XLA-compile ``target`` (releases the GIL: may run on a worker thread)."""
    if target.device_assignment is None:  # every jax: no devices to bind
        return target.lower().compile(compiler_options=options or None)
    compat_jax.need(
        "compiling a mesh lowering that has no export",
        compat_jax.COMPILE_DEVICES,
        "Lowered.compile(device_assignment=)",
    )
    return target.lower().compile(
        compiler_options=options or None, device_assignment=target.device_assignment
    )


def _compile_error(exc: Exception, options: dict[str, Any]) -> Exception:
    text = " ".join(str(exc).split())
    # XLA's wording: "No such compile option: 'x'" for an unknown name, "While setting option
    # x, 'v' is not a valid bool value." for a bad value.
    if options and any(s in text.lower() for s in ("compile option", "no such", "setting option")):
        return ConfigError(
            f"compile.compiler_options: XLA rejected {sorted(options)}: {text[:300]}"
        )
    return exc


# What the compile stage's output depends on, besides the lowered module: bump when the
# stored files or their meaning change.
#   1: module, platforms, donation, compiler options, backend.
#   2: the module actually compiled (the export's for the export form), the form,
#     the calling convention, XLA flags and JAX config values, device topology.
#   3: the flag variables the compiling platform reads, parsed as XLA/libtpu parse them (the
#     last value of a flag wins, XLA_FLAGS' file read, LIBTPU_INIT_ARGS for tpu only) with
#     XLA's own parse of XLA_FLAGS; environment variables the compiler reads; the host CPU
#     (cpu); registered HLO module transformations.
#   4: cost_analysis.json counts while loops per trip (XLA's own figures as *_xla), loops.json.
#   5: memory_breakdown.json (XLA's peak and the buffers live at it), and shardings.json for
#     every compile (memory kinds and layouts in its rows).
#   6: shardings.json has a row per input, the unused ones too (JAX's in_avals, input_formats
#     and args_info: aval, kept, donated, every Layout field); a CPU compile keys the devices
#     it runs on (device_ids), not how many the host has.
_KEY_VERSION = 6
ARTIFACTS = (
    "optimized.hlo.txt",
    "cost_analysis.json",
    "loops.json",
    "memory_analysis.json",
    "executable.bin",
    "compiled.json",
    "shardings.json",
    "memory_breakdown.json",
)


def cache_key(
    comp: Any,
    lowered: Lowered,
    target: Target,
    backend: dict[str, Any],
    environment: dict[str, Any],
) -> dict[str, Any]:
    """Everything the executable and its calling convention depend on, and nothing else (no
    paths, no times). ``comp`` is the compile section, ``environment``
    :func:`jaxaot.stages.jaxenv.key_environment`."""
    return {
        "stage": "compile",
        "key_version": _KEY_VERSION,
        "form": target.form,
        "module_sha256": target.module_sha256,
        "convention": target.convention.to_json(),
        "platforms": list(lowered.platforms),
        "donate_argnums": list(lowered.donate_argnums),
        "mesh": lowered.meta.get("mesh"),  # the export form's shardings are bound to it
        "compiler_options": options_of(comp),
        # platform + version, device kind + count + topology, jax + jaxlib
        "backend": keyed_backend(comp, lowered, backend),
        "environment": environment,  # flags, env, host CPU, HLO passes, JAX config values
    }


def keyed_backend(cfg: Any, lowered: Lowered, backend: dict[str, Any]) -> dict[str, Any]:
    """The compile key's ``backend``: on CPU the ids of the devices the executable runs on in
    place of the host's device count. An XLA CPU executable depends on its device assignment,
    not on how many devices the client has (``--xla_force_host_platform_device_count``,
    ``compile.num_devices``): the same program on device 0 compiles to the same optimized HLO
    and outputs under 1 or 8 host devices (jaxlib 0.10.2; the serialized executable differs
    only in the flag's value it records). A program whose assignment grows with the host (a
    mesh over every device) keys more ids. JAX's own persistent cache misses there: it hashes
    the CPU client's whole topology. Other platforms and topologies keep the host's count and
    topology (a TPU or GPU executable may depend on the devices around its own)."""
    if cfg.topology or backend.get("platform") != "cpu":
        return backend
    ids = [d.id for d in execution_devices(lowered, cfg.backend)]
    return {k: v for k, v in backend.items() if k != "device_count"} | {"device_ids": ids}


def _execution_devices(backend: str, device_ids: list[int], source: str) -> list[Any]:
    by_id = {d.id: d for d in devices(backend)}
    missing = [i for i in device_ids if i not in by_id]
    if missing:
        raise BackendError(
            f"{source}: the executable runs on {backend} devices {device_ids}, but this host has "
            f"{len(by_id)} (ids {sorted(by_id)}); set compile.num_devices={max(device_ids) + 1} "
            "or recompile (start_at=compile)"
        )
    return [by_id[i] for i in device_ids]


def load(
    ctx: StageContext,
    lowered: Lowered,
    read: Callable[[str], bytes],
    source: str,
    expect: Sequence[Convention],
) -> Compiled:
    """A Compiled record from stored files (a store entry or a checkpoint), all hash-verified,
    whose executable loads here and has one of the ``expect``-ed calling conventions.

    ``read(name)`` must return bytes whose sha256 was checked against a manifest in the user's
    own store or run directory: the executable is unpickled from them. A read that fails raises
    StoreError; an executable that does not load or does not fit raises
    :class:`UnusableExecutable` (the caller compiles instead).
    """
    from jax.experimental import serialize_executable

    cfg = ctx.opts
    if cfg.topology:  # compile-only devices cannot load it; a TPU host can
        from jaxaot.stages import topology

        if not topology.present(cfg):
            return topology.load(ctx, lowered, read, ARTIFACTS, _record(lowered, cfg.backend))
    files: dict[str, bytes] = {}
    for name in ARTIFACTS:  # each read (and hash check) once
        try:
            files[name] = read(name)
        except (KeyError, FileNotFoundError):
            continue  # optional artifacts (cost/memory analysis) some backends do not give
    # Custom-call kernels before deserializing (a cold LAPACK load segfaults); raises
    # ColdLoadError, not UnusableExecutable, for one this process cannot vouch for: the entry
    # is fine, this process just compiles instead.
    custom_calls.prepare(files.get("optimized.hlo.txt"), cfg.backend, lowered, source)
    try:
        meta = json.loads(files["compiled.json"])
        bound_to = _execution_devices(cfg.backend, meta["device_ids"], source)

        def deserialize() -> Any:
            payload, in_tree, out_tree = pickle.loads(files["executable.bin"])
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=cfg.backend, execution_devices=bound_to
            )

        # A sweep's later jobs load the same executable: deserialized once per process.
        key = (sha256_bytes(files["executable.bin"]), tuple(meta["device_ids"]))
        compiled = memo.executable(bound_to[0].client, key, deserialize)
        reason = mismatch(convention_of(compiled), expect)
    except Exception as exc:  # unpickling, a class renamed since, a version, a device...
        raise UnusableExecutable(f"it does not load here: {one_line(exc)}") from exc
    if reason is not None:
        raise UnusableExecutable(reason)
    for name, data in files.items():
        ctx.write(name, data)

    def parsed(name: str) -> Any:
        return json.loads(files[name]) if name in files else None

    cost, memory = parsed("cost_analysis.json"), parsed("memory_analysis.json")
    stage_metrics(ctx, cost, memory)
    if memory_breakdown.ARTIFACT in files:
        memory_breakdown.read_metrics(ctx, files[memory_breakdown.ARTIFACT])
    shardings = parsed("shardings.json") if "shardings.json" in files else None
    if shardings:  # stored by a run whose static arguments may have been elsewhere
        named = relabel_shardings(shardings, memory_breakdown.static_positions(ctx))
        if named is not shardings:
            shardings = named
            ctx.write_json("shardings.json", shardings)
    if shardings and shardings.get("mesh"):
        mesh_metrics(ctx, shardings)
    return Compiled(
        compiled=compiled, lowered=lowered, backend=cfg.backend, cost=cost, memory=memory
    )


def _record(lowered: Lowered, backend: str) -> Callable[..., Compiled]:
    def record(compiled: Any, cost: Any, memory: Any) -> Compiled:
        return Compiled(
            compiled=compiled, lowered=lowered, backend=backend, cost=cost, memory=memory
        )

    return record


# compile.dump_keep: what each kind of XLA dump file is (by name) and the option that makes XLA
# write it. Every kind but "passes" and "html" comes with xla_dump_hlo_as_text.
DUMP_KINDS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "hlo": (("before_optimizations.txt", "after_optimizations.txt"), {}),
    "passes": ((".after_", ".before_"), {"xla_dump_hlo_pass_re": ".*"}),
    "buffer_assignment": (("buffer-assignment", "live-range"), {}),
    "memory_usage": (("memory-usage-report",), {}),
    "html": ((".html",), {"xla_dump_hlo_as_html": True}),
    "llvm": ((".ll", ".o"), {}),
}
DUMP_DIR = "xla_dump"
BREAKDOWN_NAME = "breakdown.json"  # compile.breakdown's result, in compile_trace/


def dump_options(keep: Sequence[str], dump_dir: Path) -> dict[str, Any]:
    """XLA options that dump this compile only (compile options, not the process's XLA_FLAGS)."""
    options: dict[str, Any] = {"xla_dump_to": str(dump_dir), "xla_dump_hlo_as_text": True}
    for kind in keep:
        options |= DUMP_KINDS[kind][1]
    return options


def keep_dump(dump_dir: Path, keep: Sequence[str]) -> dict[str, int]:
    """Remove the dump files of kinds not kept; name -> size of the rest (for the manifest)."""
    kept: dict[str, int] = {}
    for path in sorted(dump_dir.iterdir()) if dump_dir.is_dir() else []:
        kinds = [k for k, (marks, _) in DUMP_KINDS.items() if any(m in path.name for m in marks)]
        # a per-pass file names its pass ("...0003.simplification.after_..."): "passes" only
        if (
            any(m in path.name for m in DUMP_KINDS["passes"][0])
            and "optimizations" not in path.name
        ):
            kinds = ["passes"]
        if path.is_file() and set(kinds) & set(keep):
            kept[path.name] = path.stat().st_size
        elif path.is_file():
            path.unlink()
        elif path.is_dir():  # libtpu's per-compile folder (module_N.<name>.cl_<id>/): no kind
            shutil.rmtree(path)
    return kept


def record_dump(ctx: StageContext, dump_dir: Path, note: str = "") -> None:
    files = keep_dump(dump_dir, ctx.opts.dump_keep)
    ctx.metrics["xla_dump_files"] = len(files)
    ctx.extra["xla_dump"] = {"dir": f"{ctx.stage}/{DUMP_DIR}", "files": files, "note": note}


def record_breakdown(ctx: StageContext, note: str = "") -> dict[str, Any]:
    """compile.breakdown: the trace's phases and hot spots, in the metrics and the manifest."""
    folder = ctx.out_dir / profile.COMPILE_TRACE_DIR
    breakdown = profile.compile_breakdown(folder)
    if not breakdown["threads_s"]:
        ctx.warn(
            "compile.breakdown: the trace has no XLA compile in it (served from JAX's "
            "persistent compilation cache?); no breakdown"
        )
    hot = breakdown["hot"][0] if breakdown["hot"] else {"name": None, "self_s": None}
    ctx.metrics.update(
        breakdown_threads_s=breakdown["threads_s"],
        breakdown_top=hot["name"],
        breakdown_top_s=hot["self_s"],
    )
    # Not in compiled.json: that is a stored artifact, and a store hit must not hand one run's
    # breakdown to another. Beside the trace, and in the manifest.
    (folder / BREAKDOWN_NAME).write_text(json.dumps(breakdown, indent=2) + "\n")
    ctx.extra["compile_trace"] = {
        "dir": f"{ctx.stage}/{profile.COMPILE_TRACE_DIR}",
        "files": profile.trace_files(folder),
        "breakdown": breakdown,
        "note": note,
    }
    return breakdown


def start(cfg: Any, target: Target, out_dir: Path | None = None) -> Callable[[], Any]:
    """The compile of ``target`` (from :func:`prepare`) to run, possibly on a thread: XLA
    releases the GIL while it compiles. With ``out_dir`` (the stage's folder), ``compile.dump``
    dumps this compile there and ``compile.breakdown`` traces it there."""
    if target.compile_job is not None:  # a topology's compile
        if out_dir is None or not cfg.dump or target.compile_dumped is None:
            return target.compile_job
        into = out_dir / DUMP_DIR
        dumped = target.compile_dumped

        def compile_dumping() -> Any:
            try:  # its breakdown from this dump too, before dump_keep
                return dumped(into, dump_options(cfg.dump_keep, into))
            except DoesNotFit:  # a refused program's dump stays, as dump_keep says
                keep_dump(into, cfg.dump_keep)
                raise

        return compile_dumping
    options = options_of(cfg)
    if out_dir is not None and cfg.dump:
        options |= dump_options(cfg.dump_keep, out_dir / DUMP_DIR)
    traced = out_dir is not None and cfg.breakdown
    folder: Path | None = None  # where XLA dumps the buffer assignment memory_breakdown reads
    if platform_of(cfg.backend) in BREAKDOWN_FROM_DUMP and "xla_dump_to" not in options:
        # Named by what is compiled: the executable records the folder. A traced compile must
        # not be JAX's reuse of an identical one, so its folder is its own.
        salt = {"jaxaot-trace": uuid.uuid4().hex} if traced else {}
        folder = peak_dump.folder_for(
            target.module_sha256, cfg.backend, 1, target.form == "lowered", options | salt
        )
    if traced and "xla_dump_to" not in options and folder is None:
        # JAX reuses an identical compile of this process (a sweep's, a test's): a breakdown
        # needs XLA to compile, so the options differ by a dump filter that dumps nothing (there
        # is no xla_dump_to; a dump's own folder already makes the options differ). The
        # executable is the same; the key never sees these options.
        options["xla_dump_hlo_module_re"] = f"jaxaot-breakdown-{uuid.uuid4().hex}"

    def compile_with(opts: dict[str, Any]) -> Any:
        try:
            if traced:
                assert out_dir is not None
                with profile.trace(out_dir / profile.COMPILE_TRACE_DIR):
                    return compile_lowered(target, cfg.backend, opts)
            return compile_lowered(target, cfg.backend, opts)
        except Exception as exc:
            err = _compile_error(exc, opts)
            if err is exc:
                raise
            raise err from exc

    def compile_now() -> Any:
        if folder is not None:
            return peak_dump.compile_reading(folder, options, compile_with, cfg.memory_top)
        compiled = compile_with(options)
        if platform_of(cfg.backend) in BREAKDOWN_FROM_DUMP and cfg.dump and out_dir is not None:
            # compile.dump's folder has the buffer assignment, until dump_keep removes it
            peak_dump.keep(compiled, peak_dump.read(out_dir / DUMP_DIR, compiled, cfg.memory_top))
        return compiled

    return compile_now


def run(
    ctx: StageContext, lowered: Lowered, compiled: Any = None, target: Target | None = None
) -> Compiled:
    """Compile ``target`` (default: :func:`prepare`'s) unless ``compiled`` was made ahead (see
    :func:`start`), and write the artifacts."""
    cfg = ctx.opts
    if compiled is None:
        compiled = start(cfg, target or prepare(cfg, lowered), ctx.out_dir)()
    if cfg.dump:
        record_dump(ctx, ctx.out_dir / DUMP_DIR)
    if cfg.breakdown:
        record_breakdown(ctx)
    if cfg.topology:  # a compile-only executable, plus the fit verdict
        from jaxaot.stages import topology

        record = topology.run(ctx, lowered, compiled, _record(lowered, cfg.backend))
        return replace(record, run_options=cfg.dump or cfg.breakdown)
    # From XLA's dump where the platform's executable has no buffer assignment (start); else
    # write_analysis reads the executable's own.
    peak_dump.record(ctx, compiled)
    _, cost, memory = write_analysis(ctx, compiled, lowered.meta.get("mesh"), _nr_devices(lowered))
    local_devices = compiled.runtime_executable().local_devices()
    device_ids = [d.id for d in local_devices]
    try:
        blob = serialize(compiled)
    except Exception as exc:  # not every backend can serialize executables
        ctx.warn(f"executable not serialized: {str(exc).splitlines()[0]}")
    else:
        ctx.write("executable.bin", blob)
        # What `load` would deserialize from these bytes is this executable: a later job of
        # the sweep that finds it in the store uses it without deserializing.
        memo.executable(
            local_devices[0].client, (sha256_bytes(blob), tuple(device_ids)), lambda: compiled
        )
    ctx.write_json(
        "compiled.json",
        {
            "backend": cfg.backend,
            "device_ids": device_ids,
            "module_sha256": lowered.module_sha256,
            "convention": convention_of(
                compiled
            ).to_json(),  # for people: load checks the executable
        },
    )
    return Compiled(
        compiled=compiled,
        lowered=lowered,
        backend=cfg.backend,
        cost=cost,
        memory=memory,
        run_options=cfg.dump or cfg.breakdown,
    )


def check(comp: CompileConfig, facts: CheckFacts) -> None:
    """compile's options, before JAX: backend, symbolic sizes, device counts."""
    if comp.backend not in BACKENDS:
        raise ConfigError(
            f"compile.backend: expected one of {', '.join(BACKENDS)}, found {comp.backend!r}"
        )
    for name, size in comp.shapes.items():
        if not str(name).isidentifier() or isinstance(size, bool) or not isinstance(size, int):
            raise ConfigError(
                f"compile.shapes.{name}: expected a dimension variable and an int size, found "
                f"{name!r}: {size!r}"
            )
        if size < 0:
            raise ConfigError(f"compile.shapes.{name}: expected a size >= 0, found {size}")
    if comp.num_devices is not None and comp.num_devices < 1:
        raise ConfigError(f"compile.num_devices: expected >= 1, found {comp.num_devices}")
    if comp.max_devices < 1:
        raise ConfigError(f"compile.max_devices: expected >= 1, found {comp.max_devices}")
    unknown = [k for k in comp.dump_keep if k not in DUMP_KINDS]
    if unknown or (comp.dump and not comp.dump_keep):
        raise ConfigError(
            f"compile.dump_keep: expected some of {', '.join(DUMP_KINDS)}, found {comp.dump_keep}"
        )
    if comp.breakdown and comp.topology:
        raise ConfigError(
            f"compile.breakdown=true with compile.topology={comp.topology}: not supported yet; "
            "trace a compile for this host's backend"
        )
    from jaxaot.stages.compile_options import check_effort
    from jaxaot.stages.fit_verdict import check_memory_keys

    check_effort(comp)  # compile.optimization_level, compile.memory_fitting_level
    check_memory_keys(comp)  # compile.memory_top, compile.hbm_reserve, compile.host_memory_bytes


def summarize(m: CompileMetrics) -> str:
    """The summary line: cost, memory, a topology's verdict, shardings."""
    parts = []
    if m.flops is not None:
        parts.append(human_count(m.flops, "FLOP"))
    if m.bytes_accessed is not None:
        accessed = m.bytes_accessed
        parts.append(f"{human_bytes(accessed)} accessed" if accessed >= 0 else "bytes accessed n/a")
    parts += loops_summary(m)
    if m.temp_bytes is not None:
        parts.append(
            f"mem arg {human_bytes(m.argument_bytes)} out {human_bytes(m.output_bytes)}"
            f" temp {human_bytes(m.temp_bytes)} code {human_bytes(m.code_bytes)}"
        )
    parts += memory_breakdown.summary(m)
    parts += topology_summary(m)
    if m.breakdown_top:
        parts.append(
            f"compile threads {human_seconds(m.breakdown_threads_s)}, most in "
            f"{m.breakdown_top} ({human_seconds(m.breakdown_top_s)})"
        )
    if m.xla_dump_files is not None:
        parts.append(f"XLA dump: {m.xla_dump_files} files (compile/{DUMP_DIR}/)")
    if m.mesh:
        parts.append(
            f"mesh {m.mesh}: sharded in {m.sharded_inputs}/{m.inputs}, "
            f"out {m.sharded_outputs}/{m.outputs} (compile/shardings.json)"
        )
    return "; ".join(parts)


# What a stored or checkpointed executable must match to be loaded: store entries and
# checkpoints alike (the key covers more; these are checked again at load).
COMPAT_FIELDS = ("jax", "jaxlib", "platform", "platform_version")


def compat(backend: Mapping[str, Any]) -> dict[str, Any]:
    return {k: backend.get(k) for k in COMPAT_FIELDS}


def compile_platform(comp: CompileConfig) -> str:
    """The platform whose compiler builds the executable: a topology's (libtpu for TPU
    topologies, the CUDA plugin for GPU ones), else the backend's."""
    if comp.topology:
        from jaxaot.targets.tpu import resolve

        return resolve(comp.topology, comp.num_slices).generation.platform
    return platform_of(comp.backend)


def _plan(
    comp: CompileConfig, facts: RunFacts, up: Upstream, backend: Mapping[str, Any]
) -> Plan[Target] | Uncached[Target]:
    """The store key of the executable, and the Target it compiles; no key when jax does not
    say which arguments the executable keeps (a key without them could serve another program)."""
    from jaxaot.stages.jaxenv import key_environment

    lowered = _concrete_lowering(comp, facts, up["lower"])
    target = prepare(comp, lowered)
    if target.convention.kept is None:
        why = (
            "this jax does not say which arguments an executable keeps; compiled without the store"
        )
        return Uncached(target, why)
    try:
        environment = key_environment(compile_platform(comp))
    except Unkeyable as exc:  # an HLO module transformation that cannot be identified
        return Uncached(target, str(exc))
    return Plan(key_of(cache_key(comp, lowered, target, dict(backend), environment)), target)


def _sized(ctx: StageContext[CompileConfig], lowered: Lowered) -> Lowered:
    """``lowered``, with the sizes a polymorphic lowering is compiled at in the metrics before
    anything is compiled or loaded: a compile that fails or does not fit records them too."""
    if lowered.state == "concrete":
        ctx.metrics["shapes"] = dict(lowered.meta["shapes"])
    return lowered


def _at_sizes(ctx: StageContext[CompileConfig], record: Compiled) -> Compiled:
    """The record with the sizes execute runs at (compile.shapes)."""
    return replace(record, shapes=dict(ctx.opts.shapes)) if ctx.opts.shapes else record


class CompileStage:
    """Stage 3: a Stage, Loadable, Cached (the store shares executables), Ahead (compiles while
    lower exports), Prepared, OnResume and Finishing (a topology's fit verdict)."""

    name: str = "compile"
    Options: type[CompileConfig] = CompileConfig
    Record: type[Compiled] = Compiled
    inputs: tuple[str, ...] = ("lower",)
    live_inputs: tuple[str, ...] = ()
    sections: tuple[str, ...] = ("compile",)
    artifacts: tuple[str, ...] = ARTIFACTS
    required: tuple[str, ...] = ("executable.bin",)
    show: Presentation[CompileMetrics] = Presentation(
        verb="compiling",
        noun="executable",
        figures=CompileMetrics.from_metrics,
        summarize=summarize,
    )
    again: str = "compiled again from lower/exported.bin"
    recomputed_differs: Mapping[str, str] = MappingProxyType({})
    check = staticmethod(check)
    compat = staticmethod(compat)
    plan = staticmethod(_plan)

    def run(self, ctx: StageContext[CompileConfig], up: Upstream) -> Compiled:
        lowered = _sized(ctx, _concrete_lowering(ctx.opts, ctx.facts, up["lower"]))
        return _at_sizes(ctx, run(ctx, lowered))

    def run_planned(
        self,
        ctx: StageContext[CompileConfig],
        up: Upstream,
        plan: Plan[Target] | Uncached[Target],
    ) -> Compiled:
        return _at_sizes(ctx, run(ctx, _sized(ctx, plan.state.lowered), target=plan.state))

    def run_begun(
        self, ctx: StageContext[CompileConfig], up: Upstream, plan: Plan[Target], begun: Any
    ) -> Compiled:
        # ``plan`` was made on lower's early record (no export yet): the record compiled is
        # lower's final one.
        lowered = _sized(ctx, _concrete_lowering(ctx.opts, ctx.facts, up["lower"]))
        return _at_sizes(ctx, run(ctx, lowered, compiled=begun, target=plan.state))

    def begin(self, opts: CompileConfig, plan: Plan[Target], out_dir: Path) -> Callable[[], Any]:
        return start(opts, plan.state, out_dir)

    def load(self, ctx: StageContext[CompileConfig], up: Upstream, entry: Entry) -> Compiled:
        """A checkpoint's executable, checked against what its export says it must be."""
        return self._loaded(ctx, up, entry, None)

    def load_planned(
        self, ctx: StageContext[CompileConfig], up: Upstream, entry: Entry, plan: Plan[Target]
    ) -> Compiled:
        """A store hit, checked against the convention its key was made from."""
        return self._loaded(ctx, up, entry, plan.state)

    def _loaded(
        self, ctx: StageContext[CompileConfig], up: Upstream, entry: Entry, target: Target | None
    ) -> Compiled:
        comp = ctx.opts
        lowered = _sized(
            ctx,
            target.lowered
            if target is not None
            else _concrete_lowering(comp, ctx.facts, up["lower"]),
        )
        expect = [target.convention] if target is not None else export_conventions(lowered)
        record = load(ctx, lowered, entry.read, entry.label, expect)
        if comp.dump or comp.breakdown:  # both are of a compile: compile again, only for them
            start(comp, target or prepare(comp, lowered), ctx.out_dir)()
            what = " and ".join(
                w for w, on in (("XLA's dump", comp.dump), ("its breakdown", comp.breakdown)) if on
            )
            note = f"compiled again only for {what}; the executable is {entry.label}'s"
            if comp.dump:
                record_dump(ctx, ctx.out_dir / DUMP_DIR, note)
            if comp.breakdown:
                record_breakdown(ctx, note)
            log.info("[compile] %s", note)
        return _at_sizes(ctx, record)

    def storable(self, record: Compiled, plan: Plan[Target]) -> str | None:
        if record.run_options:
            return (
                "executable not stored: compiled with compile.dump/compile.breakdown's options, "
                "which it records; a run without them compiles and stores its own"
            )
        wrong = mismatch(convention_of(record.compiled), [plan.state.convention])
        return f"executable not stored: {wrong} (a jax change?)" if wrong else None

    def before_run(self, opts: CompileConfig, facts: RunFacts) -> None:
        from jaxaot.config.argspec import concrete_bound

        # A polymorphic program compiles at compile.shapes: arguments XLA could not size at
        # those sizes are refused here, before JAX (XLA aborts the process on them).
        concrete_bound(facts.bound, opts.shapes)

    def before_resume(self, opts: CompileConfig, facts: RunFacts) -> None:
        from jaxaot.stages.topology import check_resume

        check_resume(opts)  # a topology's executable runs on a TPU host only

    def resume_default(
        self, saved: Mapping[str, Any], section: dict[str, Any], keys: set[str]
    ) -> dict[str, Any]:
        """Compile for the checkpoint's platform when it was lowered for exactly one, and the
        backend was not chosen: ``resume_from=<tpu lowering> start_at=compile`` on a TPU host."""
        if "compile.backend" in keys or "lower" not in saved:
            return section
        platforms = list(
            saved["lower"].get("platforms") or [platform_of(saved["compile"]["backend"])]
        )
        if len(platforms) != 1 or platform_of(section["backend"]) in platforms:
            return section
        log.info(
            "[compile] compile.backend=%s: the checkpoint was lowered for %s only "
            "(override compile.backend to choose another)",
            platforms[0],
            platforms,
        )
        return {**section, "backend": platforms[0]}

    def finish(
        self,
        opts: CompileConfig,
        record: Compiled | None,
        stages: dict[str, Any],
        extra: dict[str, Any],
    ) -> None:
        """A topology compile's fit verdict in the manifest; DoesNotFit (exit code 3) when no.

        The verdict is made here, from the stored or fresh memory analysis and this run's
        reserve (not part of the key): a program that does not fit by it has the compile
        stage's status ``does_not_fit``, as one XLA refused has; ``computed`` keeps how the
        executable came (``ran``, ``cached`` or ``resumed``).

        The one entry of another stage written here: a skipped execute's ``note`` says how to
        run this executable (it is for compile-only devices, which only compile.topology
        tells; execute reads its own options alone, and a skipped stage has no record and no
        member that fires)."""
        if not opts.topology or record is None:
            return
        from jaxaot.stages.topology import EXECUTE_NOTE, fit_of

        if stages.get("execute", {}).get("status") == "skipped":
            stages["execute"]["note"] = EXECUTE_NOTE
        try:
            extra["fit"] = fit_of(record, opts)
        except DoesNotFit as exc:
            stage = stages.get(self.name)
            if stage is not None:
                stage["computed"] = stage.get("status")
                stage["status"] = exc.run_status
            raise


COMPILE = CompileStage()


__all__ = [
    "COMPILE",
    "Compiled",
    "Convention",
    "Target",
    "cache_key",
    "check_platform",
    "compile_lowered",
    "compile_platform",
    "convention_of",
    "cost_of",
    "execution_devices",
    "export_conventions",
    "export_lowering",
    "kept_inputs",
    "keyed_backend",
    "load",
    "memory_of",
    "mismatch",
    "prepare",
    "run",
    "serialize",
    "start",
]
