"""The config schema: frozen dataclasses, registered in Hydra's ConfigStore as ``base_<name>``.

YAML files under ``conf/`` hold values; these classes hold the types. :func:`validate` turns a
composed DictConfig into a typed :class:`JaxaotConfig` and checks everything that can be checked
without JAX (ranges, choices, arg specs), so a bad key fails in milliseconds, naming the key.
Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.config.mesh import check_parallel
from jaxaot.config.order import STAGES
from jaxaot.config.topology_config import check_topology, for_topology
from jaxaot.config.trust import check_imports
from jaxaot.config.xla_metadata import check_metadata
from jaxaot.errors import ConfigError
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

BACKENDS: tuple[str, ...] = ("cpu", "gpu", "cuda", "rocm", "tpu")
PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")
CHECKS: tuple[str, ...] = ("none", "reference")
GRAPH_FORMATS: tuple[str, ...] = ("svg", "png")


@dataclass(frozen=True)
class ProgramConfig:
    """What to compile: a callable by import path and specs for its arguments."""

    name: str = MISSING
    target: str = MISSING
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The program's own static arguments; stage_out's defaults interpolate these.
    static_argnums: list[int] = field(default_factory=list)
    static_argnames: list[str] = field(default_factory=list)
    # The named axes a per-replica program needs: stage_out.axis_env when that is null.
    axis_env: list[Any] | None = None
    description: str = ""


@dataclass(frozen=True)
class StageOutConfig:
    static_argnums: list[int] = field(default_factory=list)
    static_argnames: list[str] = field(default_factory=list)
    # [[axis_name, size], ...]: trace as a per-replica program with these named axes.
    axis_env: list[Any] | None = None
    # Constraints on symbolic dimensions (``f32[b,512]``), as jax.export reads them: "b >= 16".
    shape_constraints: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MeshConfig:
    shape: list[int] | None = None
    axes: list[str] = field(default_factory=list)
    axis_types: list[str] | None = None
    abstract: bool = False


@dataclass(frozen=True)
class LowerConfig:
    platforms: list[str] | None = None
    donate_argnums: list[int] = field(default_factory=list)
    donate_argnames: list[str] = field(default_factory=list)
    keep_unused: bool = False
    in_shardings: Any = None
    out_shardings: Any = None
    xla_metadata: dict[str, Any] = field(default_factory=dict)
    scoped_metadata: list[Any] = field(default_factory=list)
    # Keep MLIR locations / HLO source metadata in the text artifacts (keys and snapshots strip them).
    debug_info: bool = False
    # Serialize exported.bin with this many orders of VJP (jax.export serialize(vjp_order=)).
    vjp_order: int = 0
    # Text artifacts print constants of more elements elided; None keeps them all (issue 19).
    elide_constants_over: int | None = 1024


@dataclass(frozen=True)
class CompileConfig:
    backend: str = "cpu"
    compiler_options: dict[str, Any] = field(default_factory=dict)
    num_devices: int | None = None
    # Sizes of the symbolic dimensions of a polymorphic lowering: {b: 32} (issue 17).
    shapes: dict[str, int] = field(default_factory=dict)
    # The most virtual CPU devices a run may start (jaxaot.config.mesh.devices_to_start).
    max_devices: int = 512
    # A TPU topology to compile for without the hardware (pipeline/targets/tpu.py, issue 15).
    topology: str | None = None
    num_slices: int = 1


@dataclass(frozen=True)
class ExecuteConfig:
    seed: int = 0
    inputs: Any = None
    warmup: int = 1
    repeats: int = 5
    check: str = "none"
    rtol: float | None = None
    atol: float | None = None
    save_outputs: bool = True


@dataclass(frozen=True)
class StoreConfig:
    dir: str | None = None  # None: $JAXAOT_STORE_DIR, else outputs/store (jaxaot.store.cache)
    enabled: bool = True
    trust: bool = (
        False  # True: load executables whatever the store's permissions (jaxaot.util.fsio)
    )


@dataclass(frozen=True)
class SnapshotConfig:
    """Golden lowering snapshots (pipeline/snapshots/snapshot.py) and the optimized-HLO graph."""

    write: str | None = None
    verify: str | None = None
    update: bool = False
    diff_lines: int = 60
    graph: bool = False
    graph_format: str = "svg"
    graph_max_nodes: int = 250


@dataclass(frozen=True)
class TrustConfig:
    """Which importable names this config may reach (pipeline/config/trust.py): dotted prefixes."""

    allow_imports: list[str] = field(default_factory=list)  # let in, beating the deny list
    deny_imports: list[str] = field(default_factory=list)  # refuse, on top of the built-in list


@dataclass(frozen=True)
class JaxSection:
    """JAX configuration for this run (issue 17): ``jax.config.<jax option>=<value>`` (any
    ``jax.config`` option, e.g. ``jax_enable_x64``, ``jax_default_matmul_precision``), set
    before tracing and restored after the run (stages/jaxenv.py ``run_config``)."""

    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JaxaotConfig:
    program: ProgramConfig = MISSING
    stage_out: StageOutConfig = field(default_factory=StageOutConfig)
    lower: LowerConfig = field(default_factory=LowerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    execute: ExecuteConfig = field(default_factory=ExecuteConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    jax: JaxSection = field(default_factory=JaxSection)
    stop_after: str = "execute"
    start_at: str = "stage_out"
    resume_from: str | None = None
    debug: bool = False


_SCHEMAS: dict[str, tuple[str | None, type]] = {
    "base_config": (None, JaxaotConfig),
    "base_program": ("program", ProgramConfig),
    "base_stage_out": ("stage_out", StageOutConfig),
    "base_lower": ("lower", LowerConfig),
    "base_compile": ("compile", CompileConfig),
    "base_execute": ("execute", ExecuteConfig),
    "base_mesh": ("mesh", MeshConfig),
    "base_store": ("store", StoreConfig),
    "base_snapshot": ("snapshot", SnapshotConfig),
    "base_trust": ("trust", TrustConfig),
    "base_jax": ("jax", JaxSection),
}


def _writable(node: Any) -> None:
    # A frozen dataclass makes its node read-only, and Hydra could then not merge the YAML
    # values onto the schema; the typed objects from validate() are frozen all the same.
    # Free-form dicts (compiler_options, kwargs, xla_metadata) leave struct mode so that
    # `compile.compiler_options.xla_foo=1` adds a key instead of failing as unknown.
    if OmegaConf.is_config(node):
        OmegaConf.set_readonly(node, False)
        if OmegaConf.is_dict(node):
            if OmegaConf.get_type(node) is dict:
                OmegaConf.set_struct(node, False)
            for key in node:
                _writable(node._get_node(key))


def register_configs() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from jaxaot.config.help_text import register_resolver as register_help
    from jaxaot.rundir.dirs import register_resolver

    register_resolver()  # ${unique_dir:...} in conf/config.yaml's hydra.run.dir and sweep.dir
    register_help()  # ${jaxaot_help:...} in hydra.help.template (pipeline/config/help_text.py)
    cs = ConfigStore.instance()
    for name, (group, schema) in _SCHEMAS.items():
        node = OmegaConf.structured(schema)
        _writable(node)
        cs.store(name=name, group=group, node=node)


def _stage_index(key: str, value: str) -> int:
    if value not in STAGES:
        raise ConfigError(f"{key}: expected one of {', '.join(STAGES)}, found {value!r}")
    return STAGES.index(value)


def _check_indices(key: str, values: list[int]) -> None:
    for v in values:
        if v < 0:
            raise ConfigError(f"{key}: expected non-negative argument positions, found {v}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{key}: expected distinct positions, found {values}")


def _check(cfg: JaxaotConfig) -> None:
    first = _stage_index("start_at", cfg.start_at)
    last = _stage_index("stop_after", cfg.stop_after)
    if first > last:
        raise ConfigError(
            f"start_at={cfg.start_at!r} comes after stop_after={cfg.stop_after!r}; "
            "expected start_at <= stop_after"
        )
    if first > 0 and not cfg.resume_from:
        raise ConfigError(
            f"start_at={cfg.start_at!r} needs resume_from=<run dir> to load the earlier stages"
        )
    if ":" not in cfg.program.target:
        raise ConfigError(
            f"program.target: expected 'package.module:function', found {cfg.program.target!r}"
        )
    _check_indices("stage_out.static_argnums", cfg.stage_out.static_argnums)
    _check_indices("lower.donate_argnums", cfg.lower.donate_argnums)
    if cfg.compile.backend not in BACKENDS:
        raise ConfigError(
            f"compile.backend: expected one of {', '.join(BACKENDS)}, found {cfg.compile.backend!r}"
        )
    for p in cfg.lower.platforms or ():
        # Which platforms JAX lowers for is JAX's to say (plugins add theirs): checked against
        # it by the lower stage (stages/lower.py check_platforms); here only the spelling.
        if not isinstance(p, str) or not p.isidentifier():
            raise ConfigError(
                f"lower.platforms: expected platform names (e.g. {', '.join(PLATFORMS)}), "
                f"found {p!r}"
            )
    for name in cfg.jax.config:
        if not str(name).startswith("jax_"):
            raise ConfigError(
                f"jax.config.{name}: expected a JAX config option (jax_enable_x64, "
                "jax_default_matmul_precision, ...: the names jax.config.update takes)"
            )
    if cfg.lower.platforms is not None and not cfg.lower.platforms:
        raise ConfigError("lower.platforms: expected at least one platform or null, found []")
    for name, size in cfg.compile.shapes.items():
        if not str(name).isidentifier() or isinstance(size, bool) or not isinstance(size, int):
            raise ConfigError(
                f"compile.shapes.{name}: expected a dimension variable and an int size, found "
                f"{name!r}: {size!r}"
            )
        if size < 0:
            raise ConfigError(f"compile.shapes.{name}: expected a size >= 0, found {size}")
    if cfg.lower.vjp_order < 0:
        raise ConfigError(f"lower.vjp_order: expected an int >= 0, found {cfg.lower.vjp_order}")
    elide = cfg.lower.elide_constants_over
    if elide is not None and (isinstance(elide, bool) or elide < 0):
        raise ConfigError(
            f"lower.elide_constants_over: expected a number of elements >= 0, or null to keep "
            f"every constant in the texts; found {elide!r}"
        )
    if cfg.compile.num_devices is not None and cfg.compile.num_devices < 1:
        raise ConfigError(f"compile.num_devices: expected >= 1, found {cfg.compile.num_devices}")
    if cfg.compile.max_devices < 1:
        raise ConfigError(f"compile.max_devices: expected >= 1, found {cfg.compile.max_devices}")
    ex = cfg.execute
    if ex.seed < 0:  # numpy's generators take non-negative seeds only
        raise ConfigError(f"execute.seed: expected an int >= 0, found {ex.seed}")
    if ex.check not in CHECKS:
        raise ConfigError(f"execute.check: expected one of {', '.join(CHECKS)}, found {ex.check!r}")
    if ex.warmup < 0:
        raise ConfigError(f"execute.warmup: expected >= 0, found {ex.warmup}")
    if ex.repeats < 1:
        raise ConfigError(f"execute.repeats: expected >= 1, found {ex.repeats}")
    for key, tol in (("execute.rtol", ex.rtol), ("execute.atol", ex.atol)):
        if tol is not None and tol < 0:
            raise ConfigError(f"{key}: expected >= 0 or null, found {tol}")
    check_parallel(cfg)
    check_metadata(cfg)
    check_imports(cfg)
    _check_snapshot(cfg.snapshot)
    check_topology(cfg)


def _check_snapshot(snap: SnapshotConfig) -> None:
    if snap.write and snap.verify:
        raise ConfigError(
            f"snapshot.write={snap.write!r} and snapshot.verify={snap.verify!r}: expected one of "
            "them; to rewrite a golden snapshot on purpose use snapshot.verify=<dir> "
            "snapshot.update=true"
        )
    if snap.update and not snap.verify:
        raise ConfigError(
            "snapshot.update=true: expected snapshot.verify=<golden dir> (the snapshot to rewrite)"
        )
    if snap.diff_lines < 0:
        raise ConfigError(f"snapshot.diff_lines: expected >= 0, found {snap.diff_lines}")
    if snap.graph_format not in GRAPH_FORMATS:
        raise ConfigError(
            f"snapshot.graph_format: expected one of {', '.join(GRAPH_FORMATS)}, "
            f"found {snap.graph_format!r}"
        )
    if snap.graph_max_nodes < 1:
        raise ConfigError(f"snapshot.graph_max_nodes: expected >= 1, found {snap.graph_max_nodes}")


def _one_line(exc: OmegaConfBaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    head = lines[0] if lines else type(exc).__name__
    return f"{key}: {head}" if key and key not in head else head


def _unknown_key(node: Any, prefix: str = "") -> None:
    """Refuse a key the schema lacks: ``+foo=bar`` adds one to a typed node, which
    ``OmegaConf.to_object`` would then fail to set on the frozen dataclass."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form dict (compiler_options, kwargs, ...) takes any key
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        where = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(
                f"{where}: unknown key; {prefix.rstrip('.') or 'the top level'} has "
                f"{', '.join(sorted(names))}"
            )
        child = node._get_node(key)
        if OmegaConf.is_dict(child) and not child._is_missing() and not child._is_none():
            _unknown_key(child, f"{where}.")


def validate(cfg: DictConfig | JaxaotConfig | dict[str, Any]) -> JaxaotConfig:
    """Typed, checked config from a composed one; raises :class:`ConfigError` naming the key."""
    if isinstance(cfg, JaxaotConfig):
        typed: Any = cfg
    else:
        try:
            node: Any = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)
            if OmegaConf.get_type(node) is not JaxaotConfig:  # Hydra's composition is typed already
                schema = OmegaConf.structured(JaxaotConfig)
                _writable(schema)
                node = OmegaConf.merge(schema, node)
            _unknown_key(node)
            typed = OmegaConf.to_object(node)
        except OmegaConfBaseException as exc:
            raise ConfigError(_one_line(exc)) from exc
    assert isinstance(typed, JaxaotConfig)
    if typed.stage_out.axis_env is None and typed.program.axis_env is not None:
        # A program's own named axes (a shipped collectives program runs as shipped, issue 14).
        # Not a ${program.axis_env} interpolation: OmegaConf resolves those into a None list
        # node while merging, before the program is there.
        stage_out = dataclasses.replace(typed.stage_out, axis_env=typed.program.axis_env)
        typed = dataclasses.replace(typed, stage_out=stage_out)
    typed = for_topology(typed)
    _check(typed)
    return typed


def override_key(override: str) -> str:
    """``+compile.compiler_options.x=1`` -> ``compile.compiler_options.x``."""
    return override.split("=", 1)[0].lstrip("+~")


def name_after_target(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Rename the program after its function when ``overrides`` retarget it but do not name it.

    A program config's ``name`` belongs to its ``target``: ``jaxaot program.target=jax.numpy:einsum``
    keeps the default program's other fields, and a run, report or snapshot called
    ``transformer`` would be wrong; it is called ``einsum``. ``program.name=...`` still wins.
    """
    keys = {override_key(o) for o in overrides}
    target = OmegaConf.select(cfg, "program.target")
    if "program.target" not in keys or "program.name" in keys or not isinstance(target, str):
        return
    function = target.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    if function:
        cfg.program.name = function


def to_container(cfg: JaxaotConfig) -> dict[str, Any]:
    """Plain, JSON-ready dict of a typed config (for manifests)."""
    return dataclasses.asdict(cfg)


__all__ = [
    "BACKENDS",
    "CHECKS",
    "GRAPH_FORMATS",
    "PLATFORMS",
    "STAGES",
    "CompileConfig",
    "ExecuteConfig",
    "JaxSection",
    "JaxaotConfig",
    "LowerConfig",
    "MeshConfig",
    "ProgramConfig",
    "SnapshotConfig",
    "StageOutConfig",
    "StoreConfig",
    "TrustConfig",
    "register_configs",
    "to_container",
    "validate",
]
