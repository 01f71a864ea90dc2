"""The JAX side of ``lower.{in,out}_memory_kinds`` and ``lower.{in,out}_layouts``.

:mod:`jaxaot.config.placement` says which leaf goes where; this module turns that into what
``jax.jit`` takes: each leaf's sharding with its memory kind (``sharding.with_memory_kind``; on
no mesh a ``SingleDeviceSharding`` of ``compile.backend``'s first device), wrapped in
``jax.experimental.layout.Format(Layout.AUTO | Layout(major_to_minor), sharding)`` when it has a
layout. On a mesh, a leaf with a major-to-minor layout is sharded on the concrete mesh over
``compile.backend``'s first ``mesh.size`` devices (jax 0.10.2 lowers such a ``Format`` only
with devices), every other leaf on the AbstractMesh; the module is the same either way, bar
the layouts. The lowered module carries them (``mhlo.memory_kind``, ``mhlo.layout_mode`` on its
arguments and results), so the module digest and the compile key cover them.

An argument leaf placed in host memory (``pinned_host``/``unpinned_host``) is moved to device
memory at the program's entry, inside the jitted function (:func:`moving_to_device`:
``jax.device_put(x, jax.memory.Space.Device)``), so a program written for device memory runs
with its parameters or optimizer state offloaded by config alone: JAX (0.10.2) refuses
arithmetic between host and device values at trace time ("memory_space of all inputs passed to
`add` must be the same"), and XLA runs element-wise work on a host value on the host. The
copies are in the module, so XLA schedules them (on TPU: asynchronous copy-start/copy-done).
A program that moves them itself (``jax.device_put(x, jax.memory.Space.Device)``) then moves
values already in device memory, which copies nothing. An NNX Variable's update keeps the
sharding and memory kind its Variable came in with (an offloaded optimizer state goes back to
the host); a plain program's outputs are placed by ``lower.out_memory_kinds`` (the out
shardings), with no move written.

What was asked is recorded in ``lowered.json`` (``placement``: per flat input and output of the
jit, the path, memory kind and layout) so a compile through the lowering's export can ask for
the same again (:func:`export_placed`): ``jax.jit(exported.call)`` keeps neither the layouts
nor, without a mesh, the memory kinds (jax 0.10.2).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.placement import AUTO, Placement, check_kinds, resolve_placement
from jaxaot.errors import ConfigError

if TYPE_CHECKING:
    from jaxaot.stages.contract import RunFacts


@dataclass(frozen=True)
class Placed:
    """The program, jit options and arguments with the placement applied, and its record."""

    fn: Any
    opts: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    record: dict[str, Any] | None  # lowered.json's "placement"; None when nothing is placed
    replicated_outputs: list[str]  # mesh outputs given a kind/layout but no sharding: replicated
    moved: list[str] = field(default_factory=list)  # host-placed inputs moved to device at entry


HOST_KINDS = ("pinned_host", "unpinned_host")


def moving_to_device(fn: Any, flags: dict[int | str, list[bool]]) -> Any:
    """``fn`` with the leaves of its arguments that ``flags`` marks (per position or keyword,
    one flag per leaf in flatten order) moved to device memory first, inside the trace.
    ``functools.wraps`` keeps ``fn``'s signature for jax.jit's static and donated names."""
    import jax

    def move(tree: Any, marks: list[bool]) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [
            jax.device_put(x, jax.memory.Space.Device) if m else x
            for x, m in zip(leaves, marks, strict=True)
        ]
        return jax.tree.unflatten(treedef, leaves)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        moved = list(args)
        moved_kw = dict(kwargs)
        for at, marks in flags.items():
            if isinstance(at, int):
                moved[at] = move(moved[at], marks)
            else:
                moved_kw[at] = move(moved_kw[at], marks)
        return fn(*moved, **moved_kw)

    return entry


def target_devices(facts: RunFacts, platforms: Sequence[str]) -> list[Any] | None:
    """The devices the program will run on, to check memory kinds against: a topology's
    compile-only devices, else ``compile.backend``'s when the lowering is for its platform;
    None when there are none here (a lowering for another platform, stop_after=lower)."""
    import jax

    if facts.topology:
        from jaxaot.targets.tpu import resolve, topology_devices

        return topology_devices(resolve(facts.topology, facts.num_slices))
    if facts.platform not in platforms:
        return None
    try:
        return list(jax.devices(facts.backend))
    except RuntimeError:
        return None


def memory_kinds_of(device: Any) -> list[str]:
    """The memory kinds a device has (``device.addressable_memories()``)."""
    return [m.kind for m in device.addressable_memories()]


def _layout(value: Any) -> Any:
    layout = compat_jax.layout_class()
    return layout.AUTO if value == AUTO else layout(major_to_minor=tuple(value))


def _apply(p: Placement | None, base: Any, device: Any, mesh: Any, concrete: Any = None) -> Any:
    """One leaf's jit sharding: ``base`` (a sharding or None) with ``p``'s memory kind and
    layout. A kind or concrete layout with no sharding takes a whole one: replicated on
    ``mesh``, else ``device``. A concrete layout's sharding on an AbstractMesh moves to
    ``concrete`` (that mesh over devices): jax 0.10.2 compares the layout with the devices'
    default while lowering, and an AbstractMesh has none ("_device_assignment is not
    implemented for jax.sharding.AbstractMesh")."""
    if p is None or p.empty:
        return base
    from jax.experimental.layout import Format
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    needs_whole = p.memory_kind is not None or isinstance(p.layout, tuple)
    if isinstance(p.layout, tuple) and concrete is not None:
        mesh = concrete
        if isinstance(base, NamedSharding) and isinstance(base.mesh, AbstractMesh):
            base = NamedSharding(concrete, base.spec, memory_kind=base.memory_kind)
    if base is None and needs_whole:
        base = (
            NamedSharding(mesh, PartitionSpec())
            if mesh is not None
            else SingleDeviceSharding(device)
        )
    if p.memory_kind is not None:
        base = base.with_memory_kind(p.memory_kind)
    if p.layout is None:
        return base
    return Format(_layout(p.layout), base)


def _sharding_of(spec: Any) -> Any:
    """The sharding of a jit in/out spec (a Format's own)."""
    from jax.experimental.layout import Format

    return spec.sharding if isinstance(spec, Format) else spec


def _full(prefix: Any, tree: Any) -> list[Any]:
    """A prefix tree of shardings (one standing for a subtree) expanded to ``tree``'s leaves."""
    import jax

    if prefix is None:
        return [None] * len(jax.tree.leaves(tree))
    full = jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix, tree)
    return list(jax.tree.leaves(full))


def _retyped(leaf: Any, spec: Any, carry: bool = False) -> Any:
    """A ShapeDtypeStruct carrying its own sharding, carrying the one chosen instead (jax.jit
    refuses an argument whose memory kind differs from its in_shardings'). ``carry``: every
    ShapeDtypeStruct carries the whole spec (a Format with its layout too), for a call with
    keyword arguments, which takes no in_shardings."""
    import jax

    sharding = spec if carry else _sharding_of(spec)
    if not isinstance(leaf, jax.ShapeDtypeStruct) or sharding is None:
        return leaf
    if not carry and getattr(leaf, "sharding", None) is None:
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type, sharding=sharding)


def placed(
    low: Any,
    facts: RunFacts,
    staged: Any,
    fn: Any,
    opts: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    platforms: Sequence[str],
    amesh: Any = None,
) -> Placed:
    """``fn``/``opts``/``args`` (as the lower stage built them: on ``amesh`` when the run has a
    mesh) with ``lower.{in,out}_memory_kinds`` and ``lower.{in,out}_layouts`` applied, and
    the host-placed argument leaves moved to device memory at ``fn``'s entry. ``low`` is the
    lower section."""
    import jax
    from jaxaot.config.path_shardings import path_leaves
    from jaxaot.config.tree_paths import top_names

    bound = staged.bound
    traced = [i for i in range(len(args)) if not bound.is_static(i)]
    traced_kw = [k for k in kwargs if not bound.is_static(k)]
    tops = top_names(len(args), staged.signature.get("parameters"))
    # Keyword arguments' leaves are named by keyword (as lower.in_shardings' mapping form).
    _, in_leaves = path_leaves(
        [(tops[i], args[i]) for i in traced] + [(k, kwargs[k]) for k in traced_kw],
        [f"args[{i}]" for i in traced] + [None] * len(traced_kw),
    )
    ins = resolve_placement(in_leaves, low.in_memory_kinds, low.in_layouts, "in")
    out_placed = low.out_memory_kinds is not None or low.out_layouts is not None
    outs: dict[str, Placement] = {}
    out_leaves: list[Any] = []
    out_tree: Any = None
    if out_placed:
        t = staged.traced
        assert t is not None, "output placement needs the traced program"
        out_info, out_tree = t.out_info, compat_jax.traced_out_tree(t)
        if staged.returns_updates:  # (the user's output, the NNX updates): the user's output
            out_info, out_tree = t.out_info[0], out_tree.children()[0]
        _, out_leaves = path_leaves([("output", out_info)])
        outs = resolve_placement(out_leaves, low.out_memory_kinds, low.out_layouts, "out")
    if not ins and not outs:
        return Placed(fn, opts, args, kwargs, None, [])
    devices = target_devices(facts, platforms)
    if devices:
        check_kinds({**ins, **outs}, memory_kinds_of(devices[0]), devices[0].device_kind)
    device = None
    concrete = _concrete_mesh(low, facts, amesh, devices, ins, outs) if amesh is not None else None
    if amesh is None:
        if facts.topology:
            # A topology compile places leaves through a mesh over the topology's devices
            # (stages/topology.py); one device of compile.backend is not one of them.
            keys = [
                f"lower.{k}"
                for k in ("in_memory_kinds", "out_memory_kinds", "in_layouts", "out_layouts")
                if getattr(low, k) is not None
            ]
            n = len(devices or ())
            raise ConfigError(
                f"{'/'.join(keys)} with compile.topology={facts.topology} needs a mesh "
                f"over the topology's {n} devices, found none; add mesh.shape=[{n}] "
                "mesh.axes=[data]"
            )
        if devices is None:
            raise ConfigError(
                "lower.in_memory_kinds/out_memory_kinds/in_layouts/out_layouts without a mesh "
                f"place leaves on one device of compile.backend={facts.backend}, and this "
                f"lowering is for {list(platforms)}; expected a mesh (e.g. mesh.shape=[1] "
                "mesh.axes=[data]) or lower.platforms=[" + facts.backend + "]"
            )
        device = devices[0]
        # The static keyword arguments are bound; the traced ones stay keyword arguments.
        static_kw = {k: v for k, v in kwargs.items() if bound.is_static(k)}
        if static_kw:
            fn = functools.partial(fn, **static_kw)
            kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}
        dropped = ("static_argnames",) if traced_kw else ("static_argnames", "donate_argnames")
        opts = {k: v for k, v in opts.items() if k not in dropped}
    opts = dict(opts)
    # jax.jit takes no in_shardings with keyword arguments ("pjit does not support kwargs when
    # in_shardings is specified", jax 0.10.2): each input's sharding, memory kind and layout
    # ride on its ShapeDtypeStruct instead (``sharding=`` takes a Format), which lowers alike.
    carry = bool(traced_kw)
    new_kwargs = dict(kwargs)
    new_args = list(args)
    record: dict[str, Any] = {"inputs": [], "outputs": []}
    host_flags: dict[int | str, list[bool]] = {}
    moved: list[str] = []
    came_in: dict[str, Any] = {}  # input path -> its sharding (an NNX update keeps it)
    if ins:
        base_in = opts.get("in_shardings") or (None,) * len(traced)
        specs_in = []
        k = 0
        at: list[int | str] = [*traced, *traced_kw]
        for n, i in enumerate(at):
            value = args[i] if isinstance(i, int) else kwargs[i]
            leaves = jax.tree.leaves(value)
            base = (
                [getattr(x, "sharding", None) for x in leaves]
                if carry
                else _full(base_in[n], value)
            )
            chosen = []
            flags = []
            for sh in base:
                path = in_leaves[k].path
                p = ins[path]
                spec = _apply(p, sh, device, amesh, concrete)
                chosen.append(spec)
                flags.append(p.memory_kind in HOST_KINDS)
                if flags[-1]:
                    moved.append(path)
                if spec is not None:
                    came_in[path] = _sharding_of(spec)
                if not p.empty:
                    record["inputs"].append({"index": k, "path": path, **p.to_json()})
                k += 1
            treedef = jax.tree.structure(value)
            specs_in.append(jax.tree.unflatten(treedef, chosen))
            typed = jax.tree.unflatten(
                treedef, [_retyped(x, s, carry) for x, s in zip(leaves, chosen, strict=True)]
            )
            if isinstance(i, int):
                new_args[i] = typed
            else:
                new_kwargs[i] = typed
            if any(flags):
                host_flags[i] = flags
        if not carry:
            opts["in_shardings"] = tuple(specs_in)
    if host_flags:
        fn = moving_to_device(fn, host_flags)
        if staged.returns_updates:
            opts["out_shardings"] = _updates_as_came_in(staged, opts.get("out_shardings"), came_in)
    replicated: list[str] = []
    if outs:
        existing = opts.get("out_shardings")
        user = existing[0] if staged.returns_updates and existing is not None else existing
        base = (
            [None] * len(out_leaves)
            if user is None
            else list(jax.tree.leaves(user, is_leaf=lambda x: x is None))
        )
        chosen = []
        for k, (leaf, sh) in enumerate(zip(out_leaves, base, strict=True)):
            p = outs[leaf.path]
            if (
                amesh is not None
                and sh is None
                and not p.empty
                and (p.memory_kind is not None or isinstance(p.layout, tuple))
            ):
                replicated.append(leaf.path)
            chosen.append(_apply(p, sh, device, amesh, concrete))
            if not p.empty:
                record["outputs"].append({"index": k, "path": leaf.path, **p.to_json()})
        user_specs = jax.tree_util.tree_unflatten(out_tree, chosen)
        if staged.returns_updates:
            updates = existing[1] if existing is not None else None
            opts["out_shardings"] = (user_specs, updates)
        else:
            opts["out_shardings"] = user_specs
    return Placed(fn, opts, tuple(new_args), new_kwargs, record, replicated, moved)


def _concrete_mesh(
    low: Any,
    facts: RunFacts,
    amesh: Any,
    devices: Sequence[Any] | None,
    ins: dict[str, Placement],
    outs: dict[str, Placement],
) -> Any:
    """The run's mesh over ``compile.backend``'s first devices when a leaf asks for a
    major-to-minor layout (JAX's layout tests put such a ``Format`` on a concrete mesh's
    NamedSharding); None when none does, so the lowering stays on the AbstractMesh."""
    wanting = [
        (side, path)
        for side, placements in (("in", ins), ("out", outs))
        for path, p in placements.items()
        if isinstance(p.layout, tuple)
    ]
    if not wanting:
        return None
    have = len(devices or ())
    if have < amesh.size:
        side, path = wanting[0]
        layout = list((ins if side == "in" else outs)[path].layout or ())
        found = (
            f"compile.backend={facts.backend} with {have}"
            if devices
            else f"none for lower.platforms={list(low.platforms or [])}"
        )
        backend = facts.backend
        if not devices:
            how = f"lower.platforms=[{backend}] (a lowering for this host's devices)"
        elif backend == "cpu":
            how = f"compile.num_devices={amesh.size}"
        else:
            how = f"a machine with {amesh.size} {backend} devices"
        raise ConfigError(
            f"lower.{side}_layouts: {path}'s layout {layout} "
            f"places it on the mesh's {amesh.size} devices (jax 0.10.2 compares it with their "
            f"default layout while lowering), found {found}; expected {how}, or auto/default"
        )
    from jaxaot.stages.jax_mesh import on_devices

    return on_devices(amesh, devices or ())


def _updates_as_came_in(staged: Any, existing: Any, came_in: dict[str, Any]) -> Any:
    """jit's ``(user output, NNX updates)`` out shardings with each update of a Variable that
    came in as a traced argument (its path in ``came_in``) in the sharding it came in with, its
    memory kind included: an offloaded optimizer state goes back to the host, and a donated
    Variable's buffer can hold its update. Others as they were (``existing``'s, or the
    compiler's choice)."""
    import jax
    from jaxaot.config.tree_paths import leaf_paths

    t = staged.traced
    assert t is not None, "NNX updates need the traced program"
    updates = t.out_info[1]
    user, before = (None, None) if existing is None else existing
    treedef = jax.tree.structure(updates)
    # lower's update shardings (jax_mesh.update_shardings) have one entry per update leaf.
    old = (
        [None] * len(jax.tree.leaves(updates))
        if before is None
        else jax.tree.leaves(before, is_leaf=lambda x: x is None)
    )
    chosen = [came_in.get(p, o) for (p, _), o in zip(leaf_paths(updates, ""), old, strict=True)]
    return (user, jax.tree.unflatten(treedef, chosen))


def export_placed(
    record: dict[str, Any] | None,
    ins_flat: Sequence[Any],
    outs_flat: Sequence[Any],
    device: Any = None,
) -> tuple[list[Any], list[Any]]:
    """The flat in/out shardings for ``jax.jit(exported.call)`` with the placement the lowering
    recorded (``lowered.json``'s ``placement``) put back: each recorded leaf's memory kind and
    layout on its sharding (None: one of ``device``)."""
    ins, outs = list(ins_flat), list(outs_flat)
    for side, flat in (("inputs", ins), ("outputs", outs)):
        for row in (record or {}).get(side, []):
            p = Placement.from_json(row)
            base = _sharding_of(flat[row["index"]])
            flat[row["index"]] = _apply(p, base, device, None)
    return ins, outs


__all__ = [
    "Placed",
    "export_placed",
    "memory_kinds_of",
    "placed",
    "target_devices",
]
