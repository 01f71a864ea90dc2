"""The one-screen summary printed at the end of a run."""

from __future__ import annotations

from typing import Any

from jaxaot.config.argspec import short_name
from jaxaot.util.humanize import NOT_AVAILABLE, human_bytes, human_count, human_seconds, measured


def _topology_details(m: dict[str, Any]) -> list[str]:
    """``compile.topology``'s fit verdict, collectives and roofline estimate (issue 15)."""
    if m.get("fits") is None:
        return []
    need, have = m.get("hbm_bytes_needed"), m.get("hbm_bytes_available")
    parts = [
        f"{'fits' if m['fits'] else 'DOES NOT FIT'}: {human_bytes(need)} of "
        f"{human_bytes(have)} HBM per device ({m.get('topology')})"
    ]
    if m.get("collectives") is not None:
        parts.append(f"{m['collectives']} collectives ({human_bytes(m.get('collective_bytes'))})")
    if m.get("est_step_s") is not None:
        parts.append(
            f"est. step >= {human_seconds(m['est_step_s'])} ({m.get('est_bound')}-bound "
            "roofline estimate)"
        )
    return parts


def _details(stage: str, m: dict[str, Any]) -> str:
    """One line per stage from its metrics; empty for a stage that failed before it had any."""
    if not m:
        return ""
    if stage == "stage_out":
        text = f"{m.get('inputs', 0)} in, {m.get('outputs', 0)} out, {m.get('static', 0)} static; {m.get('eqns', 0)} eqns"
        return text + (f"; {m['replicas']} replicas" if m.get("replicas") else "")
    if stage == "lower":
        parts = [f"platforms {','.join(m.get('platforms', []))}"]
        if m.get("mesh"):
            parts.append(f"mesh {m['mesh']} ({m.get('devices')} devices)")
        if m.get("flops") is not None:
            parts.append(f"{human_count(m['flops'], 'FLOP')} (pre-compile)")
        return "; ".join(parts)
    if stage == "compile":
        parts = []
        if m.get("flops") is not None:
            parts.append(human_count(m["flops"], "FLOP"))
        if m.get("bytes_accessed") is not None:
            accessed = m["bytes_accessed"]
            parts.append(
                f"{human_bytes(accessed)} accessed" if accessed >= 0 else "bytes accessed n/a"
            )
        if m.get("temp_bytes") is not None:
            parts.append(
                f"mem arg {human_bytes(m.get('argument_bytes'))} out {human_bytes(m.get('output_bytes'))}"
                f" temp {human_bytes(m.get('temp_bytes'))} code {human_bytes(m.get('code_bytes'))}"
            )
        parts += _topology_details(m)
        if m.get("mesh"):
            parts.append(
                f"mesh {m['mesh']}: sharded in {m.get('sharded_inputs')}/{m.get('inputs')}, "
                f"out {m.get('sharded_outputs')}/{m.get('outputs')} (compile/shardings.json)"
            )
        return "; ".join(parts)
    if stage == "execute":
        parts = []
        if m.get("median_s") is not None:
            parts.append(
                f"median {human_seconds(m['median_s'])} (sd {human_seconds(m.get('stddev_s'))})"
            )
        if m.get("flops_per_s"):
            parts.append(human_count(m["flops_per_s"], "FLOP/s"))
        if m.get("check") == "ok":
            # Which tolerance passed: "max rel err 1.4" alone reads as a failure when the
            # absolute bound is what held (an error next to a zero).
            passed = m.get("check_passed_by") or f"max rel err {m.get('max_rel_err', 0):.2g}"
            parts.append(f"check ok ({passed})")  # manifests before issue 14: the rel err
        elif m.get("check"):
            parts.append(
                f"check {m['check']} (max abs err {m.get('max_abs_err', 0):.2g}, "
                f"max rel err {m.get('max_rel_err', 0):.2g})"
            )
        return "; ".join(parts)
    return ""


def _value_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def output_lines(outputs: list[dict[str, Any]]) -> list[str]:
    """``output['y']  f32[8,256]`` per output, with ``= 10`` when its values are small."""
    rows = [
        (
            f"output{o.get('path') or ''}",
            f"{short_name(str(o.get('dtype')))}[{','.join(str(d) for d in o.get('shape', []))}]",
            f" = {_value_text(o['value'])}" if "value" in o else "",
        )
        for o in outputs
    ]
    width = max((len(r[0]) for r in rows), default=0)
    return [f"{a:<{width}}  {b}{c}" for a, b, c in rows]


def render(manifest: dict[str, Any], *, show_error: bool = True) -> str:
    """The summary table. ``show_error=False`` leaves out the run's error line, for callers that
    print the error themselves (the CLI's one stderr line): an error is printed once."""
    cfg, be = manifest["config"], manifest.get("backend") or {}
    prog = cfg["program"]
    head = f"jaxaot · {prog['name']} ({prog['target']})"
    if be:
        head += f" · {be.get('platform')} x{be.get('device_count')} ({be.get('device_kind')})"
        if be.get("topology"):  # compile.topology: libtpu's compile-only devices
            head += f" · topology {be['topology']}, compile only"
    rows = [
        (
            s,
            r["status"],
            "-" if r["status"] == "skipped" else human_seconds(r.get("seconds")),
            _details(s, r.get("metrics", {})) or r.get("note", ""),
        )
        for s, r in manifest["stages"].items()
    ]
    widths = [
        max(len(str(r[i])) for r in [("stage", "status", "time", ""), *rows]) for i in range(3)
    ]
    lines = [head, f"run dir: {manifest['run_dir']}"]
    lines.append(f"{'stage':<{widths[0]}}  {'status':<{widths[1]}}  {'time':>{widths[2]}}  details")
    lines += [
        f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows
    ]
    outputs = manifest["stages"].get("execute", {}).get("metrics", {}).get("outputs")
    lines += output_lines(outputs or [])
    for w in manifest.get("warnings", []):
        lines.append(f"warning: {w}")
    if show_error and manifest.get("error"):
        label = "verdict" if manifest.get("status") == "does_not_fit" else "error"
        lines.append(f"{label}: {manifest['error']}")
    return "\n".join(lines)


__all__ = [
    "NOT_AVAILABLE",
    "human_bytes",
    "human_count",
    "human_seconds",
    "measured",
    "output_lines",
    "render",
]
