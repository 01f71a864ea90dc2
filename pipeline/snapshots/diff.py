"""``jaxaot-diff A B``: what changed between two runs or snapshots, stage by stage.

Each side is a run directory (``manifest.json``) or a snapshot folder (``snapshot.json``).
Text artifacts compare in canonical form (:mod:`jaxaot.util.canonical`), so paths, locations and
module names do not count. Binary artifacts (``exported.bin``, ``executable.bin``) are compared
by bytes and only reported: they carry source locations, so they differ between call sites
even for one program. Also shown: jax/jaxlib and config changes, compile cost and memory
deltas, what grew at the memory peak (compile/memory_breakdown.json of runs: the peak, each
group, the buffers live at the peak that are new or larger), outputs, and the execute time
ratio. Exit status, like diff(1): 0 when every canonical
artifact is the same, 1 when one differs, 2 when a side cannot be read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.errors import SnapshotError
from jaxaot.rundir.manifest import MANIFEST_NAME, load_manifest
from jaxaot.snapshots.snapshot import (
    INDEX_NAME,
    Snapshot,
    compare,
    diff_lines,
    from_run,
    load_snapshot,
)
from jaxaot.util.canonical import ARTIFACT_BY_PATH, CANONICAL_ARTIFACTS
from jaxaot.util.humanize import human_bytes, human_count, human_seconds, signed_bytes
from jaxaot.util.textdiff import bounded, line_counts

_BINARIES = ("lower/exported.bin", "compile/executable.bin")
_OUTPUTS = "execute/outputs.npz"
_COST_KEYS = (
    ("flops", "flops"),
    ("bytes accessed", "bytes accessed"),
    ("transcendentals", "transcendentals"),
)
_MEMORY_KEYS = (
    ("argument_size_in_bytes", "argument"),
    ("output_size_in_bytes", "output"),
    ("alias_size_in_bytes", "alias"),
    ("temp_size_in_bytes", "temp"),
    ("generated_code_size_in_bytes", "generated code"),
)


@dataclass(frozen=True)
class Side:
    """One side of a diff: its canonical snapshot, and for a run its binaries and timings."""

    path: Path
    kind: str  # "run" | "snapshot"
    snapshot: Snapshot
    binaries: dict[str, str]  # artifact path -> sha256 (runs only)
    median_s: float | None
    breakdown: dict[str, Any] | None = None  # compile.breakdown's (runs only)
    memory: dict[str, Any] | None = None  # compile/memory_breakdown.json (runs only)
    fit: dict[str, Any] | None = None  # the manifest's fit verdict (topology compiles only)

    def describe(self) -> str:
        v = self.snapshot.meta("versions.json")
        be = v.get("backend") or {}
        where = f", {be.get('platform')} x{be.get('device_count')}" if be else ""
        return (
            f"{self.path} ({self.kind}: {self.snapshot.program}, jax {v.get('jax')}, "
            f"jaxlib {v.get('jaxlib')}{where})"
        )


def load_side(path: Path) -> Side:
    """A run directory or a snapshot folder, read with every hash checked."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        manifest = load_manifest(path)
        arts = {
            p: a["sha256"]
            for s in manifest.get("stages", {}).values()
            for p, a in s.get("artifacts", {}).items()
        }
        timings = path / "execute" / "timings.json"
        median = json.loads(timings.read_text()).get("median_s") if timings.is_file() else None
        trace = manifest.get("stages", {}).get("compile", {}).get("compile_trace") or {}
        peak = path / "compile" / "memory_breakdown.json"
        memory = json.loads(peak.read_text()) if "compile/memory_breakdown.json" in arts else None
        return Side(
            path,
            "run",
            from_run(path, manifest),
            arts,
            median,
            trace.get("breakdown"),
            memory,
            manifest.get("fit"),
        )
    if (path / INDEX_NAME).is_file():
        return Side(path, "snapshot", load_snapshot(path), {}, None)
    raise SnapshotError(
        f"{path}: neither a run directory ({MANIFEST_NAME}) nor a snapshot ({INDEX_NAME})"
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def _deltas(
    a: dict[str, Any], b: dict[str, Any], keys: tuple[tuple[str, str], ...]
) -> list[dict[str, Any]]:
    return [
        {"key": name, "a": a.get(k), "b": b.get(k), "ratio": _ratio(a.get(k), b.get(k))}
        for k, name in keys
        if k in a or k in b
    ]


BREAKDOWN_ROWS = 10  # the compile-time changes jaxaot-diff lists, largest first


def _breakdown_deltas(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where two compiles' time differs (compile.breakdown): the compiler threads' total and the
    events whose self time changed most."""
    sa = {h["name"]: h["self_s"] for h in a.get("hot", [])}
    sb = {h["name"]: h["self_s"] for h in b.get("hot", [])}
    rows = [
        {
            "name": n,
            "a": sa.get(n),
            "b": sb.get(n),
            "delta": (sb.get(n) or 0.0) - (sa.get(n) or 0.0),
        }
        for n in {*sa, *sb}
    ]
    rows.sort(key=lambda r: (-abs(r["delta"]), r["name"]))
    ta, tb = a.get("threads_s"), b.get("threads_s")
    return {"threads_s": {"a": ta, "b": tb, "ratio": _ratio(ta, tb)}, "hot": rows[:BREAKDOWN_ROWS]}


PEAK_ROWS = 10  # the top buffers jaxaot-diff lists as new or larger


def _buffer_key(row: dict[str, Any]) -> str:
    """What names one buffer in two compiles: an argument's path, else its op name and shape
    (XLA numbers instructions afresh in every compile)."""
    if row.get("path"):
        return row["path"]
    return f"{row.get('op_name') or row.get('instruction')} {row.get('shape')}"


def _flat_groups(groups: dict[str, Any] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, value in (groups or {}).items():
        if isinstance(value, dict):
            prefix = "" if name == "arguments" else f"{name} "
            out |= {f"{prefix}{k}": int(v) for k, v in value.items()}
        else:
            out[name] = int(value)
    return out


def _peak_deltas(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What grew between two compiles' memory breakdowns: the peak, each group (arguments by
    subtree, outputs, temporaries, ...), and the buffers live at B's peak that are new or
    larger than at A's."""
    figures = [
        {"key": k, "a": a.get(k), "b": b.get(k), "ratio": _ratio(a.get(k), b.get(k))}
        for k in ("peak_bytes", "live_peak_bytes")
    ]
    ga, gb = _flat_groups(a.get("groups")), _flat_groups(b.get("groups"))
    groups: list[dict[str, Any]] = [
        {"key": k, "a": ga.get(k, 0), "b": gb.get(k, 0), "delta": gb.get(k, 0) - ga.get(k, 0)}
        for k in sorted(set(ga) | set(gb))
        if ga.get(k, 0) != gb.get(k, 0)
    ]
    groups.sort(key=lambda g: -g["delta"])
    before = {_buffer_key(r): int(r["bytes"]) for r in a.get("top") or []}
    grew = []
    for row in b.get("top") or []:
        key, size = _buffer_key(row), int(row["bytes"])
        if key not in before or size > before[key]:
            grew.append({"buffer": key, "a": before.get(key), "b": size, "kind": row.get("kind")})
    return {"figures": figures, "groups": groups, "grew": grew[:PEAK_ROWS]}


def _peak_lines(p: dict[str, Any]) -> list[str]:
    out = []
    for d in p["figures"]:
        label = "memory: XLA peak" if d["key"] == "peak_bytes" else "memory: live at the peak"
        out.append(
            f"  {label:<26} {human_bytes(d['a'])} -> {human_bytes(d['b'])}{_ratio_text(d['ratio'])}"
        )
    for g in p["groups"]:
        sign = "+" if g["delta"] >= 0 else "-"
        out.append(
            f"    {g['key'][:40]:<40} {human_bytes(g['a'])} -> {human_bytes(g['b'])}"
            f" ({sign}{human_bytes(abs(g['delta']))})"
        )
    if p["grew"]:
        out.append("  live at the peak, new or larger in B:")
        for r in p["grew"]:
            was = "new" if r["a"] is None else f"was {human_bytes(r['a'])}"
            out.append(f"    {r['buffer'][:60]:<60} {human_bytes(r['b'])} ({was}, {r['kind']})")
    return out


def _outputs(a: Side, b: Side) -> str | None:
    """same / differs (max abs diff) / shapes differ, when both runs saved outputs."""
    if _OUTPUTS not in a.binaries or _OUTPUTS not in b.binaries:
        return None
    if a.binaries[_OUTPUTS] == b.binaries[_OUTPUTS]:
        return "same"
    import numpy as np

    with np.load(a.path / _OUTPUTS) as za, np.load(b.path / _OUTPUTS) as zb:
        if sorted(za.files) != sorted(zb.files):
            return "differs (different outputs)"
        worst = 0.0
        for key in za.files:
            x, y = za[key], zb[key]
            if x.shape != y.shape or x.dtype != y.dtype:
                return f"differs ({key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)})"
            if x.size:
                worst = max(
                    worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                )
    return f"differs (max abs diff {worst:.3g})"


def _verdict(fit: dict[str, Any] | None) -> str:
    if not fit:
        return "no verdict"
    where = str(fit.get("topology"))
    if fit.get("fits"):
        return f"fits ({where})"
    return "does not fit in host memory" if fit.get("hbm_fits") else f"does not fit ({where})"


def _fit_delta(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    """The two runs' fit verdicts (compile.topology) and their HBM headroom, side by side."""
    a, b = a or {}, b or {}
    return {
        "a": _verdict(a),
        "b": _verdict(b),
        "changed": _verdict(a) != _verdict(b),
        "headroom_bytes": {"a": a.get("headroom_bytes"), "b": b.get("headroom_bytes")},
    }


def diff_report(a: Side, b: Side) -> dict[str, Any]:
    """Everything ``jaxaot-diff`` prints, as JSON-ready data."""
    cmp = compare(a.snapshot, b.snapshot)
    stages: dict[str, dict[str, Any]] = {}
    for art in CANONICAL_ARTIFACTS:
        if art.path not in a.snapshot.files and art.path not in b.snapshot.files:
            continue
        diff = diff_lines(a.snapshot, b.snapshot, art.path, ("A", "B"))
        added, removed = line_counts(diff)
        state = (
            "same"
            if art.path not in cmp.differing
            else (
                "only in A"
                if art.path in cmp.only_golden
                else "only in B"
                if art.path in cmp.only_actual
                else "differs"
            )
        )
        stages.setdefault(art.stage, {"artifacts": {}})["artifacts"][art.path] = {
            "status": state,
            "added": added,
            "removed": removed,
        }
    for path in _BINARIES:  # only runs have them
        if a.kind == b.kind == "run" and (path in a.binaries or path in b.binaries):
            if path not in a.binaries or path not in b.binaries:
                state = "only in A" if path in a.binaries else "only in B"
            else:
                state = "same bytes" if a.binaries[path] == b.binaries[path] else "bytes differ"
            entry = stages.setdefault(path.split("/")[0], {"artifacts": {}})
            entry.setdefault("binaries", {})[path] = state
    if "compile" in stages:
        stages["compile"]["cost"] = _deltas(
            a.snapshot.meta("compile/cost_analysis.json"),
            b.snapshot.meta("compile/cost_analysis.json"),
            _COST_KEYS,
        )
        stages["compile"]["memory"] = _deltas(
            a.snapshot.meta("compile/memory_analysis.json"),
            b.snapshot.meta("compile/memory_analysis.json"),
            _MEMORY_KEYS,
        )
    hlo = "compile/optimized.hlo.txt"
    a_hlo, b_hlo = a.snapshot.files.get(hlo), b.snapshot.files.get(hlo)
    if a_hlo and b_hlo and a_hlo != b_hlo:  # as structure first, then as text lines
        from jaxaot.snapshots.hlo_structure import compare as compare_hlo

        stages.setdefault("compile", {"artifacts": {}})["hlo_structure"] = compare_hlo(a_hlo, b_hlo)
    if a.memory and b.memory:
        stages.setdefault("compile", {"artifacts": {}})["peak"] = _peak_deltas(a.memory, b.memory)
    if a.breakdown and b.breakdown:
        stages.setdefault("compile", {"artifacts": {}})["breakdown"] = _breakdown_deltas(
            a.breakdown, b.breakdown
        )
    if a.fit or b.fit:
        stages.setdefault("compile", {"artifacts": {}})["fit"] = _fit_delta(a.fit, b.fit)
    outputs = _outputs(a, b)
    if outputs is not None or a.median_s is not None or b.median_s is not None:
        stages["execute"] = {
            "artifacts": {},
            "outputs": outputs,
            "median_s": {"a": a.median_s, "b": b.median_s, "ratio": _ratio(a.median_s, b.median_s)},
        }
    return {
        "a": str(a.path),
        "b": str(b.path),
        "versions": list(cmp.versions),
        "config": list(cmp.config),
        "stages": {s: stages[s] for s in STAGES if s in stages},
        "first_difference": cmp.first.path if cmp.first else None,
        "differs": bool(cmp.differing),
    }


def _fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    return human_count(value) if key in ("flops", "transcendentals") else human_bytes(value)


def _ratio_text(ratio: float | None) -> str:
    return f"  (x{ratio:.2f})" if ratio is not None and ratio != 1 else ""


def _structure_lines(s: dict[str, Any]) -> list[str]:
    """The optimized HLO compared as structure (jaxaot.snapshots.hlo_structure)."""
    parsers = sorted(set(s["parsers"].values()))
    out = [f"  optimized HLO structure ({' and '.join(parsers)} parser)"]
    n = s["instructions"]
    out.append(f"    {'instructions':<24} {n['a']} -> {n['b']}")
    for kind, c in s["fusion_kinds"].items():
        out.append(f"    {'fusions ' + kind:<24} {c['a']} -> {c['b']}")
    ops = [f"{op} {c['a']} -> {c['b']}" for op, c in s["opcodes"].items()]
    if ops:
        more = f" (+{len(ops) - 8} more)" if len(ops) > 8 else ""
        out.append(f"    {'ops added/removed':<24} {', '.join(ops[:8])}{more}")
    for kind, c in s["collectives"].items():
        out.append(
            f"    {kind:<24} {c['a_count']} ({human_bytes(c['a_bytes'])}) -> "
            f"{c['b_count']} ({human_bytes(c['b_bytes'])})"
        )
    fb = s["fusion_bytes"]
    top = ", ".join(f"{t['name']} {human_bytes(t['bytes'])}" for t in fb["top_b"][:3])
    out.append(
        f"    {'fusion bytes touched':<24} {human_bytes(fb['a'])} -> {human_bytes(fb['b'])}"
        + (f"; largest in B: {top}" if top else "")
    )
    lc = s["layout_changes"]
    if lc["count"]:
        shown = ", ".join(f"{e['name']} {e['a']} -> {e['b']}" for e in lc["examples"][:3])
        out.append(f"    {'layout changes':<24} {lc['count']}: {shown}")
    return out


def render(report: dict[str, Any], a: Side, b: Side, *, lines: int, full: bool) -> str:
    out = [f"A: {a.describe()}", f"B: {b.describe()}"]
    out.append("versions: " + ("same" if not report["versions"] else "; ".join(report["versions"])))
    if report["config"]:
        out.append(f"config: {len(report['config'])} key(s) differ")
        out += [f"  {c}" for c in report["config"]]
    else:
        out.append("config: same")
    for stage, info in report["stages"].items():
        out.append(stage)
        for path, art in info["artifacts"].items():
            counts = f" (+{art['added']} -{art['removed']})" if art["status"] == "differs" else ""
            out.append(f"  {path.split('/', 1)[1]:<26} {art['status']}{counts}")
        for path, state in info.get("binaries", {}).items():
            why = (
                " (reported only: binaries embed source locations)"
                if state == "bytes differ"
                else ""
            )
            out.append(f"  {path.split('/', 1)[1]:<26} {state}{why}")
        for group in ("cost", "memory"):
            for d in info.get(group, []):
                label = f"{group}: {d['key']}"
                out.append(
                    f"  {label:<26} {_fmt(d['key'], d['a'])} -> {_fmt(d['key'], d['b'])}"
                    f"{_ratio_text(d['ratio'])}"
                )
        if info.get("fit"):
            f = info["fit"]
            room = f["headroom_bytes"]
            headroom = (
                f"; headroom {signed_bytes(room['a'])} -> {signed_bytes(room['b'])}"
                if room["a"] is not None or room["b"] is not None
                else ""
            )
            changed = "verdict changed: " if f["changed"] else "verdict: "
            body = f"{f['a']} -> {f['b']}" if f["changed"] else f["a"]
            out.append(f"  {changed}{body}{headroom}")
        if info.get("peak"):
            out += _peak_lines(info["peak"])
        if info.get("hlo_structure"):
            out += _structure_lines(info["hlo_structure"])
        if info.get("breakdown"):
            t = info["breakdown"]["threads_s"]
            out.append(
                f"  {'compile threads':<26} {human_seconds(t['a'])} -> {human_seconds(t['b'])}"
                f"{_ratio_text(t['ratio'])}"
            )
            for r in info["breakdown"]["hot"]:
                sign = "+" if r["delta"] >= 0 else "-"
                out.append(
                    f"    {r['name'][:40]:<40} {human_seconds(r['a'])} -> {human_seconds(r['b'])}"
                    f" ({sign}{human_seconds(abs(r['delta']))})"
                )
        if stage == "execute":
            if info.get("outputs"):
                out.append(f"  {'outputs.npz':<26} {info['outputs']}")
            t = info["median_s"]
            ratio = f"  (B/A = {t['ratio']:.2f}x)" if t["ratio"] is not None else ""
            out.append(
                f"  {'median time':<26} {human_seconds(t['a'])} -> {human_seconds(t['b'])}{ratio}"
            )
    first = report["first_difference"]
    if first is None:
        out.append("no difference in the canonical artifacts")
        return "\n".join(out)
    out.append(f"first difference: {ARTIFACT_BY_PATH[first].where}")
    paths = (
        [
            p
            for s in report["stages"].values()
            for p, art in s["artifacts"].items()
            if art["status"] != "same"
        ]
        if full
        else [first]
    )
    for path in paths:
        diff = diff_lines(a.snapshot, b.snapshot, path, ("A", "B"))
        text = "\n".join(diff) if full else bounded(diff, lines)
        if text:
            out.append(text)
    return "\n".join(out)


__all__ = ["Side", "diff_report", "load_side", "render"]
