"""Peak memory and what makes it: XLA's peak, the buffers live at the peak, and bytes by what
they are (arguments by top-level subtree, outputs, temporaries, constants, host memory).

Two sources give the same model, a list of XLA's buffer allocations and the values
(``LogicalBuffer``s) assigned to each:

* ``compiled.memory_analysis().serialized_buffer_assignment_proto`` (jaxlib 0.10.2: non-empty
  on CPU, empty for deviceless TPU topology compiles), decoded by hand
  (:mod:`jaxaot.util.protowire`; ``xla/service/hlo.proto``'s ``BufferAssignmentProto``);
* XLA's own dump of the compile, ``*after_optimizations-buffer-assignment.txt``
  (:func:`dump_options` asks for it).

When each value is live comes from the optimized module's schedule
(``compiled.runtime_executable().hlo_modules()``' ``HloModuleProto``, or the optimized HLO
text, which XLA prints in schedule order), flattened as XLA's ``HloLiveRange`` flattens it:
while loops' condition and body, calls and conditionals' branches before the instruction that
runs them. A value lives from the instruction that defines it (entry parameters: from the
start) through its last use, both steps included, followed through get-tuple-element, tuple,
bitcast and control flow; entry parameters and what the entry computation returns live to
the end, a single-array result from the entry root's own step. XLA's ``*-live-range.txt``
lists the same set at the same peak step on CPU (tests/test_memory_breakdown.py compares
them); libtpu's counts on-chip and host memory spaces alike, which is why the device
memory's live ranges are computed here.

Only the device's default memory space (XLA color 0) counts towards the peak; host memory
(color 5, ``S(5)``) is its own group; on-chip memory spaces (TPU VMEM/SMEM, colors 1, 2, ...)
are listed apart and never in the HBM figures. ``peak_bytes`` is XLA's own
``peak_memory_in_bytes`` as jaxlib reports it (libtpu's counts on-chip memory spaces too);
``live_peak_bytes`` is the sum of the device buffers live at the peak listed in ``top``.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.stages.buffer_assignment import (
    ARRAY_SHAPE,
    Allocation,
    Module,
    Value,
    allocations_from_proto,
    module_of,
    parse_buffer_assignment,
)
from jaxaot.util.humanize import human_bytes

if TYPE_CHECKING:
    from jaxaot.rundir.metrics import CompileMetrics
    from jaxaot.stages.contract import StageContext

ARTIFACT = "memory_breakdown.json"
# 1: peak_bytes, live_peak_bytes, top, groups, peak_groups, allocations.
FORMAT = 1

_CONTROL_FLOW = ("while", "call", "conditional", "async-start")
_FORWARDING = ("bitcast", "optimization-barrier")


# -- live ranges --------------------------------------------------------------------------------


class LiveRanges:
    """When each value is live, on the module's flattened schedule (see the module docstring)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.time: dict[str, int] = {}
        self.callers: dict[str, list[str]] = defaultdict(list)
        self.users: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for ins in module.instrs.values():
            for k, op in enumerate(ins.operands):
                self.users[op].append((ins.name, k))
        self._flatten(module.entry, set())
        self.end = len(self.time)
        self._memo: dict[tuple[str, tuple[int, ...]], int] = {}

    def _flatten(self, comp: str, active: set[str]) -> None:
        if comp in active:
            return
        active = active | {comp}
        for name in self.module.sequences.get(comp, []):
            ins = self.module.instrs.get(name)
            if ins is None:
                continue
            if ins.opcode in _CONTROL_FLOW:
                # XLA's HloWhileInstruction keeps (body, condition): flattened condition first
                callees = ins.callees[::-1] if ins.opcode == "while" else ins.callees
                for callee in callees:
                    self.callers[callee].append(name)
                    self._flatten(callee, active)
            self.time[name] = len(self.time)

    def start(self, name: str) -> int | None:
        ins = self.module.instrs.get(name)
        if ins is None or name not in self.time:
            return None
        if ins.opcode == "parameter" and ins.comp == self.module.entry:
            return 0
        return self.time[name]

    def last_use(self, name: str, index: tuple[int, ...]) -> int:
        """The last time the value at ``name``'s output ``index`` is read, or leaves."""
        key = (name, index)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = self.time.get(name, 0)  # cycles (loops) stop here
        ins = self.module.instrs[name]
        end = self.time.get(name, 0)
        if ins.opcode == "parameter" and ins.comp == self.module.entry:
            end = self.end
        for user, k in self.users.get(name, []):
            u = self.module.instrs[user]
            if user not in self.time:
                continue  # inside a fusion or a reducer: its caller's time counts
            if u.opcode == "get-tuple-element" and index and index[0] != u.tuple_index:
                continue  # reads another element (a custom call's workspace is not its result)
            end = max(end, self.time[user])
            if u.opcode == "get-tuple-element":
                if index:
                    end = max(end, self.last_use(user, index[1:]))
            elif u.opcode == "tuple":
                end = max(end, self.last_use(user, (k, *index)))
            elif u.opcode in _FORWARDING or u.opcode in _CONTROL_FLOW:
                end = max(end, self.last_use(user, index))
        if ins.root:
            if ins.comp == self.module.entry:
                end = self.end
            for caller in self.callers.get(ins.comp, []):
                end = max(end, self.time.get(caller, 0), self.last_use(caller, index))
        self._memo[key] = end
        return end


@dataclass
class _Live:
    value: Value
    alloc: Allocation
    start: int
    end: int


def _live_values(allocs: list[Allocation], ranges: LiveRanges) -> list[_Live]:
    out = []
    for alloc in allocs:
        if alloc.thread_local:
            continue
        for v in alloc.values:
            start = ranges.start(v.instruction)
            if start is None:
                continue
            end = ranges.last_use(v.instruction, v.index)
            if alloc.live_out and end < ranges.end and _reaches_root(ranges, v):
                end = ranges.end
            out.append(_Live(v, alloc, start, end))
    return out


def _reaches_root(ranges: LiveRanges, v: Value) -> bool:
    return ranges.last_use(v.instruction, v.index) >= ranges.end


def _occupied(lives: list[_Live]) -> int:
    """Bytes of one allocation in use by ``lives``: the union of their [offset, offset+size)."""
    spans = sorted((x.value.offset, x.value.offset + x.value.size) for x in lives)
    total, cur_start, cur_end = 0, -1, -1
    for s, e in spans:
        if s > cur_end:
            total += max(0, cur_end - cur_start)
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return total + max(0, cur_end - cur_start)


def peak_set(lives: list[_Live], end: int) -> tuple[int, int, list[_Live]]:
    """(time, bytes, one value per occupied slice) of the device memory in use at the peak.

    A value is live at step t when start <= t <= end: from the step that defines it through
    the step that last reads it (an instruction holds its operands and its result at once),
    entry parameters and the program's outputs to the end, as XLA's ``HloLiveRange`` bounds
    are. The peak's step is the one XLA's live-range dump names (``ComputePeakMemoryMoment``):
    the first step whose values begun by it and not ended before the step before it weigh the
    most. An output is live from the step that computes it, the entry root's included (a
    single-array result is computed at the last step). Values sharing a slice of one
    allocation (the aliases of one buffer, an in-place result and its operand) count once, by
    the largest, then the one that holds it longest (XLA's dump lists each of them)."""
    device = [x for x in lives if x.alloc.color == 0]
    weight = [0] * (end + 1)  # XLA's moment: begun by t, ending at t - 1 or later
    events: dict[int, list[_Live]] = defaultdict(list)
    for x in device:
        last = min(x.end, end - 1)
        for t in range(x.start, min(last + 1, end - 1) + 1):
            weight[t] += x.value.size
        for t in range(x.start, last + 1):
            events[t].append(x)
    best_t = max(range(max(end, 1)), key=lambda t: (weight[t], -t))
    by_alloc: dict[int, list[_Live]] = defaultdict(list)
    chosen: dict[tuple[int, int], _Live] = {}
    for x in events.get(best_t, []):
        by_alloc[x.alloc.index].append(x)
        key = (x.alloc.index, x.value.offset)
        if key not in chosen or (x.value.size, x.end) > (chosen[key].value.size, chosen[key].end):
            chosen[key] = x
    total = sum(_occupied(v) for v in by_alloc.values())
    return best_t, total, sorted(chosen.values(), key=lambda x: -x.value.size)


# -- arguments by path --------------------------------------------------------------------------


def argument_paths(compiled: Any) -> dict[int, str] | None:
    """HLO entry parameter number -> the argument's path (``args[0]['params']['w']``): jax
    drops unused arguments from the entry parameters (``kept_inputs``) unless keep_unused."""
    import jax
    from jaxaot.config.tree_paths import input_path
    from jaxaot.stages.convention import kept_inputs

    try:
        flat = jax.tree_util.tree_flatten_with_path(compiled.args_info)[0]
    except Exception:
        return None
    paths = [input_path(path) for path, _ in flat]
    kept = kept_inputs(compiled)
    order = list(kept) if kept is not None else list(range(len(paths)))
    return {n: paths[i] for n, i in enumerate(order) if i < len(paths)}


_KEY = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*")
_POSITION = re.compile(r"^args\[(\d+)\]")


def static_positions(ctx: StageContext) -> list[int]:
    """The program's static positions (``stage_out.static_argnums``, and static_argnames
    given by position): from this run's ``stage_out/signature.json``, else the run's bound
    arguments. The executable's positional arguments are the others, in order."""
    signature = ctx.out_dir.parent / "stage_out" / "signature.json"
    try:
        entries = json.loads(signature.read_text()).get("static") or []
        return sorted(
            int(m.group(1))
            for e in entries
            if (m := _POSITION.match(str(e.get("path", "")))) and m.end() == len(e["path"])
        )
    except (OSError, ValueError, AttributeError):
        return sorted(ctx.facts.bound.static_argnums)


def moved_path(path: str, old: list[int], new: list[int]) -> str:
    """``path`` (``args[i]...``, ``i`` a position of a program with static positions ``old``)
    for a program with static positions ``new``: the same executable argument."""
    m = _POSITION.match(path)
    if m is None:
        return path
    pos = int(m.group(1))
    j = pos - sum(1 for s in old if s < pos)  # among the executable's positional arguments
    for s in sorted(new):
        if s <= j:
            j += 1
    return f"args[{j}]{path[m.end() :]}"


def relabelled(breakdown: dict[str, Any], static: list[int]) -> dict[str, Any]:
    """``breakdown`` with its argument paths as the program names them (signature.json,
    arguments.txt), whose static positions are ``static``: the executable numbers only the
    traced arguments (``args[0]`` of ``f(s, x)`` with ``s`` static is ``x``, ``args[1]``).
    ``static_positions`` records the positions its paths are mapped through."""
    old = list(breakdown.get("static_positions") or [])
    if old == static:
        return breakdown

    def move(p: Any) -> Any:
        return moved_path(p, old, static) if isinstance(p, str) else p

    out = {**breakdown, "static_positions": list(static)}
    out["top"] = [
        {**r, "path": move(r.get("path")), "subtree": move(r.get("subtree"))}
        if "parameter" in r
        else r
        for r in breakdown.get("top") or []
    ]
    for name in ("groups", "peak_groups"):
        groups = breakdown.get(name)
        if isinstance(groups, dict) and isinstance(groups.get("arguments"), dict):
            out[name] = {
                **groups,
                "arguments": {move(k): v for k, v in groups["arguments"].items()},
            }
    return out


def subtree(path: str) -> str:
    """The top-level subtree of an argument path: ``args[0]['params']`` of
    ``args[0]['params']['w']``, ``args[1]`` of ``args[1]``, ``kwargs['batch']``."""
    head, rest = ("args", path[4:]) if path.startswith("args") else ("kwargs", path[6:])
    keys = _KEY.findall(rest)
    depth = 2 if head == "args" else 1
    return head + "".join(keys[:depth])


# -- the breakdown ------------------------------------------------------------------------------


def _shape_of(module: Module | None, v: Value) -> tuple[str, str]:
    """(shape text, dtype) of a value: from the module (either source names it alike), else
    as the dump prints it, layout dropped."""
    ins = module.instrs.get(v.instruction) if module else None
    if ins is None and v.shape:
        text = re.sub(r"\{[^{}]*\}", "", v.shape).strip()
        m = ARRAY_SHAPE.match(text)
        return text, (m.group(1) if m else "")
    shape: Any = ins.shape if ins else ("", ())
    for i in v.index:
        shape = shape[i] if isinstance(shape, list) and i < len(shape) else ("", ())
    if isinstance(shape, list):
        return "(" + ", ".join(_fmt(s) for s in shape) + ")", "tuple"
    return _fmt(shape), shape[0]


def _fmt(shape: Any) -> str:
    if isinstance(shape, list):
        return "(" + ", ".join(_fmt(s) for s in shape) + ")"
    return f"{shape[0]}[{','.join(map(str, shape[1]))}]"


def _kind(x: _Live, end: int) -> str:
    kind = x.alloc.kind
    if kind == "output" and x.end < end:
        return "temporary"  # a loop counter sharing the output's allocation before it
    return kind


def _row(x: _Live, module: Module | None, paths: dict[int, str] | None, end: int) -> dict:
    shape, dtype = _shape_of(module, x.value)
    ins = module.instrs.get(x.value.instruction) if module else None
    row: dict[str, Any] = {
        "bytes": x.value.size,
        "shape": shape,
        "dtype": dtype,
        "instruction": x.value.instruction + (str(list(x.value.index)) if x.value.index else ""),
        "opcode": ins.opcode if ins else None,
        "op_name": (ins.op_name or None) if ins else None,
        "source": (ins.source or None) if ins else None,
        "kind": _kind(x, end),
        "allocation": x.alloc.index,
        "live": [x.start, x.end],
    }
    if x.alloc.parameter is not None:
        path = (paths or {}).get(x.alloc.parameter)
        row["parameter"] = x.alloc.parameter
        row["path"] = path
        row["subtree"] = subtree(path) if path else None
    return row


def _groups(rows: list[tuple[str, str | None, int]]) -> dict[str, Any]:
    """(kind, subtree, bytes) rows -> bytes by what they are."""
    out: dict[str, Any] = {"arguments": {}, "outputs": 0, "temporaries": 0, "constants": 0}
    out |= {"host": 0, "on_chip": {}}
    for kind, sub, size in rows:
        if kind == "argument":
            key = sub or "arguments"
            out["arguments"][key] = out["arguments"].get(key, 0) + size
        elif kind in ("output", "temporary", "constant", "host"):
            name = {"output": "outputs", "temporary": "temporaries", "constant": "constants"}
            out[name.get(kind, kind)] += size
        elif kind != "thread-local":
            out["on_chip"][kind] = out["on_chip"].get(kind, 0) + size
    out["arguments"] = dict(sorted(out["arguments"].items(), key=lambda kv: -kv[1]))
    return out


def breakdown(
    allocs: list[Allocation],
    module: Module | None,
    paths: dict[int, str] | None,
    peak_bytes: int | None,
    source: str,
    top: int,
) -> dict[str, Any]:
    """memory_breakdown.json's content from the allocations and the module's schedule."""
    whole = []
    for a in allocs:
        sub = None
        if a.parameter is not None and paths and a.parameter in paths:
            sub = subtree(paths[a.parameter])
        whole.append((a.kind, sub, a.size))
    out: dict[str, Any] = {
        "format": FORMAT,
        "source": source,
        "peak_bytes": peak_bytes,
        "groups": _groups(whole),
        "allocations": {
            "count": len(allocs),
            "bytes": dict(sorted(_sum_by(allocs).items())),
        },
    }
    if module is None:
        out |= {"live_peak_bytes": None, "top": [], "peak_groups": None}
        return out
    ranges = LiveRanges(module)
    lives = _live_values(allocs, ranges)
    t, live_bytes, at_peak = peak_set(lives, ranges.end)
    rows = [_row(x, module, paths, ranges.end) for x in at_peak]
    out |= {
        "live_peak_bytes": live_bytes,
        "peak_time": t,
        "schedule_length": ranges.end,
        "live_at_peak": len(rows),
        "top": rows[:top],
        "peak_groups": _groups([(r["kind"], r.get("subtree"), r["bytes"]) for r in rows]),
    }
    return out


def _sum_by(allocs: list[Allocation]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for a in allocs:
        out[a.kind] += a.size
    return dict(out)


def _peak_of(compiled: Any) -> tuple[int | None, bytes]:
    try:
        stats = compiled.memory_analysis()
    except Exception:
        return None, b""
    if stats is None:
        return None, b""
    peak = getattr(stats, "peak_memory_in_bytes", None)
    proto = getattr(stats, "serialized_buffer_assignment_proto", b"") or b""
    return (int(peak) if peak is not None else None), bytes(proto)


def from_proto(compiled: Any, hlo: str, top: int) -> dict[str, Any] | None:
    """The breakdown from the executable's serialized buffer assignment; None where jaxlib
    gives none (a deviceless TPU compile: see :func:`from_dump`)."""
    peak, proto = _peak_of(compiled)
    if not proto:
        return None
    module = module_of(compiled, hlo)
    allocs = allocations_from_proto(proto, module)
    return breakdown(allocs, module, argument_paths(compiled), peak, "buffer_assignment_proto", top)


def dump_options(folder: Path) -> dict[str, Any]:
    """Compile options that make XLA dump this compile's buffer assignment into ``folder``
    (and nothing per pass)."""
    return {"xla_dump_to": str(folder), "xla_dump_hlo_as_text": True}


def dump_file(folder: Path) -> Path | None:
    """The after-optimizations buffer assignment of the dump's (last) module."""
    found = sorted(Path(folder).glob("*after_optimizations-buffer-assignment.txt"))
    return found[-1] if found else None


def from_dump(folder: Path, hlo: str, compiled: Any, top: int) -> dict[str, Any] | None:
    """The breakdown from XLA's dump of the compile (see :func:`dump_options`); None without
    one."""
    path = dump_file(folder)
    if path is None:
        return None
    allocs = parse_buffer_assignment(path.read_text(errors="replace"))
    module = module_of(compiled, hlo)
    peak, _ = _peak_of(compiled)
    return breakdown(allocs, module, argument_paths(compiled), peak, "xla_dump", top)


# -- what the stage writes and reports ------------------------------------------------------------


def top_text(b: Mapping[str, Any], n: int = 3) -> str:
    """``f32[8,4096,4096] dot.3 (512.0 MiB), ...``: the largest buffers live at the peak."""
    parts = []
    for r in list(b.get("top") or [])[:n]:
        what = r.get("path") or r["instruction"]
        parts.append(f"{r['shape']} {what} ({human_bytes(r['bytes'])})")
    return ", ".join(parts)


def metrics(b: Mapping[str, Any]) -> dict[str, Any]:
    return {"peak_bytes": b.get("peak_bytes"), "peak_top": top_text(b) or None}


def write(ctx: StageContext, breakdown: dict[str, Any]) -> None:
    """memory_breakdown.json (a stored artifact) and its metrics, its argument paths as the
    program names them (:func:`relabelled`)."""
    breakdown = relabelled(breakdown, static_positions(ctx))
    ctx.write_json(ARTIFACT, breakdown)
    ctx.metrics.update(metrics(breakdown))


def read_metrics(ctx: StageContext, data: bytes) -> None:
    """The metrics of a stored memory_breakdown.json (a store hit, a resume); written again
    when this program's static positions differ from those of the run that stored it (one
    executable serves every program with its module and calling convention)."""
    stored = json.loads(data)
    breakdown = relabelled(stored, static_positions(ctx))
    if breakdown is not stored:
        ctx.write_json(ARTIFACT, breakdown)
    ctx.metrics.update(metrics(breakdown))


def summary(m: CompileMetrics) -> list[str]:
    """The summary line's part: ``peak 1.2 GiB: <top three>``."""
    if m.peak_bytes is None:
        return []
    top = m.peak_top
    if m.verdict.known:
        # Beside a topology's verdict, XLA's peak would read as HBM, and it is not: libtpu's
        # counts on-chip (VMEM) and host memory too. The verdict's figure is the HBM one.
        return [f"live at the peak: {top}"] if top else []
    return [f"peak {human_bytes(m.peak_bytes)}" + (f": {top}" if top else "")]


__all__ = [
    "ARTIFACT",
    "LiveRanges",
    "argument_paths",
    "breakdown",
    "dump_file",
    "dump_options",
    "from_dump",
    "from_proto",
    "metrics",
    "moved_path",
    "peak_set",
    "read_metrics",
    "relabelled",
    "static_positions",
    "subtree",
    "summary",
    "top_text",
    "write",
]
