"""The ``repr`` of a run's result: a few lines saying what ran, where, and its key figures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxaot.util.humanize import human_bytes, human_count, human_seconds
from jaxaot.util.reprs import cut

if TYPE_CHECKING:
    from jaxaot.engine.runner import RunResult


def _figures(stage: str, metrics: dict[str, Any]) -> str:
    """The stage's key figures, as the summary names them."""
    shown = []
    if stage == "stage_out" and metrics.get("argument_bytes") is not None:
        shown.append(f"arguments {human_bytes(metrics['argument_bytes'])}")
    if stage == "compile":
        if isinstance(metrics.get("flops"), int | float) and metrics["flops"] >= 0:
            shown.append(human_count(metrics["flops"], "FLOP"))
        if metrics.get("temp_bytes") is not None:
            shown.append(f"temp {human_bytes(metrics['temp_bytes'])}")
    if stage == "execute" and metrics.get("median_s") is not None:
        sd = metrics.get("stddev_s")
        spread = f" (sd {human_seconds(sd)})" if sd is not None else ""
        shown.append(f"median {human_seconds(metrics['median_s'])}{spread}")
    if metrics.get("check") is not None:
        shown.append(f"check {metrics['check']}")
    return ", ".join(shown)


def result_repr(result: RunResult) -> str:
    m = result.manifest
    program = (m.get("config") or {}).get("program") or {}
    name, target = program.get("name"), program.get("target")
    what = f"{name} ({target})" if name and target and name not in str(target) else target or name
    lines = [f"RunResult({m.get('status', '?')}: program {what}, run_dir {result.run_dir}"]
    if m.get("error"):
        lines.append(f"  error: {cut(str(m['error']), 200)}")
    for stage, rec in (m.get("stages") or {}).items():
        seconds = rec.get("seconds")
        took = f"{seconds:7.3f} s" if isinstance(seconds, int | float) else " " * 9
        figures = _figures(stage, rec.get("metrics") or {})
        lines.append(f"  {stage:<10} {rec.get('status', '?'):<8}{took}  {figures}".rstrip())
    if result.records:
        keys = "|".join(f'"{s}"' for s in result.records)
        lines.append(f"  records: result[{keys}]; everything: .manifest)")
    else:
        lines[-1] += ")"
    return "\n".join(lines)


__all__ = ["result_repr"]
