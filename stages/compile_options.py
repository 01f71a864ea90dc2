"""The XLA options one compile is given: ``compile.compiler_options`` plus the effort levels
(``compile.optimization_level``, ``compile.memory_fitting_level``), which JAX passes on to
XLA's ExecutableBuildOptions when they come as compiler options. One function, used by the
compile, the topology compile and the compile key alike, so what is keyed is what is compiled.
"""

from __future__ import annotations

from typing import Any

# XLA's effort levels: name -> the value of xla::ExecutionOptions' EffortLevel, which is what
# ExecutableBuildOptions takes (JAX's jax_optimization_level names them alike).
EFFORT_VALUES: dict[str, int] = {"O0": 9, "O1": 19, "O2": 29, "O3": 39}
EFFORT_LEVELS: tuple[str, ...] = tuple(EFFORT_VALUES)
EFFORT_KEYS: tuple[str, ...] = ("optimization_level", "memory_fitting_level")


def effort_options(cfg: Any) -> dict[str, Any]:
    """``{optimization_level: 19, ...}`` for the levels ``cfg`` (the compile section) sets
    (``O1`` is 19: the number XLA's build options take)."""
    return {
        k: EFFORT_VALUES[getattr(cfg, k)] for k in EFFORT_KEYS if getattr(cfg, k, None) is not None
    }


def options_of(cfg: Any) -> dict[str, Any]:
    """The compiler options of the compile section ``cfg``: its own, then its effort levels."""
    return dict(cfg.compiler_options) | effort_options(cfg)


__all__ = ["EFFORT_KEYS", "EFFORT_LEVELS", "EFFORT_VALUES", "effort_options", "options_of"]
