"""Override values as sweep lines and reports show them: unescaped, a long one shortened.

A sweep override may carry a whole argument tree (``program.args=[{_init_: ...}, ...]``, kilobytes
of YAML); progress lines, ``sweep.md`` and the launchers' per-job lines show such a value by its
start, its item count, its size and a hash (``sweep.csv`` keeps it whole).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence

from jaxaot.util.console import LAUNCHER_LOGGERS, add_launcher_filter
from jaxaot.util.humanize import human_bytes


def override_value(override: str) -> str:
    """The value as a user reads it: ``'f32[16,256]'`` (quoted for Hydra) -> ``f32[16,256]``."""
    value = override.split("=", 1)[1] if "=" in override else ""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].replace("\\" + value[0], value[0])
    # A sweep's values come back escaped for Hydra's grammar: f32\[8\,256\] -> f32[8,256].
    return re.sub(r"\\([\\()\[\]{}:=, \t])", r"\1", value)


# Characters of an override value that a progress line or a report cell shows whole; a longer
# value (an argument tree: program.args=[{...}, ...]) is shown by its start, size and hash.
SHOWN_MAX = 48
_SHOWN_HEAD = 24


def _items(value: str) -> tuple[int, str] | None:
    """(count, noun) of a list's items or a mapping's keys at the top level of ``value``, as
    Hydra writes them (quotes and nested brackets skipped); None for anything else."""
    if len(value) < 2 or (value[0], value[-1]) not in (("[", "]"), ("{", "}")):
        return None
    depth, quote, commas, prev = 0, "", 0, ""
    for ch in value[1:-1]:
        if quote:
            quote = "" if ch == quote and prev != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth < 0:  # "{a: 1}{b: 2}": not one list or mapping
                return None
        elif ch == "," and depth == 0 and prev != "\\":
            commas += 1
        prev = ch
    count = commas + 1 if value[1:-1].strip() else 0
    noun = "item" if value[0] == "[" else "key"
    return count, noun + ("" if count == 1 else "s")


def short_value(value: str, limit: int = SHOWN_MAX) -> str:
    """An override value as a progress line or a report cell shows it: whole up to ``limit``
    characters; else its start, its size (items or keys, bytes) and the first 8 hex digits of
    its sha256, so two long values never read alike:
    ``[{_init_: mypkg.model:in… <3 items, 5.1 KiB, #1a2b3c4d>``."""
    if len(value) <= limit:
        return value
    raw = value.encode()
    items = _items(value)
    count = f"{items[0]} {items[1]}, " if items is not None else ""
    digest = hashlib.sha256(raw).hexdigest()[:8]
    return f"{value[:_SHOWN_HEAD].rstrip()}… <{count}{human_bytes(len(raw))}, #{digest}>"


def short_override(override: str) -> str:
    """``key=value`` with the value as :func:`short_value` shows it (unescaped for reading)."""
    key, sep, _ = override.partition("=")
    return key + sep + short_value(override_value(override)) if sep else override


def split_overrides(line: str) -> list[str]:
    """Overrides joined by spaces (as Hydra's launchers log a job's) split again: at spaces
    outside quotes and brackets, so ``program.args=[{a: 1}, {b: 2}]`` stays one."""
    out, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth = max(depth - 1, 0)
        elif ch == " " and depth == 0:
            out.append(line[start:i])
            start = i + 1
    out.append(line[start:])
    return [o for o in out if o]


_JOB_LINE = re.compile(r"(\t#\d+ : )(.*)", re.S)
# Hydra's launchers that log each job's overrides ("#3 : key=value ...") before it starts.


class ShortOverrides(logging.Filter):
    """Shortens the overrides in a launcher's "#3 : key=value ..." line as progress lines do."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = _JOB_LINE.fullmatch(record.msg) if isinstance(record.msg, str) else None
        if match is not None and not record.args and len(match[2]) > SHOWN_MAX:
            shown = " ".join(short_override(o) for o in split_overrides(match[2]))
            record.msg = match[1] + shown
        return True


def shorten_launcher_lines() -> None:
    """Install :class:`ShortOverrides` on Hydra's launcher loggers (once per process)."""
    add_launcher_filter(ShortOverrides)


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """The shortest dotted suffix of each key that is still unique among ``keys``."""
    out = {}
    for k in keys:
        parts = k.split(".")
        for n in range(1, len(parts) + 1):
            cand = ".".join(parts[-n:])
            if parts[-n].isdigit() and n < len(parts):
                continue  # `args.1`, not `1`
            if sum(1 for o in keys if o == cand or o.endswith("." + cand)) == 1:
                out[k] = cand
                break
        else:
            out[k] = k
    return out


__all__ = [
    "LAUNCHER_LOGGERS",
    "SHOWN_MAX",
    "ShortOverrides",
    "override_value",
    "short_names",
    "short_override",
    "short_value",
    "shorten_launcher_lines",
    "split_overrides",
]
