"""``execute.roofline=true``: intensity and achieved rates against the device's calibrated peaks
(cached per machine), per run and as a sweep plot; TPU topologies against the table."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from jaxaot.engine.summary import render
from jaxaot.stages import roofline
from jaxaot.stages.roofline import analyse

KEY_ARGS = ("cpu", "cpu", 1)


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $XDG_CACHE_HOME and an empty in-process memo: as a new process on a new machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(roofline, "_memo", {})
    return tmp_path / "xdg"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every real calibration (roofline.measure) made, with the peaks it found."""
    calls: list[dict[str, Any]] = []
    real = roofline.measure

    def counting(backend: str | None = None) -> dict[str, Any]:
        calls.append(real(backend))
        return calls[-1]

    monkeypatch.setattr(roofline, "measure", counting)
    yield calls


def _fake_measure(monkeypatch: pytest.MonkeyPatch, flops: float, bw: float) -> list[str | None]:
    """roofline.measure finding these peaks; the list of backends it was called for."""
    calls: list[str | None] = []

    def fake(backend: str | None = None) -> dict[str, Any]:
        calls.append(backend)
        return {
            "peak_flops": flops,
            "peak_bytes_per_s": bw,
            "flops_by_matmul": {"1024": flops},
            "bytes_per_s_by_size": {"64 MiB": bw},
        }

    monkeypatch.setattr(roofline, "measure", fake)
    return calls


def test_a_run_sits_under_its_calibrated_roof(tmp_path: Path) -> None:
    result = jaxaot.run(
        jaxaot.compose(["program=mlp", "execute.roofline=true"]), run_dir=tmp_path / "r"
    )
    roof = json.loads((tmp_path / "r" / "execute" / "roofline.json").read_text())
    cost = json.loads((tmp_path / "r" / "compile" / "cost_analysis.json").read_text())
    timings = json.loads((tmp_path / "r" / "execute" / "timings.json").read_text())
    assert roof["source"].startswith("calibrated here")
    assert roof["peak_flops"] > 1e8 and roof["peak_bytes_per_s"] > 1e8
    assert roof["intensity"] == pytest.approx(cost["flops"] / cost["bytes accessed"])
    assert roof["achieved_flops_per_s"] == pytest.approx(cost["flops"] / timings["median_s"])
    assert roof["roof_flops_per_s"] == pytest.approx(
        min(roof["peak_flops"], roof["intensity"] * roof["peak_bytes_per_s"])
    )
    measured = roof["achieved_flops_per_s"] / roof["roof_flops_per_s"]
    assert roof["measured_fraction_of_roof"] == pytest.approx(measured)
    assert 0 < roof["fraction_of_roof"] == pytest.approx(min(measured, 1.0))
    assert ("above_calibrated_peak" in roof) == (measured > 1)
    want = "compute" if roof["intensity"] >= roof["ridge_flops_per_byte"] else "memory"
    assert roof["bound"] == want
    metrics = result.manifest["stages"]["execute"]["metrics"]
    assert metrics["roofline_fraction"] == roof["fraction_of_roof"]
    assert f"{roof['bound']}-bound" in render(result.manifest)


def test_the_analysis_leaves_unknown_figures_unknown() -> None:
    peaks = {"peak_flops": 1e12, "peak_bytes_per_s": 1e11}
    roof = analyse({"flops": -2.0, "bytes accessed": 100.0}, 0.5, peaks)
    assert roof["intensity"] is None and "bound" not in roof
    roof = analyse({"flops": 1e9, "bytes accessed": 1e6}, 0.01, peaks)
    assert roof["intensity"] == 1000 and roof["bound"] == "compute"
    assert roof["fraction_of_roof"] == pytest.approx(1e11 / 1e12)
    roof = analyse({"flops": 1e6, "bytes accessed": 1e6}, 0.01, peaks)
    assert roof["bound"] == "memory" and roof["roof_flops_per_s"] == pytest.approx(1e11)


def test_the_sweep_report_plots_the_roofline(tmp_path: Path) -> None:
    from jaxaot.sweeps.report import write_report

    sweep = tmp_path / "multirun"
    for i, batch in enumerate((8, 64)):
        jaxaot.run(
            jaxaot.compose(
                ["program=mlp", "execute.roofline=true", f"program.args.1.shape=[{batch},256]"]
            ),
            run_dir=sweep / str(i),
        )
    table = write_report(sweep, plots=True)
    assert any(p.name == "roofline.png" for p in table.plots)
    png = (sweep / "plots" / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_tpu_topology_estimate_has_intensity_against_the_table() -> None:
    from jaxaot.stages.topology import roofline
    from jaxaot.targets.tpu import resolve

    target = resolve("v5e:2x2", 1)
    est = roofline(target, {"flops": 2e12, "bytes accessed": 1e9})
    gen = target.generation
    assert est["intensity"] == 2000 and est["estimate"] is True
    assert est["ridge_flops_per_byte"] == gen.peak_bf16_flops / gen.hbm_bandwidth


def test_the_calibration_is_cached_per_machine(
    cache_home: Path, measured: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = roofline.calibrate(*KEY_ARGS)
    path = roofline.cache_path(roofline.calibration_key(*KEY_ARGS))
    assert len(measured) == 1 and first["cached"] is False and first["calibration_s"] > 0
    assert path.parent == cache_home / "jaxaot" / "roofline" and path.is_file()
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert roofline.calibrate(*KEY_ARGS) is first  # the same process: its memo
    monkeypatch.setattr(roofline, "_memo", {})  # another process on this machine: the file
    again = roofline.calibrate(*KEY_ARGS)
    assert len(measured) == 1 and again["cached"] is True and again["calibration_s"] == 0
    assert again["peak_flops"] == first["peak_flops"] == measured[0]["peak_flops"]
    assert again["peak_bytes_per_s"] == measured[0]["peak_bytes_per_s"]
    assert first["peak_flops"] > 1e8 and first["peak_bytes_per_s"] > 1e8


def test_a_second_run_does_not_calibrate_again(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _fake_measure(monkeypatch, flops=1e15, bw=1e15)  # a roof no run here reaches
    overrides = ["program=axpy", "execute.roofline=true", "execute.repeats=2"]
    jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "a")
    monkeypatch.setattr(roofline, "_memo", {})  # as another process would
    jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "b")
    a, b = (json.loads((tmp_path / r / "execute" / "roofline.json").read_text()) for r in "ab")
    assert calls == ["cpu"]
    assert (a["cached"], b["cached"]) == (False, True) and b["calibration_s"] == 0
    assert a["cache_file"] == b["cache_file"] and b["peak_flops"] == 1e15
    assert Path(a["cache_file"]).is_relative_to(cache_home)


def test_a_run_above_its_roof_is_capped_and_warned(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A FLOP/s peak no program stays under (compute-bound: the bandwidth peak is no limit):
    # axpy of scalars is 2 FLOPs a call, under it only at over 2000 s a call (1e3 FLOP/s was
    # not: ~2 ms a call on a loaded machine).
    calls = _fake_measure(monkeypatch, flops=1e-3, bw=1e15)
    overrides = ["program=axpy", "execute.roofline=true", "execute.repeats=2"]
    first = jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "a")
    assert len(calls) == 1  # measured just now: not measured again
    roof = json.loads((tmp_path / "a" / "execute" / "roofline.json").read_text())
    assert roof["bound"] == "compute" and not roof["cache_resident"]
    assert roof["fraction_of_roof"] == 1.0 and roof["measured_fraction_of_roof"] > 1
    warning = roof["above_calibrated_peak"]
    assert "above the calibrated peak" in warning and "calibration too low" in warning
    assert roof["cache_file"] in warning
    assert warning in first.manifest["stages"]["execute"]["warnings"]
    text = render(first.manifest)
    assert "100% of roof" in text
    assert [line for line in text.splitlines() if line.startswith("warning:") and warning in line]
    monkeypatch.setattr(roofline, "_memo", {})  # a later run, from the cache: measures again once
    jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "b")
    assert len(calls) == 2
    roof = json.loads((tmp_path / "b" / "execute" / "roofline.json").read_text())
    assert roof["fraction_of_roof"] == 1.0 and "above_calibrated_peak" in roof
    # The recalibration found the same peaks: settled, in the cache file too.
    assert set(roof["settled"]) == {"peak_flops", "peak_bytes_per_s"}
    assert "did not raise" in roof["above_calibrated_peak"]
    assert json.loads(Path(roof["cache_file"]).read_text())["settled"] == roof["settled"]
    monkeypatch.setattr(roofline, "_memo", {})  # a run after that: nothing measured, same words
    third = jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "c")
    assert len(calls) == 2
    again = json.loads((tmp_path / "c" / "execute" / "roofline.json").read_text())
    assert again["fraction_of_roof"] == 1.0 and again["measured_fraction_of_roof"] > 1
    assert "did not raise" in again["above_calibrated_peak"]
    warned = third.manifest["stages"]["execute"]["warnings"]
    assert [w for w in warned if "did not raise" in w] == [again["above_calibrated_peak"]]


def test_a_recalibration_that_raises_the_peak_leaves_it_unsettled(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_measure(monkeypatch, flops=1e9, bw=1e9)
    roofline.calibrate(*KEY_ARGS)
    _fake_measure(monkeypatch, flops=1e9 * (1 + roofline.RAISE_NOISE / 2), bw=2e9)
    peaks = roofline.calibrate(*KEY_ARGS, recalibrate=True)
    # FLOP/s within the noise: settled; the bandwidth doubled: the cached one was too low.
    assert peaks["settled"] == ["peak_flops"] and peaks["peak_bytes_per_s"] == 2e9


def test_a_cache_resident_run_is_not_held_to_the_bandwidth_roof(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A bandwidth peak no program stays under, however slow the machine: memory-bound, with a
    # working set of a few bytes.
    calls = _fake_measure(monkeypatch, flops=1e15, bw=1e-3)
    overrides = ["program=axpy", "execute.roofline=true", "execute.repeats=2"]
    for run in "ab":
        monkeypatch.setattr(roofline, "_memo", {})  # each run its own process
        result = jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / run)
        roof = json.loads((tmp_path / run / "execute" / "roofline.json").read_text())
        memory = json.loads((tmp_path / run / "compile" / "memory_analysis.json").read_text())
        assert roof["working_set_bytes"] == roofline.working_set_bytes(memory)
        assert 0 < roof["working_set_bytes"] < roof["smallest_stream_bytes"] == 1 << 20
        assert roof["bound"] == "memory" and roof["cache_resident"] is True
        assert roof["fraction_of_roof"] == 1.0 and roof["measured_fraction_of_roof"] > 1
        warning = roof["above_calibrated_peak"]
        assert warning.startswith("roofline: working set ") and "is cache-resident" in warning
        assert "does not bound it" in warning and "calibration too low" not in warning
        assert warning in result.manifest["stages"]["execute"]["warnings"]
    assert calls == ["cpu"]  # the cached peaks are used, not measured again: no stream bounds it


def test_the_analysis_compares_the_working_set_with_the_sizes_calibrated() -> None:
    peaks = {"peak_flops": 1e12, "peak_bytes_per_s": 1e9, "cache_file": "/c/k.json"}
    cost = {"flops": 1e9, "bytes accessed": 4e9}  # 0.25 FLOP/B: memory-bound, 0.25 GFLOP/s roof
    small, big = 16 << 10, 4 << 20
    roof = analyse(cost, 1.0, peaks, small)  # 1 GFLOP/s: 400% of the roof
    assert roof["cache_resident"] and roof["fraction_of_roof"] == 1.0
    assert roof["measured_fraction_of_roof"] == 4.0
    assert roof["above_calibrated_peak"].startswith(
        "roofline: working set 16.0 KiB is cache-resident (bandwidth calibrated on streams of "
        "1.0 MiB and up)"
    )
    assert "is 400% of that roof, reported as 100%" in roof["above_calibrated_peak"]
    roof = analyse(cost, 1.0, peaks, big)  # as big as the streams: the roof holds, too low
    assert not roof["cache_resident"] and "calibration too low" in roof["above_calibrated_peak"]
    roof = analyse(cost, 1.0, {**peaks, "settled": ["peak_bytes_per_s"]}, big)
    assert "did not raise" in roof["above_calibrated_peak"] and roof["fraction_of_roof"] == 1.0
    roof = analyse(cost, 1.0, {**peaks, "settled": ["peak_flops"]}, big)  # not its peak
    assert "calibration too low" in roof["above_calibrated_peak"]
    roof = analyse(cost, 8.0, peaks, small)  # under the roof: no warning, the flag recorded
    assert roof["cache_resident"] and "above_calibrated_peak" not in roof
    assert roof["fraction_of_roof"] == pytest.approx(0.5)
    compute = analyse({"flops": 4e12, "bytes accessed": 1e9}, 1.0, {**peaks, "peak_flops": 1e9})
    assert compute["bound"] == "compute" and not compute["cache_resident"]
    assert "calibration too low" in compute["above_calibrated_peak"]


def test_the_working_set_is_arguments_outputs_and_temps_less_aliases() -> None:
    memory = {
        "argument_size_in_bytes": 8192,
        "output_size_in_bytes": 8192,
        "alias_size_in_bytes": 8192,
        "temp_size_in_bytes": 129,
    }
    assert roofline.working_set_bytes(memory) == 8192 + 129
    assert roofline.working_set_bytes({**memory, "alias_size_in_bytes": 0}) == 16384 + 129
    assert roofline.working_set_bytes(None) is None and roofline.working_set_bytes({}) is None


def test_a_small_loop_runs_above_no_roof_and_calibrates_once(
    cache_home: Path,
    measured: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop over 8 KiB (faster than any stream of 1 MiB or more): never a 'calibration too
    low', and the second run measures nothing."""
    overrides = [
        "program.target=roofline_programs:scaled_loop",
        "program.args=[f32[2048]]",
        "execute.roofline=true",
    ]
    for run in "ab":
        monkeypatch.setattr(roofline, "_memo", {})
        jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / run)
        roof = json.loads((tmp_path / run / "execute" / "roofline.json").read_text())
        assert roof["cache_resident"] and roof["bound"] == "memory"
        assert roof["fraction_of_roof"] == pytest.approx(min(roof["measured_fraction_of_roof"], 1))
        above = roof.get("above_calibrated_peak", "")
        assert ("cache-resident" in above) == (roof["measured_fraction_of_roof"] > 1)
        assert "calibration too low" not in above
    assert len(measured) == 1


def test_recalibrating_keeps_the_higher_peak(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_measure(monkeypatch, flops=5e9, bw=1e9)
    roofline.calibrate(*KEY_ARGS)
    _fake_measure(monkeypatch, flops=2e9, bw=3e9)  # a busier machine, but a better stream
    peaks = roofline.calibrate(*KEY_ARGS, recalibrate=True)
    assert (peaks["peak_flops"], peaks["peak_bytes_per_s"]) == (5e9, 3e9)
    monkeypatch.setattr(roofline, "_memo", {})
    cached = roofline.calibrate(*KEY_ARGS)
    assert cached["cached"] and (cached["peak_flops"], cached["peak_bytes_per_s"]) == (5e9, 3e9)


def test_a_damaged_or_foreign_cache_file_is_measured_again(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_measure(monkeypatch, flops=5e9, bw=1e9)
    key = roofline.calibration_key(*KEY_ARGS)
    path = roofline.cache_path(key)
    for text in ("{not json", json.dumps({"key": {**key, "host": "elsewhere"}, "peak_flops": 1})):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        monkeypatch.setattr(roofline, "_memo", {})
        assert roofline.calibrate(*KEY_ARGS)["peak_flops"] == 5e9
    assert len(calls) == 2 and json.loads(path.read_text())["key"] == key


def test_the_calibration_key_names_the_machine_and_its_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    one = roofline.calibration_key("cpu", "cpu", 1)
    eight = roofline.calibration_key("cpu", "cpu", 8)
    assert one != eight and roofline.cache_path(one) != roofline.cache_path(eight)
    assert {"host", "cpu", "device_kind", "jax", "jaxlib", "xla_flags"} <= set(one)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/somewhere")  # where dumps go: same code
    assert roofline.calibration_key("cpu", "cpu", 1) == one
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert roofline.calibration_key("cpu", "cpu", 1) != one
    # The suite's own cache home (tests/conftest.py): never the user's ~/.cache.
    assert roofline.cache_path(one).is_relative_to(os.environ["XDG_CACHE_HOME"])
    assert not roofline.cache_path(one).is_relative_to(Path.home() / ".cache")


def test_the_analysis_caps_a_run_above_the_roof() -> None:
    peaks = {"peak_flops": 1e9, "peak_bytes_per_s": 1e9, "cache_file": "/c/roofline/k.json"}
    roof = analyse({"flops": 4e9, "bytes accessed": 1e9}, 1.0, peaks)  # 4 GFLOP/s on a 1 roof
    assert roof["fraction_of_roof"] == 1.0 and roof["measured_fraction_of_roof"] == 4.0
    assert roof["above_calibrated_peak"].startswith("roofline: achieved 4.00 GFLOP/s is 400%")
    assert "/c/roofline/k.json" in roof["above_calibrated_peak"]
    roof = analyse({"flops": 5e8, "bytes accessed": 1e8}, 1.0, peaks)
    assert roof["fraction_of_roof"] == 0.5 and "above_calibrated_peak" not in roof
