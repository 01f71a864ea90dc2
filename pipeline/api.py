"""Composing configs from Python, the way the CLI does (for scripts, notebooks and tests)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jaxaot.conf as _conf
from jaxaot.config.argspec import quote_array_types
from jaxaot.config.schema import name_after_target, register_configs
from omegaconf import DictConfig

# conf/ in the source tree; jaxaot/conf in a wheel: the package knows where it is.
CONF_DIR = Path(_conf.__file__).resolve().parent


def conf_dir() -> Path:
    """The shipped config directory (works from a source tree and from an installed wheel)."""
    return CONF_DIR


def compose(overrides: Sequence[str] = (), *, config_name: str = "config",
            config_dir: str | Path | None = None) -> DictConfig:  # fmt: skip
    """The config ``jaxaot <overrides>`` would run, without starting a Hydra app.

    Array types may be written unquoted (``program.args=[f32[8,8]]``), as on the command line.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    overrides = [quote_array_types(o) for o in overrides]
    with initialize_config_dir(config_dir=str(config_dir or CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    name_after_target(cfg, overrides)
    return cfg


__all__ = ["compose", "conf_dir"]
