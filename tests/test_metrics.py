"""The typed records of a manifest's stage metrics (``jaxaot.rundir.metrics``): what they read,
what they tolerate, and the one list of report columns and objectives. No JAX, no process."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from jaxaot.config.order import STAGES
from jaxaot.errors import ConfigError
from jaxaot.rundir.metrics import (
    NUMERIC_UNITS,
    OBJECTIVE_BY_NAME,
    OBJECTIVES,
    RECORDS,
    REPORT_METRICS,
    TOPOLOGY_METRICS,
    CompileMetrics,
    ExecuteMetrics,
    FitVerdict,
    LowerMetrics,
    OutputFigure,
    RunMetrics,
    StageOutMetrics,
    objective,
)


def _manifest() -> dict[str, Any]:
    return {
        "stages": {
            "stage_out": {
                "status": "ran",
                "seconds": 0.04,
                "metrics": {"inputs": 7, "outputs": 1, "static": 0, "eqns": 19},
            },
            "lower": {
                "status": "ran",
                "seconds": 0.15,
                "metrics": {"platforms": ["cpu", "cuda"], "flops": 2.5e7},
            },
            "compile": {
                "status": "cached",
                "seconds": 0.0025,
                "metrics": {
                    "flops": -2,
                    "bytes_accessed": 3 * 2**20,
                    "temp_bytes": 4096,
                    "peak_top": "p0 (arg) 1 MiB",
                    "topology": "v5e-8",
                    "fits": False,
                    "hbm_bytes_needed": 20 * 2**30,
                    "headroom_bytes": -4 * 2**30,
                    "est_step_s": 0.012,
                },
            },
            "execute": {
                "status": "ran",
                "seconds": 1.5,
                "metrics": {
                    "median_s": 0.00042,
                    "flops_per_s": 6e10,
                    "check": "ok",
                    "outputs": [
                        {"path": "['y']", "dtype": "float32", "shape": [8, 256]},
                        {"path": "", "dtype": "int32", "shape": [], "value": 10},
                    ],
                },
            },
        }
    }


def test_records_read_each_stages_figures_by_attribute() -> None:
    run = RunMetrics.from_manifest(_manifest())
    assert run.stage_out.eqns == 19 and run.stage_out.argument_bytes is None
    assert run.lower.platforms == ("cpu", "cuda") and run.lower.flops == 2.5e7
    assert run.compile.temp_bytes == 4096 and run.compile.peak_top == "p0 (arg) 1 MiB"
    assert run.compile.verdict.known and run.compile.verdict.fits is False
    assert run.compile.verdict.topology == "v5e-8"
    assert run.execute.median_s == 0.00042 and run.execute.check == "ok"
    assert run.execute.outputs == (
        OutputFigure(path="['y']", dtype="float32", shape=(8, 256)),
        OutputFigure(path="", dtype="int32", shape=(), value=10, has_value=True),
    )
    assert run.run("compile").status == "cached" and run.run("compile").seconds == 0.0025
    assert list(run.runs) == list(STAGES)
    assert run.stage("compile") is run.compile and run.stage("bogus") is None


def test_numbers_are_kept_as_written() -> None:
    """Reports print the manifest's numbers: an int stays an int (sweep.csv shows 4096, not
    4096.0) and XLA's negative "unknown" sentinel is kept by the record."""
    compiled = RunMetrics.from_manifest(_manifest()).compile
    assert type(compiled.temp_bytes) is int and compiled.flops == -2


def test_older_and_partial_manifests_read_as_none() -> None:
    """A stage that failed early, a manifest older than a figure, no manifest at all: every
    figure None (lists empty), never a KeyError."""
    for manifest in (None, {}, {"stages": None}, {"stages": {"compile": {"status": "failed"}}}):
        run = RunMetrics.from_manifest(manifest)
        assert run.compile == CompileMetrics() and run.execute == ExecuteMetrics()
        assert run.compile.flops is None and not run.compile.verdict.known
        assert run.lower.platforms == () and run.execute.outputs == ()
    assert RunMetrics.from_manifest(None).run("compile").status is None
    assert CompileMetrics.from_manifest({"status": "ran", "metrics": None}) == CompileMetrics()


def test_a_value_of_another_kind_reads_as_none() -> None:
    entry = {
        "metrics": {
            "median_s": "fast",
            "stddev_s": True,
            "check": 1,
            "outputs": "many",
            "flops_per_s": [1],
        }
    }
    figures = ExecuteMetrics.from_manifest(entry)
    assert figures == ExecuteMetrics()
    assert FitVerdict.from_metrics({"fits": "yes", "topology": 8}) == FitVerdict()


def test_records_are_frozen() -> None:
    run = RunMetrics.from_manifest(_manifest())
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.compile.flops = 1  # type: ignore[misc]


def test_every_field_has_a_unit_and_every_stage_a_record() -> None:
    assert tuple(RECORDS) == STAGES
    assert RECORDS["compile"] is CompileMetrics and RECORDS["lower"] is LowerMetrics
    assert RECORDS["stage_out"] is StageOutMetrics
    units = set(NUMERIC_UNITS) | {"text", "flag", "names", "sizes", "outputs"}
    for record in (*RECORDS.values(), FitVerdict):
        for f in dataclasses.fields(record):
            assert "record" in f.metadata or f.metadata["unit"] in units, (record, f.name)


# sweep.csv's metric columns, in order: an on-disk format.
REPORT_COLUMNS = [
    "compile.flops",
    "compile.bytes_accessed",
    "compile.argument_bytes",
    "compile.output_bytes",
    "compile.temp_bytes",
    "compile.code_bytes",
    "compile.peak_bytes",
    "compile.peak_top",
    "compile.breakdown_threads_s",
    "compile.breakdown_top",
    "execute.median_s",
    "execute.stddev_s",
    "execute.flops_per_s",
    "execute.intensity",
    "execute.roofline_fraction",
    "execute.peak_flops",
    "execute.peak_bytes_per_s",
    "execute.profile_top_op",
    "execute.profile_top_share",
]
TOPOLOGY_COLUMNS = [
    "compile.topology",
    "compile.fits",
    "compile.hbm_bytes_needed",
    "compile.hbm_bytes_available",
    "compile.headroom_bytes",
    "compile.hbm_fits",
    "compile.hbm_reserve_bytes",
    "compile.host_bytes_needed",
    "compile.host_bytes_available",
    "compile.host_fits",
    "compile.est_step_s",
    "compile.collectives",
    "compile.collective_bytes",
]


def test_the_report_columns_and_objectives_are_listed_once_in_order() -> None:
    assert [m.column for m in REPORT_METRICS] == REPORT_COLUMNS
    assert [m.column for m in TOPOLOGY_METRICS] == TOPOLOGY_COLUMNS
    text = {"compile.peak_top", "compile.breakdown_top", "execute.profile_top_op"}
    assert {m.column for m in REPORT_METRICS if not m.numeric} == text
    assert [m.column for m in OBJECTIVES] == [
        *(f"{s}.seconds" for s in STAGES),
        *(c for c in REPORT_COLUMNS if c not in text),
        "compile.hbm_bytes_needed",
        "compile.host_bytes_needed",
        "compile.est_step_s",
    ]
    assert all(m.numeric for m in OBJECTIVES)


def test_an_objective_is_a_catalogued_figure_or_one_config_error() -> None:
    run = RunMetrics.from_manifest(_manifest())
    assert run.value(objective("execute.median_s")) == 0.00042
    assert run.value(objective("compile.seconds")) == 0.0025
    assert run.value(objective("compile.est_step_s")) == 0.012
    with pytest.raises(
        ConfigError,
        match=r"^hydra\.sweeper\.objectives: expected one of stage_out\.seconds, lower\.seconds, "
        r".*compile\.est_step_s, found 'execute\.mean_s'$",
    ):
        objective("execute.mean_s", "hydra.sweeper.objectives")


def test_figure_drops_xlas_unknown_sentinels_but_keeps_a_negative_headroom() -> None:
    run = RunMetrics.from_manifest(_manifest())
    by_column = {m.column: m for m in (*REPORT_METRICS, *TOPOLOGY_METRICS)}
    assert run.value(by_column["compile.flops"]) == -2
    assert run.figure(by_column["compile.flops"]) is None
    assert run.figure(by_column["compile.headroom_bytes"]) == -4 * 2**30
    assert run.figure(by_column["compile.peak_top"]) == "p0 (arg) 1 MiB"


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("execute.median_s", 0.000389348, "389.3 us"),
        ("compile.seconds", 2.5, "2.50 s"),
        ("compile.temp_bytes", 3 * 2**20, "3.0 MiB"),
        ("compile.hbm_bytes_needed", 2**30, "1.0 GiB"),
        ("execute.flops_per_s", 1.5e9, "1.5e+09"),
        ("compile.flops", 123456789, "1.23457e+08"),
        ("execute.roofline_fraction", 0.25, "0.25"),
    ],
)
def test_an_objectives_value_is_shown_in_its_unit(name: str, value: float, text: str) -> None:
    assert OBJECTIVE_BY_NAME[name].human(value) == text


def test_a_manifest_round_trip_reads_alike() -> None:
    """What the records read from a manifest written to JSON and read back."""
    manifest = _manifest()
    again = json.loads(json.dumps(manifest))
    assert RunMetrics.from_manifest(again) == RunMetrics.from_manifest(manifest)
