"""The four stages, in pipeline order, each implementing :class:`jaxaot.stages.contract.Stage`
and the capabilities it has (:mod:`jaxaot.stages.contract` says when each member fires).

The engine runs :data:`NODES` in order and knows no stage by name; sweeps, reports, summaries
and resume read what they need from here. Importing this package does not import JAX.
"""

from __future__ import annotations

from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.stages.compile import COMPILE, Compiled
from jaxaot.stages.contract import Stage
from jaxaot.stages.execute import EXECUTE, Executed
from jaxaot.stages.lower import LOWER, Lowered
from jaxaot.stages.stage_out import STAGE_OUT, StagedOut

NODES: tuple[Stage[Any, Any], ...] = (STAGE_OUT, LOWER, COMPILE, EXECUTE)
NODE_BY_NAME: dict[str, Stage[Any, Any]] = {n.name: n for n in NODES}
assert tuple(NODE_BY_NAME) == STAGES, "jaxaot.config.order.STAGES names NODES in order"

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
