"""XLA's buffer assignment and the optimized module it belongs to, read without XLA: the
allocations and the values assigned to each, from ``compiled.memory_analysis()``'s serialized
``BufferAssignmentProto`` (decoded by hand, :mod:`jaxaot.util.protowire`; field numbers from
``xla/service/hlo.proto`` as jaxlib 0.10.2 writes it) or from XLA's dump
(``*-buffer-assignment.txt``); and the module's instructions, metadata and schedule, from its
``HloModuleProto`` or its text. :mod:`jaxaot.stages.memory_breakdown` builds on both."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxaot.util import protowire as pw

HOST_COLOR = 5  # XLA's host memory space (S(5)): pinned_host buffers
_ON_CHIP = {1: "vmem", 2: "smem", 6: "sflag"}  # TPU memory spaces, as libtpu's report names them

# xla_data.proto PrimitiveType numbers -> the names HLO text prints (1..25 in order, then the
# newer types by number); an unknown number prints as "type<N>".
_PRIMITIVE_TYPES = (
    "pred s8 s16 s32 s64 u8 u16 u32 u64 f16 f32 f64 tuple opaque c64 bf16 token c128 f8e5m2 "
    "f8e4m3fn s4 u4 f8e4m3b11fnuz f8e5m2fnuz f8e4m3fnuz"
)
_DTYPES = dict(enumerate(_PRIMITIVE_TYPES.split(" "), start=1))
_DTYPES |= {26: "s2", 27: "u2", 28: "f8e4m3", 29: "f8e3m4", 32: "f4e2m1fn", 33: "f8e8m0fnu"}
# -- the module: instructions, schedule, metadata --------------------------------------------


@dataclass
class Instr:
    name: str
    opcode: str
    comp: str
    shape: Any  # (dtype, dims) or a list of shapes (a tuple)
    operands: list[str]
    callees: list[str]
    root: bool
    tuple_index: int = 0
    op_name: str = ""
    source: str = ""


@dataclass
class Module:
    instrs: dict[str, Instr]
    sequences: dict[str, list[str]]  # computation -> instruction names in schedule order
    entry: str
    by_id: dict[int, str] = field(default_factory=dict)


def _shape_proto(msg: dict[int, list[Any]]) -> Any:
    dtype = _DTYPES.get(pw.first_int(msg, 2), f"type{pw.first_int(msg, 2)}")
    if dtype == "tuple":
        return [_shape_proto(s) for s in pw.messages(msg, 4)]
    return (dtype, tuple(pw.ints(msg, 3)))


def _frames(module: dict[int, list[Any]]) -> Callable[[int], str]:
    """stack frame id -> "file:line" of its innermost location ("" for none), from the
    module's stack frame index (HloModuleProto field 17). A frame is decoded when first asked
    for: the index also holds every caller's frame (a run's whole Python stack, thousands of
    entries), which no instruction names."""
    index = pw.messages(module, 17)
    if not index:
        return lambda frame_id: ""
    idx = index[0]
    files, locations, frames = idx.get(1, []), idx.get(3, []), idx.get(4, [])
    found: dict[int, str] = {}

    def source(frame_id: int) -> str:
        if frame_id in found:
            return found[frame_id]
        out = ""
        if 1 <= frame_id <= len(frames) and not isinstance(frames[frame_id - 1], int):
            loc_id = pw.first_int(pw.message(bytes(frames[frame_id - 1])), 1)
            if 1 <= loc_id <= len(locations) and not isinstance(locations[loc_id - 1], int):
                loc = pw.message(bytes(locations[loc_id - 1]))
                fid = pw.first_int(loc, 1)
                if 1 <= fid <= len(files) and not isinstance(files[fid - 1], int):
                    name = bytes(files[fid - 1]).decode("utf-8", "replace")
                    out = f"{name}:{pw.first_int(loc, 3)}"
        found[frame_id] = out
        return out

    return source


def module_from_proto(data: bytes) -> Module:
    """The instructions and schedule of a serialized ``HloModuleProto``."""
    module = pw.message(data)
    frames = _frames(module)
    entry_id = pw.first_int(module, 6)
    comp_names: dict[int, str] = {}
    raw: list[tuple[str, dict[int, list[Any]], int]] = []
    entry = pw.text(module, 2)
    for comp in pw.messages(module, 3):
        cname, cid = pw.text(comp, 1), pw.first_int(comp, 5)
        comp_names[cid] = cname
        root = pw.first_int(comp, 6)
        for ins in pw.messages(comp, 2):
            raw.append((cname, ins, root))
        if cid == entry_id:
            entry = cname
    by_id = {pw.first_int(ins, 35): pw.text(ins, 1) for _, ins, _ in raw}
    instrs = {}
    for cname, ins, root in raw:
        meta = (pw.messages(ins, 7) or [{}])[0]
        source = frames(pw.first_int(meta, 15))
        if not source and pw.text(meta, 3):
            source = f"{pw.text(meta, 3)}:{pw.first_int(meta, 4)}"
        shape = pw.messages(ins, 3)
        name = pw.text(ins, 1)
        instrs[name] = Instr(
            name=name,
            opcode=pw.text(ins, 2),
            comp=cname,
            shape=_shape_proto(shape[0]) if shape else ("", ()),
            operands=[by_id[i] for i in pw.ints(ins, 36) if i in by_id],
            callees=[comp_names.get(i, "") for i in pw.ints(ins, 38)],
            root=pw.first_int(ins, 35) == root,
            tuple_index=pw.first_int(ins, 13),
            op_name=pw.text(meta, 2),
            source=source,
        )
    sequences = {}
    for sched in pw.messages(module, 7):
        for entry_msg in pw.messages(sched, 1):  # map<int64, InstructionSequence>
            cid = pw.first_int(entry_msg, 1)
            seq = pw.messages(entry_msg, 2)
            ids = pw.ints(seq[0], 1) if seq else []
            sequences[comp_names.get(cid, str(cid))] = [by_id[i] for i in ids if i in by_id]
    if not sequences:  # not scheduled: the order instructions are stored in
        for cname, ins, _ in raw:
            sequences.setdefault(cname, []).append(pw.text(ins, 1))
    return Module(instrs=instrs, sequences=sequences, entry=entry, by_id=by_id)


ARRAY_SHAPE = re.compile(r"([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_META_OP = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_META_FRAME = re.compile(r"stack_frame_id=(\d+)")
_META_FILE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")


def _shape_text(text: str) -> Any:
    from jaxaot.util.hlo_parse import _split_top

    text = text.strip()
    if text.startswith("("):
        inner = text[1 : text.rfind(")")]
        return [_shape_text(re.sub(r"/\*index=\d+\*/", "", p)) for p in _split_top(inner)]
    m = ARRAY_SHAPE.match(text)
    if not m:
        return (text, ())
    return (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))


def _text_frames(hlo: str) -> dict[int, str]:
    """stack frame id -> "file:line" from the debug tables newer XLA prints in HLO text."""
    tables: dict[str, dict[int, str]] = defaultdict(dict)
    current = ""
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
            continue
        m = _TABLE_ROW.match(line)
        if current and m:
            tables[current][int(m.group(1))] = m.group(2)
        elif not line.strip():
            current = ""
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    out = {}
    for k, row in tables["StackFrames"].items():
        loc = re.search(r"file_location_id=(\d+)", row)
        where = tables["FileLocations"].get(int(loc.group(1))) if loc else None
        fid = re.search(r"file_name_id=(\d+)", where or "")
        ln = re.search(r"\bline=(\d+)", where or "")
        if fid and ln:
            out[k] = f"{files.get(int(fid.group(1)), '?')}:{ln.group(1)}"
    return out


def module_from_text(hlo: str) -> Module:
    """The same from optimized HLO text (scheduled modules print in schedule order)."""
    from jaxaot.util.hlo_parse import parse_hlo

    frames = _text_frames(hlo)
    meta: dict[str, tuple[str, str]] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=", line)
        if not m or "metadata={" not in line:
            continue
        md = line[line.index("metadata={") :]
        op = _META_OP.search(md)
        frame = _META_FRAME.search(md)
        file = _META_FILE.search(md)
        source = frames.get(int(frame.group(1)), "") if frame else ""
        if not source and file:
            source = f"{file.group(1)}:{file.group(2)}"
        meta[m.group(1)] = (op.group(1).replace('\\"', '"') if op else "", source)
    instrs, sequences, entry = {}, {}, ""
    for cname, comp in parse_hlo(hlo).items():
        entry = cname if comp.entry else entry
        sequences[cname] = [i.name for i in comp.instructions]
        for i in comp.instructions:
            op_name, source = meta.get(i.name, ("", ""))
            index = i.attr("index")
            instrs[i.name] = Instr(
                name=i.name,
                opcode=i.opcode,
                comp=cname,
                shape=_shape_text(i.shape),
                operands=list(i.operands),
                callees=[c for _, c in i.callees],
                root=i.root,
                tuple_index=int(index) if index and index.isdigit() else 0,
                op_name=op_name,
                source=source,
            )
    return Module(instrs=instrs, sequences=sequences, entry=entry)


def module_of(compiled: Any, hlo: str) -> Module | None:
    try:
        data = compiled.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
        return module_from_proto(bytes(data))
    except Exception:  # no runtime executable here, or a jaxlib without hlo_modules()
        return module_from_text(hlo) if hlo else None


# -- allocations: from the proto or from the dump -----------------------------------------------


@dataclass
class Value:
    """A buffer XLA assigned: defined at ``instruction`` (output ``index``), ``size`` bytes at
    ``offset`` in its allocation."""

    instruction: str
    index: tuple[int, ...]
    size: int
    offset: int
    shape: str = ""  # as the dump prints it, when the dump is the source


@dataclass
class Allocation:
    index: int
    size: int
    color: int = 0
    parameter: int | None = None
    parameter_index: tuple[int, ...] = ()
    live_out: bool = False
    thread_local: bool = False
    constant: bool = False
    values: list[Value] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if self.color == HOST_COLOR:
            return "host"
        if self.color != 0:
            return _ON_CHIP.get(self.color, f"color {self.color}")
        if self.parameter is not None:
            return "argument"
        if self.constant:
            return "constant"
        if self.live_out:
            return "output"
        if self.thread_local:
            return "thread-local"
        return "temporary"


def allocations_from_proto(data: bytes, module: Module | None) -> list[Allocation]:
    """``BufferAssignmentProto`` bytes: logical_buffers (1: id 1, size 2, defined_at 3 {
    instruction_id 4, shape_index 3}, color 4) and buffer_allocations (3: index 1, size 2,
    is_thread_local 3, is_entry_computation_parameter 5, parameter_number 6, maybe_live_out 7,
    color 8, assigned 9 {logical_buffer_id 1, offset 2, size 3}, parameter_shape_index 10,
    is_constant 12)."""
    proto = pw.message(data)
    names = module.by_id if module is not None else {}
    buffers: dict[int, tuple[str, tuple[int, ...]]] = {}
    for lb in pw.messages(proto, 1):
        at = (pw.messages(lb, 3) or [{}])[0]
        iid = pw.first_int(at, 4)
        name = names.get(iid) or pw.text(at, 2) or f"instruction#{iid}"
        buffers[pw.first_int(lb, 1)] = (name, tuple(pw.ints(at, 3)))
    out = []
    for a in pw.messages(proto, 3):
        alloc = Allocation(
            index=pw.first_int(a, 1),
            size=pw.first_int(a, 2),
            color=pw.first_int(a, 8),
            parameter=pw.first_int(a, 6) if pw.first_int(a, 5) else None,
            parameter_index=tuple(pw.ints(a, 10)),
            live_out=bool(pw.first_int(a, 7)),
            thread_local=bool(pw.first_int(a, 3)),
            constant=bool(pw.first_int(a, 12)),
        )
        for assigned in pw.messages(a, 9):
            name, index = buffers.get(pw.first_int(assigned, 1), ("?", ()))
            alloc.values.append(
                Value(name, index, pw.first_int(assigned, 3), pw.first_int(assigned, 2))
            )
        out.append(alloc)
    return out


_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*):\s*$")
_VALUE = re.compile(
    r"^\s*value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
    r"\(size=(\d+),offset=(\d+)\): (.*)$"
)


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """XLA's ``*-buffer-assignment.txt``: the allocations and the values in each."""
    out: list[Allocation] = []
    for line in text.splitlines():
        m = _ALLOC.match(line)
        if m:
            attrs = m.group(3)
            param = re.search(r"\bparameter (\d+)", attrs)
            pindex = re.search(r"at ShapeIndex \{([\d,]*)\}", attrs)
            color = re.search(r"\bcolor (\d+)", attrs)
            out.append(
                Allocation(
                    index=int(m.group(1)),
                    size=int(m.group(2)),
                    color=int(color.group(1)) if color else 0,
                    parameter=int(param.group(1)) if param else None,
                    parameter_index=tuple(
                        int(i) for i in (pindex.group(1) if pindex else "").split(",") if i
                    ),
                    live_out="maybe-live-out" in attrs,
                    thread_local="thread-local" in attrs,
                    constant=", constant" in attrs,
                )
            )
            continue
        v = _VALUE.match(line)
        if v and out:
            index = tuple(int(i) for i in (v.group(2) or "{}")[1:-1].split(",") if i)
            out[-1].values.append(
                Value(v.group(1), index, int(v.group(3)), int(v.group(4)), v.group(5).strip())
            )
        elif line.startswith(("BufferAssignment stats", "Total bytes used")):
            break
    return out


__all__ = [
    "ARRAY_SHAPE",
    "HOST_COLOR",
    "Allocation",
    "Instr",
    "Module",
    "Value",
    "allocations_from_proto",
    "module_from_proto",
    "module_from_text",
    "module_of",
    "parse_buffer_assignment",
]
