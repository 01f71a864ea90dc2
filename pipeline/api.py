"""Composing configs from Python, the way the CLI does (for scripts, notebooks and tests)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jaxaot.conf as _conf

if TYPE_CHECKING:
    from jaxaot.engine.runner import RunResult
from jaxaot.config.argspec import quote_array_types
from jaxaot.config.sections import name_after_target, refuse_unknown_keys
from jaxaot.engine.own_args import defer_own_arguments
from jaxaot.errors import ConfigError, SnapshotMismatch
from jaxaot.schema import register_configs
from omegaconf import DictConfig

# conf/ in the source tree; jaxaot/conf in a wheel: the package knows where it is.
CONF_DIR = Path(_conf.__file__).resolve().parent


def conf_dir() -> Path:
    """The shipped config directory (works from a source tree and from an installed wheel)."""
    return CONF_DIR


def compose(
    overrides: Sequence[str] = (),
    *,
    config_name: str = "config",
    config_dir: str | Path | None = None,
) -> DictConfig:
    """The config ``jaxaot <overrides>`` would run, without starting a Hydra app.

    Array types may be written unquoted (``program.args=[f32[8,8]]``), as on the command line.
    The config returned takes Python objects in ``program.args``/``program.kwargs`` as they are:
    a ``jax.ShapeDtypeStruct`` (with its ``.sharding``, if any) is an array spec of that shape
    and dtype, an array (NumPy or JAX) a value executed as it is::

        cfg = jaxaot.compose(["program.target=mypkg.model:step"])
        cfg.program.args = [jax.ShapeDtypeStruct((8, 128), jnp.bfloat16), np.ones(4)]
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from jaxaot.config.trust import install_composition_guards
    from jaxaot.sweeps.remembered import drop_last_hit, remember_in_process
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    # A composition this process made before, of the same files, is taken again (its value
    # overrides applied anew): jaxaot.sweeps.remembered says what the key covers.
    remember_in_process()
    # trust.* and store.trust come from these overrides, never from a config file (refused);
    # installed after the memo, so that the check runs outermost, on a remembered one too.
    install_composition_guards()
    GlobalHydra.instance().clear()
    overrides = [quote_array_types(o) for o in overrides]

    def composed() -> DictConfig:
        with initialize_config_dir(config_dir=str(config_dir or CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides)

    try:
        try:
            cfg = composed()
        except ConfigError:
            # A refused remembered composition: composed again, its refusal names the file.
            if not drop_last_hit():
                raise
            cfg = composed()
    except (HydraException, OmegaConfBaseException) as exc:
        # The line the CLI prints: the closest names for a mistyped group, option or key, not
        # Hydra's "To append to your config use +progam=mlp".
        raise ConfigError(_one_line(exc, config_dir)) from exc
    # A key the schema lacks (+execute.repet=3) is refused here, as the CLI refuses it, rather
    # than by run(); mappings that take any key (program.kwargs, compiler_options) take it.
    refuse_unknown_keys(cfg)
    name_after_target(cfg, overrides)
    # program.args may still be set in Python before run(): a refusal waits for run().
    defer_own_arguments(cfg, overrides)
    # OmegaConf refuses objects it cannot represent (a ShapeDtypeStruct, an array) unless this
    # flag is set; OmegaConf 2.3 has no public setter for it.
    cfg._set_flag("allow_objects", True)
    return cfg


def _one_line(exc: BaseException, config_dir: str | Path | None) -> str:
    from jaxaot.config.suggest import config_names, one_line
    from jaxaot.schema import JaxaotConfig

    try:
        names = config_names([str(config_dir)] if config_dir else [], schema=JaxaotConfig)
    except Exception:  # naming the closest names must never hide the error itself
        names = None
    return one_line(exc, names)


def verify_snapshot(
    golden_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    update: bool = False,
    run_dir: str | Path | None = None,
    config_dir: str | Path | None = None,
) -> RunResult:
    """Verify ``golden_dir`` from a user's own test suite, without spawning the CLI.

    Composes ``overrides`` as ``jaxaot`` would (``stop_after=compile`` unless given), runs in
    this process and raises AssertionError carrying the summary and the bounded diff when the
    lowering differs. ``update=True`` rewrites the golden snapshot instead.
    """
    import tempfile

    from jaxaot.engine.runner import run

    cfg = compose(list(overrides), config_dir=config_dir)
    if not any(o.lstrip("+~").split("=", 1)[0] == "stop_after" for o in overrides):
        cfg.stop_after = "compile"
    cfg.snapshot.verify = str(golden_dir)
    cfg.snapshot.update = update
    out = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="jaxaot-verify-"))
    try:
        return run(cfg, run_dir=out)
    except SnapshotMismatch as exc:
        raise AssertionError(f"{exc}\n{exc.diff}") from None


__all__ = ["compose", "conf_dir", "verify_snapshot"]
