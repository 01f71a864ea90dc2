"""Costs that count loops: a scan's body counted once per trip, checked against unrolled copies.

XLA's cost analysis (jaxlib 0.10.2) counts a while loop's body once; :mod:`jaxaot.stages.
loop_costs` multiplies it by the trip count. Each figure here is compared with the same
program written with a Python loop (no while in its HLO), which XLA counts in full.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import loop_programs as lp
import pytest
from conftest import FAST_CPU_CODEGEN, cli_env, run_cli
from jaxaot.rundir.metrics import CompileMetrics
from jaxaot.stages import loop_costs, loop_trips
from jaxaot.stages.executable import costs_of

TESTS = Path(__file__).parent
F32 = jnp.float32


def _costs(fn: Any, *args: Any, strip_annotation: bool = False) -> tuple[dict, dict]:
    compiled = jax.jit(fn).lower(*args).compile(FAST_CPU_CODEGEN)
    hlo = compiled.as_text()
    if strip_annotation:  # as TPU's optimized HLO comes: no known_trip_count
        hlo = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", hlo)
        assert "known_trip_count" not in hlo
    cost, info = costs_of(compiled, hlo)
    assert cost is not None and info is not None
    return cost, info


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _deep_args(layers: int = 32) -> tuple[Any, ...]:
    return (
        jax.ShapeDtypeStruct((layers, 64, 64), F32),
        jax.ShapeDtypeStruct((layers, 64), F32),
        jax.ShapeDtypeStruct((16, 64), F32),
    )


def test_a_32_layer_scan_costs_what_its_unrolled_copy_costs() -> None:
    scanned, info = _costs(lp.deep_scan, *_deep_args())
    unrolled, none = _costs(lp.deep_unrolled, *_deep_args())
    assert none["loops"] == [] and unrolled["flops"] == unrolled["flops_xla"]
    # XLA alone: one layer of 32 (a 32x undercount of the matmuls).
    assert scanned["flops_xla"] < unrolled["flops"] / 20
    assert _close(scanned["flops"], unrolled["flops"], 0.01)
    assert _close(scanned["transcendentals"], unrolled["transcendentals"], 0.01)
    assert _close(scanned["bytes accessed"], unrolled["bytes accessed"], 0.05)
    [loop] = info["loops"]
    assert (loop["trip_count"], loop["source"], loop["body_runs"]) == (32, "known_trip_count", 32)
    assert scanned["loops"] == 1 and scanned["loops_unknown_trip_count"] == 0


def test_the_shipped_transformer_costs_what_its_unrolled_copy_costs() -> None:
    from jaxaot.examples import transformer

    L = 2
    s = jax.ShapeDtypeStruct
    params = {
        "embed": s((256, 128), F32),
        "layers": {
            "ln1": s((L, 128), F32),
            "wq": s((L, 128, 4, 32), F32),
            "wk": s((L, 128, 4, 32), F32),
            "wv": s((L, 128, 4, 32), F32),
            "wo": s((L, 4, 32, 128), F32),
            "ln2": s((L, 128), F32),
            "w1": s((L, 128, 512), F32),
            "w2": s((L, 512, 128), F32),
        },
        "ln_f": s((128,), F32),
        "unembed": s((128, 256), F32),
    }
    tokens = s((4, 64), jnp.int32)
    scanned, _ = _costs(transformer.forward, params, tokens)
    unrolled, _ = _costs(lp.transformer_unrolled, params, tokens)
    assert scanned["flops_xla"] < 0.6 * unrolled["flops"]  # one of two layers
    assert _close(scanned["flops"], unrolled["flops"], 0.01)
    assert _close(scanned["bytes accessed"], unrolled["bytes accessed"], 0.05)


def test_nested_scans_multiply() -> None:
    args = (jax.ShapeDtypeStruct((8, 64, 64), F32), jax.ShapeDtypeStruct((16, 64), F32))
    nested, info = _costs(lp.nested_scan, *args)
    unrolled, _ = _costs(lp.nested_unrolled, *args)
    assert _close(nested["flops"], unrolled["flops"], 0.01)
    assert nested["flops_xla"] < unrolled["flops"] / 20  # 1 of 24 matmuls
    runs = sorted((lp_["trip_count"], lp_["body_runs"]) for lp_ in info["loops"])
    assert runs == [(3, 24), (8, 8)]


def test_a_fori_loop_with_static_bounds_counts_its_trips() -> None:
    args = (jax.ShapeDtypeStruct((8, 64, 64), F32), jax.ShapeDtypeStruct((16, 64), F32))
    looped, info = _costs(lp.fori, *args)
    unrolled, _ = _costs(lp.fori_unrolled, *args)
    assert [x["trip_count"] for x in info["loops"]] == [5]
    assert _close(looped["flops"], unrolled["flops"], 0.01)


@pytest.mark.parametrize(
    ("fn", "args", "trips"),
    [
        (lp.deep_scan, _deep_args(32), [32]),
        (lp.nested_scan, _deep_args(8)[::2], [3, 8]),
        (lp.fori, _deep_args(8)[::2], [5]),
    ],
)
def test_without_xla_s_annotation_the_induction_variable_gives_the_trip_count(
    fn: Any, args: tuple[Any, ...], trips: list[int]
) -> None:
    annotated, _ = _costs(fn, *args)
    derived, info = _costs(fn, *args, strip_annotation=True)
    assert sorted(x["trip_count"] for x in info["loops"]) == trips
    assert {x["source"] for x in info["loops"]} == {"induction variable"}
    assert derived["flops"] == annotated["flops"]


def test_a_reverse_scan_and_the_lowered_module_count_their_trips() -> None:
    """A scan run backwards counts down; the lowered (unoptimized) HLO has no annotation."""

    def rev(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w, reverse=True)[0]

    args = (jax.ShapeDtypeStruct((6, 64, 64), F32), jax.ShapeDtypeStruct((16, 64), F32))
    _, info = _costs(rev, *args, strip_annotation=True)
    assert [x["trip_count"] for x in info["loops"]] == [6]
    lowered_cost, lowered_info = costs_of(jax.jit(lp.nested_scan).lower(*args))
    assert sorted(x["trip_count"] for x in lowered_info["loops"]) == [3, 6]  # type: ignore[index]
    assert lowered_cost["flops"] > 15 * lowered_cost["flops_xla"]  # type: ignore[index]


def test_a_data_dependent_while_loop_stays_counted_once_and_says_so() -> None:
    args = (jax.ShapeDtypeStruct((2, 64, 64), F32), jax.ShapeDtypeStruct((16, 64), F32))
    cost, info = _costs(lp.until_small, *args)
    [loop] = info["loops"]
    assert loop["trip_count"] is None and loop["source"] == "unknown trip count"
    assert cost["flops"] == cost["flops_xla"] and cost["loops_unknown_trip_count"] == 1
    words = loop_costs.loops_summary(
        CompileMetrics.from_metrics(
            {
                "flops": cost["flops"],
                "flops_xla": cost["flops_xla"],
                "loops": 1,
                "loops_unknown_trip_count": 1,
            }
        )
    )
    assert words == ["1 loop(s) of unknown trip count counted once (compile/loops.json)"]


@pytest.mark.parametrize(
    ("start", "step", "bound", "direction", "trips"),
    [
        (0, 1, 8, "LT", 8),
        (0, 3, 8, "LT", 3),
        (1, 1, 5, "LE", 5),
        (7, -1, 0, "GE", 8),
        (7, -2, 0, "GT", 4),
        (0, 2, 8, "NE", 4),
        (0, 3, 8, "NE", None),  # never equal: not a count
        (5, 1, 2, "LT", 0),
        (0, -1, 8, "LT", None),  # runs forever
    ],
)
def test_trip_counts_of_counted_loops(
    start: int, step: int, bound: int, direction: str, trips: int | None
) -> None:
    assert loop_trips._trips(start, step, bound, direction) == trips


_COLLECTIVE_LOOP = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %r = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %r)
}

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.0: f32[8]) -> f32[8] {
  %x.0 = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x.0)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %g = f32[8]{0} all-gather(%x.0), dimensions={0}, replica_groups={}
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_a_collective_in_a_loop_body_counts_once_per_trip() -> None:
    found = loop_costs.loop_collectives(_COLLECTIVE_LOOP)
    assert found["all-reduce"] == {"count": 12, "bytes": 12 * 32.0}
    assert found["all-gather"] == {"count": 1, "bytes": 32.0}


def test_a_run_reports_loop_aware_costs_and_keeps_xla_s(compose_run: Any) -> None:
    """Through the API: program=transformer against the unrolled copy on the same args."""
    scanned = compose_run("program=transformer")
    unrolled = compose_run(
        "program=transformer", "program.target=loop_programs:transformer_unrolled"
    )
    cost = json.loads((scanned.run_dir / "compile" / "cost_analysis.json").read_text())
    full = json.loads((unrolled.run_dir / "compile" / "cost_analysis.json").read_text())
    assert _close(cost["flops"], full["flops"], 0.01)
    assert cost["flops_xla"] < 0.6 * full["flops"]
    assert scanned["compile"].cost["flops"] == cost["flops"]
    loops = json.loads((scanned.run_dir / "compile" / "loops.json").read_text())
    assert [x["trip_count"] for x in loops["loops"]] == [2]
    assert loops["note"].startswith(loop_costs.NOTE)
    m = scanned.manifest["stages"]
    assert m["compile"]["metrics"]["flops"] == cost["flops"]
    assert m["compile"]["metrics"]["flops_xla"] == cost["flops_xla"]
    ex = m["execute"]["metrics"]  # FLOP/s from the loop-aware count
    assert ex["flops_per_s"] == pytest.approx(cost["flops"] / ex["median_s"], rel=1e-6)


def test_the_lower_stage_s_pre_compile_figure_counts_loops_too(compose_run: Any) -> None:
    scanned = compose_run("program=transformer", "stop_after=lower")
    unrolled = compose_run(
        "program=transformer",
        "program.target=loop_programs:transformer_unrolled",
        "stop_after=lower",
    )
    cost = json.loads((scanned.run_dir / "lower" / "cost_analysis.json").read_text())
    full = json.loads((unrolled.run_dir / "lower" / "cost_analysis.json").read_text())
    assert _close(cost["flops"], full["flops"], 0.01)
    assert cost["flops_xla"] < 0.6 * full["flops"]
    assert scanned.manifest["stages"]["lower"]["metrics"]["flops"] == cost["flops"]


def test_the_cli_summary_shows_the_loop_aware_figure(tmp_path: Path) -> None:
    from jaxaot.util.humanize import human_count

    env = cli_env(PYTHONPATH=f"{TESTS}:{cli_env()['PYTHONPATH']}")
    rd = tmp_path / "run"
    proc = run_cli(
        [
            "program.target=loop_programs:deep_scan",
            "program.args=[f32[32,64,64],f32[32,64],f32[16,64]]",
            "stop_after=compile",
            f"hydra.run.dir={rd}",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cost = json.loads((rd / "compile" / "cost_analysis.json").read_text())
    assert cost["flops"] > 20 * cost["flops_xla"]
    [row] = [line for line in proc.stdout.splitlines() if line.startswith("compile ")]
    assert human_count(cost["flops"], "FLOP") in row
    assert (
        f"1 loop(s) counted per trip (XLA, loop bodies once: {human_count(cost['flops_xla'], 'FLOP')})"
        in row
    )


def test_a_tpu_topology_estimate_counts_the_transformer_s_layers(compose_run: Any) -> None:
    """TPU's optimized HLO has no trip-count annotation and its compile-only client no cost
    analysis: the induction variable and XLA's generic analysis of the body stand in."""
    scanned = compose_run("program=transformer", "compile.topology=v5e:2x2")
    unrolled = compose_run(
        "program=transformer",
        "program.target=loop_programs:transformer_unrolled",
        "compile.topology=v5e:2x2",
    )
    a, b = scanned["compile"].cost, unrolled["compile"].cost
    assert _close(a["flops"], b["flops"], 0.02) and a["flops_xla"] < 0.6 * b["flops"]
    loops = json.loads((scanned.run_dir / "compile" / "loops.json").read_text())
    assert [(x["trip_count"], x["source"]) for x in loops["loops"]] == [(2, "induction variable")]
    roof = json.loads((scanned.run_dir / "compile" / "compiled.json").read_text())["roofline"]
    assert roof["flops"] == a["flops"] and roof["flops_xla"] == a["flops_xla"]


def test_xla_s_analysis_counts_a_loop_once_here_and_one_that_counted_trips_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The correction rests on XLA counting a body once (jaxlib 0.10.2, probed on every
    analysis); an XLA that counted trips itself would be added nothing."""
    assert loop_costs.analyser(None).counts_loops() is False
    real = loop_costs.analyser

    def counting(client: Any = None) -> Any:
        analyse = real(client)
        analyse.counts_loops = lambda: True
        return analyse

    monkeypatch.setattr(loop_costs, "analyser", counting)
    cost, info = _costs(lp.deep_scan, *_deep_args(8))
    assert cost["flops"] == cost["flops_xla"]
    assert "counts loop bodies per trip itself" in info["note"]


def test_a_gpu_topology_estimate_from_the_lowering_counts_the_layers(compose_run: Any) -> None:
    """A deviceless GPU executable has no cost analysis: the estimate comes from the lowering's
    HLO, whose loops carry no annotation (the induction variable gives their trip counts)."""
    # Both sides compile their GEMMs as cuBLAS calls, not Triton kernels: XLA:GPU's compile takes
    # about half the time, and the estimate, read from the lowering's HLO, is the same.
    cublas = "+compile.compiler_options.xla_gpu_enable_triton_gemm=false"
    runs = [
        compose_run("program=transformer", "compile.topology=h100", cublas, *extra)
        for extra in ([], ["program.target=loop_programs:transformer_unrolled"])
    ]
    scanned, unrolled = (
        json.loads((r.run_dir / "compile" / "compiled.json").read_text())["roofline"] for r in runs
    )
    assert scanned["source"].startswith("lowering cost analysis")
    assert _close(scanned["flops"], unrolled["flops"], 0.01)
    assert scanned["flops_xla"] < 0.6 * unrolled["flops"]
    assert _close(scanned["bytes_accessed"], unrolled["bytes_accessed"], 0.05)
