"""Command-line quoting: array types in an override quoted so that Hydra's grammar reads them
as strings."""

from __future__ import annotations

import re

# Something written like an array type (``name[dims]``) inside a longer override value, for
# quoting it before Hydra parses the line. Any name, not only known dtypes: an unknown dtype or a
# malformed shape should reach parse_type (which names it) rather than fail Hydra's grammar.
_TYPE_IN_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\[[^\[\]{}'\"=]*\](?:~[A-Za-z0-9_]*)?")
# Characters after which a value (a list item, a dict value) can start in Hydra's grammar.
_VALUE_START = frozenset("[,:{( \t")


def quote_array_types(override: str) -> str:
    """Quote JAX-style array types in a command-line override so Hydra's grammar accepts them.

    Hydra reads ``[`` as the start of a list, so ``program.args=[f32[128,512]]`` would not
    parse; ``program.args=['f32[128,512]']`` does. Text already inside quotes and ``${...}``
    interpolations are left alone.
    """
    if "=" not in override or "[" not in override:
        return override
    key, _, value = override.partition("=")
    out, i, quote = [], 0, ""
    while i < len(value):
        ch = value[i]
        if quote:
            out.append(ch)
            if ch == "\\" and i + 1 < len(value):
                out.append(value[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
            i += 1
            continue
        if ch in "'\"":
            quote = ch
            out.append(ch)
            i += 1
            continue
        if value.startswith("${", i):
            end = _interpolation_end(value, i)
            out.append(value[i:end])
            i = end
            continue
        m = _TYPE_IN_TEXT_RE.match(value, i)
        if m and (i == 0 or value[i - 1] in _VALUE_START):
            out.append("'" + m.group(0) + "'")
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return key + "=" + "".join(out)


def _interpolation_end(text: str, start: int) -> int:
    """Index just past the ``}`` closing the ``${`` at ``start`` (or the end of ``text``)."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)
