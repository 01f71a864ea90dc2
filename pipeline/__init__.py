"""jaxaot: JAX's ahead-of-time flow (stage out, lower, compile, execute) as a config-driven
pipeline with checkpoints.

Importing this package does not import JAX; the runner imports it only after the config
has been validated.

The import name is ``jaxaot``; in the repository this package is the ``pipeline/`` folder
(``stages/``, ``conf/`` and ``jaxaot_examples/`` are ``jaxaot.stages``, ``jaxaot.conf`` and
``jaxaot.examples``): see pyproject.toml's ``package-dir`` and the README's layout section.

    >>> import jaxaot
    >>> cfg = jaxaot.compose(["program=axpy", "stop_after=compile"])
    >>> result = jaxaot.run(cfg)                        # doctest: +SKIP
    >>> result["compile"].cost["flops"]                 # doctest: +SKIP
    2.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if __name__ != "jaxaot":  # the repository root on sys.path: a second copy of every module
    raise ImportError(
        f"jaxaot's source folder was imported as {__name__!r}; import it as 'jaxaot' "
        "(pip install -e . installs that name)"
    )

from jaxaot.errors import (
    ArgSpecError,
    BackendError,
    CheckError,
    ConfigError,
    JaxaotError,
    StageError,
    StoreError,
    TargetError,
)
from jaxaot.version import __version__

if TYPE_CHECKING:
    from jaxaot.api import compose
    from jaxaot.engine.runner import RunResult, run
    from jaxaot.schema import JaxaotConfig, validate

# Hydra and OmegaConf load on first use, so tools that need neither (jaxaot-store) start fast.
_LAZY = {
    "compose": "api",
    "JaxaotConfig": "schema",
    "validate": "schema",
    "RunResult": "engine.runner",
    "run": "engine.runner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'jaxaot' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the lazy ones (not loaded yet) included, and the module's own dunder
    attributes; not the typing helpers this file imports, nor its submodules."""
    own = {name for name in globals() if name.startswith("__") and name.endswith("__")}
    return sorted(own | set(__all__))


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
