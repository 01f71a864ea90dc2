"""Optimized HLO as structure, for ``jaxaot-diff`` (issue 18, item 4): fusions by kind, opcodes,
collectives and their bytes, the bytes each fusion touches, and layouts.

The module is parsed by jaxlib's own HLO parser (``jaxlib._hlo.hlo_module_from_text``: names,
opcodes, operands and each instruction's text as XLA prints it) when it accepts the text
(it reads jaxaot's elided constants, ``constant({...})``, too); otherwise (a text from another
XLA, with an opcode or attribute this one does not know) by :mod:`jaxaot.util.hlo_parse`'s
regexes. Either way the same facts come out, and the result says
which parser read it. Importing this module imports neither JAX nor jaxlib.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from jaxaot.util.hlo_parse import COLLECTIVES, array_bytes, collectives, parse_hlo

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<shape>.*?)\s(?P<op>[\w-]+)\(")
_KIND = re.compile(r"\bkind=(k\w+)")
_LAYOUT = re.compile(r"\{[\d,]*(?::[^}]*)?\}")
_CALLS = re.compile(r"\bcalls=%?([\w.-]+)")
TOP_FUSIONS = 5
LAYOUT_EXAMPLES = 8


@dataclass
class Structure:
    """What one optimized HLO module is made of."""

    parser: str  # "jaxlib" | "regex"
    opcodes: Counter[str] = field(default_factory=Counter)  # every computation's instructions
    fusion_kinds: Counter[str] = field(default_factory=Counter)  # fusion instructions by kind
    fusion_bytes: dict[str, float] = field(default_factory=dict)  # fusion -> operand + result bytes
    layouts: dict[str, str] = field(default_factory=dict)  # unfused instruction -> its layout(s)
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)


def _lines_jaxlib(text: str) -> tuple[list[tuple[str, bool, str]], set[str]]:
    """(computation, fused?, instruction line) via jaxlib's parser; raises if it refuses."""
    from jaxlib import _hlo  # type: ignore[attr-defined]  # HLO bindings, no JAX import

    module = _hlo.hlo_module_from_text(text)
    lines = [
        (c.name, False, i.to_string()) for c in module.computations() for i in c.instructions()
    ]
    return lines, _fused_names([line for _, _, line in lines])


def _lines_regex(text: str) -> tuple[list[tuple[str, bool, str]], set[str]]:
    comps = parse_hlo(text)

    def operand(o: str) -> str:
        return f"%{o}" if re.match(r"^[A-Za-z_][\w.-]*$", o) else o

    lines = [
        (
            c.name,
            False,
            f"%{i.name} = {i.shape} {i.opcode}({', '.join(map(operand, i.operands))}){i.attrs}",
        )
        for c in comps.values()
        for i in c.instructions
    ]
    return lines, _fused_names([line for _, _, line in lines])


def _fused_names(lines: list[str]) -> set[str]:
    """The computations that fusion instructions call: their ops are a fusion's insides."""
    return {m.group(1) for line in lines if " fusion(" in line for m in _CALLS.finditer(line)}


def structure(text: str) -> Structure:
    try:
        lines, fused = _lines_jaxlib(text)
        parser = "jaxlib"
    except Exception:  # another XLA's text, or no jaxlib: the regex reader
        lines, fused = _lines_regex(text)
        parser = "regex"
    out = Structure(parser=parser)
    shapes: dict[str, str] = {}
    parsed = []
    for comp, _, line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        shapes[m["name"]] = m["shape"]
        parsed.append((comp, m, line))
    for comp, m, line in parsed:
        op = m["op"]
        out.opcodes[op] += 1
        inside = comp in fused
        if op == "fusion":
            kind = _KIND.search(line)
            out.fusion_kinds[kind.group(1) if kind else "?"] += 1
            operands = re.findall(r"%([\w.-]+)", line.split(f"{op}(", 1)[1].split(")", 1)[0])
            touched = sum(array_bytes(m["shape"])) + sum(
                sum(array_bytes(shapes.get(o, ""))) for o in operands
            )
            out.fusion_bytes[m["name"]] = touched
        if not inside and op not in ("parameter", "constant", "tuple", "get-tuple-element"):
            layout = " ".join(_LAYOUT.findall(m["shape"]))
            if layout:
                out.layouts[m["name"]] = layout
    out.collectives = {k: v for k, v in collectives(text).items() if v["count"]}
    return out


def compare(a_text: str, b_text: str) -> dict[str, Any]:
    """What differs between two optimized modules, as structure (JSON-ready)."""
    a, b = structure(a_text), structure(b_text)
    opcodes = {
        op: {"a": a.opcodes.get(op, 0), "b": b.opcodes.get(op, 0)}
        for op in sorted({*a.opcodes, *b.opcodes})
        if a.opcodes.get(op, 0) != b.opcodes.get(op, 0)
    }
    kinds = {
        k: {"a": a.fusion_kinds.get(k, 0), "b": b.fusion_kinds.get(k, 0)}
        for k in sorted({*a.fusion_kinds, *b.fusion_kinds})
    }
    coll = {
        k: {
            "a_count": a.collectives.get(k, {}).get("count", 0),
            "b_count": b.collectives.get(k, {}).get("count", 0),
            "a_bytes": a.collectives.get(k, {}).get("bytes", 0.0),
            "b_bytes": b.collectives.get(k, {}).get("bytes", 0.0),
        }
        for k in COLLECTIVES
        if k in a.collectives or k in b.collectives
    }
    changed = [
        {"name": n, "a": a.layouts[n], "b": b.layouts[n]}
        for n in sorted(set(a.layouts) & set(b.layouts))
        if a.layouts[n] != b.layouts[n]
    ]

    def top(s: Structure) -> list[dict[str, Any]]:
        rows = sorted(s.fusion_bytes.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_FUSIONS]
        return [{"name": n, "bytes": v} for n, v in rows]

    return {
        "parsers": {"a": a.parser, "b": b.parser},
        "instructions": {"a": sum(a.opcodes.values()), "b": sum(b.opcodes.values())},
        "fusion_kinds": kinds,
        "opcodes": opcodes,
        "collectives": coll,
        "fusion_bytes": {
            "a": sum(a.fusion_bytes.values()),
            "b": sum(b.fusion_bytes.values()),
            "top_a": top(a),
            "top_b": top(b),
        },
        "layout_changes": {"count": len(changed), "examples": changed[:LAYOUT_EXAMPLES]},
        "same": not (opcodes or changed or any(v["a"] != v["b"] for v in kinds.values())),
    }


__all__ = ["Structure", "compare", "structure"]
