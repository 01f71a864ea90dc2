"""Optimized HLO as structure, for ``jaxaot-diff``: fusions by kind, opcodes,
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

from jaxaot.compat import jax as compat_jax
from jaxaot.util.hlo_parse import (
    COLLECTIVES,
    Instruction,
    array_bytes,
    collectives,
    parse_hlo,
    parse_instruction,
)

_LAYOUT = re.compile(r"\{[\d,]*(?::[^}]*)?\}")
_SKIP_LAYOUT = ("parameter", "constant", "tuple", "get-tuple-element")  # no layout decision
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


def _computations(text: str) -> tuple[str, dict[str, list[Instruction]]]:
    """Each computation's instructions: jaxlib's parser reads the module and prints each
    instruction as XLA does (which :func:`parse_instruction` reads); the regex reader when
    jaxlib refuses the text, cannot list instructions (jaxlib < 0.10.2) or is not there."""
    try:
        listed = compat_jax.hlo_instructions(text)  # imports jaxlib, not JAX
    except Exception:  # another XLA's text, or no jaxlib
        listed = None
    if listed is None:
        return "regex", {n: list(c.instructions) for n, c in parse_hlo(text).items()}
    return "jaxlib", {
        name: [i for i in map(parse_instruction, printed) if i] for name, printed in listed.items()
    }


def structure(text: str) -> Structure:
    parser, comps = _computations(text)
    out = Structure(parser=parser)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    fused = {
        callee
        for instrs in comps.values()
        for i in instrs
        if i.opcode == "fusion"
        for role, callee in i.callees
        if role == "calls"
    }
    for name, instrs in comps.items():
        for ins in instrs:
            out.opcodes[ins.opcode] += 1
            if ins.opcode == "fusion":
                out.fusion_kinds[ins.attr("kind") or "?"] += 1
                out.fusion_bytes[ins.name] = sum(array_bytes(ins.shape)) + sum(
                    sum(array_bytes(shapes.get(o, ""))) for o in ins.operands
                )
            if name not in fused and ins.opcode not in _SKIP_LAYOUT:
                layout = " ".join(_LAYOUT.findall(ins.shape))
                if layout:
                    out.layouts[ins.name] = layout
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
