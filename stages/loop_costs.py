"""Costs that count loops: XLA's cost analysis with each while loop's body counted per trip.

XLA's ``HloCostAnalysis`` (jaxlib 0.10.2, every backend) counts a ``while`` as one run of its
body and condition: a ``lax.scan`` over 32 layers reports the FLOPs of one layer. Here the
optimized HLO is read for its while loops and their trip counts: XLA's own annotation
(``backend_config={"known_trip_count":{"n":"8"}}``, which the CPU and GPU pipelines add), or
else the induction variable (a tuple element initialised to a constant, stepped by a constant
in the body and compared with a constant in the condition, as ``lax.scan`` and a ``fori_loop``
with static bounds lower; TPU's optimized HLO carries no annotation). A loop whose trip count
is neither (a ``while_loop`` on data) stays counted once and is listed as of unknown trip count.

The body and condition are costed by XLA itself: each becomes the entry of a module of its own
(its text and the computations it calls, parsed by ``hlo_module_from_text``), analysed by
``hlo_module_cost_analysis`` with the platform's client; a compile-only client (a TPU or GPU
topology) has no cost analysis of its own, and the host CPU client's (XLA's generic
``HloCostAnalysis``) costs the body there. The loop-aware figure is XLA's total plus, for each
loop, ``n x body + (n + 1) x condition`` less the one run XLA counted, nested loops multiplied
(a conditional's branches as XLA takes them: the most costly, per figure). Only ``flops``,
``transcendentals`` and ``bytes accessed`` are corrected; XLA's figures stay beside them as
``flops_xla``, ``transcendentals_xla`` and ``bytes accessed_xla``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.stages.loop_trips import callee_of, trip_count
from jaxaot.util.canonical import canonical_hlo
from jaxaot.util.hlo_parse import COLLECTIVES, Computation, Instruction, array_bytes, parse_hlo

if TYPE_CHECKING:
    from jaxaot.rundir.metrics import CompileMetrics

KEYS = ("flops", "transcendentals", "bytes accessed")
NOTE = "XLA counts loop bodies once"
# Every way a computation names another (for the module built around a loop body).
_CALLS = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|select|scatter|"
    r"comparator)=%?([\w.-]+)"
)
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


@dataclass
class Loop:
    """One ``while`` of the optimized HLO and how many times its body runs."""

    name: str
    computation: str  # the computation holding the while
    body: str
    condition: str
    trip_count: int | None  # None: unknown, counted once
    source: str  # "known_trip_count" | "induction variable" | "unknown trip count"
    runs: int = 1  # body runs per call of the program (enclosing loops multiplied)
    body_cost: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "while": self.name,
            "in": self.computation,
            "body": self.body,
            "condition": self.condition,
            "trip_count": self.trip_count,
            "source": self.source,
            "body_runs": self.runs,
            **{f"body_{k.replace(' ', '_')}": v for k, v in self.body_cost.items()},
        }


# --- the module's computations -------------------------------------------------------------


def _blocks(text: str) -> tuple[list[str], dict[str, list[str]], str | None]:
    """(computation names in file order, each one's lines, the entry's name)."""
    order: list[str] = []
    blocks: dict[str, list[str]] = {}
    entry = None
    cur: list[str] | None = None
    for line in text.splitlines():
        if cur is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                if line.startswith("HloModule"):
                    continue
                head = line[6:] if line.startswith("ENTRY ") else line
                name = head.split(None, 1)[0].lstrip("%")
                if line.startswith("ENTRY "):
                    entry = name
                cur = [head]
                order.append(name)
                blocks[name] = cur
            continue
        cur.append(line)
        if line.strip() == "}":
            cur = None
    return order, blocks, entry


def _callees(lines: list[str]) -> set[str]:
    out: set[str] = set()
    for line in lines[1:]:
        out.update(m.group(1) for m in _CALLS.finditer(line))
        for m in _CALL_LISTS.finditer(line):
            out.update(p.strip().lstrip("%") for p in m.group(1).split(",") if p.strip())
    return out


class _Module:
    """The optimized HLO as computations, with XLA's cost of any of them as an entry."""

    def __init__(self, text: str, analyse: Any) -> None:
        text = canonical_hlo(text)
        self.comps: dict[str, Computation] = parse_hlo(text)
        self.order, self.blocks, self.entry = _blocks(text)
        self.edges = {n: _callees(lines) & set(self.blocks) for n, lines in self.blocks.items()}
        self._analyse = analyse
        self._xla: dict[str, dict[str, float] | None] = {}
        self._has_while: dict[str, bool] = {}

    def has_while(self, name: str) -> bool:
        """Whether ``name`` or anything it calls holds a while loop."""
        if name not in self._has_while:
            self._has_while[name] = False  # a cycle (none in valid HLO) ends here
            comp = self.comps.get(name)
            own = comp is not None and any(i.opcode == "while" for i in comp.instructions)
            self._has_while[name] = own or any(self.has_while(c) for c in self.edges[name])
        return self._has_while[name]

    def reachable(self, name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n not in seen and n in self.blocks:
                seen.add(n)
                todo += self.edges[n]
        return seen

    def xla(self, name: str) -> dict[str, float] | None:
        """XLA's cost of computation ``name`` run once (loops in it counted once), or None
        where XLA could not parse or cost it."""
        if name not in self._xla:
            keep = self.reachable(name)
            parts = ["HloModule loop_costs"]
            for n in self.order:
                if n in keep:
                    lines = self.blocks[n]
                    head = ("ENTRY " if n == name else "") + lines[0]
                    parts.append("\n".join([head, *lines[1:]]))
            self._xla[name] = self._analyse("\n\n".join(parts))
        return self._xla[name]


# --- the loop-aware totals -----------------------------------------------------------------


def _add(a: dict[str, float], b: dict[str, float], scale: float = 1.0) -> dict[str, float]:
    return {k: a.get(k, 0.0) + scale * b.get(k, 0.0) for k in KEYS}


class _Counter:
    def __init__(self, mod: _Module) -> None:
        self.mod = mod
        self.loops: dict[tuple[str, str], Loop] = {}
        self.failed: list[str] = []

    def loop(self, comp: Computation, ins: Instruction) -> Loop:
        key = (comp.name, ins.name)
        if key not in self.loops:
            n, source = trip_count(self.mod.comps, comp, ins)
            self.loops[key] = Loop(
                ins.name, comp.name, callee_of(ins, "body"), callee_of(ins, "condition"), n, source
            )
        return self.loops[key]

    def true(self, name: str) -> dict[str, float] | None:
        """XLA's cost of ``name`` with its loops counted per trip (None: XLA could not)."""
        base = self.mod.xla(name)
        if base is None:
            self.failed.append(name)
            return None
        return _add(base, self.delta(name))

    def delta(self, name: str) -> dict[str, float]:
        """What counting loops adds to XLA's cost of computation ``name``."""
        out = {k: 0.0 for k in KEYS}
        comp = self.mod.comps.get(name)
        if comp is None or not self.mod.has_while(name):
            return out
        for ins in comp.instructions:
            if ins.opcode == "while":
                out = _add(out, self._while(comp, ins))
            elif ins.opcode == "conditional":
                branches = [c for _, c in ins.callees if c in self.mod.blocks]
                if any(self.mod.has_while(b) for b in branches):
                    xs = [self.mod.xla(b) for b in branches]
                    ts = [self.true(b) for b in branches]
                    if all(x is not None for x in xs) and all(t is not None for t in ts):
                        for k in KEYS:
                            out[k] += max(t[k] for t in ts) - max(x.get(k, 0.0) for x in xs)  # type: ignore[index,union-attr]
            else:
                for role, callee in ins.callees:
                    # XLA costs a call (to_apply=) and a fusion or async op (calls=) as one
                    # run of the callee; a reducer's to_apply runs per element (no loops there).
                    called = role == "calls" or (role == "to_apply" and ins.opcode == "call")
                    if called and callee in self.mod.blocks:
                        out = _add(out, self.delta(callee))
        return out

    def _while(self, comp: Computation, ins: Instruction) -> dict[str, float]:
        loop = self.loop(comp, ins)
        if loop.trip_count is None and not (
            self.mod.has_while(loop.body) or self.mod.has_while(loop.condition)
        ):
            return {k: 0.0 for k in KEYS}
        parts = [(self.mod.xla(n), self.true(n)) for n in (loop.body, loop.condition)]
        if any(x is None or t is None for x, t in parts):
            if loop.trip_count is not None:
                loop.source += ", body cost not available: counted once"
                loop.trip_count = None
            return {k: 0.0 for k in KEYS}
        (bx, bt), (cx, ct) = parts
        loop.body_cost = {k: float(bx.get(k, 0.0)) for k in KEYS}  # type: ignore[union-attr]
        n = loop.trip_count if loop.trip_count is not None else 1
        cn = n + 1 if loop.trip_count is not None else 1
        out = _add(_add({k: 0.0 for k in KEYS}, bt, n), ct, cn)  # type: ignore[arg-type]
        return _add(_add(out, bx, -1.0), cx, -1.0)  # type: ignore[arg-type]


def runs(mod: _Module, counter: _Counter) -> dict[str, int]:
    """How many times each computation runs per call of the program: trip counts multiplied
    down the call graph (a loop of unknown trip count: once; a condition: trips + 1)."""
    post: list[str] = []
    seen: set[str] = set()

    def visit(n: str) -> None:
        stack = [(n, iter(sorted(mod.edges[n])))]
        seen.add(n)
        while stack:
            cur, it = stack[-1]
            nxt = next((c for c in it if c not in seen), None)
            if nxt is None:
                post.append(cur)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(mod.edges[nxt]))))

    if mod.entry is None:
        return {}
    visit(mod.entry)
    times = dict.fromkeys(post, 0)
    times[mod.entry] = 1
    for name in reversed(post):  # callers before callees
        comp = mod.comps.get(name)
        if comp is None or not times[name]:
            continue
        for ins in comp.instructions:
            if ins.opcode == "while":
                loop = counter.loop(comp, ins)
                n = loop.trip_count if loop.trip_count is not None else 1
                if loop.body in times:
                    times[loop.body] += times[name] * n
                if loop.condition in times:
                    times[loop.condition] += times[name] * (
                        n + 1 if loop.trip_count is not None else 1
                    )
            else:
                for _, callee in ins.callees:
                    if callee in times:
                        times[callee] += times[name]
    return times


def loop_collectives(hlo_text: str, times: dict[str, int] | None = None) -> dict[str, Any]:
    """:func:`jaxaot.util.hlo_parse.collectives` with each counted as often as its
    computation runs (a collective in a 32-layer scan's body: 32 times)."""
    if times is None and " while(" not in hlo_text:
        times = {}
    if times is None:
        mod = _Module(hlo_text, lambda _text: None)
        times = runs(mod, _Counter(mod))
        comps = mod.comps
    else:
        comps = parse_hlo(hlo_text)
    found: dict[str, dict[str, float]] = {n: {"count": 0, "bytes": 0.0} for n in COLLECTIVES}
    for comp in comps.values():
        k = times.get(comp.name, 1)
        for ins in comp.instructions:
            op = ins.opcode.removesuffix("-start")
            if op not in found or ins.opcode.endswith("-done"):
                continue
            sizes = array_bytes(ins.shape)
            found[op]["count"] += k
            found[op]["bytes"] += k * (
                (max(sizes) if ins.opcode.endswith("-start") else sum(sizes)) if sizes else 0.0
            )
    return found


# A loop of 4 known trips around 1024 adds: XLA's analysis counting it once says ~1 K FLOPs;
# one that already counted loops would say ~4 K, and nothing must be added to its figures.
_PROBE = """HloModule probe

body {
  p = (s32[], f32[1024]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  one = s32[] constant(1)
  next = s32[] add(i, one)
  x = f32[1024]{0} get-tuple-element(p), index=1
  y = f32[1024]{0} add(x, x)
  ROOT t = (s32[], f32[1024]{0}) tuple(next, y)
}

cond {
  q = (s32[], f32[1024]{0}) parameter(0)
  j = s32[] get-tuple-element(q), index=0
  four = s32[] constant(4)
  ROOT lt = pred[] compare(j, four), direction=LT
}

ENTRY main {
  a = f32[1024]{0} parameter(0)
  zero = s32[] constant(0)
  init = (s32[], f32[1024]{0}) tuple(zero, a)
  w = (s32[], f32[1024]{0}) while(init), condition=cond, body=body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT out = f32[1024]{0} get-tuple-element(w), index=1
}
"""


def analyser(client: Any = None) -> Any:
    """A function from HLO module text to XLA's cost analysis of it (None where XLA refuses),
    by ``client`` (the executable's), or by the host CPU client (XLA's generic analysis) where
    that one has none (a compile-only topology client); ``analyse.label()`` says which."""
    import jax

    clients: list[tuple[Any, str]] = []
    if client is not None:
        clients.append((client, str(getattr(client, "platform", "the executable's client"))))
    cpu = jax.devices("cpu")[0].client
    if client is not cpu:
        clients.append((cpu, "cpu (XLA's generic HloCostAnalysis)"))
    chosen: list[tuple[Any, str]] = []

    def analyse(text: str) -> dict[str, float] | None:
        try:
            module = compat_jax.hlo_module_from_text(text)
        except Exception:
            return None
        for each, label in chosen or clients:
            try:
                cost = compat_jax.hlo_module_cost_analysis(each, module)
            except Exception:
                continue
            if not chosen:
                chosen.append((each, label))
            return {str(k): float(v) for k, v in cost.items()}
        return None

    def counts_loops() -> bool:
        """Whether the chosen client's analysis already counts a loop per trip."""
        probe = analyse(_PROBE)
        return probe is not None and probe.get("flops", 0.0) > 2 * 1026

    analyse.label = lambda: chosen[0][1] if chosen else None  # type: ignore[attr-defined]
    analyse.counts_loops = counts_loops  # type: ignore[attr-defined]
    return analyse


def loop_aware(
    raw: dict[str, float], hlo_text: str, client: Any = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """(``raw``, XLA's cost analysis of the module ``hlo_text``, with flops, transcendentals
    and bytes accessed counting loops and XLA's figures kept as ``<key>_xla``; a description
    of the loops and collectives counted that way)."""
    if " while(" not in hlo_text:  # no loop: XLA's figures are the program's (no parse)
        cost = {**raw, **{f"{k}_xla": raw[k] for k in KEYS if k in raw}}
        return {**cost, "loops": 0.0, "loops_unknown_trip_count": 0.0}, {"loops": []}
    analyse = analyser(client)
    mod = _Module(hlo_text, analyse)
    counter = _Counter(mod)
    cost = dict(raw)
    for k in KEYS:
        if k in raw:
            cost[f"{k}_xla"] = raw[k]
    delta = counter.delta(mod.entry) if mod.entry else {k: 0.0 for k in KEYS}
    counts_itself = analyse.counts_loops()
    if counts_itself:  # this XLA's figures are the program's already: add nothing
        delta = {k: 0.0 for k in KEYS}
    for k in KEYS:
        # XLA's negative sentinels (-2: unknown) stay as they are: no figure to add to.
        if k in raw and raw[k] >= 0:
            cost[k] = raw[k] + delta[k]
    times = runs(mod, counter)
    for comp in mod.comps.values():  # loops on no path from the entry still get listed
        for ins in comp.instructions:
            if ins.opcode == "while":
                counter.loop(comp, ins)
    loops = list(counter.loops.values())
    for loop in loops:
        loop.runs = times.get(loop.body, 0)
    cost["loops"] = float(len(loops))
    cost["loops_unknown_trip_count"] = float(sum(lp.trip_count is None for lp in loops))
    info = {
        "note": f"{NOTE}: flops, transcendentals and bytes accessed count each while loop's "
        "body once per trip (nested loops multiplied); the *_xla figures are XLA's own",
        "body_costs_from": analyse.label() if loops else None,
        "loops": [lp.to_json() for lp in loops],
    }
    if counts_itself:
        info["note"] = "this XLA's cost analysis counts loop bodies per trip itself"
    if counter.failed:  # computations XLA could not cost alone: their loops counted once
        info["not_costed"] = sorted(set(counter.failed))
    collectives = loop_collectives(hlo_text, times) if loops else {}
    if any(c["count"] for c in collectives.values()):
        info["collectives"] = collectives
    return cost, info


def loops_summary(m: CompileMetrics) -> list[str]:
    """The summary line's words on loops: XLA's figure where counting loops changed it, and
    the loops whose trip count is unknown (counted once)."""
    from jaxaot.util.humanize import human_count

    parts = []
    xla, flops = m.flops_xla, m.flops
    if m.loops and xla is not None and flops is not None and 0 <= xla != flops:
        parts.append(
            f"{m.loops} loop(s) counted per trip (XLA, loop bodies once: "
            f"{human_count(xla, 'FLOP')})"
        )
    if m.loops_unknown_trip_count:
        parts.append(
            f"{m.loops_unknown_trip_count} loop(s) of unknown trip count counted once "
            "(compile/loops.json)"
        )
    return parts


__all__ = [
    "KEYS",
    "NOTE",
    "Loop",
    "analyser",
    "loop_aware",
    "loop_collectives",
    "loops_summary",
]
