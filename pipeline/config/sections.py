"""The config sections every run shares (program, mesh, store, snapshot, trust, jax) and the
config language's helpers; each stage's own section is declared by its node
(``stages/<name>.py``), and :mod:`jaxaot.schema` assembles the root and checks what spans its
sections. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.errors import ConfigError
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

BACKENDS: tuple[str, ...] = ("cpu", "gpu", "cuda", "rocm", "tpu")
PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")
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
class MeshConfig:
    shape: list[int] | None = None
    axes: list[str] = field(default_factory=list)
    axis_types: list[str] | None = None
    abstract: bool = False
    # Trace the program and its reference with the mesh in context (jax.set_mesh). False: the
    # mesh only places arguments and outputs, as jax.jit(f, in_shardings=NamedSharding(mesh,
    # spec)) does without set_mesh (a program that builds its own mesh).
    context: bool = True


@dataclass(frozen=True)
class StoreConfig:
    # A folder, or a bucket: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX (jaxaot.store.tiered).
    # None: $JAXAOT_STORE_DIR, else $XDG_CACHE_HOME/jaxaot/store.
    dir: str | None = None
    enabled: bool = True
    # True: load executables whatever the store's permissions (jaxaot.util.fsio). A bucket
    # is trusted only when the command line gives both store.dir=<it> and store.trust=true,
    # or $JAXAOT_TRUST_STORE names it (a URL prefix); never by a config's choice.
    trust: bool = False
    # A bucket store's local cache folder. None: the local store ($JAXAOT_STORE_DIR when that
    # is a folder, else the default).
    cache_dir: str | None = None
    # A bucket store: seconds (1-600) this machine's claim on a key lives without its
    # heartbeat; written in the claim, so that waiters take a dead holder over after the
    # holder's own lease.
    lease_s: float = 60.0


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
    """The command line's import rules (pipeline/config/trust/): dotted prefixes. Only the
    command line sets them; a value from a config file is refused when composing."""

    allow_imports: list[str] = field(default_factory=list)  # let in beyond the default allow list
    deny_imports: list[str] = field(default_factory=list)  # refuse, although otherwise allowed


@dataclass(frozen=True)
class JaxSection:
    """JAX configuration for this run: ``jax.config.<jax option>=<value>`` (any
    ``jax.config`` option, e.g. ``jax_enable_x64``, ``jax_default_matmul_precision``), set
    before tracing and restored after the run (stages/jaxenv.py ``run_config``)."""

    config: dict[str, Any] = field(default_factory=dict)


def writable(node: Any) -> None:
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
                writable(node._get_node(key))


def check_indices(key: str, values: list[int]) -> None:
    for v in values:
        if v < 0:
            raise ConfigError(f"{key}: expected non-negative argument positions, found {v}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{key}: expected distinct positions, found {values}")


def check_snapshot(snap: SnapshotConfig) -> None:
    """The snapshot section's keys together (the folders are checked apart: snapshot_dirs)."""
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


def config_error(exc: OmegaConfBaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    head = lines[0] if lines else type(exc).__name__
    return f"{key}: {head}" if key and key not in head else head


def refuse_unknown_keys(node: Any, prefix: str = "", root: Any = None) -> None:
    """Refuse a key the schema lacks: ``+foo=bar`` adds one to a typed node, which
    ``OmegaConf.to_object`` would then fail to set on the frozen dataclass. ``root``: the root
    config's schema (default: ``node``'s), whose key tree the closest names come from."""
    schema = OmegaConf.get_type(node)
    root = root if root is not None else schema
    if not dataclasses.is_dataclass(schema):
        return  # a free-form dict (compiler_options, kwargs, ...) takes any key
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        where = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(
                _closest_names(where, node._get_node(key), root)
                or f"{where}: unknown key; {prefix.rstrip('.') or 'the top level'} has "
                f"{', '.join(sorted(names))}"
            )
        child = node._get_node(key)
        if OmegaConf.is_dict(child) and not child._is_missing() and not child._is_none():
            refuse_unknown_keys(child, f"{where}.", root)


def _closest_names(where: str, node: Any, root: Any) -> str | None:
    """``unknown key 'execute.repet' (did you mean execute.repeats?)``; a top-level name close
    to a group's, ``unknown config group 'progam' (did you mean program=mlp? ...)``. None when
    no name is close."""
    from jaxaot.config.suggest import closest, config_names, fix_key, unknown_name

    raw = node._value() if OmegaConf.is_config(node) or hasattr(node, "_value") else node
    value = raw if isinstance(raw, str) else None
    names = config_names(schema=root)
    if "/" in where:
        return unknown_name(where, value, names)
    if "." not in where:
        near = closest(where, [*names.top_groups(), *names.keys], 1)
        return unknown_name(where, value, names) if near else None
    fixed = fix_key(where, names.keys)
    return unknown_name(where, None, names) if fixed and fixed != where else None


def override_key(override: str) -> str:
    """``+compile.compiler_options.x=1`` -> ``compile.compiler_options.x``."""
    return override.split("=", 1)[0].lstrip("+~")


def name_after_target(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Rename the program after its function when ``overrides`` retarget it but do not name it.

    A program config's ``name`` belongs to its ``target``: ``jaxaot program.target=jax.numpy:einsum``
    keeps the default program's other fields, and a run, report or snapshot called
    ``transformer`` would be wrong; it is called ``einsum``. ``program.name=...`` still wins.

    First, what the overrides cannot mean: an internal schema chosen as an option
    (``program=base_program``). (A changed target left with another program's arguments is
    refused by jaxaot.engine.own_args, which imports the target.)
    """
    from jaxaot.config.suggest import internal_choices

    refusal = internal_choices(overrides)
    if refusal:
        raise ConfigError(refusal)
    keys = {override_key(o) for o in overrides}
    target = OmegaConf.select(cfg, "program.target")
    if "program.target" not in keys or "program.name" in keys or not isinstance(target, str):
        return
    function = target.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    if function:
        cfg.program.name = function


__all__ = [
    "BACKENDS",
    "GRAPH_FORMATS",
    "PLATFORMS",
    "JaxSection",
    "MeshConfig",
    "ProgramConfig",
    "SnapshotConfig",
    "StoreConfig",
    "TrustConfig",
    "check_indices",
    "check_snapshot",
    "config_error",
    "name_after_target",
    "override_key",
    "refuse_unknown_keys",
    "writable",
]
