"""HLO text as data: computations and their instructions, parsed from what XLA prints.

Enough of the grammar for drawing and summarizing a module, not a full HLO parser: each
instruction's name, opcode, shape, operands, attributes and the computations it calls. Works
on the lowered and the optimized HLO, with or without ``%`` prefixes, metadata and the debug
tables newer XLA prints (they are dropped first, by :func:`jaxaot.util.canonical.canonical_hlo`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxaot.util.canonical import canonical_hlo

_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s({]+)")
_INSTR = re.compile(r"\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w-]+)\(")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Instruction:
    """One ``[ROOT] %name = shape opcode(operands), attributes`` line."""

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    attrs: str
    root: bool

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=([^,\s]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def callees(self) -> list[tuple[str, str]]:
        """(role, computation) for every computation this instruction calls."""
        out = [(m.group(1), m.group(2)) for m in _CALLEE.finditer(self.attrs)]
        for m in _BRANCHES.finditer(self.attrs):
            out += [("branch", b.strip().lstrip("%")) for b in m.group(1).split(",") if b.strip()]
        return out


@dataclass(frozen=True)
class Computation:
    """A named computation (``ENTRY`` or called: fused, loop body, reducer) in file order."""

    name: str
    entry: bool
    instructions: tuple[Instruction, ...]

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


def _closing(text: str, start: int) -> int:
    """Index of the bracket that closes the one at ``start`` (quotes respected)."""
    depth, quoted, i = 0, False, start
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return len(text) - 1


def _split_top(text: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in text:
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_instruction(line: str) -> Instruction | None:
    """One ``[ROOT] %name = shape opcode(operands), attrs`` line, or None."""
    head = _INSTR.match(line)
    if not head:
        return None
    rest = line[head.end() :]
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
        shape, rest = rest[:end], rest[end:]
    else:
        shape, _, rest = rest.partition(" ")
        rest = " " + rest
    op = _OPCODE.match(rest)
    if not op:
        return None
    close = _closing(rest, op.end() - 1)
    operands = tuple(p.split()[-1].lstrip("%") for p in _split_top(rest[op.end() : close]))
    return Instruction(
        name=head.group(2),
        opcode=op.group(1),
        shape=shape,
        operands=operands,
        attrs=rest[close + 1 :],
        root=bool(head.group(1)),
    )


def parse_hlo(text: str) -> dict[str, Computation]:
    """Computations of an HLO module's text, in file order (metadata and debug tables dropped)."""
    comps: dict[str, Computation] = {}
    current: tuple[str, bool, list[Instruction]] | None = None
    for line in canonical_hlo(text).splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                m = _HEADER.match(line)
                if m and not line.startswith("HloModule"):
                    current = (m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            name, entry, instrs = current
            comps[name] = Computation(name, entry, tuple(instrs))
            current = None
            continue
        instr = parse_instruction(line)
        if instr is not None:
            current[2].append(instr)
    return comps


def module_name(text: str) -> str:
    m = re.match(r"HloModule ([^\s,]+)", text)
    return m.group(1) if m else "module"


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def array_bytes(shape: str) -> list[float]:
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        out.append(n * size)
    return out


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
    """Count and result bytes per device of each collective in the optimized HLO.

    Async pairs (``all-gather-start``/``-done``) count once, at the start; a start's tuple
    shape holds its operand and result, so its largest array is taken. A variadic collective's
    tuple result is summed.
    """
    found = {name: {"count": 0, "bytes": 0.0} for name in COLLECTIVES}
    for comp in parse_hlo(hlo_text).values():
        for ins in comp.instructions:
            op = ins.opcode.removesuffix("-start")
            if op not in found or ins.opcode.endswith("-done"):
                continue
            sizes = array_bytes(ins.shape)
            found[op]["count"] += 1
            found[op]["bytes"] += (
                (max(sizes) if ins.opcode.endswith("-start") else sum(sizes)) if sizes else 0.0
            )
    return found


__all__ = [
    "COLLECTIVES",
    "Computation",
    "Instruction",
    "array_bytes",
    "collectives",
    "module_name",
    "parse_hlo",
    "parse_instruction",
]
