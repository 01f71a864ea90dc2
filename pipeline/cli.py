"""The ``jaxaot`` command: a Hydra app over the shipped ``conf/``.

Errors that jaxaot raises on purpose are printed as one line on stderr with a non-zero exit;
``debug=true`` (or ``JAXAOT_DEBUG=1``) shows the traceback too.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import hydra
from omegaconf import DictConfig

from .argspec import quote_array_types
from .config import register_configs
from .errors import JaxaotError

log = logging.getLogger("jaxaot")


def _debug(cfg: DictConfig | None) -> bool:
    if os.environ.get("JAXAOT_DEBUG", "") not in ("", "0"):
        return True
    return bool(cfg is not None and cfg.get("debug", False))


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(cfg: DictConfig) -> int:
    from .runner import run

    try:
        result = run(cfg, print_summary=True)
    except JaxaotError as exc:
        if _debug(cfg):
            traceback.print_exc()
        print(f"jaxaot: error: {exc}", file=sys.stderr, flush=True)
        if _is_multirun():
            return 1
        sys.exit(1)
    except Exception as exc:
        if _debug(cfg):
            traceback.print_exc()
        print(f"jaxaot: internal error: {type(exc).__name__}: {' '.join(str(exc).split())} "
              "(rerun with debug=true for the traceback)", file=sys.stderr, flush=True)  # fmt: skip
        if _is_multirun():
            return 2
        sys.exit(2)
    return 0 if result.ok else 1


def main() -> None:
    """Console-script entry point."""
    register_configs()
    sys.argv = [sys.argv[0], *(quote_array_types(a) for a in sys.argv[1:])]
    _app()


if __name__ == "__main__":
    main()
