"""The four stages, one module each, in pipeline order.

Each stage's ``run(ctx, *upstream)`` takes the typed config (through the
:class:`jaxaot.stages.node.StageContext`) and the upstream record, writes its artifacts and
returns a small frozen record that leads to the next stage, the way ``jax.stages`` goes
Traced -> Lowered -> Compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxaot.stages import compile, execute, lower, stage_out
from jaxaot.stages.compile import Compiled
from jaxaot.stages.execute import Executed
from jaxaot.stages.lower import Lowered
from jaxaot.stages.stage_out import StagedOut

STAGE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "stage_out": stage_out.run,
    "lower": lower.run,
    "compile": compile.run,
    "execute": execute.run,
}

__all__ = ["STAGE_FUNCTIONS", "Compiled", "Executed", "Lowered", "StagedOut"]
