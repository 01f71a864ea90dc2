"""``compile.topology`` in the config: what it implies for the other keys, checked before JAX.

A run with ``compile.topology`` compiles for libtpu's compile-only devices of a described TPU
topology, with no TPU attached. That fixes three other keys, set here when they were left alone and
refused when they say otherwise: the backend is ``tpu``, the lowering covers ``tpu``, and the
run stops after compile (there is nothing to execute on; ``resume_from=<run>
start_at=execute`` on a TPU host runs the stored executable).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxaot.config.mesh import mesh_spec
from jaxaot.errors import ConfigError
from jaxaot.targets.tpu import resolve

if TYPE_CHECKING:
    from jaxaot.schema import JaxaotConfig


def for_topology(cfg: JaxaotConfig) -> JaxaotConfig:
    """``cfg`` with the keys ``compile.topology`` implies; a ConfigError for contradictions."""
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


def check_topology(cfg: JaxaotConfig) -> None:
    """The topology name resolves, and the mesh covers exactly its devices."""
    comp = cfg.compile
    if not comp.topology:
        if comp.num_slices != 1:
            raise ConfigError(
                f"compile.num_slices={comp.num_slices} needs compile.topology (the slice shape), "
                "found none; e.g. compile.topology=v5e:4x4 compile.num_slices=2"
            )
        return
    target = resolve(comp.topology, comp.num_slices)
    mesh = mesh_spec(cfg)
    if mesh is not None and mesh.size != target.devices:
        what = "stage_out.axis_env" if mesh.per_replica else f"mesh.shape={list(mesh.shape)}"
        raise ConfigError(
            f"{what} has {mesh.size} devices but compile.topology={comp.topology} has "
            f"{target.devices} ({target.describe()}); expected a mesh of {target.devices} "
            "devices (or another topology)"
        )
    if mesh is not None and target.num_slices > 1 and mesh.shape[0] % target.num_slices:
        raise ConfigError(
            f"mesh.shape={list(mesh.shape)}: with compile.num_slices={target.num_slices} the "
            f"first axis ({mesh.axes[0]}) spans the slices; expected its size to be a multiple "
            f"of {target.num_slices}"
        )


__all__ = ["check_topology", "for_topology"]
