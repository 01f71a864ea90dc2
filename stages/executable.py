"""What every executable gets, whichever stage compiled it (compile or topology):
``jax.jit(exported.call)`` lowered for a platform (resumed, multi-platform and topology
compiles), a live lowering rebound to another client's devices (topology compiles), XLA's cost
analysis with while loops counted per trip (:mod:`jaxaot.stages.loop_costs`; XLA's own figures
kept as ``flops_xla`` ...) and memory analysis as metrics, and the serialized executable."""

from __future__ import annotations

import pickle
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.mesh import MeshSpec
from jaxaot.stages.contract import StageContext
from jaxaot.stages.cost_figures import costs_of
from jaxaot.stages.lower import Lowered

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


def export_lowering(lowered: Lowered, platform: str, mesh: Any = None, device: Any = None) -> Any:
    """``jax.jit(exported.call)`` lowered for ``platform``: with the export's shardings laid
    over the concrete ``mesh``, or everything on ``device``, or (neither) unconstrained; with
    the layouts and memory kinds the lowering recorded (``placement``) on mesh or device;
    donating what the lowering donated, keyword arguments included (``donate_argnames``).

    jax.jit takes no in_shardings with keyword arguments ("pjit does not support kwargs when
    in_shardings is specified", jax 0.10.2): an export with keyword inputs is traced with each
    input's sharding (a Format with its layout) on its ShapeDtypeStruct instead, which lowers
    to the same module."""
    import jax
    from jax.sharding import SingleDeviceSharding
    from jaxaot.stages.jax_inputs import jit_inputs
    from jaxaot.stages.jax_placement import export_placed

    exp = lowered.export()
    in_flat: list[Any] = [None] * len(exp.in_avals)
    shardings: dict[str, Any] = {}
    if mesh is not None or device is not None:
        if mesh is not None:
            ins_flat, outs_flat = exp.in_shardings_jax(mesh), exp.out_shardings_jax(mesh)
        else:
            one = SingleDeviceSharding(device)
            ins_flat, outs_flat = [one] * len(exp.in_avals), [one] * len(exp.out_avals)
        # The export keeps neither layouts nor memory kinds (jax 0.10.2): those the lowering
        # recorded (lower.{in,out}_layouts / _memory_kinds) are asked for again.
        in_flat, outs_flat = export_placed(
            lowered.meta.get("placement"), ins_flat, outs_flat, device
        )
        given, in_flat = jit_inputs(exp.in_tree, in_flat)
        shardings = {"out_shardings": jax.tree_util.tree_unflatten(exp.out_tree, outs_flat)}
        shardings |= given
    avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s)
        for a, s in zip(exp.in_avals, in_flat, strict=True)
    ]
    jitted = jax.jit(
        exp.call,
        donate_argnums=lowered.donate_argnums,
        donate_argnames=lowered.donate_argnames or None,
        **shardings,
    )
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, avals)
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))


def rebound(live: Any, client: Any) -> Any | None:
    """``live`` (a ``jax.stages.Lowered`` made in this process, for another platform, against an
    ``AbstractMesh``) compiling on ``client`` (a topology's compile-only client) instead of this
    host's backend; None for a lowering bound to this host's devices (no mesh: JAX placed it on
    the default device), one with constants hoisted to arguments, or where this jax lays its
    lowerings out otherwise.

    An AbstractMesh lowering names no devices: JAX binds it to the default backend's client
    only to compile it, and ``compile(device_assignment=)`` takes any devices of that client.
    Rebound, it is the module, shardings and calling convention a plain
    ``jit(f).lower(...).compile()`` over the topology's mesh compiles (tests/test_topology.py
    checks the optimized HLO equal), without lowering the program again through its export.
    jax 0.10 has no public way to say which client compiles a lowering: the copy
    replaces ``compile_args["backend"]`` of the private ``MeshComputation``, and never touches
    ``live`` itself. Constants hoisted to arguments (jax_use_simplified_jaxpr_constants):
    jax 0.10 cannot serialize that executable; the export can.
    """
    return compat_jax.lowered_for_client(live, client)


# What write_analysis already has for the executable it analyses (its optimized HLO text), and
# what cost_of found beyond the figures (the loops), keyed by id() for that call only: cost_of
# keeps its one-argument form, the seam tests patch.
_ANALYSING: dict[int, dict[str, Any]] = {}


def cost_of(compiled: Any) -> dict[str, float] | None:
    """:func:`costs_of`'s cost analysis (the loops it found go to :func:`write_analysis`)."""
    seen = _ANALYSING.get(id(compiled))
    cost, loops = costs_of(compiled, seen.get("hlo") if seen else None)
    if seen is not None:
        seen["loops"] = loops
    return cost


def memory_of(compiled: Any) -> dict[str, int] | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:
        return None
    if stats is None:
        return None
    return {f: int(getattr(stats, f)) for f in _MEMORY_FIELDS if hasattr(stats, f)}


def stage_metrics(
    ctx: StageContext, cost: dict[str, float] | None, memory: dict[str, int] | None
) -> None:
    if cost:
        ctx.metrics.update(flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))
        if "flops_xla" in cost:  # XLA's own figures: loop bodies counted once
            ctx.metrics.update(
                flops_xla=cost.get("flops_xla"),
                bytes_accessed_xla=cost.get("bytes accessed_xla"),
                loops=int(cost.get("loops", 0)),
                loops_unknown_trip_count=int(cost.get("loops_unknown_trip_count", 0)),
            )
    if memory:
        ctx.metrics.update(
            argument_bytes=memory.get("argument_size_in_bytes"),
            output_bytes=memory.get("output_size_in_bytes"),
            temp_bytes=memory.get("temp_size_in_bytes"),
            code_bytes=memory.get("generated_code_size_in_bytes"),
        )


def mesh_metrics(ctx: StageContext, shardings: dict[str, Any]) -> None:
    # An input dropped as unused (kept: false) has no sharding: neither sharded nor counted.
    kept = [r for r in shardings["inputs"] if r.get("kept", True)]
    ctx.metrics.update(
        mesh=MeshSpec.from_json(shardings["mesh"]).describe(),
        devices=shardings["devices"],
        sharded_inputs=sum(not r["replicated"] for r in kept),
        inputs=len(kept),
        sharded_outputs=sum(not r["replicated"] for r in shardings["outputs"]),
        outputs=len(shardings["outputs"]),
    )


def _layout_json(fmt: Any) -> dict[str, Any] | None:
    """A ``Format``'s layout as every field JAX's ``Layout`` has (jax 0.10.2: major_to_minor,
    tiling, sub_byte_element_size_in_bits), tuples as lists; None where it has none (an input
    dropped as unused, or a backend that does not say)."""
    layout = compat_jax.format_layout(fmt)
    if not isinstance(layout, compat_jax.layout_class()):
        return None
    return {name: _plain(value) for name, value in compat_jax.layout_fields(layout).items()}


def _plain(value: Any) -> Any:
    """A layout field as JSON: tuples (of tuples) as lists."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _flat_formats(compiled: Any, name: str, n: int) -> list[Any]:
    """``compiled.input_formats``/``output_formats`` flattened to one ``Format`` per leaf
    (``Format(None, None)`` for an input dropped as unused); None each where the executable
    cannot give them."""
    import jax
    from jax.experimental.layout import Format

    try:
        flat = jax.tree.leaves(getattr(compiled, name), is_leaf=lambda x: isinstance(x, Format))
    except Exception:  # an executable without formats (a backend without layouts)
        return [None] * n
    return flat if len(flat) == n else [None] * n


def _rows(
    paths: list[str],
    avals: list[Any],
    formats: list[Any],
    donations: list[bool | None] | None = None,
) -> list[dict[str, Any]]:
    """One row per leaf; ``donations`` (inputs only) says which inputs are donated."""
    inputs = donations is not None
    rows = []
    for k, (path, aval, fmt) in enumerate(zip(paths, avals, formats, strict=True)):
        donated = donations[k] if donations is not None else None
        shape = tuple(aval.shape)
        sharding = getattr(fmt, "sharding", None)
        spec = getattr(sharding, "spec", None)
        row: dict[str, Any] = {
            "path": path,
            "shape": list(shape),
            "dtype": str(aval.dtype),
            "sharding": None,
            "shard_shape": None,
            "replicated": None,
            "memory_kind": None,
            "layout": _layout_json(fmt),
        }
        if inputs:  # JAX's in_avals (weak types as ~), whether the executable kept it
            row.update(aval=str(aval), kept=sharding is not None, donated=donated)
        if sharding is not None:
            row.update(
                sharding=compat_jax.spec_text(spec) if spec is not None else str(sharding),
                shard_shape=list(sharding.shard_shape(shape)),
                replicated=bool(sharding.is_fully_replicated),
                memory_kind=getattr(sharding, "memory_kind", None),
            )
        rows.append(row)
    return rows


def describe_formats(compiled: Any) -> dict[str, Any]:
    """shardings.json's rows: per flat input, as ``jax.stages.Compiled`` says (jax 0.10.2), its
    aval (``in_avals``, which keeps the inputs dead-argument elimination dropped), whether the
    executable kept it, and its format (``input_formats``: layout and sharding, with the
    sharding's memory kind; a dropped input has ``Format(None, None)``: all null here) and
    whether it is donated (``args_info``); per
    output its aval and format (``output_formats``)."""
    import jax
    from jaxaot.config.tree_paths import input_path

    try:
        in_avals = compiled.in_avals  # every input, the dropped ones too
    except Exception:  # a compiled object without them: the lowering's arguments
        in_avals = jax.tree.map(compat_jax.arg_aval, compiled.args_info)
    in_flat = jax.tree_util.tree_flatten_with_path(in_avals)[0]
    in_paths = [input_path(path) for path, _ in in_flat]
    ins = [a for _, a in in_flat]
    out_flat = jax.tree_util.tree_flatten_with_path(compat_jax.out_info(compiled))[0]
    out_paths = [jax.tree_util.keystr(path) or "output" for path, _ in out_flat]
    outs = [o for _, o in out_flat]
    try:  # and whether each is donated (args_info: donated=True)
        donations: list[bool | None] = [
            bool(i.donated) for i in jax.tree.leaves(compiled.args_info)
        ]
    except Exception:
        donations = []
    if len(donations) != len(ins):
        donations = [None] * len(ins)
    return {
        "inputs": _rows(
            in_paths, ins, _flat_formats(compiled, "input_formats", len(ins)), donations
        ),
        "outputs": _rows(out_paths, outs, _flat_formats(compiled, "output_formats", len(outs))),
    }


def relabel_shardings(shardings: dict[str, Any], static: list[int]) -> dict[str, Any]:
    """``shardings`` with its input paths as the program names them (signature.json), whose
    static positions are ``static``: ``args[0]`` of the executable of ``f(s, x)`` with ``s``
    static is ``x``, ``args[1]``. ``static_positions`` (absent: none) records the positions
    its paths are mapped through, so a store hit made with others is relabelled again."""
    from jaxaot.stages.memory_breakdown import moved_path

    old = list(shardings.get("static_positions") or [])
    if old == static:
        return shardings
    rows = [{**r, "path": moved_path(r["path"], old, static)} for r in shardings["inputs"]]
    out = {**shardings, "inputs": rows, "static_positions": list(static)}
    if not static:
        del out["static_positions"]
    return out


def serialize(compiled: Any) -> bytes:
    """Executable bytes plus the pytree structure needed to call it, as one blob."""
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return pickle.dumps((bytes(payload), in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)


def write_analysis(
    ctx: StageContext, compiled: Any, mesh: dict[str, Any] | None, devices: int
) -> tuple[str, dict[str, float] | None, dict[str, int] | None]:
    """What every compile writes about its executable: the optimized HLO, its shardings on the
    mesh (if any), cost analysis (counting loops; ``loops.json`` lists them) and memory
    analysis, what is live at the peak (``memory_breakdown.json``), and their metrics; returns
    (hlo, cost, memory)."""
    hlo = compiled.as_text() or ""
    ctx.write("optimized.hlo.txt", hlo)
    # Every compile's input/output formats, memory kinds and kept inputs, on one device too;
    # inputs named by their position in program.args (the executable numbers traced ones only).
    from jaxaot.stages.memory_breakdown import static_positions

    shardings = relabel_shardings(
        describe_formats(compiled) | {"mesh": mesh, "devices": devices}, static_positions(ctx)
    )
    ctx.write_json("shardings.json", shardings)
    if mesh:
        mesh_metrics(ctx, shardings)
    seen: dict[str, Any] = {"hlo": hlo}
    _ANALYSING[id(compiled)] = seen
    try:
        cost, memory = cost_of(compiled), memory_of(compiled)
    finally:
        _ANALYSING.pop(id(compiled), None)
    loops = seen.get("loops")
    if cost:
        ctx.write_json("cost_analysis.json", cost)
    if loops and (loops.get("loops") or "loops" not in loops):
        ctx.write_json("loops.json", loops)
    if memory:
        ctx.write_json("memory_analysis.json", memory)
    stage_metrics(ctx, cost, memory)
    record_memory_breakdown(ctx, compiled, hlo)
    return hlo, cost, memory


def record_memory_breakdown(ctx: StageContext, compiled: Any, hlo: str) -> None:
    """memory_breakdown.json from the executable's serialized buffer assignment, where jaxlib
    gives one and the stage has none yet (topology and CUDA compiles: XLA's dump, read by
    :mod:`jaxaot.stages.peak_dump`). A proto this cannot read is a warning, not a failure."""
    from jaxaot.stages import memory_breakdown

    if memory_breakdown.ARTIFACT in ctx.artifacts:  # from XLA's dump (compile.start)
        return
    top = int(getattr(ctx.opts, "memory_top", 10))  # the compile section's
    try:
        found = memory_breakdown.from_proto(compiled, hlo, top)
    except Exception as exc:  # a jaxlib whose proto differs: the compile itself is fine
        ctx.warn(f"memory breakdown not written: {type(exc).__name__}: {exc}")
        return
    if found is not None:
        memory_breakdown.write(ctx, found)


__all__ = [
    "cost_of",
    "costs_of",
    "describe_formats",
    "export_lowering",
    "memory_of",
    "mesh_metrics",
    "rebound",
    "record_memory_breakdown",
    "relabel_shardings",
    "serialize",
    "stage_metrics",
    "write_analysis",
]
