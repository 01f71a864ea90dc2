"""jaxaot: JAX's ahead-of-time flow (stage out, lower, compile, execute) as a config-driven
pipeline with checkpoints.

Importing this package does not import JAX; the runner imports it only after the config
has been validated.

    >>> import pipeline
    >>> cfg = pipeline.compose(["program=axpy", "stop_after=compile"])
    >>> result = pipeline.run(cfg)                      # doctest: +SKIP
    >>> result["compile"].cost["flops"]                 # doctest: +SKIP
    2.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ArgSpecError,
    BackendError,
    CheckError,
    ConfigError,
    JaxaotError,
    StageError,
    StoreError,
    TargetError,
)

if TYPE_CHECKING:
    from .api import compose
    from .config import JaxaotConfig, validate
    from .runner import RunResult, run

# Hydra and OmegaConf load on first use, so tools that need neither (jaxaot-store) start fast.
_LAZY = {
    "compose": "api",
    "JaxaotConfig": "config",
    "validate": "config",
    "RunResult": "runner",
    "run": "runner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "ArgSpecError",
    "BackendError",
    "CheckError",
    "ConfigError",
    "JaxaotConfig",
    "JaxaotError",
    "RunResult",
    "StageError",
    "StoreError",
    "TargetError",
    "__version__",
    "compose",
    "run",
    "validate",
]
