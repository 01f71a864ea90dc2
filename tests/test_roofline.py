"""``execute.roofline=true`` (issue 18, item 5): intensity and achieved rates against the
device's calibrated peaks, per run and as a sweep plot; TPU topologies against the table."""

from __future__ import annotations

import json
from pathlib import Path

import jaxaot
import pytest
from jaxaot.engine.summary import render
from jaxaot.stages.roofline import analyse


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
    assert (
        0
        < roof["fraction_of_roof"]
        == pytest.approx(roof["achieved_flops_per_s"] / roof["roof_flops_per_s"])
    )
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
