"""``hydra/sweeper=jaxaot_basic``: Hydra's BasicSweeper with jaxaot's composition cache.

Same options, same sweep order, same validation of every job before any is launched; the
validation's compositions are reused by the launcher instead of being recomputed (on a Hydra
the cache knows: jaxaot.compat.hydra.HYDRA_KNOWN; on another, Hydra's own sweeper as is). No
``from __future__ import annotations`` here: Hydra executes plugin modules before registering
them in ``sys.modules``, where dataclasses would look string annotations up.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra.types import HydraContext, TaskFunction
from jaxaot.compat.hydra import BasicSweeper, BasicSweeperConf
from jaxaot.sweeps.compose_cache import SweepConfigLoader, with_sweep_loader
from jaxaot.util.console import unescape_launch_lines
from omegaconf import DictConfig


@dataclass
class JaxaotBasicSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.jaxaot_basic_sweeper.basic_sweeper.JaxaotBasicSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="jaxaot_basic", node=JaxaotBasicSweeperConf, provider="jaxaot"
)


class JaxaotBasicSweeper(BasicSweeper):
    """BasicSweeper whose Hydra context composes each distinct defaults list once per process."""

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        unescape_launch_lines()  # "#0 : program.args.1=f32[8,256]", as written
        super().setup(
            hydra_context=with_sweep_loader(hydra_context),
            task_function=task_function,
            config=config,
        )

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.config is not None and self.hydra_context is not None
        loader = self.hydra_context.config_loader
        if isinstance(loader, SweepConfigLoader):
            loader.validate_batch(self.config, batch)
        else:  # a Hydra the composition cache does not know: Hydra's own validation
            super().validate_batch_is_legal(batch)


__all__ = ["JaxaotBasicSweeper", "JaxaotBasicSweeperConf"]
