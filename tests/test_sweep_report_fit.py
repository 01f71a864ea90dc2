"""sweep.md of a fit search: the search's section (fit.json) before the plots."""

from __future__ import annotations

import json
from pathlib import Path

from jaxaot.sweeps import fit_search
from jaxaot.sweeps.fit_search import FitOptions, Search, bisect, fronts
from jaxaot.sweeps.plots import write_plots
from jaxaot.sweeps.report import MD_NAME, collect, to_markdown, write_report


def _fit_json(sweep_dir: Path) -> None:
    """fit.json of a search over x={n} in [1, 16] whose boundary is 12."""
    opts = FitOptions(overrides=["x={n}"], low=1, high=16)
    search = Search(fixed=["remat=full"], label="compile.topology=v5e:2x2 remat=full")

    def probe(n: int) -> bool:
        search.probes.append(
            {
                "n": n,
                "fits": n <= 12,
                "status": "fits" if n <= 12 else "does_not_fit",
                "error": None,
                "hbm_bytes_needed": n << 30,
                "hbm_bytes_available": 15 << 30,
                "est_step_s": n / 2,
                "topology": "v5e:2x2",
            }
        )
        return n <= 12

    searches = [bisect(opts, probe, search).to_json(opts)]
    fit = {**opts.header(), "searches": searches, "fronts": fronts(searches)}
    (sweep_dir / fit_search.FIT_NAME).write_text(json.dumps(fit))


def test_the_fit_search_section_comes_before_the_plots(tmp_path: Path) -> None:
    assert "## Fit search" not in to_markdown(collect(tmp_path))  # no fit.json: no section
    _fit_json(tmp_path)
    section = fit_search.report_section(tmp_path)
    write_report(tmp_path)  # no job rows: no plots
    assert "\n".join(section) in (tmp_path / MD_NAME).read_text()
    table = collect(tmp_path)
    table.plots = write_plots(table, tmp_path / "plots")  # the fit search's own plots
    md = to_markdown(table)
    assert "\n".join(section) in md
    assert "| remat=full | v5e:2x2 | 12 | 13 |" in md
    assert table.plots and "## Plots" in md
    assert md.index("## Fit search") < md.index("## Plots")
    assert "![fit_search](plots/fit_search.png)" in md


def test_a_probe_keeps_its_compiles_verdict_figures() -> None:
    from jaxaot.rundir.metrics import CompileMetrics

    compiled = CompileMetrics.from_manifest(
        {
            "status": "failed",
            "metrics": {
                "topology": "v5e:2x2",
                "fits": False,
                "hbm_bytes_needed": 20 * 2**30,
                "hbm_bytes_available": 16 * 2**30,
                "est_step_s": 0.5,
                "peak_bytes": 3,
            },
        }
    )
    figures = fit_search.probe_figures(compiled)
    assert tuple(figures) == fit_search.PROBE_METRICS
    assert figures == {
        "topology": "v5e:2x2",
        "hbm_bytes_needed": 20 * 2**30,
        "hbm_bytes_available": 16 * 2**30,
        "est_step_s": 0.5,
        "peak_bytes": 3,
        "host_bytes_needed": None,
    }
    assert set(fit_search.probe_figures(CompileMetrics()).values()) == {None}
