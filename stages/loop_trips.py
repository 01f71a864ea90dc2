"""Trip counts of the while loops in optimized (or lowered) HLO.

XLA's own annotation first (``backend_config={"known_trip_count":{"n":"8"}}``, which the CPU and
GPU pipelines of jaxlib 0.10.2 add after optimization); else the induction variable: a tuple
element initialised to a constant, stepped by a constant in the body and compared with a
constant (or a loop-invariant element initialised to one) in the condition, as ``lax.scan``
(forwards or reversed) and a ``fori_loop`` with static bounds lower. TPU's optimized HLO
(libtpu 0.0.42) carries no annotation. Anything else (a ``while_loop`` on data) has no count.
Values are followed through copies, bitcasts, converts, reshapes and into fusions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from jaxaot.util.hlo_parse import Computation, Instruction

_KNOWN_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(-?\d+)"?')
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape", "copy-done")


def _instr(comp: Computation, name: str) -> Instruction | None:
    for i in comp.instructions:
        if i.name == name:
            return i
    return None


def _root(comp: Computation) -> Instruction | None:
    roots = [i for i in comp.instructions if i.root]
    return roots[0] if roots else (comp.instructions[-1] if comp.instructions else None)


def callee_of(ins: Instruction, key: str) -> str:
    """The computation an instruction's ``key=`` attribute names (no ``%``), or ""."""
    return (ins.attr(key) or "").lstrip("%")


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _expr(
    comps: Mapping[str, Computation],
    comp: Computation,
    name: str,
    args: list[Any] | None,
    depth: int = 0,
) -> Any:
    """A scalar value of ``comp`` as a small expression: ("const", c), ("iv", k) for element k
    of the loop tuple (``args`` None: ``comp`` is the body or condition), ("op", opcode,
    direction, a, b) or None; fusions are looked into, parameters mapped to ``args``."""
    ins = _instr(comp, name)
    if ins is None or depth > 32:
        return None
    op = ins.opcode
    if op == "constant":
        c = _int(ins.operands[0]) if ins.operands else None
        return None if c is None else ("const", c)
    if op in _PASS_THROUGH and ins.operands:
        return _expr(comps, comp, ins.operands[0], args, depth + 1)
    if op == "parameter":
        idx = _int(ins.operands[0]) if ins.operands else None
        return args[idx] if args is not None and idx is not None and idx < len(args) else None
    if op == "get-tuple-element":
        src = _instr(comp, ins.operands[0]) if ins.operands else None
        index = _int(ins.attr("index") or "")
        if src is not None and src.opcode == "parameter" and args is None and index is not None:
            return ("iv", index)
        return None
    if op == "fusion":
        fused = comps.get(callee_of(ins, "calls"))
        if fused is None:
            return None
        inner = [_expr(comps, comp, o, args, depth + 1) for o in ins.operands]
        root = _root(fused)
        return _expr(comps, fused, root.name, inner, depth + 1) if root else None
    if op in ("add", "subtract", "compare") and len(ins.operands) == 2:
        a, b = (_expr(comps, comp, o, args, depth + 1) for o in ins.operands)
        return ("op", op, ins.attr("direction"), a, b)
    return None


def _loop_tuple(
    comps: Mapping[str, Computation], comp: Computation, ins: Instruction
) -> list[str] | None:
    """The instruction names that make the while's initial tuple, or None."""
    src = _instr(comp, ins.operands[0]) if ins.operands else None
    while src is not None and src.opcode in ("copy", "bitcast"):
        src = _instr(comp, src.operands[0])
    return list(src.operands) if src is not None and src.opcode == "tuple" else None


def _const_init(
    comps: Mapping[str, Computation], comp: Computation, init: list[str], k: int
) -> int | None:
    if k >= len(init):
        return None
    e = _expr(comps, comp, init[k], None)
    return e[1] if e is not None and e[0] == "const" else None


_SWAP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def induction_trip_count(
    comps: Mapping[str, Computation], comp: Computation, ins: Instruction
) -> int | None:
    """The trip count of while ``ins`` (in ``comp``) from its induction variable, or None."""
    cond, body = comps.get(callee_of(ins, "condition")), comps.get(callee_of(ins, "body"))
    init = _loop_tuple(comps, comp, ins)
    if cond is None or body is None or init is None:
        return None
    body_root = _root(body)
    if body_root is None or body_root.opcode != "tuple":
        return None

    def value(e: Any) -> int | None:
        """A constant, or a loop-tuple element the body passes through unchanged."""
        if e is None:
            return None
        if e[0] == "const":
            return e[1]
        invariant = e[0] == "iv" and e[1] < len(body_root.operands)
        if invariant and _expr(comps, body, body_root.operands[e[1]], None) == e:
            return _const_init(comps, comp, init, e[1])
        return None

    root = _root(cond)
    test = _expr(comps, cond, root.name, None) if root else None
    if test is None or test[:2] != ("op", "compare"):
        return None
    direction, a, b = test[2], test[3], test[4]
    if b is not None and b[0] == "iv" and not (a is not None and a[0] == "iv"):
        a, b, direction = b, a, _SWAP.get(direction or "")
    if a is None or a[0] != "iv" or direction is None:
        return None
    k, bound = a[1], value(b)
    start = _const_init(comps, comp, init, k)
    if bound is None or start is None or k >= len(body_root.operands):
        return None
    nxt = _expr(comps, body, body_root.operands[k], None)
    if nxt is None or nxt[0] != "op" or nxt[1] not in ("add", "subtract"):
        return None
    x, y = nxt[3], nxt[4]
    if nxt[1] == "add" and y == ("iv", k):
        x, y = y, x
    if x != ("iv", k):
        return None
    step = value(y)
    if not step:
        return None
    step = -step if nxt[1] == "subtract" else step
    return _trips(start, step, bound, direction)


def _trips(start: int, step: int, bound: int, direction: str) -> int | None:
    """Runs of ``for (i = start; i <direction> bound; i += step)``, or None if not finite."""
    if direction in ("LT", "LE"):
        if step <= 0:
            return None
        end = bound if direction == "LT" else bound + 1
        return max(0, math.ceil((end - start) / step))
    if direction in ("GT", "GE"):
        if step >= 0:
            return None
        end = bound if direction == "GT" else bound - 1
        return max(0, math.ceil((start - end) / -step))
    if direction == "NE":
        dist = bound - start
        return dist // step if dist % step == 0 and dist // step >= 0 else None
    return None


def trip_count(
    comps: Mapping[str, Computation], comp: Computation, ins: Instruction
) -> tuple[int | None, str]:
    m = _KNOWN_TRIP.search(ins.attrs)
    if m:
        return int(m.group(1)), "known_trip_count"
    n = induction_trip_count(comps, comp, ins)
    return (n, "induction variable") if n is not None else (None, "unknown trip count")


__all__ = ["callee_of", "induction_trip_count", "trip_count"]
