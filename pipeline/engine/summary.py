"""The one-screen summary printed at the end of a run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxaot.config.argspec import short_name
from jaxaot.rundir.metrics import OutputFigure, RunMetrics
from jaxaot.stages import NODE_BY_NAME
from jaxaot.util.humanize import human_seconds


def _details(stage: str, metrics: dict[str, Any]) -> str:
    """The node's own summary line from its metrics; empty for a stage that failed before it
    had any (or one this jaxaot does not know: a manifest from another version)."""
    node = NODE_BY_NAME.get(stage)
    return node.show.line(metrics) if node is not None and metrics else ""


def _value_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def output_lines(outputs: Sequence[OutputFigure]) -> list[str]:
    """``output['y']  f32[8,256]`` per output, with ``= 10`` when its values are small."""
    rows = [
        (
            f"output{o.path}",
            f"{short_name(o.dtype)}[{','.join(str(d) for d in o.shape)}]",
            f" = {_value_text(o.value)}" if o.has_value else "",
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
    if manifest.get("resumed_from"):  # resume_from (a folder, or latest): the checkpoint used
        lines.append(f"resumed from: {manifest['resumed_from']}")
    lines.append(f"{'stage':<{widths[0]}}  {'status':<{widths[1]}}  {'time':>{widths[2]}}  details")
    lines += [
        f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows
    ]
    lines += output_lines(RunMetrics.from_manifest(manifest).execute.outputs)
    for r in manifest[
        "stages"
    ].values():  # what a stage left beside its artifacts, and how to open it
        if isinstance(r.get("profile"), dict) and r["profile"].get("open"):
            lines.append(f"profile: {r['profile']['open']}")
    for w in manifest.get("warnings", []):
        lines.append(f"warning: {w}")
    if show_error and manifest.get("error"):
        label = "verdict" if manifest.get("status") == "does_not_fit" else "error"
        lines.append(f"{label}: {manifest['error']}")
    return "\n".join(lines)


__all__ = ["output_lines", "render"]
