"""The compile stage for a described TPU topology: hardware that is not there.

With ``compile.topology`` (and libtpu installed) the program compiles on this host for libtpu's
compile-only devices of that topology: the real TPU-optimized HLO, per-device memory and cost
analysis, and a serializable executable. The mesh is laid over the topology's devices. A
program lowered in this run for TPU alone compiles as it was lowered, rebound to the topology's
client (:func:`live_lowering`): one lowering, as a plain ``jit(f).lower(...).compile()`` has,
and the compile starts ahead, while the lower stage still exports and writes. Any other (a
resumed lowering, several platforms, NVIDIA targets) compiles through the lowering's
``jax.export``, its shardings rebound to those devices.

On top of what any compile writes, ``compiled.json`` (and the stage's metrics) carry the
**fit verdict** (HBM needed per device vs what XLA allows on the generation), the collectives
of the optimized HLO, and a roofline **estimate** of the step time. XLA refusing the program
for HBM is a verdict too (:class:`jaxaot.errors.DoesNotFit`), not a crash.

The executable cannot be loaded here (a compile-only client cannot deserialize): a store hit
or a resumed compile serves the verified artifacts and the verdict, with no live executable;
a TPU host loads it like any other (``resume_from=<run> start_at=execute``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.config.mesh import MeshSpec
from jaxaot.errors import BackendError, DoesNotFit, EntryUnusable, StageError
from jaxaot.stages import peak_dump
from jaxaot.stages.compile_options import options_of
from jaxaot.stages.contract import StageContext
from jaxaot.stages.executable import (
    cost_of,
    export_lowering,
    mesh_metrics,
    serialize,
    stage_metrics,
    write_analysis,
)
from jaxaot.stages.fit_verdict import does_not_fit, pair_text, parse_rejection, verdict
from jaxaot.stages.fit_verdict import metrics as fit_metrics
from jaxaot.stages.loop_costs import loop_collectives
from jaxaot.stages.lower import Lowered
from jaxaot.targets.tpu import Target, quiet_libtpu, resolve, topology_devices
from jaxaot.util.hlo_parse import COLLECTIVES, collectives
from jaxaot.util.humanize import human_bytes, human_seconds

if TYPE_CHECKING:
    from jaxaot.rundir.metrics import CompileMetrics

# The execute stage of a compile.topology run: recorded as skipped, with this note.
EXECUTE_NOTE = (
    "compiled for a topology's compile-only devices: run it on a host with that "
    "TPU topology or those GPUs with resume_from=<this run> start_at=execute"
)


def target_of(cfg: Any) -> Target:
    """The run's target from the typed ``compile`` config."""
    return resolve(cfg.topology, cfg.num_slices)


def _mesh(mesh: MeshSpec, devs: list[Any]) -> Any:
    """The mesh over the topology's devices in physical order (``jax.make_mesh``), or, when no
    axis of the physical torus matches a mesh axis (32 x 8 on a 16 x 16 torus), with physical
    axes split between mesh axes."""
    import jax
    from jax.experimental import mesh_utils
    from jaxaot.stages.jax_mesh import axis_types, concrete_mesh

    try:
        return concrete_mesh(mesh, devs)
    except NotImplementedError:
        grid = mesh_utils.create_device_mesh(mesh.shape, devs, allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, mesh.axes, axis_types=axis_types(mesh))


def _hybrid(mesh: MeshSpec, devs: list[Any], num_slices: int) -> Any:
    """A multi-slice mesh: the first axis spans the slices (over DCN), the rest stays in each
    slice (ICI); ``jax.make_mesh`` refuses multi-slice devices."""
    import jax
    from jax.experimental import mesh_utils
    from jaxaot.stages.jax_mesh import axis_types

    ici = (mesh.shape[0] // num_slices, *mesh.shape[1:])
    dcn = (num_slices,) + (1,) * (len(mesh.shape) - 1)
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devs)
    return jax.sharding.Mesh(grid, mesh.axes, axis_types=axis_types(mesh))


def _placement(lowered: Lowered, target: Target) -> tuple[Any, tuple[Any, ...]]:
    """(the concrete mesh over the topology's devices or None, the devices the program is
    compiled for in the mesh's order: its device assignment)."""
    devs = topology_devices(target)
    mesh = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
    if mesh is None or mesh.size <= 1:
        return None, (devs[0],)
    on_mesh = (
        _mesh(mesh, devs) if target.num_slices == 1 else _hybrid(mesh, devs, target.num_slices)
    )
    return on_mesh, tuple(on_mesh.devices.flat)


def live_lowering(lowered: Lowered, target: Target) -> Any | None:
    """The program's own lowering, rebound to the topology's compile-only client, when the
    compile can take it as is (what a plain ``jit(f).lower(...).compile()`` over the topology's
    mesh compiles: one lowering, and the compile can start before the export exists); None
    where it goes through the export: a resumed or polymorphic lowering (no live one), one
    for several platforms, NVIDIA targets, or a jax whose lowerings this cannot
    rebind."""
    from jaxaot.stages.executable import rebound

    platform = target.generation.platform
    if platform != "tpu" or lowered.lowered is None or lowered.state not in ("early", "live"):
        return None
    if lowered.platforms != (platform,):
        return None
    _, assignment = _placement(lowered, target)
    if int(lowered.meta.get("nr_devices") or 1) != len(assignment):
        return None
    return rebound(lowered.lowered, assignment[0].client)


def compile_for(lowered: Lowered, target: Target, options: dict[str, Any], live: Any = None) -> Any:
    """``live`` (from :func:`live_lowering`) or else the lowering's export compiled for
    ``target``'s compile-only devices."""
    on_mesh, assignment = _placement(lowered, target)
    if live is not None:
        # libtpu's start-up noise is behind it (topology_devices): nothing to hide on fd 2,
        # which this may hold while the lower stage still writes, on the compile-ahead thread.
        return live.compile(compiler_options=options or None, device_assignment=assignment)
    platform = target.generation.platform
    if platform == "cuda":  # ptxas/libdevice of the plugin's CUDA major, this compile only
        from jaxaot.targets.cuda import compile_options

        options = compile_options(options)
    with quiet_libtpu():
        export = export_lowering(
            lowered, platform, mesh=on_mesh, device=assignment[0] if on_mesh is None else None
        )
        return export.compile(compiler_options=options or None)


@dataclass(frozen=True)
class Plan:
    """How a topology compile goes: the job to run (on the compile-ahead thread or in the
    compile stage), and whether it compiles the live lowering (else the export): what the
    compile key must name."""

    job: Callable[[], Any]
    live: bool
    # The same compile dumping into the run's folder (compile.dump): (folder, its options).
    dumped: Callable[[Path, dict[str, Any]], Any] | None = None


def start(cfg: Any, lowered: Lowered) -> Plan:
    """Like ``jaxaot.stages.compile.start`` for a topology: check, then plan the compile."""
    target = target_of(cfg)
    platform = target.generation.platform
    if platform not in lowered.platforms:
        raise BackendError(
            f"compile.topology={cfg.topology}: the program was lowered for "
            f"{list(lowered.platforms)}; expected {platform} among lower.platforms"
        )
    topology_devices(target)  # a clear error without libtpu, before the worker thread
    live = live_lowering(lowered, target)
    if live is None and lowered.exported is None:
        # Also the runner's compile-ahead of a lowering that compiles through its export,
        # before the export exists: it leaves the compile to the compile stage, which has it.
        raise StageError(
            "compile",
            f"compile.topology={cfg.topology} compiles through the lowering's jax.export, and "
            "there is none (see lower's warnings)",
        )
    options = options_of(cfg)
    folder = peak_dump.folder_for(
        lowered.module_sha256, target.topology, target.num_slices, live is not None, options
    )

    def compile_into(into: Path, dump: dict[str, Any]) -> Any:
        try:
            compiled = compile_for(lowered, target, options | dump, live)
        except Exception as exc:
            refused = rejected_for_hbm(exc, target, cfg)
            if refused is None:
                raise
            # XLA writes the buffer assignment before it checks the limit: what is live at the
            # peak of the program it refused.
            # The lowering names the arguments (its args_info and kept inputs), as the
            # executable would have.
            named = live if live is not None else lowered.lowered
            peak_dump.attach(refused, peak_dump.read(into, named, cfg.memory_top))
            raise refused from None
        peak_dump.keep(compiled, peak_dump.read(into, compiled, cfg.memory_top))
        return compiled

    def compile_now() -> Any:
        with peak_dump.locked(folder):
            return compile_into(folder, peak_dump.options(folder))

    return Plan(job=compile_now, live=live is not None, dumped=compile_into)


def rejected_for_hbm(exc: BaseException, target: Target, cfg: Any = None) -> DoesNotFit | None:
    """XLA's ``RESOURCE_EXHAUSTED ... exceeds available HBM`` as a :class:`DoesNotFit`: a
    program XLA refused never fits (:func:`jaxaot.stages.fit_verdict.verdict`)."""
    rejection = parse_rejection(exc)
    if rejection is None:
        return None
    return does_not_fit(verdict(target, cfg, rejection=rejection))


def roofline(target: Target, cost: dict[str, float] | None) -> dict[str, Any] | None:
    """An ESTIMATE of one step per device: max(FLOPs / peak bf16, bytes accessed / HBM
    bandwidth), from XLA's cost analysis with loops counted per trip (``flops_xla``: XLA's own,
    loop bodies once) and the published peaks. No collectives, no overlap model, no measured
    efficiency: a lower bound to compare configurations, not a prediction."""
    if not cost or cost.get("flops") is None:
        return None
    gen = target.generation
    flops, moved = float(cost["flops"]), float(cost.get("bytes accessed", 0.0))
    compute_s, memory_s = flops / gen.peak_bf16_flops, moved / gen.hbm_bandwidth
    return {
        "estimate": True,
        "flops": flops,
        "bytes_accessed": moved,
        "flops_xla": cost.get("flops_xla"),
        "bytes_accessed_xla": cost.get("bytes accessed_xla"),
        "compute_s": compute_s,
        "memory_s": memory_s,
        "step_s": max(compute_s, memory_s),
        "bound": "compute" if compute_s >= memory_s else "memory",
        "peak_bf16_flops": gen.peak_bf16_flops,
        "hbm_bandwidth": gen.hbm_bandwidth,
        # Against the published table (no calibration for hardware that is not here).
        "intensity": flops / moved if moved > 0 else None,
        "ridge_flops_per_byte": gen.peak_bf16_flops / gen.hbm_bandwidth,
    }


def analysis(
    target: Target,
    hlo: str,
    cost: dict[str, float] | None,
    memory: dict[str, int] | None,
    cfg: Any = None,
) -> dict[str, Any]:
    """What a topology compile adds to ``compiled.json``, and the run's fit verdict (``cfg``:
    the compile section), which goes to the metrics and manifest only."""
    return {
        "target": target.to_json(),
        "fit": verdict(target, cfg, memory=memory) if memory else None,
        # Each collective counted as often as it runs (one in a scan's body: per layer).
        "collectives": loop_collectives(hlo),
        "roofline": roofline(target, cost),
    }


def metrics(info: dict[str, Any]) -> dict[str, Any]:
    """Flat report/summary columns of :func:`analysis` (or of a DoesNotFit's verdict)."""
    fit, roof, coll = info.get("fit") or {}, info.get("roofline") or {}, info.get("collectives")
    out: dict[str, Any] = {
        "topology": (info.get("target") or {}).get("topology") or fit.get("topology")
    }
    out.update(fit_metrics(fit))
    out["est_step_s"] = roof.get("step_s")
    out["est_bound"] = roof.get("bound")
    if coll:
        out["collectives"] = int(sum(c["count"] for c in coll.values()))
        out["collective_bytes"] = float(sum(c["bytes"] for c in coll.values()))
    return out


def run(ctx: StageContext, lowered: Lowered, compiled: Any, record: Callable[..., Any]) -> Any:
    """Write what ``jaxaot.stages.compile.run`` writes, for compile-only devices, plus the analysis.

    ``record(compiled, cost, memory)`` builds the stage's Compiled record.
    """

    cfg = ctx.opts
    target = target_of(cfg)
    hlo, cost, memory = write_analysis(ctx, compiled, lowered.meta.get("mesh"), target.devices)
    peak_dump.record(ctx, compiled)  # memory_breakdown.json from XLA's dump
    info = analysis(target, hlo, cost, memory, cfg)
    if info["roofline"] is None and target.generation.platform == "cuda":
        info["roofline"] = _lowering_roofline(target, lowered)
    ctx.metrics.update(metrics(info))
    devs = topology_devices(target)
    mesh = lowered.meta.get("mesh")
    n = MeshSpec.from_json(mesh).size if mesh else 1
    try:
        ctx.write("executable.bin", serialize(compiled))
    except Exception as exc:
        ctx.warn(f"executable not serialized: {str(exc).splitlines()[0]}")
    if target.generation.platform == "cuda":  # no GPU here, nothing autotuned
        from jaxaot.targets.cuda import autotune_note

        info["autotuned"] = False
        ctx.metrics["autotuned"] = False
        ctx.warn(autotune_note(dict(cfg.compiler_options)))
    ctx.write_json(
        "compiled.json",
        {
            "backend": target.generation.platform,
            "device_ids": [d.id for d in devs[:n]],
            "module_sha256": lowered.module_sha256,
            # Not the verdict: it depends on this run's compile.hbm_reserve/host_memory_bytes,
            # which no store key holds (the manifest's "fit" and the metrics have it).
            **{k: v for k, v in info.items() if k != "fit"},
        },
    )
    return record(compiled, cost, memory)


def _lowering_roofline(target: Target, lowered: Lowered) -> dict[str, Any] | None:
    """XLA gives no cost analysis for a deviceless GPU executable: the roofline estimate then
    comes from the lowering's (the whole program, before partitioning) split evenly over the
    devices, and says so."""
    whole = cost_of(lowered.lowered) if lowered.lowered is not None else None
    if not whole or whole.get("flops") is None:
        return None
    n = target.devices
    roof = roofline(target, {k: v / n for k, v in whole.items()})
    if roof is not None:
        roof["source"] = f"lowering cost analysis (whole program, pre-partitioning) / {n} devices"
    return roof


def load(
    ctx: StageContext,
    lowered: Lowered,
    read: Callable[[str], bytes],
    names: tuple[str, ...],
    record: Callable[..., Any],
) -> Any:
    """A stored topology compile (hash-verified by ``read``): its artifacts and verdict, with
    no live executable (a compile-only client cannot load one)."""
    files: dict[str, bytes] = {}
    for name in names:
        try:
            files[name] = read(name)
        except (KeyError, FileNotFoundError):
            continue
    meta = json.loads(files["compiled.json"])
    if meta.get("module_sha256") != lowered.module_sha256:
        raise EntryUnusable("stored executable is for another module")
    for name, data in files.items():
        ctx.write(name, data)
    cost = json.loads(files["cost_analysis.json"]) if "cost_analysis.json" in files else None
    memory = json.loads(files["memory_analysis.json"]) if "memory_analysis.json" in files else None
    stage_metrics(ctx, cost, memory)
    if "memory_breakdown.json" in files:
        from jaxaot.stages import memory_breakdown

        memory_breakdown.read_metrics(ctx, files["memory_breakdown.json"])
    shardings = json.loads(files["shardings.json"]) if "shardings.json" in files else None
    if shardings and shardings.get("mesh"):
        mesh_metrics(ctx, shardings)
    # The verdict and estimate from the stored analyses and today's accelerator table, as a
    # fresh compile would give them (the table is not part of the store key).
    target = target_of(ctx.opts)
    fresh = {
        "fit": verdict(target, ctx.opts, memory=memory) if memory else None,
        "roofline": roofline(target, cost) or meta.get("roofline"),
    }
    ctx.metrics.update(metrics(meta | fresh))
    return record(None, cost, memory)


def fit_of(compile_record: Any, cfg: Any) -> dict[str, Any] | None:
    """The fit verdict of a compiled program (None without a memory analysis); raises
    :class:`DoesNotFit` when it does not fit: more device memory than available (less the
    reserve) by its memory analysis (a program XLA accepted within rounding of its limit: its
    check and this sum need not agree to the byte), or more host memory than the host has."""
    memory = getattr(compile_record, "memory", None)
    if not memory:
        return None
    fit = verdict(target_of(cfg), cfg, memory=memory)
    if not fit["fits"]:
        raise does_not_fit(fit)
    return fit


def check_resume(cfg: Any) -> None:
    """``start_at=execute`` of a topology compile needs a TPU host: refuse on any other."""
    if not cfg.topology:
        return
    if target_of(cfg).generation.platform == "cuda":
        from jaxaot.targets.cuda import refuse_resume

        refuse_resume(target_of(cfg))
        return
    if not tpu_present():
        raise BackendError(
            f"start_at=execute: the executable was compiled for TPU topology {cfg.topology} "
            "(compile.topology), and this host has no TPU; run this command on a TPU host with "
            "that topology, or start_at=compile to compile again here"
        )


def present(cfg: Any) -> bool:
    """Whether this host has the hardware of ``cfg.topology`` (TPU, or NVIDIA GPUs)."""
    if target_of(cfg).generation.platform == "cuda":
        from jaxaot.targets.cuda import gpu_present

        return gpu_present(target_of(cfg))
    return tpu_present()


def tpu_present() -> bool:
    """Whether this host has real TPU devices (libtpu's start-up noise hidden)."""
    import jax

    try:
        with quiet_libtpu():
            return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


def topology_summary(m: CompileMetrics) -> list[str]:
    """``compile.topology``'s fit verdict (device and host memory, the reserve), collectives
    and roofline estimate: the figures printed as the verdict compared them."""
    v = m.verdict
    if v.fits is None:
        return []
    need, have = v.hbm_bytes_needed, v.hbm_bytes_available
    hbm = pair_text(need, have) if need is not None and have is not None else "-"
    reserve = v.hbm_reserve_bytes
    kept = f", {human_bytes(reserve)} reserved" if reserve else ""
    if v.fits or v.hbm_fits is not True:
        head = f"{'fits' if v.fits else 'DOES NOT FIT'}: {hbm} HBM per device"
    else:  # the device memory fits; the host's does not
        head = f"DOES NOT FIT in host memory (HBM fits: {hbm} per device"
        kept += ")"
    parts = [f"{head}{kept} ({v.topology})"]
    if need is not None and have is not None and need > have:
        parts.append(f"{human_bytes(need - have)} over")
    host_need, host_have = v.host_bytes_needed, v.host_bytes_available
    if host_need:
        host = pair_text(host_need, host_have) if host_have is not None else human_bytes(host_need)
        mark = " (DOES NOT FIT)" if v.host_fits is False else ""
        parts.append(f"host memory {host} per device{mark}")
    if m.peak_top and m.peak_bytes is None:  # XLA refused it: no peak figure
        parts.append(f"live at the peak: {m.peak_top}")
    if v.collectives is not None:
        parts.append(f"{v.collectives} collectives ({human_bytes(v.collective_bytes)})")
    if v.est_step_s is not None:
        parts.append(
            f"est. step >= {human_seconds(v.est_step_s)} ({v.est_bound}-bound roofline estimate)"
        )
    return parts


__all__ = [
    "COLLECTIVES",
    "EXECUTE_NOTE",
    "Plan",
    "analysis",
    "check_resume",
    "collectives",
    "compile_for",
    "fit_of",
    "live_lowering",
    "load",
    "metrics",
    "present",
    "rejected_for_hbm",
    "roofline",
    "run",
    "start",
    "tpu_present",
    "verdict",
]
