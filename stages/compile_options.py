"""The XLA options one compile is given: ``compile.compiler_options`` plus the effort levels
(``compile.optimization_level``, ``compile.memory_fitting_level``), which JAX passes on to
XLA's ExecutableBuildOptions when they come as compiler options. One function, used by the
compile, the topology compile and the compile key alike, so what is keyed is what is compiled.
"""

from __future__ import annotations

from typing import Any

from jaxaot.errors import ConfigError

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


def check_effort(cfg: Any) -> None:
    """``compile.optimization_level`` / ``compile.memory_fitting_level`` are O0..O3 or null, and
    the same levels given as raw ``compile.compiler_options`` are XLA's numbers, set once: XLA
    takes any number it is given without a word (7 compiles as if unset)."""
    for key in EFFORT_KEYS:
        level = getattr(cfg, key, None)
        if level is not None and level not in EFFORT_VALUES:
            raise ConfigError(
                f"compile.{key}: expected one of {', '.join(EFFORT_LEVELS)} or null (JAX's "
                f"default), found {level!r}; e.g. compile.{key}=O1"
            )
        if key not in cfg.compiler_options:
            continue
        raw = cfg.compiler_options[key]
        if level is not None:
            raise ConfigError(
                f"compile.compiler_options.{key}={raw!r} and compile.{key}={level} both set the "
                f"effort; expected one: drop compile.compiler_options.{key}"
            )
        if isinstance(raw, bool) or raw not in (0, *EFFORT_VALUES.values()):
            names = ", ".join(f"{n}={v}" for n, v in EFFORT_VALUES.items())
            raise ConfigError(
                f"compile.compiler_options.{key}: expected one of XLA's effort levels ({names}), "
                f"found {raw!r}; set compile.{key}=O1 instead"
            )


__all__ = [
    "EFFORT_KEYS",
    "EFFORT_LEVELS",
    "EFFORT_VALUES",
    "check_effort",
    "effort_options",
    "options_of",
]
