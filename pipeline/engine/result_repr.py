"""The ``repr`` of a run's result: a few lines saying what ran, where, and its key figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxaot.rundir.metrics import (
    CompileMetrics,
    ExecuteMetrics,
    RunMetrics,
    StageMetrics,
    StageOutMetrics,
)
from jaxaot.util.humanize import human_bytes, human_count, human_seconds
from jaxaot.util.reprs import cut

if TYPE_CHECKING:
    from jaxaot.engine.runner import RunResult


def _figures(figures: StageMetrics | None) -> str:
    """The stage's key figures, as the summary names them."""
    shown = []
    if isinstance(figures, StageOutMetrics) and figures.argument_bytes is not None:
        shown.append(f"arguments {human_bytes(figures.argument_bytes)}")
    if isinstance(figures, CompileMetrics):
        if figures.flops is not None and figures.flops >= 0:  # -2: XLA does not know
            shown.append(human_count(figures.flops, "FLOP"))
        if figures.temp_bytes is not None:
            shown.append(f"temp {human_bytes(figures.temp_bytes)}")
    if isinstance(figures, ExecuteMetrics):
        if figures.median_s is not None:
            sd = figures.stddev_s
            spread = f" (sd {human_seconds(sd)})" if sd is not None else ""
            shown.append(f"median {human_seconds(figures.median_s)}{spread}")
        if figures.check is not None:
            shown.append(f"check {figures.check}")
    return ", ".join(shown)


def result_repr(result: RunResult) -> str:
    m = result.manifest
    program = (m.get("config") or {}).get("program") or {}
    name, target = program.get("name"), program.get("target")
    what = f"{name} ({target})" if name and target and name not in str(target) else target or name
    lines = [f"RunResult({m.get('status', '?')}: program {what}, run_dir {result.run_dir}"]
    if m.get("error"):
        lines.append(f"  error: {cut(str(m['error']), 200)}")
    run = RunMetrics.from_manifest(m)
    for stage, ran in run.runs.items():
        took = f"{ran.seconds:7.3f} s" if ran.seconds is not None else " " * 9
        figures = _figures(run.stage(stage))
        lines.append(f"  {stage:<10} {ran.status or '?':<8}{took}  {figures}".rstrip())
    if result.records:
        keys = "|".join(f'"{s}"' for s in result.records)
        lines.append(f"  records: result[{keys}]; everything: .manifest)")
    else:
        lines[-1] += ")"
    return "\n".join(lines)


__all__ = ["result_repr"]
