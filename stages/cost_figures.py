"""XLA's cost analysis of a lowering or an executable, with while loops counted per trip
(:mod:`jaxaot.stages.loop_costs`): the figure the lower stage (pre-compile) and the compile
stage report, the same way."""

from __future__ import annotations

from typing import Any


def _raw_cost(obj: Any) -> dict[str, float] | None:
    try:
        cost = obj.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return {str(k): float(v) for k, v in cost.items()} if cost else None


def _client(compiled: Any) -> Any:
    """The client the executable was compiled by, where JAX says (None: a lowering, or a
    compile-only executable with no runtime one)."""
    try:
        return compiled.runtime_executable().local_devices()[0].client
    except Exception:
        return None


def costs_of(
    compiled: Any, hlo: str | None = None, raw: dict[str, float] | None = None
) -> tuple[dict[str, float] | None, dict[str, Any] | None]:
    """(XLA's cost analysis of ``compiled`` (a ``jax.stages.Compiled`` or ``Lowered``) with
    flops, transcendentals and bytes accessed counting while loops per trip and XLA's own
    figures beside as ``<key>_xla``, the loops counted: :mod:`jaxaot.stages.loop_costs`).
    ``hlo``: the (optimized, for an executable) HLO text, where the caller has it; ``raw``:
    XLA's cost analysis, where the caller has it (the lower stage's, from its HLO module)."""
    import jax
    from jaxaot.stages import loop_costs

    if raw is None:
        raw = _raw_cost(compiled)
    if raw is None:
        return None, None
    try:
        if hlo is None:
            lowering = isinstance(compiled, jax.stages.Lowered)
            hlo = compiled.as_text(dialect="hlo") if lowering else compiled.as_text()
        return loop_costs.loop_aware(raw, hlo or "", _client(compiled))
    except Exception as exc:  # XLA's figures, said to be so, rather than none
        one = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return raw, {"note": f"{loop_costs.NOTE}; loops not counted here: {one[:200]}"}


__all__ = ["costs_of"]
