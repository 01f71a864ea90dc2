"""``hydra/sweeper=jaxaot_optuna``: minimise a jaxaot objective with Optuna.

The published ``hydra-optuna-sweeper`` 1.3.0 pins ``optuna<3`` (it cannot be installed beside
current Optuna), so jaxaot ships this one, written against Optuna's ask/tell API. Importing
this module is cheap (Hydra imports every plugin at start-up); Optuna is imported only when a
sweep starts. No ``from __future__ import annotations`` here: Hydra executes plugin modules
before registering them in ``sys.modules``, where dataclasses would look string annotations up.
"""

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from hydra.core.config_store import ConfigStore
from jaxaot.sweeps.autotune import AutotuneOptions, optimize
from jaxaot.sweeps.compose_cache import LaunchingSweeper
from omegaconf import OmegaConf


def _schema() -> type:
    """Schema of ``hydra.sweeper``: ``_target_`` plus exactly the fields of AutotuneOptions.

    Generated, not repeated, so the two cannot drift apart. The options are frozen; Hydra needs
    a mutable dataclass to merge YAML and command-line values onto.
    """
    hints = typing.get_type_hints(AutotuneOptions)
    fields: list[Any] = [("_target_", str, field(default=f"{__name__}.JaxaotOptunaSweeper"))]
    for f in dataclasses.fields(AutotuneOptions):
        default = (
            field(default=f.default)
            if f.default is not dataclasses.MISSING
            else field(default_factory=f.default_factory)
        )
        fields.append((f.name, hints[f.name], default))
    schema = dataclasses.make_dataclass("JaxaotOptunaSweeperConf", fields)
    schema.__module__ = __name__  # make_dataclass(module=...) is Python 3.12+
    return schema


JaxaotOptunaSweeperConf = _schema()

ConfigStore.instance().store(
    group="hydra/sweeper", name="jaxaot_optuna", node=JaxaotOptunaSweeperConf, provider="jaxaot"
)


class JaxaotOptunaSweeper(LaunchingSweeper):
    """Asks Optuna for trials, launches them with the configured launcher, tells the results."""

    def __init__(self, **options: Any) -> None:
        params = options.pop("params", None) or {}
        if OmegaConf.is_config(params):
            params = OmegaConf.to_container(params, resolve=True)
        self.opts = AutotuneOptions(params={str(k): str(v) for k, v in params.items()}, **options)

    def sweep(self, arguments: list[str]) -> Sequence[Any]:
        assert self.config is not None and self.hydra_context is not None
        return optimize(
            opts=self.opts,
            arguments=arguments,
            config=self.config,
            launcher=self.launcher,
            config_loader=self.hydra_context.config_loader,
            validate=self.validate_batch_is_legal,
        )


__all__ = ["JaxaotOptunaSweeper", "JaxaotOptunaSweeperConf"]
