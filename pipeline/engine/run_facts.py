"""The run's facts (:class:`~jaxaot.stages.contract.RunFacts`), worked out once per run from
the typed config and the bound arguments, before JAX is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxaot.config.mesh import Shardings, mesh_spec
from jaxaot.config.order import STAGES
from jaxaot.config.trust import policy_of
from jaxaot.stages.contract import RunFacts

if TYPE_CHECKING:
    from jaxaot.config.argspec import BoundArgs
    from jaxaot.schema import JaxaotConfig


def run_facts(cfg: JaxaotConfig, bound: BoundArgs) -> RunFacts:
    """What the stages read besides their own options: the program, its bound arguments, the
    import policy, the backend and its platform, the mesh and how arguments are split over
    it, and whether execute builds its inputs."""
    from jaxaot.stages.jaxenv import platform_of

    last = STAGES.index(cfg.stop_after)
    return RunFacts(
        program=cfg.program.name,
        target=cfg.program.target,
        bound=bound,
        policy=policy_of(cfg.trust),
        backend=cfg.compile.backend,
        platform=platform_of(cfg.compile.backend),
        topology=cfg.compile.topology,
        num_slices=cfg.compile.num_slices,
        mesh=mesh_spec(cfg.mesh, cfg.stage_out),
        mesh_context=bool(cfg.mesh.context),
        shardings=Shardings(cfg.lower.in_shardings, cfg.lower.logical_axis_rules),
        shapes=dict(cfg.compile.shapes),
        seed=cfg.execute.seed,
        builds_inputs=last >= STAGES.index("execute") and cfg.execute.inputs is None,
    )


__all__ = ["run_facts"]
