"""What a code object looks up by name (globals among them), nested code included."""

from __future__ import annotations

import types


def global_names(code: types.CodeType) -> set[str]:
    """Every name the code (and code nested in it) looks up: globals among them."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names
