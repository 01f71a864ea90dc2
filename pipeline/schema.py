"""The root config: the shared sections (:mod:`jaxaot.config.sections`) plus each stage's
own ``Options`` (:data:`jaxaot.stages.NODES`), registered in Hydra's ConfigStore as
``base_<name>``.

YAML files under ``conf/`` hold values; the dataclasses hold the types. :func:`validate` turns a
composed DictConfig into a typed :class:`JaxaotConfig` and checks everything that can be checked
without JAX (ranges, choices, arg specs): the run's own keys (:func:`check_shared`), then each
stage's ``check``, then what spans sections (:func:`check_relations`), so a bad key fails in
milliseconds, naming the key. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxaot.config.argspec import bind_config
from jaxaot.config.jax_options import check_before_import
from jaxaot.config.mesh import check_bound, check_parallel, lowers_here, mesh_spec
from jaxaot.config.order import STAGES
from jaxaot.config.placement import check_placement
from jaxaot.config.sections import (
    JaxSection,
    MeshConfig,
    ProgramConfig,
    SnapshotConfig,
    StoreConfig,
    TrustConfig,
    check_snapshot,
    config_error,
    refuse_unknown_keys,
    writable,
)
from jaxaot.config.snapshot_dirs import check_snapshot_dirs
from jaxaot.config.topology_config import check_topology
from jaxaot.config.trust import check_imports, policy_of
from jaxaot.errors import ConfigError
from jaxaot.stages import NODES
from jaxaot.stages.compile import CompileConfig
from jaxaot.stages.contract import CheckFacts
from jaxaot.stages.execute import ExecuteConfig
from jaxaot.stages.lower import LowerConfig
from jaxaot.stages.stage_out import StageOutConfig
from jaxaot.targets.tpu import resolve
from jaxaot.util.store_root import check_store_dir
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

if TYPE_CHECKING:
    from jaxaot.config.argspec import BoundArgs


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
    verbose: bool = False  # stage log lines on the screen too (always in the run's jaxaot.log)


_SCHEMAS: dict[str, tuple[str | None, type]] = {
    "base_config": (None, JaxaotConfig),
    "base_program": ("program", ProgramConfig),
    **{f"base_{node.name}": (node.name, node.Options) for node in NODES},
    "base_mesh": ("mesh", MeshConfig),
    "base_store": ("store", StoreConfig),
    "base_snapshot": ("snapshot", SnapshotConfig),
    "base_trust": ("trust", TrustConfig),
    "base_jax": ("jax", JaxSection),
}


def register_configs() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from jaxaot.config.help_text import register_resolver as register_help
    from jaxaot.rundir.dirs import register_resolver

    register_resolver()  # ${unique_dir:...} in conf/config.yaml's hydra.run.dir and sweep.dir
    register_help()  # ${jaxaot_help:...} in hydra.help.template (pipeline/config/help_text.py)
    cs = ConfigStore.instance()
    for name, (group, schema) in _SCHEMAS.items():
        entry = _stored_entry(cs, group, name)
        if entry is not None and entry is _STORED.get(name):
            continue  # ours, still there (a second run in one process: the jaxaot server's)
        node = OmegaConf.structured(schema)
        writable(node)
        cs.store(name=name, group=group, node=node)
        _STORED[name] = _stored_entry(cs, group, name)


# The ConfigStore entries register_configs made, to know them again (~50 ms to remake).
_STORED: dict[str, Any] = {}


def _stored_entry(cs: Any, group: str | None, name: str) -> Any:
    cur = cs.repo
    for part in group.split("/") if group else []:
        cur = cur.get(part, {})
    return cur.get(f"{name}.yaml")


def typed_config(cfg: DictConfig | JaxaotConfig | dict[str, Any]) -> JaxaotConfig:
    """The typed root of a composed config, with what its keys imply (a program's own named
    axes, a topology's backend and platforms), not yet checked (:func:`validate` checks);
    raises :class:`ConfigError` for an unknown key or a value of the wrong type."""
    if isinstance(cfg, JaxaotConfig):
        typed: Any = cfg
    else:
        try:
            node: Any = cfg if OmegaConf.is_config(cfg) else OmegaConf.create(cfg)
            if OmegaConf.get_type(node) is not JaxaotConfig:  # Hydra's composition is typed already
                schema = OmegaConf.structured(JaxaotConfig)
                writable(schema)
                node = OmegaConf.merge(schema, node)
            refuse_unknown_keys(node)
            typed = OmegaConf.to_object(node)
        except OmegaConfBaseException as exc:
            raise ConfigError(config_error(exc)) from exc
    assert isinstance(typed, JaxaotConfig)
    if typed.stage_out.axis_env is None and typed.program.axis_env is not None:
        # A program's own named axes (a shipped collectives program runs as shipped).
        # Not a ${program.axis_env} interpolation: OmegaConf resolves those into a None list
        # node while merging, before the program is there.
        stage_out = dataclasses.replace(typed.stage_out, axis_env=typed.program.axis_env)
        typed = dataclasses.replace(typed, stage_out=stage_out)
    return for_topology(typed)


def for_topology(cfg: JaxaotConfig) -> JaxaotConfig:
    """``cfg`` with the keys ``compile.topology`` implies (:mod:`jaxaot.config.topology_config`);
    a ConfigError for contradictions."""
    comp = cfg.compile
    if not comp.topology:
        return cfg
    platform = resolve(comp.topology, comp.num_slices).generation.platform  # tpu | cuda
    if platform == "cuda":  # the CUDA plugin is registered here: this host may have no GPU
        from jaxaot.targets.cuda import prepare

        prepare()
    if comp.backend not in ("cpu", platform, "gpu" if platform == "cuda" else platform):
        raise ConfigError(
            f"compile.backend={comp.backend!r} contradicts compile.topology={comp.topology!r} "
            f"(that topology compiles for {platform}); drop compile.backend or compile.topology"
        )
    platforms = cfg.lower.platforms
    if platforms is not None and platform not in platforms:
        raise ConfigError(
            f"lower.platforms={list(platforms)} contradicts compile.topology={comp.topology!r}; "
            f"expected {platform} among them (or lower.platforms=null: [{platform}])"
        )
    stop_after = cfg.stop_after
    if stop_after == "execute" and cfg.start_at != "execute":
        stop_after = "compile"  # compile-only devices: nothing to execute on
    return dataclasses.replace(
        cfg,
        compile=dataclasses.replace(comp, backend=platform),
        lower=dataclasses.replace(cfg.lower, platforms=list(platforms or [platform])),
        stop_after=stop_after,
    )


def validated(
    cfg: DictConfig | JaxaotConfig | dict[str, Any],
) -> tuple[JaxaotConfig, BoundArgs | None]:
    """:func:`validate`, and the arguments when its mesh checks bound them (a run with a mesh or
    axis_env): the run binds them once."""
    typed = typed_config(cfg)
    check_sections(typed)
    bound = check_relations(typed)
    return typed, bound


def check_sections(typed: JaxaotConfig) -> None:
    """Each section on its own: the shared sections' checks, then each stage's ``check`` with
    its options. Reads no file and binds no argument; :func:`validated` runs it first, and a
    resume runs it on the user's config before it opens the checkpoint."""
    check_shared(typed)
    facts = CheckFacts(policy=policy_of(typed.trust))
    for n in NODES:
        n.check(getattr(typed, n.name), facts)


def _stage_index(key: str, value: str) -> int:
    if value not in STAGES:
        raise ConfigError(f"{key}: expected one of {', '.join(STAGES)}, found {value!r}")
    return STAGES.index(value)


def check_shared(cfg: JaxaotConfig) -> None:
    """The run's own keys and the shared sections, before each stage node's checks."""
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
    for name, value in cfg.jax.config.items():
        if not str(name).startswith("jax_"):
            raise ConfigError(
                f"jax.config.{name}: expected a JAX config option (jax_enable_x64, "
                "jax_default_matmul_precision, ...: the names jax.config.update takes)"
            )
        check_before_import(str(name), value)  # the rest once JAX is imported (jaxenv)


def check_relations(cfg: JaxaotConfig) -> BoundArgs | None:
    """What spans sections, after :func:`check_shared` and each stage checked its own: meshes
    and shardings against the devices, the import policy over every importable name, snapshots,
    the target topology. The arguments when the mesh checks bound them, else None."""
    # lower's placement keys against the mesh and compile.topology
    check_placement(cfg.lower, cfg.mesh, cfg.stage_out, cfg.compile)
    mesh = mesh_spec(cfg.mesh, cfg.stage_out)
    check_parallel(
        mesh,
        cfg.lower,
        cfg.compile,
        cfg.stop_after,
        lowers=lowers_here(cfg.resume_from, cfg.start_at),
    )
    bound = None
    if mesh is not None:  # the arguments against the mesh: bound once, for the run
        bound = bind_config(cfg.program, cfg.stage_out, cfg.lower)
        check_bound(bound, mesh, cfg.lower)
    check_imports(cfg.program, cfg.trust)
    check_snapshot(cfg.snapshot)
    check_topology(cfg.compile.topology, cfg.compile.num_slices, mesh)
    # Last, the only checks that look at the file system: where the store and snapshots go.
    check_store_dir(cfg.store.dir, cfg.store.enabled)
    check_snapshot_dirs(cfg.snapshot)
    return bound


def validate(cfg: DictConfig | JaxaotConfig | dict[str, Any]) -> JaxaotConfig:
    """Typed, checked config from a composed one; raises :class:`ConfigError` naming the key."""
    return validated(cfg)[0]


def to_container(cfg: JaxaotConfig) -> dict[str, Any]:
    """Plain, JSON-ready dict of a typed config (for manifests)."""
    return dataclasses.asdict(cfg)


__all__ = [
    "JaxaotConfig",
    "check_relations",
    "check_sections",
    "check_shared",
    "for_topology",
    "register_configs",
    "to_container",
    "typed_config",
    "validate",
    "validated",
]
