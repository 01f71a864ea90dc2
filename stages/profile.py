"""``execute.profile=true``: a ``jax.profiler`` trace of the timed calls, and per-op time from it.

The trace is written where XProf / TensorBoard's profile plugin look for one
(``execute/profile/plugins/profile/<session>/*.xplane.pb``), with a Perfetto trace beside it
(``perfetto_trace.json.gz``). :func:`op_times` reads the XSpace with ``jax.profiler.ProfileData``
(no viewer needed) and sums, per HLO instruction of this executable, the events the runtime
tagged with it (``hlo_op`` and ``hlo_module`` stats: XLA:CPU's thunks, a GPU's or TPU's "XLA
Ops"); device planes are preferred when they have such events, the host's otherwise.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROFILE_DIR = "profile"
TOP_OPS = 20  # ops listed in profile.json (all of them are counted in the totals)
_MODULE = re.compile(r"^HloModule ([^\s,]+)", re.M)


@contextlib.contextmanager
def trace(folder: Path) -> Iterator[Path]:
    """Trace what runs inside into ``folder`` (XProf layout + a Perfetto trace)."""
    import jax

    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        yield folder


def trace_files(folder: Path) -> dict[str, int]:
    """Every file of the trace, relative to ``folder``, with its size (for the manifest)."""
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _stats(event: Any) -> dict[str, Any]:
    return {name: value for name, value in event.stats}


def op_times(folder: Path, hlo_text: str, calls: int) -> dict[str, Any]:
    """Per-op time of this executable in the trace under ``folder``: ops sorted by self time
    (without the ops they enclose), each with its count, self and inclusive seconds and its
    share of the ops' self time."""
    import jax

    xplanes = sorted(folder.rglob("*.xplane.pb"))
    if not xplanes:
        raise FileNotFoundError(f"no *.xplane.pb under {folder}")
    module = m.group(1) if (m := _MODULE.search(hlo_text)) else None
    data = jax.profiler.ProfileData.from_file(str(xplanes[-1]))
    # plane -> op -> [(inclusive ns, self ns)]; a while or call op encloses its body's ops on the
    # same line, so "self" time (minus the enclosed ops) is what adds up to the calls' time.
    by_plane: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for plane in data.planes:
        for line in plane.lines:
            events = []
            for event in line.events:
                stats = _stats(event)
                op = stats.get("hlo_op")
                if op is None or (module is not None and stats.get("hlo_module") != module):
                    continue
                events.append((int(event.start_ns), int(event.end_ns), str(op)))
            if events:
                ops = by_plane.setdefault(plane.name, {})
                for op, inclusive, own in _self_times(events):
                    ops.setdefault(op, []).append((inclusive, own))
    device = {p: ops for p, ops in by_plane.items() if p.startswith("/device:")}
    chosen = device or by_plane
    merged: dict[str, list[tuple[int, int]]] = {}
    for ops in chosen.values():
        for op, times in ops.items():
            merged.setdefault(op, []).extend(times)
    total_ns = sum(own for times in merged.values() for _, own in times)
    rows = sorted(merged.items(), key=lambda kv: -sum(own for _, own in kv[1]))
    return {
        "module": module,
        "planes": sorted(chosen),
        "calls": calls,
        "op_seconds_per_call": total_ns / 1e9 / max(calls, 1),
        "ops": [
            {
                "op": op,
                "count": len(times),
                "self_s": sum(own for _, own in times) / 1e9,
                "total_s": sum(inc for inc, _ in times) / 1e9,
                "mean_self_s": sum(own for _, own in times) / len(times) / 1e9,
                "share": sum(own for _, own in times) / total_ns if total_ns else 0.0,
            }
            for op, times in rows[:TOP_OPS]
        ],
        "n_ops": len(rows),
    }


def _self_times(events: list[tuple[int, int, str]]) -> list[tuple[str, int, int]]:
    """(op, inclusive ns, self ns) of one line's events: self = inclusive minus the events
    directly inside it."""
    return [(name, inclusive, own) for name, inclusive, own, _ in _tree(events)]


def how_to_open(folder: Path) -> str:
    perfetto = next(iter(sorted(folder.rglob("perfetto_trace.json.gz"))), None)
    where = f"; Perfetto: open {perfetto} at ui.perfetto.dev" if perfetto else ""
    return f"xprof server --logdir {folder} (pip install 'jaxaot[profile]'){where}"


# -- compile.breakdown: where a compile's time goes -------------------------------------------
COMPILE_TRACE_DIR = "compile_trace"
TOP_EVENTS = 25
# XLA's compile threads (XLA:CPU's, the GPU and TPU compilers'); the Python thread only waits.
_COMPILER_LINE = re.compile(r"Compil|codegen|Codegen|xla", re.I)


def compile_breakdown(folder: Path) -> dict[str, Any]:
    """XLA's compile phases and passes from a trace of one compile: the outermost events of the
    compiler threads (``phases``, inclusive), and every event by self time (``hot``: passes,
    codegen steps), the top :data:`TOP_EVENTS`; seconds, summed over the compile's threads."""
    import jax

    xplanes = sorted(folder.rglob("*.xplane.pb"))
    if not xplanes:
        raise FileNotFoundError(f"no *.xplane.pb under {folder}")
    data = jax.profiler.ProfileData.from_file(str(xplanes[-1]))
    phases: dict[tuple[int, str], int] = {}
    hot: dict[str, int] = {}
    roots_ns = 0
    for plane in data.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            if line.name == "python" or not _COMPILER_LINE.search(line.name):
                continue
            events = [(int(e.start_ns), int(e.end_ns), str(e.name)) for e in line.events]
            for name, inclusive, own, depth in _tree(events):
                hot[name] = hot.get(name, 0) + own
                if depth <= 1:
                    phases[(depth, name)] = phases.get((depth, name), 0) + inclusive
                if depth == 0:
                    roots_ns += inclusive
    # Lists, not dicts: the order (most time first) is the point, and JSON files sort keys.
    return {
        "threads_s": roots_ns / 1e9,
        "phases": [
            {"name": name, "depth": depth, "s": ns / 1e9}
            for (depth, name), ns in sorted(phases.items(), key=lambda kv: (kv[0][0], -kv[1]))
        ],
        "hot": [
            {"name": name, "self_s": ns / 1e9}
            for name, ns in sorted(hot.items(), key=lambda kv: -kv[1])[:TOP_EVENTS]
        ],
    }


def _tree(events: list[tuple[int, int, str]]) -> list[tuple[str, int, int, int]]:
    """(name, inclusive ns, self ns, depth) of one line's nested events."""
    out = []
    stack: list[list[Any]] = []  # [end, name, inclusive, children ns, depth]
    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            done = stack.pop()
            out.append((done[1], done[2], max(done[2] - done[3], 0), done[4]))
        if stack:
            stack[-1][3] += end - start
        stack.append([end, name, end - start, 0, len(stack)])
    while stack:
        done = stack.pop()
        out.append((done[1], done[2], max(done[2] - done[3], 0), done[4]))
    return out


__all__ = [
    "COMPILE_TRACE_DIR",
    "PROFILE_DIR",
    "compile_breakdown",
    "how_to_open",
    "op_times",
    "trace",
    "trace_files",
]
