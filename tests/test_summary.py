"""The one-screen summary (``jaxaot.engine.summary.render``) of a run's manifest."""

from __future__ import annotations

from typing import Any

import pytest
from jaxaot.engine.summary import render
from jaxaot.util.humanize import human_bytes, human_count, human_seconds


def _manifest(**changes: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "run_dir": "outputs/run1",
        "config": {"program": {"name": "mlp", "target": "jaxaot.examples.mlp:mlp"}},
        "backend": {"platform": "cpu", "device_count": 1, "device_kind": "cpu"},
        "stages": {
            "stage_out": {
                "status": "ran",
                "seconds": 0.0421,
                "metrics": {"inputs": 7, "outputs": 1, "static": 0, "eqns": 19},
            },
            "lower": {
                "status": "ran",
                "seconds": 0.151,
                "metrics": {"platforms": ["cpu"], "flops": 2.5e7},
            },
            "compile": {
                "status": "cached",
                "seconds": 0.0025,
                "metrics": {
                    "flops": 2.5e7,
                    "bytes_accessed": 3 * 2**20,
                    "argument_bytes": 2**20,
                    "output_bytes": 32768,
                    "temp_bytes": 4096,
                    "code_bytes": 512,
                },
            },
            "execute": {
                "status": "ran",
                "seconds": 1.5,
                "metrics": {
                    "median_s": 0.00042,
                    "stddev_s": 3e-6,
                    "flops_per_s": 6e10,
                    "check": "ok",
                    "max_rel_err": 1.5e-7,
                },
            },
        },
        "warnings": ["execute: non-finite values (nan/inf) in output(s) ['y']"],
        "error": None,
    }
    manifest.update(changes)
    return manifest


def _row(text: str, stage: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(stage + " "))


def test_render_has_a_row_per_stage_with_times_flops_bytes_memory_and_median() -> None:
    text = render(_manifest())
    lines = text.splitlines()
    assert lines[0] == "jaxaot · mlp (jaxaot.examples.mlp:mlp) · cpu x1 (cpu)"
    assert lines[1] == "run dir: outputs/run1"
    assert lines[2].split() == ["stage", "status", "time", "details"]
    assert _row(text, "stage_out").split()[:3] == ["stage_out", "ran", "42.10"]
    assert "7 in, 1 out, 0 static; 19 eqns" in _row(text, "stage_out")
    assert "151.00 ms" in _row(text, "lower")
    assert "platforms cpu; 25.00 MFLOP (pre-compile)" in _row(text, "lower")
    compile_row = _row(text, "compile")
    assert compile_row.split()[:4] == ["compile", "cached", "2.50", "ms"]
    assert "25.00 MFLOP; 3.0 MiB accessed" in compile_row
    assert "mem arg 1.0 MiB out 32.0 KiB temp 4.0 KiB code 512 B" in compile_row
    execute_row = _row(text, "execute")
    assert "1.50 s" in execute_row
    assert (
        "median 420.0 us (sd 3.0 us); 60.00 GFLOP/s; check ok (max rel err 1.5e-07)" in execute_row
    )
    assert lines[-1] == "warning: execute: non-finite values (nan/inf) in output(s) ['y']"
    assert len(lines) == 8  # one screen


def test_render_a_failed_run() -> None:
    manifest = _manifest(
        stages={
            "stage_out": {"status": "ran", "seconds": 0.01, "metrics": {"inputs": 2}},
            "lower": {"status": "ran", "seconds": 0.02, "metrics": {"platforms": ["cpu"]}},
            "compile": {"status": "failed", "seconds": 0.003, "metrics": {}},
            "execute": {"status": "skipped", "seconds": 0.0, "artifacts": {}},
        },
        warnings=[],
        error="compile.compiler_options: XLA rejected ['xla_nope']",
    )
    text = render(manifest)
    # A stage that failed before it measured anything shows no made-up figures.
    assert _row(text, "compile").split() == ["compile", "failed", "3.00", "ms"]
    assert _row(text, "execute").split() == ["execute", "skipped", "-"]
    assert text.splitlines()[-1] == "error: compile.compiler_options: XLA rejected ['xla_nope']"
    assert not any(line != line.rstrip() for line in text.splitlines())


def test_render_without_backend_or_cost() -> None:
    manifest = _manifest(backend={}, warnings=[])
    manifest["stages"] = {
        "lower": {"status": "ran", "seconds": 0.1, "metrics": {"platforms": ["tpu"]}}
    }
    text = render(manifest)
    assert text.splitlines()[0] == "jaxaot · mlp (jaxaot.examples.mlp:mlp)"
    assert _row(text, "lower").endswith("platforms tpu")


def test_render_a_real_run(compose_run) -> None:
    result = compose_run("program=axpy", "execute.repeats=2")
    text = render(result.manifest)
    for stage in ("stage_out", "lower", "compile", "execute"):
        assert _row(text, stage)
    assert "2 FLOP" in _row(text, "compile")
    assert "median " in _row(text, "execute")


@pytest.mark.parametrize(
    ("fn", "value", "text"),
    [
        (human_bytes, None, "-"),
        (human_bytes, 100, "100 B"),
        (human_bytes, 1536, "1.5 KiB"),
        (human_bytes, 5 * 2**30, "5.0 GiB"),
        (human_count, 2.0, "2"),
        (human_count, 1.5e9, "1.50 G"),
        (human_seconds, None, "-"),
        (human_seconds, 2.5e-5, "25.0 us"),
        (human_seconds, 0.25, "250.00 ms"),
        (human_seconds, 3.0, "3.00 s"),
    ],
)
def test_human_units(fn: Any, value: Any, text: str) -> None:
    assert fn(value) == text


def test_xla_unknown_sentinels_are_shown_as_n_a() -> None:
    # XLA's cost analysis says flops: -2 (and other negatives) when it cannot count.
    manifest = _manifest()
    manifest["stages"]["lower"]["metrics"]["flops"] = -2.0
    manifest["stages"]["compile"]["metrics"].update(flops=-2.0, bytes_accessed=-1.0)
    manifest["stages"]["execute"]["metrics"]["flops_per_s"] = -2.0 / 0.00042  # older manifests
    text = render(manifest)
    assert "platforms cpu; FLOP n/a (pre-compile)" in _row(text, "lower")
    assert "ms  FLOP n/a; bytes accessed n/a; mem arg 1.0 MiB" in _row(text, "compile")
    assert "(sd 3.0 us); FLOP/s n/a; check ok" in _row(text, "execute")
    assert "-2" not in text and "-4" not in text


@pytest.mark.parametrize(
    ("value", "count", "size"),
    [(-2.0, "FLOP n/a", "n/a"), (-1, "FLOP n/a", "n/a"), (0, "0 FLOP", "0 B"), (None, "-", "-")],
)
def test_negative_figures_are_not_available(value: Any, count: str, size: str) -> None:
    assert human_count(value, "FLOP") == count
    assert human_bytes(value) == size


def test_a_run_keeps_the_raw_sentinel_in_cost_analysis_json(
    compose_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from jaxaot.stages import executable  # where every compile takes its cost analysis

    real = executable.cost_of
    monkeypatch.setattr(
        executable, "cost_of", lambda compiled: {**(real(compiled) or {}), "flops": -2.0}
    )
    result = compose_run("program=axpy", "program.args=[f32[4],f32[4]]")
    cost = json.loads((result.run_dir / "compile" / "cost_analysis.json").read_text())
    assert cost["flops"] == -2.0  # XLA's own answer, kept as is
    text = render(result.manifest)
    assert "FLOP n/a" in _row(text, "compile")
    assert "flops_per_s" not in result.manifest["stages"]["execute"]["metrics"] or (
        result.manifest["stages"]["execute"]["metrics"]["flops_per_s"] is None
    )
    assert "FLOP/s" not in _row(text, "execute")


# --- results on screen: outputs with their values ------------------------------------------


def test_the_summary_shows_small_outputs_with_values_and_large_ones_by_type(compose_run) -> None:
    import json

    from jaxaot.engine.summary import output_lines
    from jaxaot.rundir.metrics import OutputFigure

    result = compose_run("program=axpy", "program.args=[3,4]")
    text = render(result.manifest)
    assert text.splitlines()[-1] == "output  i32[] = 10"  # "runs to 10", on screen
    saved = json.loads((result.run_dir / "execute" / "outputs.json").read_text())
    assert [(o["dtype"], o["shape"], o["value"]) for o in saved] == [("int32", [], 10)]

    lines = output_lines(
        [
            OutputFigure.from_json(o)
            for o in (
                {"path": "['loss']", "dtype": "float32", "shape": [], "value": 0.25},
                {"path": "['y']", "dtype": "bfloat16", "shape": [8, 256]},
                {"path": "['v']", "dtype": "float32", "shape": [3], "value": [1.0, "nan", -0.5]},
                {"path": "['m']", "dtype": "bool", "shape": [2], "value": [True, False]},
            )
        ]
    )
    assert lines == [
        "output['loss']  f32[] = 0.25",
        "output['y']     bf16[8,256]",
        "output['v']     f32[3] = [1, nan, -0.5]",
        "output['m']     bool[2] = [True, False]",
    ]


def test_outputs_json_holds_values_up_to_eight_elements(compose_run) -> None:
    import json

    ones = "{shape: [8], dtype: f32, init: ones}"
    small = compose_run("program=axpy", f"program.args=[{ones},{ones}]")  # 2 * 1 + 1
    (out,) = json.loads((small.run_dir / "execute" / "outputs.json").read_text())
    assert out["shape"] == [8] and out["value"] == [3.0] * 8
    assert "f32[8] = [3, 3, 3, 3, 3, 3, 3, 3]" in render(small.manifest)
    large = compose_run("program=axpy", "program.args=[f32[9],f32[9]]")
    (out,) = json.loads((large.run_dir / "execute" / "outputs.json").read_text())
    assert out["shape"] == [9] and "value" not in out
    assert render(large.manifest).splitlines()[-1] == "output  f32[9]"


@pytest.mark.parametrize(
    ("metrics", "shown"),
    [
        ({"check": "ok", "max_rel_err": 0.0, "check_passed_by": "exact"}, "check ok (exact)"),
        (
            {
                "check": "ok",
                "max_rel_err": 1.4,
                "max_abs_err": 2e-7,
                "check_passed_by": "abs err 2e-07 <= atol 1e-05 + rtol 0.0001 x |ref|",
            },
            "check ok (abs err 2e-07 <= atol 1e-05 + rtol 0.0001 x |ref|)",
        ),
        (
            {"check": "ok", "max_rel_err": 3e-6, "check_passed_by": "rel err 3e-06 <= rtol 0.0001"},
            "check ok (rel err 3e-06 <= rtol 0.0001)",
        ),
    ],
)
def test_check_ok_names_the_tolerance_that_passed(metrics: dict[str, Any], shown: str) -> None:
    manifest = _manifest()
    manifest["stages"]["execute"]["metrics"] = {"median_s": 1e-3, **metrics}
    assert _row(render(manifest), "execute").endswith(shown)


def test_an_error_near_zero_passes_by_the_absolute_tolerance() -> None:
    from types import SimpleNamespace

    import numpy as np
    from jaxaot.stages.execute import _compare

    ctx = SimpleNamespace(opts=SimpleNamespace(rtol=None, atol=None))
    want = np.array([1e-7, 1.0], np.float32)
    got = np.array([2.4e-7, 1.0], np.float32)  # rel err 1.4 next to a zero, abs err 1.4e-7
    check = _compare(ctx, [got], [want])  # type: ignore[arg-type]
    assert check["ok"] and check["max_rel_err"] > 1
    assert check["passed_by"].startswith("abs err 1.4e-07 <= atol 1e-05")
    close = _compare(ctx, [np.float32(1.00001)], [np.float32(1.0)])  # type: ignore[arg-type]
    assert close["passed_by"].startswith("rel err 1e-05 <= rtol 0.0001")
    same = _compare(ctx, [want], [want])  # type: ignore[arg-type]
    assert same["passed_by"] == "exact"
