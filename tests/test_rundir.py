"""Run directories are never shared: unique time-stamped dirs, refused reuse.

Two runs started in the same second get ``<time>``, ``<time>-1``, ...: one shared
``outputs/<date>/<time>/`` would let the later silently replace the earlier's manifest,
``.hydra/`` and artifacts. A run dir named on the command line that already holds a run is refused.
"""

from __future__ import annotations

import multiprocessing
import subprocess
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env, read_manifest, run_cli, start_cli
from jaxaot.errors import ConfigError
from jaxaot.rundir.dirs import claim, unique_dir
from rundir_races import race_claim, race_unique_dir

# Spawned children import their target's module (tests/rundir_races.py): under a
# second each when quiet, minutes on a loaded 2-core machine. The wait bounds a hang, not a
# speed.
SPAWN_WAIT_S = 600

LOWER = ["program=axpy", "program.args=[f32[4],f32[4]]", "stop_after=lower"]


def _finish(proc: subprocess.Popen[str]) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


# --- the resolver: one new directory per call, across processes ------------------------------


def test_unique_dir_takes_the_next_free_suffix(tmp_path: Path) -> None:
    base = tmp_path / "a" / "12-00-00"
    assert [unique_dir(str(base)) for _ in range(3)] == [str(base), f"{base}-1", f"{base}-2"]
    assert all(Path(d).is_dir() for d in (base, f"{base}-1", f"{base}-2"))


def test_concurrent_processes_get_distinct_dirs(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(6), ctx.Queue()
    procs = [
        ctx.Process(target=race_unique_dir, args=(str(tmp_path / "t"), barrier, queue))
        for _ in range(6)
    ]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=SPAWN_WAIT_S) for _ in procs)
    for p in procs:
        p.join(SPAWN_WAIT_S)
    assert got == sorted([str(tmp_path / "t")] + [f"{tmp_path / 't'}-{i}" for i in range(1, 6)])


# --- claiming: a directory that holds a run is never reused ----------------------------------


def test_claim_publishes_the_manifest_once(tmp_path: Path) -> None:
    claim(tmp_path / "r", {"status": "running", "n": 1}, key="run_dir")
    with pytest.raises(
        ConfigError,
        match=r"^run_dir='.*/r' holds an earlier run \(manifest\.json\); "
        r"a run never reuses another run's directory: remove it",
    ):
        claim(tmp_path / "r", {"status": "running", "n": 2}, key="run_dir")
    assert '"n": 1' in (tmp_path / "r" / "manifest.json").read_text()
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["manifest.json"]  # no temp left


def test_of_concurrent_claims_on_one_dir_exactly_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=race_claim, args=(str(tmp_path / "r"), n, barrier, queue))
        for n in range(4)
    ]
    for p in procs:
        p.start()
    got = [queue.get(timeout=SPAWN_WAIT_S) for _ in procs]
    for p in procs:
        p.join(SPAWN_WAIT_S)
    winners = [n for n in got if n is not None]
    assert len(winners) == 1
    assert f'"n": {winners[0]}' in (tmp_path / "r" / "manifest.json").read_text()


def test_two_cli_runs_forced_into_one_dir_keep_both_manifests(tmp_path: Path) -> None:
    # Both ask the resolver for the same stamp at once, as two runs in one second do.
    same = "hydra.run.dir=${unique_dir:" + str(tmp_path / "same") + "}"
    procs = [start_cli([*LOWER, f"execute.seed={i}", same], cwd=tmp_path) for i in range(2)]
    for p in procs:
        _finish(p)
    dirs = [tmp_path / "same", tmp_path / "same-1"]
    seeds = sorted(read_manifest(d)["config"]["execute"]["seed"] for d in dirs)
    assert seeds == [0, 1]  # each kept its own manifest ...
    for d in dirs:  # ... and its own .hydra/ record
        seed = read_manifest(d)["config"]["execute"]["seed"]
        assert f"execute.seed={seed}" in (d / ".hydra" / "overrides.yaml").read_text()
        assert read_manifest(d)["status"] == "ok"


def test_default_run_dirs_of_simultaneous_runs_differ(tmp_path: Path) -> None:
    procs = [start_cli(LOWER, cwd=tmp_path) for _ in range(2)]
    for p in procs:
        _finish(p)
    manifests = sorted((tmp_path / "outputs").glob("*/*/manifest.json"))
    assert len(manifests) == 2
    assert all(read_manifest(m.parent)["status"] == "ok" for m in manifests)


def test_a_named_run_dir_that_holds_a_run_is_refused_untouched(tmp_path: Path) -> None:
    run_dir = tmp_path / "fixed"
    first = run_cli([*LOWER, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = run_cli([*LOWER, "execute.seed=7", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert second.returncode == 1
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"jaxaot: error: hydra.run.dir='{run_dir}' holds an earlier run (manifest.json); a run "
        "never reuses another run's directory: remove it to replace that run, or leave "
        "hydra.run.dir unset for a fresh outputs/<date>/<time>/"
    ]
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # not even .hydra/ or jaxaot.log was touched


def test_a_named_sweep_dir_that_holds_a_sweep_is_refused(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    (sweep / ".jaxaot").mkdir(parents=True)
    proc = run_cli(["-m", *LOWER, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"jaxaot: error: hydra.sweep.dir='{sweep}' holds an earlier sweep (.jaxaot); a run never "
        "reuses another run's directory: remove it to replace that run, or leave hydra.sweep.dir "
        "unset for a fresh outputs/multirun/<date>/<time>/"
    )


def test_python_run_refuses_a_run_dir_that_holds_a_run(tmp_path: Path) -> None:
    cfg = jaxaot.compose(LOWER)
    first = jaxaot.run(cfg, run_dir=tmp_path / "r")
    assert first.ok
    before = (tmp_path / "r" / "manifest.json").read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"^run_dir='.*/r' holds an earlier run .* pass a new "
        r"run_dir \(or none, for a fresh outputs/<date>/<time>/\)$",
    ):
        jaxaot.run(cfg, run_dir=tmp_path / "r")
    assert (tmp_path / "r" / "manifest.json").read_bytes() == before


def test_resuming_into_the_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    first = jaxaot.run(jaxaot.compose(LOWER), run_dir=tmp_path / "r")
    resume = jaxaot.compose([*LOWER[:2], f"resume_from={first.run_dir}", "start_at=lower"])
    with pytest.raises(ConfigError, match=r"holds an earlier run"):
        jaxaot.run(resume, run_dir=tmp_path / "r")
    assert read_manifest(tmp_path / "r")["status"] == "ok"


def test_printing_the_resolved_config_creates_no_dirs(tmp_path: Path) -> None:
    proc = run_cli(["--cfg", "hydra", "--resolve"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "dir: outputs/20" in proc.stdout  # the time-stamped dir, as it would be
    assert not list(tmp_path.iterdir())


@pytest.mark.extra("sweep")
def test_a_default_sweep_dir_holds_all_its_jobs_under_a_parallel_launcher(tmp_path: Path) -> None:
    # joblib's workers get the sweep's config pickled with its resolver cache: every job
    # resolves ${unique_dir:...} to the one sweep dir the launching process created.
    proc = run_cli(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            *LOWER,
            "execute.seed=0,1",
            "hydra.callbacks.sweep.plots=false",
        ],
        cwd=tmp_path,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    seeds = sorted(read_manifest(sweep / str(n))["config"]["execute"]["seed"] for n in range(2))
    assert seeds == [0, 1]


def test_load_manifest_refuses_other_versions_and_damage_naming_the_file(tmp_path: Path) -> None:
    import json

    from jaxaot.errors import StoreError
    from jaxaot.rundir.manifest import MANIFEST_FORMAT_VERSION, MANIFEST_NAME, load_manifest

    path = tmp_path / MANIFEST_NAME
    with pytest.raises(StoreError, match=rf"resume_from=.*: no {MANIFEST_NAME} there"):
        load_manifest(tmp_path)
    path.write_text(json.dumps({"format_version": MANIFEST_FORMAT_VERSION, "stages": {}}))
    assert load_manifest(tmp_path) == {"format_version": MANIFEST_FORMAT_VERSION, "stages": {}}
    refusals = {
        json.dumps({"format_version": MANIFEST_FORMAT_VERSION + 1}): (
            rf"manifest format version {MANIFEST_FORMAT_VERSION + 1}, "
            rf"this jaxaot reads version {MANIFEST_FORMAT_VERSION}"
        ),
        '{"stages": {}}': "has no integer format_version",
        '{"format_version": "1"}': "has no integer format_version",
        "[1]": "is not a JSON object",
        '{"format_version": 1': "is not valid JSON",
    }
    for text, reason in refusals.items():
        path.write_text(text)
        with pytest.raises(StoreError, match=rf"^{path}: .*{reason}"):
            load_manifest(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.raises(StoreError, match=rf"^{path}: unreadable manifest"):
        load_manifest(tmp_path)
