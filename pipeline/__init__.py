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

from .api import compose
from .config import JaxaotConfig, validate
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
from .runner import RunResult, run

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
