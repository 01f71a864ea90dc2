"""Unified diffs of canonical text and of flattened configs, bounded for terminals.

Shared by ``snapshot.verify`` and ``jaxaot-diff``: a terminal gets the first lines of the first
difference, a file gets everything.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any


def unified(old: str, new: str, old_label: str, new_label: str, context: int = 3) -> list[str]:
    """Unified diff lines (no trailing newlines); empty when the texts are equal."""
    return list(
        difflib.unified_diff(
            old.splitlines(), new.splitlines(), old_label, new_label, n=context, lineterm=""
        )
    )


def line_counts(diff: list[str]) -> tuple[int, int]:
    """(added, removed) lines of a unified diff, headers excluded."""
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    return added, removed


def bounded(diff: list[str], limit: int, full_path: str | None = None) -> str:
    """The first ``limit`` lines of ``diff`` and a line saying how many more there are."""
    shown = diff[:limit]
    rest = len(diff) - len(shown)
    if rest > 0:
        where = f"; full diff: {full_path}" if full_path else ""
        shown.append(f"... {rest} more diff line{'s' if rest != 1 else ''}{where}")
    return "\n".join(shown)


def _is_container(value: Any) -> bool:
    return isinstance(value, Mapping | list)


def _walk(old: Any, new: Any, key: str, out: list[str]) -> None:
    # Recurse into mappings, and into lists of mappings/lists (program.args); a list of
    # scalars (a shape) or a change of kind is one entry.
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{key}.{k}" if key else str(k)
            _walk(old.get(k, _ABSENT), new.get(k, _ABSENT), sub, out)
    elif (
        isinstance(old, list)
        and isinstance(new, list)
        and len(old) == len(new)
        and any(_is_container(v) for v in old + new)
    ):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _walk(a, b, f"{key}.{i}" if key else str(i), out)
    elif old != new:
        out.append(f"{key}: {_short(old)} -> {_short(new)}")


_ABSENT = object()  # a key that one side lacks


def _short(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for each changed entry, keys spelled as Hydra overrides are
    (``program.args.1.shape``); ``(absent)`` for a missing side."""
    out: list[str] = []
    _walk(old, new, "", out)
    return out


__all__ = ["bounded", "changed_keys", "line_counts", "unified"]
