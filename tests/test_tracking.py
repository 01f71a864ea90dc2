"""MLflow tracking (``+tracking=mlflow``): runs and sweeps logged to a real ``mlflow server`` on
loopback (tests/mlflow_server.py), every logged value read back through MlflowClient and
compared with the run's own files."""

from __future__ import annotations

import csv
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env, extra_reason, missing_extra_modules, read_manifest, run_cli
from jaxaot.errors import EXIT_DOES_NOT_FIT
from mlflow_server import free_port, mlflow_server  # noqa: F401  (the module's fixture)

# Known from the venv's path, not by importing mlflow (2-3 s of CPU in every worker's collection).
if missing_extra_modules("tracking"):
    pytest.skip(extra_reason("tracking"), allow_module_level=True)

from jaxaot.sweeps.tracking import (
    PARENT_NAME,
    MlflowTracking,
    Session,
    TrackingFailed,
    default_uri,
)
from jaxaot.sweeps.tracking_record import (
    LINKS_NAME,
    config_params,
    metric_values,
)

pytestmark = [pytest.mark.extra("testing", "tracking"), pytest.mark.xdist_group("t1_tracking")]

AXPY = ["program=axpy", "program.args=[3,4]"]


def _tracked(server: Any, experiment: str, *extra: str) -> list[str]:
    return [
        "+tracking=mlflow",
        f"hydra.callbacks.tracking.uri={server.uri}",
        f"hydra.callbacks.tracking.experiment={experiment}",
        *extra,
    ]


def _run(tmp: Path, *args: str) -> tuple[Any, Path]:
    run_dir = tmp / "run"
    proc = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp)
    return proc, run_dir


def _runs(server: Any, experiment: str) -> list[Any]:
    client = server.client()
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment}"
    return list(client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]))


def _artifacts(client: Any, run_id: str, path: str | None = None) -> dict[str, int]:
    found: dict[str, int] = {}
    for a in client.list_artifacts(run_id, path):
        if a.is_dir:
            found.update(_artifacts(client, run_id, a.path))
        else:
            found[a.path] = a.file_size or 0  # MLflow lists an empty file's size as None
    return found


def _files(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _download(client: Any, run_id: str, path: str, dst: Path) -> bytes:
    dst.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_bytes()


def _check_run(server: Any, run: Any, run_dir: Path, overrides: list[str], tmp: Path) -> None:
    """Every value the run logged against its run dir: parameters, metrics, tags, files."""
    client = server.client()
    manifest = read_manifest(run_dir)
    data = run.data
    # parameters: the resolved options and the command line's group choices
    expected = config_params(manifest["config"])
    assert {k: data.params[k] for k in expected} == expected
    assert data.params["program"] == "axpy" and data.params["tracking"] == "mlflow"
    for i, arg in enumerate(manifest["config"]["program"]["args"]):
        assert data.params[f"program.args.{i}"] == json.dumps(arg)
    # metrics: every figure of the manifest, each equal to what the manifest says
    assert data.metrics == metric_values(manifest)
    stages = manifest["stages"]
    for stage in ("stage_out", "lower", "compile"):
        assert data.metrics[f"{stage}.seconds"] == stages[stage]["seconds"]
    compile_metrics = stages["compile"]["metrics"]
    for name in ("flops", "bytes_accessed", "argument_bytes", "temp_bytes", "peak_bytes"):
        assert data.metrics[f"compile.{name}"] == compile_metrics[name]
    if manifest["status"] == "ok":
        for name in ("median_s", "stddev_s"):
            assert data.metrics[f"execute.{name}"] == stages["execute"]["metrics"][name]
    # tags: what ran, on what, with which key, and how it ended
    tags = data.tags
    assert tags["jaxaot.program"] == manifest["config"]["program"]["name"]
    assert tags["jaxaot.jax"] == manifest["versions"]["jax"]
    assert tags["jaxaot.jaxlib"] == manifest["versions"]["jaxlib"]
    assert tags["jaxaot.compile_key"] == stages["compile"]["key"]
    assert tags["jaxaot.status"] == manifest["status"]
    assert tags["jaxaot.run_dir"] == manifest["run_dir"]
    assert tags["jaxaot.overrides"] == " ".join(overrides)
    assert tags.get("jaxaot.error") == manifest["error"]
    if manifest["backend"]["topology"] is None:
        assert tags["jaxaot.backend"] == manifest["backend"]["platform"]
    # files: every file of the run dir uploaded as it is (all under the default 10 MiB); a
    # sweep job's job.json is the sweep callback's, written after the job is logged
    local = {k: v for k, v in _files(run_dir).items() if k != "job.json"}
    assert _artifacts(client, run.info.run_id) == local
    got = _download(client, run.info.run_id, "manifest.json", tmp / "dl" / run.info.run_id)
    assert got == (run_dir / "manifest.json").read_bytes()


def test_a_run_is_one_mlflow_run_with_every_figure(mlflow_server: Any, tmp_path: Path) -> None:  # noqa: F811
    overrides = [*AXPY, *_tracked(mlflow_server, "single")]
    proc, run_dir = _run(tmp_path, *overrides)
    assert proc.returncode == 0, proc.stderr
    assert "tracking" not in proc.stderr
    # one line says where the run goes; MLflow's own "View run ..." line is not printed
    assert proc.stdout.count(f"tracking: runs to {mlflow_server.uri}\n") == 1
    assert "View run" not in proc.stdout
    (run,) = _runs(mlflow_server, "single")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"axpy {run_dir.name}"
    assert "mlflow.parentRunId" not in run.data.tags
    manifest = read_manifest(run_dir)
    assert run.info.start_time == int(manifest["started"] * 1000)
    _check_run(mlflow_server, run, run_dir, [*AXPY, "+tracking=mlflow"], tmp_path)


def test_a_failed_run_is_logged_failed_with_its_error_and_large_files_as_links(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    # a float where axpy's int arithmetic runs, and a stop after compile: the executable
    # (several KiB) and the manifest are over the 2 KiB limit
    overrides = [
        "program=axpy",
        "program.args=[3]",
        *_tracked(mlflow_server, "failed", "hydra.callbacks.tracking.max_artifact_bytes=2048"),
    ]
    proc, run_dir = _run(tmp_path, *overrides)
    assert proc.returncode != 0
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["error"]
    (run,) = _runs(mlflow_server, "failed")
    client = mlflow_server.client()
    assert run.info.status == "FAILED"
    assert run.data.tags["jaxaot.status"] == "failed"
    assert run.data.tags["jaxaot.error"] == manifest["error"]
    assert run.data.metrics == metric_values(manifest)
    local = _files(run_dir)
    uploaded = _artifacts(client, run.info.run_id)
    links = _download(client, run.info.run_id, LINKS_NAME, tmp_path / "dl").decode()
    listed = {}
    for line in links.splitlines()[1:]:
        rel, size, where = line.split("\t")
        assert Path(where) == (run_dir / rel).resolve()
        listed[rel] = int(size)
    assert listed == {k: v for k, v in local.items() if v > 2048} and "manifest.json" in listed
    assert {k: v for k, v in uploaded.items() if k != LINKS_NAME} == {
        k: v for k, v in local.items() if v <= 2048
    }


def test_a_run_that_does_not_fit_is_logged_with_its_verdict(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    overrides = [
        *AXPY,
        "compile.topology=v5e:2x2",
        "compile.hbm_reserve=16911433724",  # all but 4 bytes of a v5e chip's HBM
        *_tracked(mlflow_server, "misfit"),
    ]
    proc, run_dir = _run(tmp_path, *overrides)
    assert proc.returncode == EXIT_DOES_NOT_FIT, proc.stderr
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "does_not_fit"
    (run,) = _runs(mlflow_server, "misfit")
    metrics = manifest["stages"]["compile"]["metrics"]
    assert run.info.status == "FINISHED"  # a verdict, not a crash
    assert run.data.tags["jaxaot.status"] == "does_not_fit"
    assert run.data.tags["jaxaot.error"] == manifest["error"]
    assert run.data.tags["jaxaot.topology"] == "v5e:2x2"
    assert run.data.tags["jaxaot.backend"] == manifest["backend"]["platform"] == "tpu"
    assert run.data.tags["jaxaot.libtpu"] == manifest["backend"]["libtpu"]
    assert run.data.metrics["compile.fits"] == 0.0
    assert run.data.metrics["compile.headroom_bytes"] == metrics["headroom_bytes"] < 0
    assert run.data.metrics["compile.hbm_bytes_needed"] == metrics["hbm_bytes_needed"]
    assert run.data.metrics == metric_values(manifest)


def test_a_sweep_is_a_parent_run_with_one_nested_run_per_job(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "program=axpy",
        "program.args=[3,4],[5,6]",
        *_tracked(mlflow_server, "sweep"),
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = run_cli(args, cwd=tmp_path, env=cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store")))
    assert proc.returncode == 0, proc.stderr
    assert "sweep: 2 jobs, 2 ok, 0 failed" in proc.stdout
    runs = _runs(mlflow_server, "sweep")
    parents = [r for r in runs if r.data.tags.get("jaxaot.kind") == "sweep"]
    assert len(parents) == 1 and len(runs) == 3
    parent = parents[0]
    assert json.loads((sweep_dir / PARENT_NAME).read_text())["run_id"] == parent.info.run_id
    assert parent.info.status == "FINISHED"
    assert parent.data.params["program.args"] == "[3,4],[5,6]"
    assert parent.data.metrics == {
        "sweep.jobs": 2.0,
        "sweep.ok": 2.0,
        "sweep.failed": 0.0,
        "sweep.does_not_fit": 0.0,
    }
    client = mlflow_server.client()
    uploaded = _artifacts(client, parent.info.run_id)
    report = {"sweep.md", "sweep.csv", "multirun.yaml"}
    plots = {f"plots/{p.name}" for p in (sweep_dir / "plots").glob("*.png")}
    assert plots and set(uploaded) == report | plots
    got = _download(client, parent.info.run_id, "sweep.csv", tmp_path / "dl")
    assert got == (sweep_dir / "sweep.csv").read_bytes()
    children = sorted(
        (r for r in runs if r is not parent), key=lambda r: int(r.data.tags["jaxaot.job"])
    )
    rows = list(csv.DictReader((sweep_dir / "sweep.csv").read_text().splitlines()))
    for job, (child, row) in enumerate(zip(children, rows, strict=True)):
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED"
        job_dir = sweep_dir / str(job)
        args_value = json.loads(f"[{row['program.args']}]")[0]
        assert child.info.run_name == f"{job}: program.args={row['program.args']}"
        assert "program.args" not in child.data.params  # one parameter per argument only
        assert [json.loads(child.data.params[f"program.args.{i}"]) for i in (0, 1)] == args_value
        overrides = ["program=axpy", f"program.args={row['program.args']}", "+tracking=mlflow"]
        _check_run(mlflow_server, child, job_dir, overrides, tmp_path)


def _black_hole() -> socket.socket:
    """A listening socket that never answers: the kernel accepts, nobody reads."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


@pytest.mark.parametrize("server", ["down", "silent"])
def test_an_unreachable_server_costs_one_warning_and_changes_nothing(
    server: str, tmp_path: Path
) -> None:
    hole = _black_hole() if server == "silent" else None
    port = hole.getsockname()[1] if hole else free_port()
    uri = f"http://127.0.0.1:{port}"
    try:
        began = time.monotonic()
        proc, run_dir = _run(
            tmp_path,
            *AXPY,
            "+tracking=mlflow",
            f"hydra.callbacks.tracking.uri={uri}",
            "hydra.callbacks.tracking.timeout_s=1",
            "hydra.callbacks.tracking.max_retries=1",
        )
        took = time.monotonic() - began
    finally:
        if hole is not None:
            hole.close()
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith(f"jaxaot: tracking: the run not logged to MLflow at {uri} (")
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "ok" and manifest["error"] is None
    artifacts = set(manifest["stages"]["compile"]["artifacts"])
    assert artifacts <= set(_files(run_dir))
    assert not [p for p in _files(run_dir) if "mlflow" in p or p == LINKS_NAME]
    # one request: a 1 s timeout, one retry after a 1 s backoff; then nothing more is tried
    assert took < 60, took


@pytest.mark.slow  # waits out two request timeouts
def test_a_silent_server_is_given_up_within_the_timeouts() -> None:
    hole = _black_hole()
    try:
        session = Session(f"http://127.0.0.1:{hole.getsockname()[1]}", 1, 1, budget_s=30)
        began = time.monotonic()
        with pytest.raises(TrackingFailed, match=r"^finding the experiment: "):
            session.experiment_id("x")
        took = time.monotonic() - began
    finally:
        hole.close()
    # two attempts of 1 s each and a backoff of about 1 s between them
    assert 1.5 < took < 8, took
    spent = Session("http://127.0.0.1:9", 1, 0, budget_s=1)
    spent._deadline = time.monotonic() - 1
    with pytest.raises(
        TrackingFailed, match=r"^creating the run: out of time \(1 s for this run\)"
    ):
        spent.call("creating the run", "create_run", "0")


def test_the_tracking_uri_is_the_configs_then_the_environments_then_mlflows_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # MLflow 3's own default, made absolute: `mlflow ui` in this folder opens it
    assert default_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert MlflowTracking()._uri() == default_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert MlflowTracking()._uri() == "http://127.0.0.1:5000"
    assert MlflowTracking(uri="http://h:1")._uri() == "http://h:1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"timeout_s": 0},
            r"^hydra\.callbacks\.tracking\.timeout_s: expected an integer from 1 to 60, found 0;",
        ),
        (
            {"max_retries": "2"},
            r"^hydra\.callbacks\.tracking\.max_retries: expected an integer from 0 to 5, found '2';",
        ),
        (
            {"budget_s": 0.5},
            r"^hydra\.callbacks\.tracking\.budget_s: expected a number from 1 to 600, found 0\.5;",
        ),
        (  # a down server must not stall a run for a day, whatever a config says
            {"budget_s": 86400},
            r"^hydra\.callbacks\.tracking\.budget_s: expected a number from 1 to 600, found 86400;",
        ),
        ({"timeout_s": 3600}, r"^hydra\.callbacks\.tracking\.timeout_s: expected an integer from"),
        ({"max_retries": 50}, r"^hydra\.callbacks\.tracking\.max_retries: expected an integer f"),
        ({"experiment": ""}, r"^hydra\.callbacks\.tracking\.experiment: expected an experiment"),
        ({"uri": 5}, r"^hydra\.callbacks\.tracking\.uri: expected a tracking URI or null, found 5"),
    ],
)
def test_bad_tracking_options_are_refused_naming_the_key(
    kwargs: dict[str, Any], message: str
) -> None:
    from jaxaot.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        MlflowTracking(**kwargs)


def test_the_import_policy_admits_the_tracking_callback_and_no_foreign_one(
    tmp_path: Path,
) -> None:
    from jaxaot.config.trust import HYDRA, check_name
    from jaxaot.config.trust.sources import user_policy

    check_name(
        "jaxaot.sweeps.tracking.MlflowTracking", "hydra.callbacks.tracking", user_policy(), HYDRA
    )
    marker = tmp_path / "pwned"
    proc = run_cli(
        [
            *AXPY,
            "+tracking=mlflow",
            "hydra.callbacks.tracking._target_=distutils.spawn.spawn",
            f"+hydra.callbacks.tracking.cmd=[touch,{marker}]",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jaxaot: error: hydra.callbacks.tracking._target_=")
    assert "'distutils.spawn.spawn', which the import policy does not allow" in lines[0]
    assert not marker.exists() and not (tmp_path / "r" / "manifest.json").exists()


def test_without_mlflow_one_line_names_the_extra_and_nothing_is_tracked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import sys

    from omegaconf import OmegaConf

    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    callback = MlflowTracking()
    callback.on_run_start(OmegaConf.create({}))
    assert capsys.readouterr().err == (
        "jaxaot: tracking: +tracking=mlflow needs mlflow, which is not installed; install it "
        "with: pip install 'jaxaot[tracking]' (this run is not tracked)\n"
    )
    config = OmegaConf.create({"hydra": {"mode": "RUN", "runtime": {"output_dir": str(tmp_path)}}})
    callback.on_job_start(config)
    callback.on_job_end(config, None)
    assert capsys.readouterr().err == ""


def test_a_database_uri_without_sqlalchemy_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "sqlalchemy" else real(n, *a)
    )
    with pytest.raises(
        TrackingFailed,
        match=r"^the tracking URI sqlite:////x\.db is a database, which needs the full mlflow \("
        r"pip install mlflow, which also brings `mlflow ui`\); or track to a server",
    ):
        Session("sqlite:////x.db", 1, 0, budget_s=5).experiment_id("x")


def test_a_sweep_with_the_server_down_warns_once_and_its_jobs_log_nothing(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "program=axpy",
        "program.args=[3,4],[5,6]",
        "+tracking=mlflow",
        f"hydra.callbacks.tracking.uri={uri}",
        "hydra.callbacks.tracking.timeout_s=1",
        "hydra.callbacks.tracking.max_retries=1",
        "hydra.callbacks.sweep.plots=false",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = run_cli(args, cwd=tmp_path, env=cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store")))
    assert proc.returncode == 0, proc.stderr
    assert "sweep: 2 jobs, 2 ok, 0 failed" in proc.stdout
    warnings = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith(f"jaxaot: tracking: the sweep not logged to MLflow at {uri} (")
    assert json.loads((sweep_dir / PARENT_NAME).read_text()) == {
        "uri": uri,
        "experiment_id": None,
        "run_id": None,
        "max_artifact_bytes": 10 * 2**20,
    }


@pytest.fixture(scope="module")
def slurm() -> Any:
    """A single-node SLURM cluster (tests/slurm_cluster.py; conftest runs the tests that use a
    fixture of this name in one xdist worker, one cluster at a time)."""
    from conftest import missing_extra_modules
    from slurm_cluster import SlurmCluster, unavailable

    reason = unavailable() or (extra_reason("sweep") if missing_extra_modules("sweep") else None)
    if reason:
        pytest.skip(reason)
    with SlurmCluster() as cluster:
        yield cluster


# MLflow 3.17's sqlite store, read in this process, uses a loader SQLAlchemy 2.1 deprecates.
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_slurm_jobs_log_from_the_node_into_the_sweeps_parent_run(
    slurm: Any, tmp_path: Path
) -> None:
    """The jobs run as SLURM array tasks; each reads the parent run's id from the sweep dir
    and logs its own run, nested under it, into the same tracking store (a sqlite file on the
    shared file system here: no server to reach from the node)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep_dir = tmp_path / "sweep"
    env = slurm.env(cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu"))
    args = [
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.partition=debug",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1",
        "hydra.callbacks.sweep.plots=false",
        *AXPY[:1],
        "program.args=[3,4],[5,6]",
        "+tracking=mlflow",
        f"hydra.callbacks.tracking.uri={uri}",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = run_cli(args, cwd=tmp_path, module="jaxaot.cli.main", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep: 2 jobs, 2 ok, 0 failed" in proc.stdout
    assert len(list((sweep_dir / ".submitit").glob("*/*_submitted.pkl"))) == 2  # on the node
    client = MlflowClient(tracking_uri=uri)
    parent_id = json.loads((sweep_dir / PARENT_NAME).read_text())["run_id"]
    experiment = client.get_experiment_by_name("jaxaot")
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if r.info.run_id != parent_id]
    assert len(runs) == 3 and client.get_run(parent_id).info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent_id}
    args = sorted(
        [r.data.params["program.args.0"], r.data.params["program.args.1"]] for r in children
    )
    assert args == [["3", "4"], ["5", "6"]]
    for child in children:
        run_dir = Path(child.data.tags["jaxaot.run_dir"])
        assert run_dir.parent == sweep_dir
        assert child.data.metrics == metric_values(read_manifest(run_dir))


# --- where data goes is the user's call; bounds; interrupted and failed logging ---------------


def _hydra_config(tmp: Path, *, task: list[str], hydra: list[str], tracking: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "program": {"name": "transformer"},
            "hydra": {
                "mode": "RUN",
                "runtime": {"output_dir": str(tmp / "run")},
                "job": {"num": 0},
                "overrides": {"task": task, "hydra": hydra},
                "callbacks": {
                    "tracking": {"_target_": "jaxaot.sweeps.tracking.MlflowTracking", **tracking}
                },
            },
        }
    )


def test_a_preset_may_not_switch_tracking_on_or_choose_where_it_goes(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    presets = tmp_path / "cfg" / "preset"
    presets.mkdir(parents=True)
    (presets / "on.yaml").write_text(
        "# @package _global_\nhydra:\n  callbacks:\n    tracking:\n"
        "      _target_: jaxaot.sweeps.tracking.MlflowTracking\n"
        f"      uri: {mlflow_server.uri}\n      experiment: preset\n"
    )
    (presets / "uri.yaml").write_text(
        f"# @package _global_\nhydra:\n  callbacks:\n    tracking:\n      uri: {mlflow_server.uri}\n"
    )
    for n, chosen in enumerate(["+preset=on", "+tracking=mlflow +preset=uri"]):
        proc = run_cli(
            [
                "--config-dir",
                str(tmp_path / "cfg"),
                *AXPY,
                *chosen.split(),
                "stop_after=lower",
                "hydra.callbacks.tracking.experiment=preset",
                f"hydra.run.dir={tmp_path / str(n)}",
            ],
            cwd=tmp_path,
            env=cli_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'env.db'}"),
        )
        assert proc.returncode == 0, proc.stderr
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        key = "hydra.callbacks.tracking" if n == 0 else "hydra.callbacks.tracking.uri="
        name = "on" if n == 0 else "uri"
        assert line.startswith(f"jaxaot: error: {key}"), line
        assert f"preset/{name}.yaml in file://{tmp_path / 'cfg'}" in line, line
        assert line.endswith("(nothing is tracked)")
        assert "tracking: runs to" not in proc.stdout
    assert mlflow_server.client().get_experiment_by_name("preset") is None
    assert not (tmp_path / "env.db").exists()


def test_the_user_side_check_admits_the_command_line_and_refuses_the_rest(tmp_path: Path) -> None:
    from jaxaot.errors import ConfigError
    from jaxaot.sweeps.tracking import check_user_side

    uri = "http://127.0.0.1:1"
    ok = [
        (["+tracking=mlflow"], [], {}),
        (["+tracking=mlflow"], [f"hydra.callbacks.tracking.uri={uri}"], {"uri": uri}),
        ([], ["+hydra.callbacks.tracking._target_=jaxaot.sweeps.tracking.MlflowTracking"], {}),
        (
            ["+tracking=mlflow"],
            ["hydra.callbacks.tracking.max_artifact_bytes=5"],
            {"max_artifact_bytes": 5},
        ),
    ]
    for task, hydra, tracking in ok:
        check_user_side(_hydra_config(tmp_path, task=task, hydra=hydra, tracking=tracking))
    refused = [
        ([], [], {}, r"^hydra\.callbacks\.tracking \(from a config file, not the command line\) "),
        (["+tracking=mlflow"], [], {"uri": uri}, r"^hydra\.callbacks\.tracking\.uri='http://"),
        (["+tracking=mlflow"], ["hydra.callbacks.tracking.uri=http://other"], {"uri": uri}, "uri"),
        (["+tracking=mlflow"], [], {"max_artifact_bytes": 2**40}, "max_artifact_bytes=1099"),
        # a config added the callback; the command line changing one of its options is no consent
        ([], ["hydra.callbacks.tracking.experiment=x"], {}, r"^hydra\.callbacks\.tracking \(from"),
    ]
    for task, hydra, tracking, message in refused:
        with pytest.raises(ConfigError, match=message):
            check_user_side(_hydra_config(tmp_path, task=task, hydra=hydra, tracking=tracking))
    config = _hydra_config(tmp_path, task=["+tracking=mlflow"], hydra=[], tracking={})
    config.hydra.sweeper = {"params": {"hydra.callbacks.tracking.uri": f"{uri},{uri}2"}}
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.params\.hydra\.callbacks"):
        check_user_side(config)


def test_overrides_are_logged_as_written_never_with_a_secret_resolved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from jaxaot.sweeps.tracking import _overrides
    from jaxaot.sweeps.tracking_record import run_record

    monkeypatch.setenv("JAXAOT_TEST_SECRET", "hunter2")
    line = "+compile.compiler_options.x=${oc.env:JAXAOT_TEST_SECRET}"
    config = _hydra_config(tmp_path, task=["+tracking=mlflow", line], hydra=[], tracking={})
    overrides = _overrides(config, "task")
    assert overrides == ["+tracking=mlflow", line]
    record = run_record(
        tmp_path, name="n", overrides=overrides, config={}, fallback=("ok", None), max_bytes=0
    )
    assert "hunter2" not in json.dumps([record.params, record.tags])
    assert record.tags["jaxaot.overrides"] == f"+tracking=mlflow {line}"


def test_the_budget_bounds_a_run_however_slow_each_request() -> None:
    limits = Session("http://x", 10, 2, budget_s=60).limits
    assert limits(100) == (10, 2)
    assert limits(25) == (10, 1)  # two 10 s attempts and a ~1 s wait fit, a third does not
    assert limits(5.5) == (5, 0)
    assert limits(1.2) == (1, 0)
    hole = _black_hole()
    try:
        session = Session(f"http://127.0.0.1:{hole.getsockname()[1]}", 10, 2, budget_s=2)
        began = time.monotonic()
        with pytest.raises(TrackingFailed):
            session.experiment_id("x")
        with pytest.raises(TrackingFailed, match="out of time"):
            session.experiment_id("x")
        took = time.monotonic() - began
    finally:
        hole.close()
    assert took < 3.5, took  # the budget and at most one second; unbounded: 3 x 10 s + waits


def test_a_failure_while_logging_ends_the_run_failed_not_running(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text(json.dumps({"status": "ok"}))

    def broken(self: Session, run_id: str, record: Any) -> None:
        raise TrackingFailed("logging parameters: boom")

    monkeypatch.setattr(Session, "log", broken)
    callback = MlflowTracking(uri=mlflow_server.uri, experiment="broken")
    callback._log_job(_hydra_config(tmp_path, task=[], hydra=[], tracking={}), None)
    (run,) = _runs(mlflow_server, "broken")
    assert run.info.status == "FAILED"


def test_an_interrupt_logs_the_run_and_the_open_sweep_killed(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from jaxaot.sweeps import tracking
    from jaxaot.sweeps.tracking_record import Record

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manifest = {"status": "interrupted", "config": {"program": {"name": "axpy"}}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    callback = MlflowTracking(uri=mlflow_server.uri, experiment="killed")
    config = _hydra_config(tmp_path, task=[], hydra=[], tracking={})
    session = Session(mlflow_server.uri, 5, 0, budget_s=10)
    parent = session.start(session.experiment_id("killed"), Record("sweep s", "running"), None)
    tracking._pending[str(run_dir)] = (callback, config)
    tracking._open_sweeps[str(tmp_path / "sweep")] = (mlflow_server.uri, parent)
    tracking.end_interrupted()
    assert not tracking._pending and not tracking._open_sweeps
    runs = {r.info.run_id: r for r in _runs(mlflow_server, "killed")}
    assert runs.pop(parent).info.status == "KILLED"
    (run,) = runs.values()
    assert run.info.status == "KILLED" and run.data.tags["jaxaot.status"] == "interrupted"
    # the run's name is the program its manifest names, not the composed config's default
    assert run.info.run_name == "axpy run"


def test_the_default_database_is_created_once_under_a_lock_and_a_half_built_one_is_named(
    tmp_path: Path,
) -> None:
    import sqlite3
    import threading

    from jaxaot.sweeps.tracking import ensure_sqlite

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            ensure_sqlite(uri)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    session = Session(uri, 5, 0, budget_s=30)
    assert session.experiment_id("one") == session.experiment_id("one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "mlflow.db.lock"]
    half = tmp_path / "half.db"
    with sqlite3.connect(half) as con:
        con.execute("CREATE TABLE experiments (id INTEGER)")
    with pytest.raises(
        TrackingFailed, match=rf"^{half} is a half-built MLflow database .*delete it"
    ):
        ensure_sqlite(f"sqlite:///{half}")


def test_skipped_stages_have_no_figures() -> None:
    manifest = {
        "stages": {
            "stage_out": {"status": "ran", "seconds": 0.5},
            "lower": {"status": "ran", "seconds": 0.25},
            "compile": {"status": "skipped", "seconds": 0.0},
            "execute": {"status": "skipped", "seconds": 0.0},
        }
    }
    assert metric_values(manifest) == {"stage_out.seconds": 0.5, "lower.seconds": 0.25}


def test_a_failing_after_report_hook_keeps_the_report_and_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from jaxaot.sweeps.callbacks import SweepCallback, after_report
    from omegaconf import OmegaConf

    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()

    def broken(_: Path) -> None:
        raise RuntimeError("tracker down")

    after_report(sweep_dir, broken)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})
    SweepCallback(plots=False).on_multirun_end(config)
    out, err = capsys.readouterr()
    assert "sweep: 0 jobs, 0 ok, 0 failed" in out
    assert "RuntimeError('tracker down')" in err and len(err.splitlines()) == 1


def test_a_run_ended_by_sigterm_is_logged_killed(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    import signal
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    args = [*AXPY, *_tracked(mlflow_server, "sigterm"), "execute.repeats=100000000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxaot", *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "manifest.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert read_manifest(run_dir)["status"] == "interrupted"
    (run,) = _runs(mlflow_server, "sigterm")
    assert run.info.status == "KILLED" and run.data.tags["jaxaot.status"] == "interrupted"


def test_long_overrides_are_clipped_in_the_sweeps_name_tags_and_parameters(
    mlflow_server: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from omegaconf import OmegaConf

    long = "a" * 9000
    uri_line = f"hydra.callbacks.tracking.uri={mlflow_server.uri}"
    config = _hydra_config(
        tmp_path,
        task=["+tracking=mlflow", f"+x={long}"],
        hydra=[uri_line],
        tracking={"uri": mlflow_server.uri, "experiment": "clipped"},
    )
    OmegaConf.update(config, "hydra.sweep.dir", str(tmp_path / ("s" * 250)))
    OmegaConf.update(config, "hydra.sweeper.params", {"+y": f"{long},b"})
    MlflowTracking(uri=mlflow_server.uri, experiment="clipped").on_multirun_start(config)
    (parent,) = _runs(mlflow_server, "clipped")
    assert len(parent.info.run_name) == 250 and parent.info.run_name.endswith("...")
    assert len(parent.data.tags["jaxaot.overrides"]) == 5000
    assert len(parent.data.params["x"]) == len(parent.data.params["y"]) == 6000
