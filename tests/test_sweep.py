"""Sweeps through the CLI: launchers, the report, progress lines, failures and compile counts.

Each sweep runs once per module (module-scoped fixtures) and several tests read its results,
which keeps the file to a handful of small subprocess sweeps.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import SuiteServer, cli_env, extra_reason, read_manifest, run_cli, served_env

pytest.importorskip("matplotlib", reason=extra_reason("sweep"))

from jaxaot.sweeps.progress import WARNING_CHARS, human_value, progress_line
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MLP_SMALL = "program.args.1=f32[8,256]"


def _sweep(
    tmp: Path, *overrides: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    sweep_dir = tmp / "sweep"
    env = {**(env or cli_env()), "JAXAOT_STORE_DIR": str(tmp / "store")}
    proc = run_cli(["-m", *overrides, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp, env=env)
    return proc, sweep_dir


def _progress(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if re.match(r"\[\d+/\d+\] ", ln)]


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def _compile_statuses(sweep_dir: Path) -> list[str]:
    return sorted(
        read_manifest(sweep_dir / r["dir"])["stages"]["compile"]["status"] for r in _rows(sweep_dir)
    )


def _assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.size[0] > 300 and img.size[1] > 200


def _assert_csv_matches_manifests(sweep_dir: Path) -> None:
    for row in _rows(sweep_dir):
        manifest = read_manifest(sweep_dir / row["dir"])
        for stage, rec in manifest["stages"].items():
            assert row[f"{stage}.status"] == rec["status"]
            assert float(row[f"{stage}.seconds"]) == rec["seconds"]
        metrics = {
            **manifest["stages"]["compile"]["metrics"],
            **manifest["stages"].get("execute", {}).get("metrics", {}),
        }
        for col in (
            "compile.flops",
            "compile.bytes_accessed",
            "compile.argument_bytes",
            "compile.output_bytes",
            "compile.temp_bytes",
            "compile.code_bytes",
            "execute.median_s",
            "execute.flops_per_s",
        ):
            want = metrics.get(col.split(".", 1)[1])
            assert (float(row[col]) if row[col] else None) == want, (col, row[col], want)


@pytest.fixture(scope="module")
def basic_sweep(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[Any, Path]:
    """2 compiler options x 2 seeds = 4 jobs, 2 distinct compiles, basic launcher."""
    return _sweep(
        tmp_path_factory.mktemp("basic"),
        "program=mlp",
        MLP_SMALL,
        "compile.compiler_options.xla_cpu_enable_fast_math=true,false",
        "execute.seed=0,1",
        "execute.repeats=2",
        env=served_env(suite_server),
    )


@pytest.fixture(scope="module")
def joblib_sweep(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[Any, Path]:
    """An execute-only sweep (4 seeds) in 2 parallel worker processes."""
    return _sweep(
        tmp_path_factory.mktemp("joblib"),
        "program=mlp",
        MLP_SMALL,
        "execute.seed=0,1,2,3",
        "execute.repeats=2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        env=served_env(suite_server),
    )


# its sweep is a fixture chosen at run time: in the xdist worker of the tests that share them
# (conftest's group for this module's module-scoped fixtures)
@pytest.mark.xdist_group("test_sweep")
@pytest.mark.parametrize("which", ["basic_sweep", "joblib_sweep"])
def test_report_has_a_row_per_job_and_valid_plots(
    which: str, request: pytest.FixtureRequest
) -> None:
    proc, sweep_dir = request.getfixturevalue(which)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(sweep_dir)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    assert sorted(int(r["job"]) for r in rows) == [0, 1, 2, 3]
    _assert_csv_matches_manifests(sweep_dir)
    md = (sweep_dir / "sweep.md").read_text()
    assert "4 jobs: 4 ok, 0 failed." in md
    assert md.count("\n| ") == 5  # header + 4 rows
    plots = sorted((sweep_dir / "plots").glob("*.png"))
    assert plots and all(f"plots/{p.name}" in md for p in plots)
    for p in plots:
        _assert_valid_png(p)
    assert f"report: {sweep_dir / 'sweep.md'}" in proc.stdout


def test_report_columns_are_the_varying_overrides(basic_sweep: tuple[Any, Path]) -> None:
    _, sweep_dir = basic_sweep
    header = (sweep_dir / "sweep.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == [
        "job",
        "compile.compiler_options.xla_cpu_enable_fast_math",
        "execute.seed",
        "status",
    ]
    assert "program" not in header  # fixed overrides are named once, above the table
    md = (sweep_dir / "sweep.md").read_text()
    assert "Fixed overrides: `program=mlp program.args.1=f32[8,256] execute.repeats=2`" in md
    names = {p.name for p in (sweep_dir / "plots").glob("*.png")}
    assert names == {"compile.compiler_options.xla_cpu_enable_fast_math.png", "execute.seed.png"}


def test_progress_line_per_job(basic_sweep: tuple[Any, Path]) -> None:
    proc, _ = basic_sweep
    lines = _progress(proc.stdout)
    assert [ln.split()[0] for ln in lines] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert lines[0].startswith("[1/4] xla_cpu_enable_fast_math=True seed=0 | ok | compile ran")
    assert all("MFLOP" in ln and "execute" in ln for ln in lines)
    assert "stage      status" not in proc.stdout  # no per-job summary table in a sweep


def test_basic_sweep_compiles_each_key_once(basic_sweep: tuple[Any, Path]) -> None:
    _, sweep_dir = basic_sweep
    assert _compile_statuses(sweep_dir) == ["cached", "cached", "ran", "ran"]


def test_execute_only_sweep_in_parallel_compiles_once(joblib_sweep: tuple[Any, Path]) -> None:
    proc, sweep_dir = joblib_sweep
    assert _compile_statuses(sweep_dir) == ["cached", "cached", "cached", "ran"]
    lines = sorted(ln.split()[0] for ln in _progress(proc.stdout))
    assert lines == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]  # finish order numbers are unique


def test_failing_points_are_rows_with_errors_and_exit_nonzero(tmp_path: Path) -> None:
    proc, sweep_dir = _sweep(
        tmp_path,
        "program=axpy",
        "compile.backend=cpu,tpu",
        "execute.repeats=1,0",
        "hydra.callbacks.sweep.plots=false",
    )
    assert proc.returncode == 1
    rows = {(r["compile.backend"], r["execute.repeats"]): r for r in _rows(sweep_dir)}
    assert len(rows) == 4
    assert rows["cpu", "1"]["status"] == "ok" and rows["cpu", "1"]["error"] == ""
    assert rows["cpu", "0"]["status"] == "failed"
    assert rows["cpu", "0"]["error"] == "execute.repeats: expected >= 1, found 0"
    assert rows["tpu", "1"]["status"] == "failed"
    assert rows["tpu", "1"]["error"].startswith("compile.backend='tpu': no tpu backend")
    md = (sweep_dir / "sweep.md").read_text()
    assert "4 jobs: 1 ok, 3 failed." in md and "**failed**" in md
    assert "[2/4] backend=cpu repeats=0 | failed | execute.repeats: expected >= 1" in proc.stdout
    # The failed jobs as the progress lines numbered them, not by their folders (0-based).
    assert proc.stderr.splitlines()[-1] == (
        "sweep: 3 of 4 jobs failed: [2/4], [3/4], [4/4] (errors above and in sweep.md)"
    )
    assert "[HYDRA]" not in proc.stdout + proc.stderr
    record = json.loads((sweep_dir / rows["cpu", "0"]["dir"] / "job.json").read_text())
    assert record["code"] == 1 and record["num"] == 1


def test_compile_only_sweep_with_submitit_local(tmp_path: Path) -> None:
    proc, sweep_dir = _sweep(
        tmp_path,
        "program=mlp",
        "stop_after=compile",
        "program.args.1=f32[8,256],f32[32,256]",
        "hydra/launcher=submitit_local",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(sweep_dir)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    assert (sweep_dir / ".submitit").is_dir()  # the jobs really went through submitit
    # The jobs' output goes to submitit's logs; their progress lines reach the user anyway.
    progress = re.findall(
        r"^\[(\d)/2\] args\.1=(f32\[\d+,256\]) \| (\w+) \| compile ran", proc.stdout, re.M
    )
    assert sorted(n for n, _, _ in progress) == ["1", "2"], proc.stdout
    assert sorted((shape, status) for _, shape, status in progress) == [
        ("f32[32,256]", "ok"),
        ("f32[8,256]", "ok"),
    ]
    _assert_csv_matches_manifests(sweep_dir)
    by_shape = {r["program.args.1"]: r for r in rows}
    assert float(by_shape["f32[32,256]"]["compile.flops"]) > float(
        by_shape["f32[8,256]"]["compile.flops"]
    )
    assert all(r["compile.temp_bytes"] and r["execute.median_s"] == "" for r in rows)
    assert {r["execute.status"] for r in rows} == {"skipped"}
    _assert_valid_png(sweep_dir / "plots" / "program.args.1.png")


def test_a_jobs_stage_warnings_are_on_its_progress_line_and_in_the_report(tmp_path: Path) -> None:
    # log of random normal inputs: NaN for the negative ones, the execute stage's warning
    proc, sweep_dir = _sweep(
        tmp_path,
        "program.target=jax.numpy:log",
        "program.args=[f32[16]],[f32[32]]",
        "hydra.callbacks.sweep.plots=false",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # each warning once: on its job's progress line
    lines = _progress(proc.stdout)
    assert len(lines) == 2
    for line in lines:
        assert " | ok, 1 warning | compile " in line, line
        assert line.endswith(" | warning: execute: non-finite values (nan/inf) in output(s) <root>")
    rows = _rows(sweep_dir)
    assert [r["warnings"] for r in rows] == [
        "execute: non-finite values (nan/inf) in output(s) <root>"
    ] * 2
    md = (sweep_dir / "sweep.md").read_text()
    assert "| ok, 1 warning |" in md
    assert "## Warnings\n\n- job 0: execute: non-finite values" in md
    assert "- job 1: execute: non-finite values" in md


def test_progress_line_counts_warnings_and_shortens_the_first() -> None:
    manifest = {"warnings": ["compile: " + "x" * 200, "execute: non-finite values"]}
    line = progress_line(1, 2, ["execute.seed=0"], "ok", manifest, None)
    head, status, figures, warning = line.split(" | ")
    assert head == "[1/2] seed=0" and status == "ok, 2 warnings" and figures == ""
    assert warning.startswith("warning: compile: xxx") and warning.endswith("... (+1 more)")
    assert len(warning) == len("warning: ") + WARNING_CHARS + len(" (+1 more)")
    assert progress_line(1, 2, ["execute.seed=0"], "ok", {}, None) == "[1/2] seed=0 | ok"


@pytest.mark.parametrize(
    "args",
    [
        ["program=axpy", "program.args=[3,4]", "execute.repeat=2,3"],  # a mistyped key
        ["program=mpl,axpy"],  # a mistyped option
    ],
)
def test_a_sweep_refused_before_its_first_job_leaves_no_folder(
    tmp_path: Path, args: list[str]
) -> None:
    proc = run_cli(["-m", *args], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("jaxaot: error: ") and "did you mean" in proc.stderr
    assert not (tmp_path / "outputs").exists()
    named = tmp_path / "named" / "sweep"
    proc = run_cli(["-m", *args, f"hydra.sweep.dir={named}"], cwd=tmp_path)
    assert proc.returncode == 1 and not (tmp_path / "named").exists()


def test_a_sweep_folder_with_a_finished_job_is_kept(tmp_path: Path) -> None:
    from jaxaot.rundir import dirs

    sweep = tmp_path / "sweep"
    dirs.check_user_dirs([f"hydra.sweep.dir={sweep}"], True)  # made by this process
    (sweep / ".jaxaot" / "finished").mkdir(parents=True)
    (sweep / ".jaxaot" / "sweep.json").write_text("{}")
    (sweep / "multirun.yaml").write_text("")
    assert not dirs.remove_unstarted(sweep)  # a job finished: the sweep started
    (sweep / ".jaxaot" / "finished").rmdir()
    (sweep / "0").mkdir()
    assert not dirs.remove_unstarted(sweep)  # a job folder
    (sweep / "0").rmdir()
    assert dirs.remove_unstarted(sweep) and not tmp_path.joinpath("sweep").exists()


def test_objective_values_read_in_their_units() -> None:
    assert human_value("execute.median_s", 0.000389348) == "389.3 us"
    assert human_value("compile.seconds", 2.5) == "2.50 s"
    assert human_value("compile.temp_bytes", 3 * 2**20) == "3.0 MiB"
    assert human_value("compile.bytes_accessed", 512) == "512 B"
    assert human_value("execute.flops_per_s", 1.5e9) == "1.5e+09"  # a rate: as measured
    assert human_value("compile.flops", 123456789) == "1.23457e+08"
