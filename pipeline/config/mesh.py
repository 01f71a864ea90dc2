"""Parallel programs from config: axis environments, meshes, shardings and device counts.

Everything here is checked before JAX is imported: a per-replica program's named axes
(``stage_out.axis_env``), a GSPMD mesh (``mesh.*``), the sharding specs in ``lower.*`` against
the argument shapes, and how many devices a run needs. Lowering never needs devices (the
stages lower against an ``AbstractMesh``); only a run that compiles starts virtual CPU devices,
as many as the mesh has unless ``compile.num_devices`` says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from jaxaot.config.argspec import (
    ArraySpec,
    BoundArgs,
    Given,
    Literal,
    PytreeNode,
    leaves,
)
from jaxaot.config.derived import DERIVED_TYPES, describe
from jaxaot.config.path_shardings import (
    LogicalRules,
    Resolution,
    is_pattern_form,
    parse_logical_rules,
    parse_rules,
    resolve,
)
from jaxaot.config.sharding import Leaf, Spec, check_axis_names, check_subtree, match_specs
from jaxaot.config.tree_paths import top_names
from jaxaot.errors import ConfigError

if TYPE_CHECKING:
    from jaxaot.config.sections import MeshConfig

AXIS_TYPES: tuple[str, ...] = ("auto", "explicit", "manual")
# Axis names for a mesh given by shape alone (mesh.axes=[]), by position.
DEFAULT_AXES: tuple[str, ...] = ("data", "model", "pipe", "expert")


class ArgShardings(Protocol):
    """How the arguments are split over the mesh: ``lower.in_shardings`` and
    ``lower.logical_axis_rules`` (the lower section has both; the run's facts carry them for
    the stages that build argument types before lowering)."""

    @property
    def in_shardings(self) -> Any: ...
    @property
    def logical_axis_rules(self) -> Any: ...


class LowerShardings(ArgShardings, Protocol):
    """``lower``'s sharding options: an :class:`ArgShardings` plus ``lower.out_shardings``."""

    @property
    def out_shardings(self) -> Any: ...


class ReplicaAxes(Protocol):
    """``stage_out.axis_env``: the named axes of a per-replica program (the stage_out section
    has it)."""

    @property
    def axis_env(self) -> Any: ...


class DeviceOptions(Protocol):
    """The compile options that say how many devices a run starts (the compile section has
    them)."""

    @property
    def backend(self) -> str: ...
    @property
    def num_devices(self) -> int | None: ...
    @property
    def max_devices(self) -> int: ...


@dataclass(frozen=True)
class Shardings:
    """The two ``lower`` options every stage that builds argument types reads (an
    :class:`ArgShardings`)."""

    in_shardings: Any = None
    logical_axis_rules: Any = None


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh as plain data: what stages turn into an ``AbstractMesh`` or a ``Mesh``."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    axis_types: tuple[str, ...]
    abstract: bool = False
    per_replica: bool = False  # from stage_out.axis_env: every axis is a replica axis

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axes, self.shape, strict=True))

    def describe(self) -> str:
        return ",".join(f"{a}={n}" for a, n in zip(self.axes, self.shape, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "axes": list(self.axes),
            "axis_types": list(self.axis_types),
            "per_replica": self.per_replica,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MeshSpec:
        return cls(
            shape=tuple(data["shape"]),
            axes=tuple(data["axes"]),
            axis_types=tuple(data["axis_types"]),
            per_replica=bool(data.get("per_replica", False)),
        )


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value.isidentifier()


def axis_env(stage_out: ReplicaAxes) -> tuple[tuple[str, int], ...] | None:
    """``stage_out.axis_env`` as ``((name, size), ...)``, or None when it is not set."""
    raw = stage_out.axis_env
    if raw is None:
        return None
    key = "stage_out.axis_env"
    if isinstance(raw, str) or not isinstance(raw, Sequence) or not raw:
        raise ConfigError(f"{key}: expected [[axis_name, size], ...] (at least one), found {raw!r}")
    env: list[tuple[str, int]] = []
    for i, pair in enumerate(raw):
        ok = isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
        if not ok or not _is_name(pair[0]):
            raise ConfigError(f"{key}[{i}]: expected [axis_name, size], found {pair!r}")
        size = pair[1]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(
                f"{key}[{i}]: expected a size >= 1 for axis {pair[0]!r}, found {size!r}"
            )
        env.append((str(pair[0]), int(size)))
    names = [n for n, _ in env]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: expected distinct axis names, found {names}")
    return tuple(env)


def _config_mesh(m: MeshConfig) -> MeshSpec | None:
    if m.shape is None:
        if m.axes:
            raise ConfigError(
                f"mesh.axes={list(m.axes)} but mesh.shape is null; expected a shape with one size "
                "per axis, e.g. mesh.shape=[4,2] (or a preset: mesh=data4_model2)"
            )
        return None
    shape = list(m.shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ConfigError(f"mesh.shape: expected a non-empty list of sizes >= 1, found {shape}")
    axes = list(m.axes) or list(DEFAULT_AXES[: len(shape)])
    if len(axes) != len(shape):
        raise ConfigError(
            f"mesh.axes: expected {len(shape)} axis name(s) for mesh.shape={shape}, found {axes}; "
            f"e.g. mesh.axes=[{', '.join((DEFAULT_AXES + ('x',) * len(shape))[: len(shape)])}]"
        )
    if not all(_is_name(a) for a in axes) or len(set(axes)) != len(axes):
        raise ConfigError(f"mesh.axes: expected distinct identifiers, found {axes}")
    types = list(m.axis_types) if m.axis_types is not None else ["auto"] * len(shape)
    if len(types) != len(shape) or any(t not in AXIS_TYPES for t in types):
        raise ConfigError(
            f"mesh.axis_types: expected null or {len(shape)} of {', '.join(AXIS_TYPES)}, "
            f"found {types}"
        )
    return MeshSpec(tuple(shape), tuple(axes), tuple(types), abstract=m.abstract)


def mesh_spec(mesh: MeshConfig, stage_out: ReplicaAxes) -> MeshSpec | None:
    """The run's mesh: from ``mesh.*``, or the replica mesh of ``stage_out.axis_env``."""
    env = axis_env(stage_out)
    spec = _config_mesh(mesh)
    if env is not None and spec is not None:
        raise ConfigError(
            f"stage_out.axis_env and mesh.shape={list(spec.shape)} are both set; expected one: "
            "axis_env for a per-replica program, a mesh (with lower.in_shardings) for a global one"
        )
    if env is not None:
        return MeshSpec(
            tuple(n for _, n in env),
            tuple(a for a, _ in env),
            ("auto",) * len(env),
            per_replica=True,
        )
    return spec


def will_compile(stop_after: str) -> bool:
    """Whether a run that stops after ``stop_after`` compiles."""
    from jaxaot.config.order import STAGES

    return STAGES.index(stop_after) >= STAGES.index("compile")


def lowers_here(resume_from: str | None, start_at: str) -> bool:
    """Whether this run lowers the program (else its lowering comes from ``resume_from``).

    A lowering on an abstract mesh compiles on any concrete mesh of the same axes, as JAX
    compiles an ``AbstractMesh`` lowering (or calls its export) on a ``Mesh``: a resume at
    compile runs it on the backend's first ``mesh.size`` devices."""
    from jaxaot.config.order import STAGES

    return not resume_from or STAGES.index(start_at) <= STAGES.index("lower")


def devices_to_start(comp: DeviceOptions, mesh: MeshSpec | None, stop_after: str) -> int | None:
    """Virtual CPU devices for a run on ``mesh`` that stops after ``stop_after``:
    ``compile.num_devices`` (``comp``: the compile section), else what the mesh needs when the
    run compiles. None leaves JAX's count alone (1, or what ``XLA_FLAGS`` /
    ``JAX_NUM_CPU_DEVICES`` say): lowering-only runs and programs without a mesh.

    Checked against XLA:CPU's limit and ``compile.max_devices`` before any device starts: a
    device costs memory and a thread, and ``axis_env=[[i,1000],[j,1000]]`` would start a million.
    """
    if comp.num_devices is not None:
        n, what = comp.num_devices, f"compile.num_devices={comp.num_devices}"
    elif mesh is not None and will_compile(stop_after):
        n = mesh.size
        env = ",".join(f"[{a},{k}]" for a, k in mesh.sizes.items())
        what = (
            f"stage_out.axis_env=[{env}]" if mesh.per_replica else f"mesh.shape={list(mesh.shape)}"
        )
    else:
        return None
    if comp.backend == "cpu":
        _check_device_count(comp.max_devices, n, what)
    return n


# XLA:CPU numbers a process's devices process_index * 2048 + local id (kMaxCpuDevicesPerProcess
# = 1 << 11 in xla/pjrt/plugin/xla_cpu/cpu_topology.h, jaxlib 0.10): device 2048 counts as
# another process, and compiling for it fails with "Multiprocess computations aren't implemented
# on the CPU backend". Measured on jax 0.10.2: 2048 devices compile and run, 2049 do not.
XLA_CPU_MAX_DEVICES = 2048

_NO_DEVICES = (
    "stop_after=lower needs no devices (lower here, then compile on the target with "
    "resume_from=<run> start_at=compile)"
)


def _check_device_count(cap: int, n: int, what: str) -> None:
    if n > XLA_CPU_MAX_DEVICES:
        raise ConfigError(
            f"{what} needs {n} virtual CPU devices, but XLA:CPU runs at most "
            f"{XLA_CPU_MAX_DEVICES} in one process (it numbers devices process*2048 + local, so "
            f"device {XLA_CPU_MAX_DEVICES} would belong to another process); expected at most "
            f"{XLA_CPU_MAX_DEVICES} devices; {_NO_DEVICES}"
        )
    if n > cap:
        raise ConfigError(
            f"{what} needs {n} virtual CPU devices, more than compile.max_devices={cap}; "
            f"expected fewer devices, or compile.max_devices={n} to start them all (each costs "
            f"memory and a thread; XLA:CPU allows up to {XLA_CPU_MAX_DEVICES}); {_NO_DEVICES}"
        )


def _leaf_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _leaf_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_leaf_tree(v) for v in tree]
    if isinstance(tree, ArraySpec):
        return Leaf(tree.shape, tree.type_str)
    if isinstance(tree, PytreeNode):
        # A named container takes one sharding for all its arrays (a pytree prefix, as
        # jax.jit's in_shardings allows): replicated unless a rank-0 spec is given.
        return Leaf((), f"{tree.cls} container (one spec for all its arrays)")
    if isinstance(tree, Given):  # an array or ShapeDtypeStruct given from Python
        return Leaf(tuple(tree.value.shape), tree.type_str)
    if isinstance(tree, DERIVED_TYPES):
        # Its arrays are known once it is evaluated: one spec stands for all of them (a pytree
        # prefix, as jax.jit's in_shardings allows), checked against them then (input_specs).
        return Leaf((), f"{describe(tree)}: one spec for all its arrays", subtree=True)
    if isinstance(tree, Literal):
        return Leaf((), f"scalar {tree.value!r}")
    raise ConfigError(f"program.args: cannot shard a {type(tree).__name__} ({tree!r})")


def _check_subtrees(
    bound: BoundArgs, mesh: MeshSpec, specs: Sequence[Any], args: Sequence[Any]
) -> None:
    """The positional form's spec for each derived value against the arrays it turned into
    (``args``: the abstract arguments jax.jit traces)."""
    from jaxaot.config.argspec import short_name
    from jaxaot.config.tree_paths import leaf_paths

    def walk(node: Any, spec: Any, value: Any, where: str) -> None:
        if isinstance(node, DERIVED_TYPES):
            if not isinstance(spec, Spec):
                return
            arrays = [
                (
                    p,
                    Leaf(
                        tuple(v.shape), f"{short_name(str(v.dtype))}[{','.join(map(str, v.shape))}]"
                    ),
                )
                for p, v in leaf_paths(value, where)
                if hasattr(v, "shape") and hasattr(v, "dtype")
            ]
            check_subtree(spec, arrays, key="lower.in_shardings", mesh=mesh.sizes)
        elif isinstance(node, dict) and isinstance(value, Mapping):
            for k, child in node.items():
                sub = spec.get(k) if isinstance(spec, Mapping) else spec
                if k in value:
                    walk(child, sub, value[k], f"{where}.{k}")
        elif isinstance(node, list) and isinstance(value, list | tuple):
            for i, (child, v) in enumerate(zip(node, value, strict=False)):
                sub = spec[i] if isinstance(spec, list | tuple) else spec
                walk(child, sub, v, f"{where}[{i}]")

    traced = [i for i in range(len(bound.args)) if not bound.is_static(i)]
    for spec, i in zip(specs, traced, strict=False):
        if i < len(args):
            walk(bound.args[i], spec, args[i], f"program.args[{i}]")


def argument_tree(bound: BoundArgs) -> tuple[tuple[Any, ...], list[str]]:
    """The traced positional arguments as Leaf trees, with their config paths."""
    traced = [(i, a) for i, a in enumerate(bound.args) if not bound.is_static(i)]
    return tuple(_leaf_tree(a) for _, a in traced), [f"program.args[{i}]" for i, _ in traced]


def traced_kwargs(bound: BoundArgs) -> list[str]:
    return [k for k in bound.kwargs if not bound.is_static(k)]


def check_in_shardings(sh: ArgShardings, bound: BoundArgs, mesh: MeshSpec) -> tuple[Any, ...]:
    """``lower.in_shardings`` (the positional form) matched to the argument tree (null: every
    argument replicated)."""
    tree, names = argument_tree(bound)
    return match_specs(
        sh.in_shardings, tree, key="lower.in_shardings", names=names, mesh=mesh.sizes
    )


def logical_rules(sh: ArgShardings, mesh: MeshSpec) -> LogicalRules:
    return parse_logical_rules(sh.logical_axis_rules, mesh.axes)


def uses_paths(sh: ArgShardings) -> bool:
    """Whether input shardings come from path patterns and logical-axis rules (resolved on the
    abstract arguments) rather than the positional form (matched on the config's specs)."""
    return is_pattern_form(sh.in_shardings) or bool(sh.logical_axis_rules)


def input_specs(
    sh: ArgShardings,
    bound: BoundArgs,
    mesh: MeshSpec,
    args: Sequence[Any],
    names: Sequence[str] | None = None,
    logical_axes: Mapping[str, Sequence[str | None] | None] | None = None,
) -> tuple[tuple[Any, ...], Resolution | None]:
    """One :class:`Spec` tree per traced positional argument, and the path resolution (None
    for the positional form). ``args`` are the abstract arguments jax.jit traces, ``names``
    the parameter names (else ``args[i]``), ``logical_axes`` library metadata by leaf path
    (used with the mapping form or a null ``in_shardings``)."""
    metadata_alone = sh.in_shardings is None and bool(logical_axes)
    if not uses_paths(sh) and not metadata_alone:
        specs = check_in_shardings(sh, bound, mesh)
        _check_subtrees(bound, mesh, specs, args)
        return specs, None
    traced = [i for i in range(len(args)) if not bound.is_static(i)]
    tops = top_names(len(args), names)
    trees, res = resolve(
        [(tops[i], args[i]) for i in traced],
        sh.in_shardings,
        key="lower.in_shardings",
        mesh=mesh.sizes,
        logical=logical_rules(sh, mesh),
        logical_axes=logical_axes,
        aliases=[f"args[{i}]" if tops[i] != f"args[{i}]" else None for i in traced],
    )
    return tuple(trees), res


def check_parallel(
    mesh: MeshSpec | None, low: LowerShardings, comp: DeviceOptions, stop_after: str, lowers: bool
) -> None:
    """Every pre-JAX check of the mesh (:func:`mesh_spec`), the sharding options of ``lower``
    and device counts that needs no argument; :func:`check_bound` then checks the bound
    arguments against the mesh. ``lowers``: whether this run lowers (:func:`lowers_here`)."""
    for key, value in (
        ("lower.in_shardings", low.in_shardings),
        ("lower.out_shardings", low.out_shardings),
    ):
        if value is None:
            continue
        if mesh is None:
            raise ConfigError(
                f"{key} needs a mesh: pick a preset (mesh=data4_model2) or set mesh.shape and "
                "mesh.axes"
            )
        if mesh.per_replica:
            raise ConfigError(
                f"{key}: a per-replica program (stage_out.axis_env) is split over all its axes "
                "by jaxaot; expected lower.in_shardings/out_shardings only with mesh.*"
            )
        if is_pattern_form(value):
            parse_rules(value, key, mesh.axes, logical_rules(low, mesh))
        else:
            check_axis_names(value, key, mesh.axes)
    if low.logical_axis_rules:
        if mesh is None or mesh.per_replica:
            raise ConfigError(
                "lower.logical_axis_rules needs a mesh (mesh=... or mesh.shape and mesh.axes); "
                "found " + ("stage_out.axis_env" if mesh is not None else "no mesh")
            )
        logical_rules(low, mesh)
        if low.in_shardings is not None and not is_pattern_form(low.in_shardings):
            raise ConfigError(
                "lower.logical_axis_rules apply to path patterns and library metadata, but "
                "lower.in_shardings is a positional list; expected it as a mapping of path "
                "patterns (e.g. {'args[0]': [data, null]}) or null"
            )
    if mesh is None:
        devices_to_start(comp, None, stop_after)  # compile.num_devices alone: the device limits
        return
    if mesh.abstract and will_compile(stop_after) and lowers:
        raise ConfigError(
            f"mesh.abstract=true describes a mesh to lower for, not to run on, but stop_after="
            f"{stop_after}; expected stop_after=lower (compile on the target with "
            "resume_from=<run> start_at=compile), or mesh.abstract=false to compile here"
        )
    n = comp.num_devices
    if n is not None and n < mesh.size and will_compile(stop_after) and comp.backend == "cpu":
        raise ConfigError(
            f"compile.num_devices={n} but {_mesh_key(mesh)} needs {mesh.size} devices; expected "
            f"compile.num_devices={mesh.size} (or null: start what the mesh needs), or "
            "stop_after=lower to lower without devices"
        )
    devices_to_start(comp, mesh, stop_after)  # the device limits, before any device starts


def _mesh_key(mesh: MeshSpec) -> str:
    return "stage_out.axis_env" if mesh.per_replica else f"mesh.shape={list(mesh.shape)}"


def check_bound(bound: BoundArgs, mesh: MeshSpec, low: ArgShardings) -> None:
    """The bound arguments against the mesh: a per-replica program's are concrete and
    positional; ``lower.in_shardings`` in the positional form matches their shapes."""
    if mesh.per_replica:
        symbolic = [
            (p, leaf)
            for top, tree in bound.traced_args()
            for p, leaf in leaves(tree, top)
            if isinstance(leaf, ArraySpec) and leaf.symbolic
        ]
        if symbolic:
            # Measured on jax 0.10.2: the per-replica shard_map of a polymorphic program lowers
            # to stablehlo.dynamic_gather, and compiling it crashes the process (SIGSEGV).
            raise ConfigError(
                f"{symbolic[0][0]}: {symbolic[0][1].type_str} has symbolic dimensions, which "
                "stage_out.axis_env programs cannot have (XLA crashes compiling them, jax "
                "0.10.2); expected concrete sizes, or a mesh (mesh.*) instead of axis_env"
            )
    # On a mesh, traced keyword arguments carry their shardings on their ShapeDtypeStructs
    # (jax.jit takes no in_shardings with keyword arguments; stages/lower_shardings.py). A
    # per-replica program splits its positional arguments over the replicas
    # (stages/jax_mesh.py).
    kw = traced_kwargs(bound)
    if kw and mesh.per_replica:
        raise ConfigError(
            f"program.kwargs.{kw[0]}: {_mesh_key(mesh)} programs take traced arguments positionally (each "
            "gets a leading replica axis); expected it in program.args, or a mesh (mesh.*)"
        )
    # A static_argnames entry may name a positional parameter, which only the target's
    # signature resolves; the lower stage checks the shapes then.
    positional = low.in_shardings is not None and not uses_paths(low)
    if positional and set(bound.static_argnames) <= set(bound.kwargs):
        check_in_shardings(low, bound, mesh)


__all__ = [
    "AXIS_TYPES",
    "DEFAULT_AXES",
    "XLA_CPU_MAX_DEVICES",
    "ArgShardings",
    "DeviceOptions",
    "LowerShardings",
    "MeshSpec",
    "ReplicaAxes",
    "Shardings",
    "argument_tree",
    "axis_env",
    "check_bound",
    "check_in_shardings",
    "check_parallel",
    "devices_to_start",
    "input_specs",
    "logical_rules",
    "lowers_here",
    "mesh_spec",
    "traced_kwargs",
    "uses_paths",
    "will_compile",
]
