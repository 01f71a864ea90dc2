"""The four stages, in pipeline order, each implementing :class:`jaxaot.stages.contract.Stage`
and the capabilities it has (:mod:`jaxaot.stages.contract` says when each member fires).

The engine runs :data:`NODES` in order and knows no stage by name; sweeps, reports, summaries
and resume read what they need from here. Importing this package does not import JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxaot.config.order import STAGES
from jaxaot.stages.compile import COMPILE, Compiled
from jaxaot.stages.contract import Stage
from jaxaot.stages.execute import EXECUTE, Executed
from jaxaot.stages.lower import LOWER, Lowered
from jaxaot.stages.stage_out import STAGE_OUT, StagedOut

NODES: tuple[Stage[Any, Any], ...] = (STAGE_OUT, LOWER, COMPILE, EXECUTE)
NODE_BY_NAME: dict[str, Stage[Any, Any]] = {n.name: n for n in NODES}
assert tuple(NODE_BY_NAME) == STAGES, "jaxaot.config.order.STAGES names NODES in order"

if TYPE_CHECKING:  # mypy checks each stage's members against every capability it has
    from jaxaot.stages.compile import CompileConfig, Target
    from jaxaot.stages.contract import Ahead, Finishing, Loadable, OnResume, Prepared
    from jaxaot.stages.execute import ExecuteConfig
    from jaxaot.stages.lower import LowerConfig
    from jaxaot.stages.stage_out import StageOutConfig

    _stage_out: Loadable[StageOutConfig, StagedOut] = STAGE_OUT
    _lower: Loadable[LowerConfig, Lowered] = LOWER
    _compile_loads: Loadable[CompileConfig, Compiled] = COMPILE
    _compile_ahead: Ahead[CompileConfig, Target, Any, Compiled] = COMPILE  # and so Cached
    _compile_prepared: Prepared[CompileConfig] = COMPILE
    _compile_on_resume: OnResume[CompileConfig] = COMPILE
    _compile_finishing: Finishing[CompileConfig, Compiled] = COMPILE
    _execute: Prepared[ExecuteConfig] = EXECUTE

__all__ = [
    "COMPILE",
    "EXECUTE",
    "LOWER",
    "NODES",
    "NODE_BY_NAME",
    "STAGE_OUT",
    "Compiled",
    "Executed",
    "Lowered",
    "StagedOut",
]
