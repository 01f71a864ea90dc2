"""``compile.topology`` in the config: what it implies for the other keys, checked before JAX.

A run with ``compile.topology`` compiles for libtpu's compile-only devices of a described TPU
topology, with no TPU attached. That fixes three other keys, set by
:func:`jaxaot.schema.for_topology` when they were left alone and refused when they say otherwise:
the backend is ``tpu``, the lowering covers ``tpu``, and the run stops after compile (there is
nothing to execute on; ``resume_from=<run> start_at=execute`` on a TPU host runs the stored
executable). Here: the topology against the other compile options and the mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxaot.errors import ConfigError
from jaxaot.targets.tpu import resolve

if TYPE_CHECKING:
    from jaxaot.config.mesh import MeshSpec


def check_topology(topology: str | None, num_slices: int, mesh: MeshSpec | None) -> None:
    """``compile.topology`` resolves with ``compile.num_slices``, and the run's mesh covers
    exactly its devices."""
    if not topology:
        if num_slices != 1:
            raise ConfigError(
                f"compile.num_slices={num_slices} needs compile.topology (the slice shape), "
                "found none; e.g. compile.topology=v5e:4x4 compile.num_slices=2"
            )
        return
    target = resolve(topology, num_slices)
    if mesh is not None and mesh.size != target.devices:
        what = "stage_out.axis_env" if mesh.per_replica else f"mesh.shape={list(mesh.shape)}"
        raise ConfigError(
            f"{what} has {mesh.size} devices but compile.topology={topology} has "
            f"{target.devices} ({target.describe()}); expected a mesh of {target.devices} "
            "devices (or another topology)"
        )
    if mesh is not None and target.num_slices > 1 and mesh.shape[0] % target.num_slices:
        raise ConfigError(
            f"mesh.shape={list(mesh.shape)}: with compile.num_slices={target.num_slices} the "
            f"first axis ({mesh.axes[0]}) spans the slices; expected its size to be a multiple "
            f"of {target.num_slices}"
        )


__all__ = ["check_topology"]
