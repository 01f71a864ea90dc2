"""The report and progress helpers in-process: rebuilding a report from what jobs left on disk,
interrupted jobs, finish-order slots, the heartbeat, and override formatting."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from jaxaot.cli.report_cmd import main as report_main
from jaxaot.sweeps import report
from jaxaot.sweeps.progress import (
    Heartbeat,
    ProgressRelay,
    SweepPlan,
    claim_finish_slot,
    override_value,
    progress_line,
    relay_line,
    short_names,
    write_job_record,
)


def _manifest(status: str, stages: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    return {"format_version": 1, "status": status, "error": error, "stages": stages}


def _stage(status: str, seconds: float, **metrics: Any) -> dict[str, Any]:
    return {"status": status, "seconds": seconds, "metrics": metrics, "artifacts": {}}


def _job(
    sweep: Path,
    num: int,
    overrides: list[str],
    manifest: dict[str, Any] | None,
    record: bool = True,
) -> Path:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if manifest is not None:
        (d / "manifest.json").write_text(json.dumps(manifest))
    if record:
        status = "ok" if manifest and manifest["status"] == "ok" else "failed"
        write_job_record(
            d,
            {
                "num": num,
                "overrides": overrides,
                "status": status,
                "code": 0 if status == "ok" else 1,
                "error": None,
            },
        )
    return d


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Three jobs as a sweep leaves them: ok, failed in compile, and killed during compile."""
    root = tmp_path / "multirun"
    SweepPlan(total=3, varying=("compile.compiler_options.xla_cpu_enable_fast_math",)).write(root)
    ok = _manifest(
        "ok",
        {
            "stage_out": _stage("ran", 0.01),
            "lower": _stage("ran", 0.02),
            "compile": _stage(
                "cached",
                0.03,
                flops=100.0,
                bytes_accessed=64.0,
                argument_bytes=32,
                output_bytes=16,
                temp_bytes=8,
                code_bytes=0,
            ),
            "execute": _stage("ran", 0.04, median_s=2e-6, stddev_s=1e-7, flops_per_s=5e7),
        },
    )
    failed = _manifest(
        "failed",
        {
            "stage_out": _stage("ran", 0.01),
            "lower": _stage("ran", 0.02),
            "compile": _stage("failed", 0.5),
        },
        error="compile.compiler_options: XLA rejected ['xla_bad']",
    )
    killed = _manifest("running", {"stage_out": _stage("ran", 0.01)})
    _job(root, 0, ["program=axpy", "compile.compiler_options.xla_cpu_enable_fast_math=true"], ok)
    _job(root, 1, ["program=axpy", "+compile.compiler_options.xla_bad=1"], failed)
    _job(
        root,
        2,
        ["program=axpy", "compile.compiler_options.xla_cpu_enable_fast_math=false"],
        killed,
        record=False,
    )
    return root


def test_report_rebuilt_from_disk(sweep: Path) -> None:
    table = report.collect(sweep)
    assert [r["job"] for r in table.rows] == [0, 1, 2]
    assert table.varying == [
        "compile.compiler_options.xla_cpu_enable_fast_math",
        "compile.compiler_options.xla_bad",
    ]
    assert table.fixed == ["program=axpy"]
    ok, failed, killed = table.rows
    assert (
        ok["status"] == "ok" and ok["compile.status"] == "cached" and ok["compile.flops"] == 100.0
    )
    assert failed["error"] == "compile.compiler_options: XLA rejected ['xla_bad']"
    assert failed["compile.status"] == "failed" and failed["execute.status"] is None
    assert killed["status"] == "incomplete" and "did not finish" in killed["error"]
    assert killed["compile.compiler_options.xla_cpu_enable_fast_math"] == "false"


def test_xla_unknown_sentinels_are_n_a_in_the_report_and_progress_lines(tmp_path: Path) -> None:
    root = tmp_path / "multirun"
    SweepPlan(total=1, varying=("program",)).write(root)
    raw = _manifest(
        "ok",
        {
            "stage_out": _stage("ran", 0.01),
            "lower": _stage("ran", 0.02, flops=-2.0),
            "compile": _stage(
                "ran",
                0.03,
                flops=-2.0,
                bytes_accessed=-2.0,
                argument_bytes=32,
                output_bytes=16,
                temp_bytes=8,
                code_bytes=0,
            ),
            "execute": _stage("ran", 0.04, median_s=2e-6, stddev_s=1e-7),
        },
    )
    _job(root, 0, ["program=inv"], raw)
    table = report.write_report(root, plots=False)
    (row,) = table.rows
    # No figure to sort or autotune on: an objective on compile.flops must not pick -2 as best.
    assert (row["compile.flops"], row["compile.bytes_accessed"]) == (None, None)
    assert row["compile.temp_bytes"] == 8
    csv_row = (root / report.CSV_NAME).read_text().splitlines()[1]
    assert "-2" not in csv_row
    md = (root / report.MD_NAME).read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("| 0 |"))
    assert "| n/a | n/a | 32 B | 16 B | 8 B | 0 B | 2.0 us | n/a |" in line
    assert "-2" not in md.replace(str(root), "<sweep dir>")  # (pytest-2xx in the tmp path)
    progress = progress_line(1, 1, ["program=inv"], "ok", raw, None)
    assert progress.endswith("compile ran 30.00 ms, FLOP n/a, temp 8 B, execute 2.0 us")


def test_report_cli_exits_1_when_a_job_failed(
    sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_main([str(sweep), "--no-plots"]) == 1
    assert "3 jobs, 2 failed" in capsys.readouterr().out
    assert not (sweep / "plots").exists()
    csv_text = (sweep / "sweep.csv").read_text().splitlines()
    assert len(csv_text) == 4
    assert csv_text[1].startswith(
        "0,true,,ok,ran,0.01,ran,0.02,cached,0.03,ran,0.04,100.0,64.0,32,16,8,0,"
    )
    md = (sweep / "sweep.md").read_text()
    assert "3 jobs: 1 ok, 2 failed." in md and "| 2 | false |  | **incomplete** |" in md
    assert "cached 30.00 ms" in md and "2.0 us" in md


def test_report_without_matplotlib_still_writes_tables(
    sweep: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.delitem(sys.modules, "jaxaot.sweeps.plots", raising=False)
    table = report.write_report(sweep)
    assert table.plots == []
    assert (
        "Plots skipped: matplotlib is not installed (pip install 'jaxaot[sweep]')."
        in (sweep / "sweep.md").read_text()
    )


def test_finish_slots_are_unique_across_threads(tmp_path: Path) -> None:
    slots: list[int] = []
    lock = threading.Lock()

    def claim() -> None:
        for _ in range(4):
            n = claim_finish_slot(tmp_path)
            with lock:
                slots.append(n)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(slots) == list(range(1, 33))


def test_heartbeat_names_the_running_stage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = Heartbeat(tmp_path, 1.0, "job 3", ["stage_out", "lower", "compile"]).message()
    assert before is not None and before.startswith("still starting or tracing (job 3): ")
    (tmp_path / "manifest.json").write_text(
        json.dumps(
            _manifest("running", {"stage_out": _stage("ran", 0.1), "lower": _stage("ran", 0.2)})
        )
    )
    caplog.set_level(logging.INFO, logger="jaxaot")
    beat = Heartbeat(tmp_path, 0.02, "job 3", ["stage_out", "lower", "compile", "execute"])
    beat.start()
    deadline = time.time() + 5
    while (
        not any("still compiling" in r.message for r in caplog.records) and time.time() < deadline
    ):
        time.sleep(0.01)
    beat.stop()
    line = next(r.message for r in caplog.records if "still compiling" in r.message)
    assert line.startswith("still compiling (job 3): ") and " in compile, " in line
    assert not beat._thread.is_alive()


def test_relay_prints_each_job_line_once_and_says_it_is_alive(tmp_path: Path) -> None:
    printed: list[str] = []
    relay = ProgressRelay(tmp_path, total=3, heartbeat_s=0.2, poll_s=0.02, write=printed.append)
    relay.start()
    relay_line(tmp_path, 2, "[2/3] n=2 | ok")
    relay_line(tmp_path, 1, "[1/3] n=1 | ok")
    deadline = time.time() + 5
    while not any(p.startswith("[sweep]") for p in printed) and time.time() < deadline:
        time.sleep(0.01)
    relay_line(tmp_path, 3, "[3/3] n=3 | failed | boom")
    relay.stop()  # the last line is printed even if it arrives as the sweep ends
    jobs = [p for p in printed if not p.startswith("[sweep]")]
    assert sorted(jobs) == ["[1/3] n=1 | ok", "[2/3] n=2 | ok", "[3/3] n=3 | failed | boom"]
    assert len(set(jobs)) == 3
    alive = next(p for p in printed if p.startswith("[sweep]"))
    assert alive.startswith("[sweep] 2/3 jobs finished, ") and "queued or running" in alive
    assert not relay._thread.is_alive()


def test_override_formatting() -> None:
    assert override_value("program.args.1='f32[8,256]'") == "f32[8,256]"
    assert override_value("x=it\\'s") == "it\\'s"
    assert short_names(
        [
            "compile.compiler_options.xla_cpu_enable_fast_math",
            "program.args.1",
            "execute.seed",
            "seed",
        ]
    ) == {
        "compile.compiler_options.xla_cpu_enable_fast_math": "xla_cpu_enable_fast_math",
        "program.args.1": "args.1",
        "execute.seed": "execute.seed",
        "seed": "seed",
    }
    line = progress_line(2, None, ["execute.seed=1"], "failed", None, "boom")
    assert line == "[2/?] seed=1 | failed | boom"


def test_a_negative_headroom_survives_into_the_report(tmp_path: Path) -> None:
    """A verdict's headroom is negative when the program does not fit; it is no sentinel."""
    raw = _manifest(
        "does_not_fit",
        {
            "compile": _stage(
                "failed",
                0.3,
                topology="v5e:2x2",
                fits=False,
                hbm_bytes_needed=20 * 2**30,
                hbm_bytes_available=16 * 2**30,
                headroom_bytes=-4 * 2**30,
                flops=-2.0,
            ),
        },
        error="does not fit",
    )
    _job(tmp_path / "multirun", 0, ["compile.topology=v5e:2x2"], raw)
    (row,) = report.collect(tmp_path / "multirun").rows
    assert row["compile.headroom_bytes"] == -4 * 2**30
    assert row["compile.fits"] is False
    assert row["compile.flops"] is None  # while XLA's sentinel is still no figure
