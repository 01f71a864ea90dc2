"""Stage 3, compile: the lowered program to an XLA executable for ``compile.backend``.

``compile.compiler_options`` go to this one compile (never through the process-global
``XLA_FLAGS``, so sweep jobs in one process do not leak flags into each other). A program lowered
for a mesh runs on the backend's first N devices. Writes ``optimized.hlo.txt``,
``cost_analysis.json``, ``memory_analysis.json``, ``executable.bin`` and, for a mesh,
``shardings.json`` (each input's and output's compiled sharding).

The compile key covers the calling convention of what is compiled, and every executable
loaded from the store or a checkpoint is checked against the convention the run expects before
it is called (:mod:`jaxaot.stages.convention`, issue 12).
"""

from __future__ import annotations

import functools
import json
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from jaxaot.config.mesh import MeshSpec
from jaxaot.errors import BackendError, ConfigError, StageError, one_line
from jaxaot.stages import custom_calls
from jaxaot.stages.convention import (
    Convention,
    UnusableExecutable,
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
    serialize,
    stage_metrics,
)
from jaxaot.stages.jax_mesh import concrete_mesh, describe_shardings
from jaxaot.stages.jaxenv import devices, platform_of
from jaxaot.stages.lower import Lowered
from jaxaot.stages.node import StageContext
from jaxaot.util import memo
from jaxaot.util.fsio import sha256_bytes


@dataclass(frozen=True)
class Target:
    """What the compile stage compiles, and what its key and load check are made of.

    ``form`` is ``lowered`` (the program's own lowering, compiled as is) or ``exported``
    (``jax.jit(exported.call)`` lowered for one platform: a resumed run, or a multi-platform
    lowering). ``module_sha256`` identifies what is compiled: the canonical module text of the
    live lowering, or the sha256 of the serialized export (``exported.bin``'s very bytes, never
    a side file). The export form's lowering is made only when it is compiled (:meth:`lower`):
    a store hit needs just the hash and the convention.
    """

    form: str
    module_sha256: str
    convention: Convention
    lower: Callable[[], Any]  # -> jax.stages.Lowered, built once
    device_assignment: tuple[Any, ...] | None = None
    # The whole compile, where it is not ``lower().compile()``: a topology's (issue 15).
    compile_job: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Compiled:
    """An executable ready to call, with what the compiler said about it."""

    compiled: Any  # jax.stages.Compiled
    lowered: Lowered
    backend: str
    cost: dict[str, float] | None
    memory: dict[str, int] | None


def check_platform(lowered: Lowered, backend: str) -> str:
    """The platform to compile for, or a BackendError when the lowering does not cover it."""
    platform = platform_of(backend)
    if platform not in lowered.platforms:
        raise BackendError(
            f"compile.backend={backend!r} needs a lowering for {platform!r}, but lower.platforms "
            f"was {list(lowered.platforms)}; compile for one of those "
            f"(compile.backend={lowered.platforms[0]}), add {platform!r} to lower.platforms, or "
            f"lower only here (stop_after=lower) and compile on a {'/'.join(lowered.platforms)} "
            "machine (resume_from=<this run> start_at=compile)"
        )
    return platform


def _nr_devices(lowered: Lowered) -> int:
    if lowered.exported is not None:
        return int(lowered.exported.nr_devices)
    return int(lowered.meta.get("nr_devices") or 1)


def execution_devices(lowered: Lowered, backend: str) -> list[Any]:
    """The devices the program runs on: the first ``nr_devices`` of the backend."""
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
    return present[:needed]


def _export_lowering(lowered: Lowered, backend: str, devs: list[Any]) -> Any:
    """The export lowered for ``backend``'s platform, on the program's mesh."""
    mesh = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
    concrete = concrete_mesh(mesh, devs) if mesh is not None and len(devs) == mesh.size else None
    return export_lowering(lowered, platform_of(backend), concrete)


def prepare(cfg: Any, lowered: Lowered) -> Target:
    """Check the backend, platform and device count, and choose what to compile: the live
    lowering when there is one for exactly this platform, else the export."""
    import jax

    if cfg.topology:  # issue 15: through the export, onto libtpu's compile-only devices
        from jaxaot.stages import topology

        job = topology.start(cfg, lowered)  # checks platforms, the export and libtpu
        exp = lowered.exported

        def no_lowering() -> Any:
            raise AssertionError("a topology compile is its compile_job")

        return Target(
            form="topology",
            module_sha256=sha256_bytes(bytes(exp.serialize())),
            convention=export_conventions(lowered)[1],
            lower=no_lowering,
            compile_job=job,
        )
    devices(cfg.backend)  # a clear BackendError when the backend is absent
    platform = check_platform(lowered, cfg.backend)
    devs = execution_devices(lowered, cfg.backend)  # enough for the mesh, before compiling
    if lowered.lowered is not None and lowered.platforms == (platform,):
        mesh = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
        sharded = mesh is not None and len(devs) == mesh.size
        live = lowered.lowered
        return Target(
            form="lowered",
            module_sha256=lowered.module_sha256,
            convention=convention_of(live),
            lower=lambda: live,
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
    # leaves of the donated positional arguments; the runner checks the compiled executable
    # against this before it stores it.
    positions = jax.tree_util.tree_unflatten(exp.in_tree, range(len(exp.in_avals)))[0]
    donated = sorted(
        i for a in lowered.donate_argnums for i in jax.tree_util.tree_leaves(positions[a])
    )
    convention = replace(export_conventions(lowered)[1], donated=tuple(donated))
    return Target(
        form="exported",
        module_sha256=sha256_bytes(bytes(exp.serialize())),
        convention=convention,
        lower=functools.cache(lambda: _export_lowering(lowered, cfg.backend, devs)),
    )


def compile_lowered(target: Target, backend: str, options: dict[str, Any]) -> Any:
    """XLA-compile ``target`` (releases the GIL: may run on a worker thread)."""
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
#   2 (issue 12): the module actually compiled (the export's for the export form), the form,
#     the calling convention, XLA flags and JAX config values, device topology.
_KEY_VERSION = 2
ARTIFACTS = (
    "optimized.hlo.txt",
    "cost_analysis.json",
    "memory_analysis.json",
    "executable.bin",
    "compiled.json",
    "shardings.json",
)


def cache_key(
    cfg: Any, lowered: Lowered, target: Target, backend: dict[str, Any], environment: dict[str, Any]
) -> dict[str, Any]:
    """Everything the executable and its calling convention depend on, and nothing else (no
    paths, no times). ``environment`` is :func:`jaxaot.stages.jaxenv.key_environment`."""
    return {
        "stage": "compile",
        "key_version": _KEY_VERSION,
        "form": target.form,
        "module_sha256": target.module_sha256,
        "convention": target.convention.to_json(),
        "platforms": list(lowered.platforms),
        "donate_argnums": list(lowered.donate_argnums),
        "mesh": lowered.meta.get("mesh"),  # the export form's shardings are bound to it
        "compiler_options": dict(cfg.compile.compiler_options),
        "backend": backend,  # platform + version, device kind + count + topology, jax + jaxlib
        "environment": environment,  # XLA flags in effect, JAX config values
    }


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

    cfg = ctx.cfg.compile
    if cfg.topology:  # issue 15: compile-only devices cannot load it; a TPU host can
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
    if "shardings.json" in files:
        mesh_metrics(ctx, parsed("shardings.json"))
    return Compiled(
        compiled=compiled, lowered=lowered, backend=cfg.backend, cost=cost, memory=memory
    )


def _record(lowered: Lowered, backend: str) -> Callable[..., Compiled]:
    def record(compiled: Any, cost: Any, memory: Any) -> Compiled:
        return Compiled(
            compiled=compiled, lowered=lowered, backend=backend, cost=cost, memory=memory
        )

    return record


def start(cfg: Any, target: Target) -> Callable[[], Any]:
    """The compile of ``target`` (from :func:`prepare`) to run, possibly on a thread: XLA
    releases the GIL while it compiles."""
    if target.compile_job is not None:  # a topology's compile (issue 15)
        return target.compile_job
    options = dict(cfg.compiler_options)

    def compile_now() -> Any:
        try:
            return compile_lowered(target, cfg.backend, options)
        except Exception as exc:
            err = _compile_error(exc, options)
            if err is exc:
                raise
            raise err from exc

    return compile_now


def run(
    ctx: StageContext, lowered: Lowered, compiled: Any = None, target: Target | None = None
) -> Compiled:
    """Compile ``target`` (default: :func:`prepare`'s) unless ``compiled`` was made ahead (see
    :func:`start`), and write the artifacts."""
    cfg = ctx.cfg.compile
    if compiled is None:
        compiled = start(cfg, target or prepare(cfg, lowered))()
    if cfg.topology:  # issue 15: compile-only executable, plus the fit verdict
        from jaxaot.stages import topology

        return topology.run(ctx, lowered, compiled, _record(lowered, cfg.backend))
    ctx.write("optimized.hlo.txt", compiled.as_text() or "")
    if lowered.meta.get("mesh"):
        shardings = describe_shardings(compiled)
        shardings |= {"mesh": lowered.meta["mesh"], "devices": _nr_devices(lowered)}
        ctx.write_json("shardings.json", shardings)
        mesh_metrics(ctx, shardings)
    cost, memory = cost_of(compiled), memory_of(compiled)
    if cost:
        ctx.write_json("cost_analysis.json", cost)
    if memory:
        ctx.write_json("memory_analysis.json", memory)
    stage_metrics(ctx, cost, memory)
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
        compiled=compiled, lowered=lowered, backend=cfg.backend, cost=cost, memory=memory
    )


__all__ = [
    "Compiled",
    "Convention",
    "Target",
    "UnusableExecutable",
    "cache_key",
    "check_platform",
    "compile_lowered",
    "convention_of",
    "cost_of",
    "execution_devices",
    "export_conventions",
    "export_lowering",
    "kept_inputs",
    "load",
    "memory_of",
    "mismatch",
    "prepare",
    "run",
    "serialize",
    "start",
]
