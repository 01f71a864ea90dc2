"""Typing of the ``jax.config`` section: each value checked against the option's own type.

``jax.config.update`` types most options itself (ints, floats, strings, enums refuse a wrong
value), but a boolean option takes ``bool(value)`` (jax 0.10): the string ``'false'`` and
``'banana'`` both turn ``jax_enable_x64`` on. So the values are typed here, strictly:

- a boolean option takes a YAML boolean (``true``/``false``, unquoted) and nothing else, not
  the strings ``'true'``/``'false'``/``'1'``/``'0'`` (a quoted value is a string in the config
  language, and a run that guessed would differ from one that did not); ``null`` leaves the
  option as the process has it (JAX's default or its ``JAX_*`` environment variable);
- an int option takes an int (not a bool), a float option a number, a string option a string;
- an enum option takes one of its values, listed in the message.

:func:`check_before_import` runs with the config checks, before JAX is imported: it knows the
options jaxaot itself reads (``jax_enable_x64`` decides x64) and a few common boolean ones.
:func:`check_option` runs when the run applies the values (stages/jaxenv.py ``run_config``),
just after JAX is imported, with JAX's own table of every option's type.
"""

from __future__ import annotations

import enum
from typing import Any

from jaxaot.errors import ConfigError

# Boolean options known without importing JAX (checked against JAX's table by the tests).
KNOWN_BOOLEANS: frozenset[str] = frozenset(
    {
        "jax_enable_x64",
        "jax_debug_nans",
        "jax_debug_infs",
        "jax_disable_jit",
        "jax_log_compiles",
        "jax_enable_checks",
    }
)


def _kind(value: Any) -> str:
    """What a config value is, in the words of a message (``a string``, ``an int``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an int"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _refuse(name: str, expected: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(
        f"jax.config.{name}: expected {expected}, found {value!r} ({_kind(value)}); {fix}"
    )


def _check_boolean(name: str, value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    raise _refuse(
        name,
        "a boolean (true or false)",
        value,
        f"write jax.config.{name}=true or jax.config.{name}=false, unquoted (strings are not "
        "read as booleans), or null to leave it as it is",
    )


def check_before_import(name: str, value: Any) -> None:
    """What can be checked of ``jax.config.<name>=<value>`` without JAX: a scalar, and the
    right type for the options in :data:`KNOWN_BOOLEANS`."""
    if not (value is None or isinstance(value, bool | int | float | str)):
        raise _refuse(
            name,
            "one value (a boolean, number or string)",
            value,
            f"JAX options take a single value: jax.config.{name}=<value>",
        )
    if name in KNOWN_BOOLEANS:
        _check_boolean(name, value)


def is_boolean(name: str) -> bool:
    """Whether ``name`` is a boolean option of the JAX in this process."""
    import jax

    meta = getattr(jax.config, "meta", {}).get(name)
    if meta is not None:
        return meta[0] is bool
    return isinstance(jax.config.values.get(name), bool)


def check_option(name: str, value: Any) -> None:
    """``jax.config.<name>=<value>`` against JAX's own type for the option (its ``meta``
    table: ``bool``, ``int``, ``float``, ``str``, ``'enum'`` with ``enum_values``,
    ``'enum_class'``). ``null`` is left to JAX, except for booleans (see the module doc)."""
    import jax

    meta = getattr(jax.config, "meta", {}).get(name)
    if meta is None:  # an option JAX keeps no type for: check what its current value says
        if isinstance(jax.config.values.get(name), bool):
            _check_boolean(name, value)
        return
    kind, _, kwargs = meta
    if kind is bool:
        _check_boolean(name, value)
    elif value is None:
        return  # optional options take None; JAX refuses it for the others (one line)
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(name, "an int", value, f"write jax.config.{name}=<integer>")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _refuse(name, "a number", value, f"write jax.config.{name}=<number>")
    elif kind is str:
        if not isinstance(value, str):
            raise _refuse(name, "a string", value, f"quote it: jax.config.{name}='{value}'")
    elif kind == "enum":
        allowed = [str(v) for v in kwargs.get("enum_values", ())]
        if allowed and value not in allowed:
            raise _refuse(name, f"one of {', '.join(allowed)}", value, "use one of those values")
    elif kind == "enum_class":
        cls = kwargs.get("enum_class")
        if (
            isinstance(cls, type)
            and issubclass(cls, enum.Enum)
            and (isinstance(value, bool) or _enum_member(cls, value) is None)
        ):
            raise _refuse(
                name, f"one of {', '.join(_spellings(cls))}", value, "use one of those values"
            )


def _enum_member(cls: type[enum.Enum], value: Any) -> enum.Enum | None:
    """The member JAX's parser makes of ``value`` (``cls(value)``), or None."""
    try:
        return cls(value)
    except (ValueError, TypeError):
        return None


def _spellings(cls: type[enum.Enum]) -> list[str]:
    """How to write each member of an enum option: its value when a string, else its lowercase
    name where the enum reads that (``jax_explicit_x64_dtypes``: warn, error, allow)."""
    out = []
    for m in cls:
        candidates = [m.value] if isinstance(m.value, str) else [m.name.lower(), m.value]
        out.append(str(next((c for c in candidates if _enum_member(cls, c) is m), m.value)))
    return out


__all__ = ["KNOWN_BOOLEANS", "check_before_import", "check_option", "is_boolean"]
