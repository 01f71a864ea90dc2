"""Stage 3, compile: the lowered program to an XLA executable for ``compile.backend``.

``compile.compiler_options`` go to this one compile (never through the process-global
``XLA_FLAGS``, so sweep jobs in one process do not leak flags into each other). A program lowered
for a mesh runs on the backend's first N devices. Writes ``optimized.hlo.txt``,
``cost_analysis.json``, ``memory_analysis.json``, ``executable.bin`` and, for a mesh,
``shardings.json`` (each input's and output's compiled sharding).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline import memo
from pipeline.context import StageContext
from pipeline.errors import BackendError, ConfigError, StageError
from pipeline.fsutil import sha256_bytes
from pipeline.jaxenv import devices, platform_of
from pipeline.parallel import MeshSpec

from .lower import Lowered
from .parallel import concrete_mesh, describe_shardings

_MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_generated_code_size_in_bytes",
)


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


def compile_lowered(lowered: Lowered, backend: str, options: dict[str, Any]) -> Any:
    """Compile from the live Lowered when there is one, else from the export (a resumed run)."""
    import jax

    devs = execution_devices(lowered, backend)
    mesh = MeshSpec.from_json(lowered.meta["mesh"]) if lowered.meta.get("mesh") else None
    sharded = mesh is not None and len(devs) == mesh.size > 1
    if lowered.lowered is not None and lowered.platforms == (platform_of(backend),):
        # Lowered against an AbstractMesh: bind it to concrete devices here.
        return lowered.lowered.compile(compiler_options=options or None,
                                       device_assignment=tuple(devs) if sharded else None)  # fmt: skip
    exp = lowered.exported
    shardings: dict[str, Any] = {}
    if sharded:
        assert mesh is not None
        concrete = concrete_mesh(mesh, devs)
        ins = jax.tree_util.tree_unflatten(exp.in_tree, exp.in_shardings_jax(concrete))
        outs = jax.tree_util.tree_unflatten(exp.out_tree, exp.out_shardings_jax(concrete))
        shardings = {"in_shardings": ins[0], "out_shardings": outs}
    jitted = jax.jit(exp.call, donate_argnums=lowered.donate_argnums, **shardings)
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, exp.in_avals)
    traced = jitted.trace(*args, **kwargs)
    return traced.lower(lowering_platforms=(platform_of(backend),)).compile(
        compiler_options=options or None
    )


def memory_of(compiled: Any) -> dict[str, int] | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:
        return None
    if stats is None:
        return None
    return {f: int(getattr(stats, f)) for f in _MEMORY_FIELDS if hasattr(stats, f)}


def cost_of(compiled: Any) -> dict[str, float] | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return {str(k): float(v) for k, v in cost.items()} if cost else None


def serialize(compiled: Any) -> bytes:
    """Executable bytes plus the pytree structure needed to call it, as one blob."""
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return pickle.dumps((bytes(payload), in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)


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
_KEY_VERSION = 1
ARTIFACTS = ("optimized.hlo.txt", "cost_analysis.json", "memory_analysis.json",
             "executable.bin", "compiled.json", "shardings.json")  # fmt: skip


def cache_key(cfg: Any, lowered: Lowered, backend: dict[str, Any]) -> dict[str, Any]:
    """Everything the executable depends on, and nothing else (no paths, no times)."""
    return {
        "stage": "compile",
        "key_version": _KEY_VERSION,
        "module_sha256": lowered.module_sha256,
        "platforms": list(lowered.platforms),
        "donate_argnums": list(lowered.donate_argnums),
        "compiler_options": dict(cfg.compile.compiler_options),
        "backend": backend,  # platform + version, device kind + count, jax + jaxlib
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
    ctx: StageContext, lowered: Lowered, read: Callable[[str], bytes], source: str
) -> Compiled:
    """A Compiled record from stored files (a store entry or a checkpoint), all hash-verified.

    ``read(name)`` must return bytes whose sha256 was checked against a manifest in the user's
    own store or run directory: the executable is unpickled from them.
    """
    from jax.experimental import serialize_executable

    cfg = ctx.cfg.compile
    if cfg.topology:  # issue 15: compile-only devices cannot load it; a TPU host can
        from . import topology

        if not topology.present(cfg):
            return topology.load(ctx, lowered, read, ARTIFACTS, _record(lowered, cfg.backend))
    files: dict[str, bytes] = {}
    for name in ARTIFACTS:  # each read (and hash check) once
        try:
            files[name] = read(name)
        except (KeyError, FileNotFoundError):
            continue  # optional artifacts (cost/memory analysis) some backends do not give
    meta = json.loads(files["compiled.json"])
    bound_to = _execution_devices(cfg.backend, meta["device_ids"], source)

    def deserialize() -> Any:
        payload, in_tree, out_tree = pickle.loads(files["executable.bin"])
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=cfg.backend, execution_devices=bound_to
        )

    # A sweep's later jobs load the same executable: deserialized once per process and client.
    key = (sha256_bytes(files["executable.bin"]), tuple(meta["device_ids"]))
    compiled = memo.executable(bound_to[0].client, key, deserialize)
    for name, data in files.items():
        ctx.write(name, data)

    def parsed(name: str) -> Any:
        return json.loads(files[name]) if name in files else None

    cost, memory = parsed("cost_analysis.json"), parsed("memory_analysis.json")
    _metrics(ctx, cost, memory)
    if "shardings.json" in files:
        _mesh_metrics(ctx, parsed("shardings.json"))
    return Compiled(compiled=compiled, lowered=lowered, backend=cfg.backend, cost=cost,
                    memory=memory)  # fmt: skip


def _record(lowered: Lowered, backend: str) -> Callable[..., Compiled]:
    def record(compiled: Any, cost: Any, memory: Any) -> Compiled:
        return Compiled(compiled=compiled, lowered=lowered, backend=backend, cost=cost,
                        memory=memory)  # fmt: skip

    return record


def _metrics(
    ctx: StageContext, cost: dict[str, float] | None, memory: dict[str, int] | None
) -> None:
    if cost:
        ctx.metrics.update(flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))
    if memory:
        ctx.metrics.update(
            argument_bytes=memory.get("argument_size_in_bytes"),
            output_bytes=memory.get("output_size_in_bytes"),
            temp_bytes=memory.get("temp_size_in_bytes"),
            code_bytes=memory.get("generated_code_size_in_bytes"),
        )


def _mesh_metrics(ctx: StageContext, shardings: dict[str, Any]) -> None:
    ctx.metrics.update(
        mesh=MeshSpec.from_json(shardings["mesh"]).describe(),
        devices=shardings["devices"],
        sharded_inputs=sum(not r["replicated"] for r in shardings["inputs"]),
        inputs=len(shardings["inputs"]),
        sharded_outputs=sum(not r["replicated"] for r in shardings["outputs"]),
        outputs=len(shardings["outputs"]),
    )


def start(cfg: Any, lowered: Lowered) -> Callable[[], Any]:
    """Check the backend, platform and device count, then return the compile to run (possibly
    on a thread: XLA releases the GIL while it compiles)."""
    if cfg.topology:  # issue 15: libtpu's compile-only devices of a described topology
        from . import topology

        return topology.start(cfg, lowered)
    devices(cfg.backend)  # a clear BackendError when the backend is absent
    platform = check_platform(lowered, cfg.backend)
    execution_devices(lowered, cfg.backend)  # enough devices for the mesh, before compiling
    if lowered.exported is None and (lowered.lowered is None or lowered.platforms != (platform,)):
        # jax compiles a multi-platform lowering only through its export, and there is none:
        # a compile started ahead of the export (the runner then compiles in the compile
        # stage), or a program jax.export cannot serialize (host callbacks).
        raise StageError(
            "compile",
            f"a lowering for {list(lowered.platforms)} compiles for {platform!r} only through "
            f"its jax.export, and there is none (see lower's warnings); lower for "
            f"lower.platforms=[{platform}] alone",
        )
    options = dict(cfg.compiler_options)

    def compile_now() -> Any:
        try:
            return compile_lowered(lowered, cfg.backend, options)
        except Exception as exc:
            err = _compile_error(exc, options)
            if err is exc:
                raise
            raise err from exc

    return compile_now


def run(ctx: StageContext, lowered: Lowered, compiled: Any = None) -> Compiled:
    """Compile (unless ``compiled`` was made ahead, see :func:`start`) and write the artifacts."""
    cfg = ctx.cfg.compile
    if compiled is None:
        compiled = start(cfg, lowered)()
    if cfg.topology:  # issue 15: compile-only executable, plus the fit verdict
        from . import topology

        return topology.run(ctx, lowered, compiled, _record(lowered, cfg.backend))
    ctx.write("optimized.hlo.txt", compiled.as_text() or "")
    if lowered.meta.get("mesh"):
        shardings = describe_shardings(compiled)
        shardings |= {"mesh": lowered.meta["mesh"], "devices": _nr_devices(lowered)}
        ctx.write_json("shardings.json", shardings)
        _mesh_metrics(ctx, shardings)
    cost, memory = cost_of(compiled), memory_of(compiled)
    if cost:
        ctx.write_json("cost_analysis.json", cost)
    if memory:
        ctx.write_json("memory_analysis.json", memory)
    _metrics(ctx, cost, memory)
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
        memo.executable(local_devices[0].client, (sha256_bytes(blob), tuple(device_ids)),
                        lambda: compiled)  # fmt: skip
    ctx.write_json("compiled.json", {
        "backend": cfg.backend, "device_ids": device_ids, "module_sha256": lowered.module_sha256,
    })  # fmt: skip
    return Compiled(compiled=compiled, lowered=lowered, backend=cfg.backend, cost=cost,
                    memory=memory)  # fmt: skip


__all__ = [
    "Compiled",
    "check_platform",
    "compile_lowered",
    "cost_of",
    "execution_devices",
    "memory_of",
    "run",
    "serialize",
    "start",
]
