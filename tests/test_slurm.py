"""Sweeps through a real SLURM cluster (``hydra/launcher=slurm``), and the pieces they rest on.

The cluster tests start one throw-away single-node cluster for the module (tests/slurm_cluster.py:
munge, slurmctld, slurmd, all in a temp dir) and skip, saying why, where that cannot run (not
root, no slurm-wlm/munge: ``make slurm``). Each sweep is a real ``sbatch`` job array; the
cluster has no slurmdbd, so ``sacct`` is unavailable and states come from ``squeue``.
The unit tests below them need no cluster.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, cli_env, extra_reason, missing_extra_modules, read_manifest
from jaxaot.config.order import STAGES
from jaxaot.sweeps.requeue import prepare, resume_point, stamp_manifest
from jaxaot.sweeps.slurm import JobState, _expand, _parse, query_states, wait_all

TESTS = Path(__file__).resolve().parent
LAUNCHER = [
    "hydra/launcher=slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=60",
    "hydra.callbacks.sweep.plots=false",
]
SLOW = ["program.target=slurm_programs:slow_compile", "hydra.callbacks.sweep.heartbeat_s=0"]


@pytest.fixture(scope="module")
def slurm() -> Iterator[Any]:
    from slurm_cluster import SlurmCluster, unavailable

    reason = unavailable() or (extra_reason("sweep") if missing_extra_modules("sweep") else None)
    if reason:
        print(f"\nSLURM tests skipped: {reason}", file=sys.stderr)
        pytest.skip(reason)
    with SlurmCluster() as cluster:
        yield cluster


def _env(cluster: Any, tmp: Path) -> dict[str, str]:
    env = cluster.env(cli_env(JAXAOT_STORE_DIR=str(tmp / "store"), JAX_PLATFORMS="cpu"))
    env["PYTHONPATH"] = f"{REPO}:{TESTS}:{env.get('PYTHONPATH', '')}".rstrip(":")
    return env


def _start(cluster: Any, tmp: Path, *overrides: str) -> tuple[subprocess.Popen[str], Path]:
    """``jaxaot -m <overrides>`` on the cluster, in the background; (process, sweep dir)."""
    sweep = tmp / "sweep"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxaot.cli.main",
            "-m",
            *LAUNCHER,
            *overrides,
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp,
        env=_env(cluster, tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, sweep


def _finish(proc: subprocess.Popen[str], timeout: float = 150) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"sweep still running after {timeout} s\n{out}\n{err[-3000:]}")
    return proc.returncode, out, err


def _rows(sweep: Path) -> dict[str, dict[str, str]]:
    with open(sweep / "sweep.csv", newline="") as f:
        return {r["job"]: r for r in csv.DictReader(f)}


def _stages(run_dir: Path) -> dict[str, str]:
    return {s: rec["status"] for s, rec in read_manifest(run_dir)["stages"].items()}


def _wait_for(what: str, check: Any, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _finished(run_dir: Path, stage: str) -> bool:
    try:
        return stage in json.loads((run_dir / "manifest.json").read_text())["stages"]
    except (OSError, ValueError, KeyError):
        return False


def _slurm_ids(sweep: Path) -> list[str]:
    """The SLURM job ids of a sweep's jobs (submitit's per-job folders hold their pickle)."""
    return sorted(p.parent.name for p in (sweep / ".submitit").glob("*/*_submitted.pkl"))


def _log(sweep: Path, suffix: str, kind: str) -> str:
    """The submitit log (out/err) of the sweep job whose SLURM id ends with ``suffix``."""
    job = next(i for i in _slurm_ids(sweep) if i.endswith(suffix))
    return (sweep / ".submitit" / job / f"{job}_0_log.{kind}").read_text()


# -- on the cluster -------------------------------------------------------------------------


def test_sweep_runs_as_a_job_array_sharing_one_store(slurm: Any, tmp_path: Path) -> None:
    """Two jobs with one compile key: both SLURM array tasks, one compile between them."""
    t0 = time.monotonic()
    proc, sweep = _start(
        slurm, tmp_path, "program=mlp", "program.args.1=f32[8,256]", "execute.repeats=1,2"
    )
    rc, out, err = _finish(proc)
    wall = time.monotonic() - t0
    assert rc == 0, err[-3000:]
    ids = _slurm_ids(sweep)
    assert len(ids) == 2 and all("_" in i for i in ids), ids  # an array: <array>_<task>
    script = next((sweep / ".submitit").glob("*/*_submission.sh")).read_text()
    for flag in ("--array=0-1%2", "--partition=debug", "--cpus-per-task=1", "--signal=USR2@120"):
        assert f"#SBATCH {flag}" in script, script
    rows = _rows(sweep)
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert sorted(r["slurm_job"] for r in rows.values()) == ids
    # The state SLURM gives once the jobs end (no slurmdbd here: from squeue, not sacct).
    assert {(r["slurm_state"], r["slurm_state_source"]) for r in rows.values()} == {
        ("COMPLETED", "squeue")
    }
    # One store shared by the jobs: the key compiled once, the other job loaded it.
    assert sorted(_stages(sweep / r["dir"])["compile"] for r in rows.values()) == ["cached", "ran"]
    # The jobs' output went to submitit's logs; their progress lines reached this terminal.
    progress = re.findall(r"^\[(\d)/2\] repeats=(\d) \| ok \| compile (\w+)", out, re.M)
    assert sorted(n for n, _, _ in progress) == ["1", "2"], out
    assert sorted(r for _, r, _ in progress) == ["1", "2"]
    assert sorted(c for _, _, c in progress) == ["cached", "ran"]
    assert "sweep: 2 jobs, 2 ok, 0 failed" in out
    assert re.search(r"^\[\d/2\] repeats=1 \| ok", _log(sweep, "_0", "out"), re.M)
    # Quiet: the launch lines (one per job, the submitted ids) are in the sweep's log only.
    assert "submitted 2 SLURM jobs" not in out + err and "#0 : " not in out + err
    launched = (sweep / "multirun.log").read_text()
    assert "submitted 2 SLURM jobs" in launched and "#0 : " in launched
    print(f"\nmeasured: 2 SLURM jobs, 1 compile, wall {wall:.1f} s")


def test_failed_and_cancelled_jobs_are_rows_and_the_sweep_exits_1(
    slurm: Any, tmp_path: Path
) -> None:
    proc, sweep = _start(
        slurm,
        tmp_path,
        "program.target=slurm_programs:sleepy",
        "program.args=[f32[4]]",
        "execute.repeats=0,1",
    )
    _wait_for("job 1 to start", lambda: (sweep / "1" / ".hydra" / "overrides.yaml").exists())
    job1 = next(i for i in _slurm_ids(sweep) if i.endswith("_1"))
    slurm.cmd("scancel", job1)
    rc, out, err = _finish(proc)
    assert rc == 1, err[-3000:]
    rows = _rows(sweep)
    assert rows["0"]["status"] == "failed"
    assert rows["0"]["error"] == "execute.repeats: expected >= 1, found 0"
    assert rows["0"]["slurm_state"] == "COMPLETED"  # SLURM-wise the job ended normally
    assert rows["1"]["status"] == "cancelled"
    assert (rows["1"]["slurm_job"], rows["1"]["slurm_state"]) == (job1, "CANCELLED")
    assert rows["1"]["slurm_state_source"] == "squeue"  # no slurmdbd here: sacct is disabled
    assert rows["1"]["error"].startswith(f"SLURM job {job1} ended CANCELLED (state from squeue)")
    md = (sweep / "sweep.md").read_text()
    assert "2 jobs: 0 ok, 2 failed." in md and f"{job1} CANCELLED" in md
    assert re.search(
        r"^\[\d/2\] repeats=1 \| cancelled \| SLURM job \S+ ended CANCELLED", out, re.M
    ), out
    assert "sweep: 2 jobs, 0 ok, 2 failed" in out


def test_requeued_jobs_resume_from_their_last_finished_stage(slurm: Any, tmp_path: Path) -> None:
    """Mid-compile, job 0 gets submitit's preemption signal (USR2: checkpoint, then requeue) and
    job 1 is requeued by SLURM itself (``scontrol requeue``: SIGTERM, killed, started again).
    Each first attempt also leaves submitit's temporary result file, as a job killed while
    submitit saved its result does (seen under load: the attempt finished its work after the
    requeue): the requeued attempt still saves its own."""
    proc, sweep = _start(
        slurm,
        tmp_path,
        "program.target=slurm_programs:slow_compile_killed_saving",
        *SLOW[1:],
        "program.args=[f32[64]],[f32[32]]",
    )
    signalled: set[str] = set()

    def signal_lowered_jobs() -> bool:
        for n in {"0", "1"} - signalled:
            if not _finished(sweep / n, "lower"):
                continue
            assert not _finished(sweep / n, "compile"), "slow_compile compiled too fast"
            job = next(i for i in _slurm_ids(sweep) if i.endswith(f"_{n}"))
            if n == "0":
                slurm.cmd("scancel", "--signal=USR2", job)
            else:
                slurm.cmd("scontrol", "requeue", job)
            signalled.add(n)
        return len(signalled) == 2

    _wait_for("both jobs to finish lowering", signal_lowered_jobs)
    rc, out, err = _finish(proc)
    assert rc == 0, err[-3000:]
    rows = _rows(sweep)
    for n in ("0", "1"):
        run_dir = sweep / n
        manifest = read_manifest(run_dir)
        attempt = sweep / ".jaxaot" / "requeued" / n / "attempt-1"
        assert manifest["status"] == "ok" and manifest["requeued"] == 1
        assert manifest["resumed_from"] == str(attempt.resolve())
        assert manifest["previous_attempts"] == [str(attempt)]
        before = _stages(attempt)
        assert before["stage_out"] == before["lower"] == "ran"
        # The requeued attempt loaded what had finished (hash-verified) and ran the rest.
        start = STAGES.index(resume_point(read_manifest(attempt), list(STAGES)) or "stage_out")
        assert start >= STAGES.index("compile")
        assert _stages(run_dir) == {
            s: "resumed" if i < start else "ran" for i, s in enumerate(STAGES)
        }
        assert rows[n]["status"] == "ok" and rows[n]["requeued"] == "1"
        assert (rows[n]["slurm_state"], rows[n]["slurm_state_source"]) == ("COMPLETED", "squeue")
    # USR2 landed mid-compile: submitit's checkpoint ran, the attempt recorded itself as
    # interrupted (preempted) before submitit requeued it, and the requeued one compiled.
    # (After `scontrol requeue` the old processes live until SIGKILL, KillWait later, and may
    # finish the compile first.)
    preempted = read_manifest(sweep / ".jaxaot/requeued/0/attempt-1")
    assert preempted["status"] == "interrupted"  # not the program's exit: no failed stage
    assert preempted["error"].startswith("preempted by SLURM"), preempted["error"]
    assert preempted["stages"]["compile"]["status"] == "interrupted"
    assert _stages(sweep / "0")["compile"] == "ran"
    assert "Caught signal SIGUSR2" in _log(sweep, "_0", "err")
    assert "this job is preempted" in _log(sweep, "_0", "err")
    # The report sees one row per job; the interrupted attempts stay under .jaxaot/.
    assert sorted(rows) == ["0", "1"]
    for shape in ("64", "32"):
        assert re.search(rf"^\[\d/2\] args=\['f32\[{shape}\]'\] \| ok \|", out, re.M), out
    for n in ("0", "1"):
        assert "which an earlier attempt left as it was killed" in _log(sweep, f"_{n}", "err")
        assert not list((sweep / ".submitit").glob(f"*_{n}/*.save_tmp"))


# -- no cluster needed ----------------------------------------------------------------------

# submitit's preemption handler as SLURM's timing may have it: the launcher's checkpoint (what
# submitit calls first), then `scontrol requeue`, after which SLURM kills the job KillWait
# seconds later (submitit ignores the SIGTERM): here at once, before submitit's SystemExit.
# "signal": on SIGUSR2, sent by the test; "after lower": right after the manifest write that
# records lower, before the run's loop reaches compile (already computing on a worker thread).
PREEMPTED_THEN_KILLED = """
import os, signal, sys
import jaxaot
from jaxaot.sweeps.slurm_launcher import JaxaotSlurmLauncher
from jaxaot.rundir.manifest import Manifest

def preempt(signum, frame):
    JaxaotSlurmLauncher.checkpoint(JaxaotSlurmLauncher.__new__(JaxaotSlurmLauncher))
    os.kill(os.getpid(), signal.SIGKILL)

write = Manifest.write

def write_then_preempt(self):
    write(self)
    if "lower" in self.stages and "compile" not in self.stages:
        preempt(None, None)

if sys.argv[2] == "signal":
    signal.signal(signal.SIGUSR2, preempt)
else:
    Manifest.write = write_then_preempt
cfg = jaxaot.compose(["program.target=slurm_programs:slow_compile", "program.args=[f32[64]]"])
jaxaot.run(cfg, run_dir=sys.argv[1])
"""


@pytest.mark.parametrize("when", ["signal", "after lower"])
def test_a_preempted_run_is_recorded_before_the_job_is_requeued(tmp_path: Path, when: str) -> None:
    """The checkpoint hook writes the manifest itself: a run killed right after it (while its
    compile still runs on a worker thread) says interrupted, and in which stage."""
    run_dir = tmp_path / "run"
    env = cli_env(JAXAOT_STORE_DIR=str(tmp_path / "store"), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = f"{REPO}:{TESTS}:{env.get('PYTHONPATH', '')}".rstrip(":")
    proc = subprocess.Popen(
        [sys.executable, "-c", PREEMPTED_THEN_KILLED, str(run_dir), when],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if when == "signal":
            _wait_for("lower", lambda: _finished(run_dir, "lower") or proc.poll() is not None)
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert not _finished(run_dir, "compile"), "slow_compile compiled too fast"
            proc.send_signal(signal.SIGUSR2)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "interrupted"
    assert manifest["error"] == (
        "preempted by SLURM (submitit checkpointed and requeued the job) during stage 'compile'"
    )
    assert _stages(run_dir) == {"stage_out": "ran", "lower": "ran", "compile": "interrupted"}
    assert manifest["wall_seconds"] > 0


# What SLURM does once `scontrol requeue` takes effect, at once: SIGTERM to every process of
# the job, scontrol itself included while it has not exited (here: a child that signals its own
# process group, as SLURM would, then exits 0 if it is still alive).
REQUEUE_THEN_SIGTERM = """
import subprocess
from jaxaot.sweeps.slurm_launcher import JaxaotSlurmLauncher

JaxaotSlurmLauncher.checkpoint(JaxaotSlurmLauncher.__new__(JaxaotSlurmLauncher))
subprocess.check_call(["sh", "-c", "kill -TERM 0; exit 0"])  # raises if SIGTERM killed it
print("requeue command survived")
"""


def test_after_the_checkpoint_sigterm_kills_neither_the_requeue_command_nor_the_run() -> None:
    """submitit runs `scontrol requeue` after the checkpoint; SLURM's SIGTERM must not kill it
    (CalledProcessError raised into the run recorded it as a failed stage) or the run."""
    env = cli_env(JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = f"{REPO}:{TESTS}:{env.get('PYTHONPATH', '')}".rstrip(":")
    proc = subprocess.run(
        [sys.executable, "-c", REQUEUE_THEN_SIGTERM],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # its own process group: `kill 0` reaches no test process
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "requeue command survived"


def _manifest(**stages: str) -> dict[str, Any]:
    return {"stages": {s: {"status": v} for s, v in stages.items()}}


@pytest.mark.parametrize(
    ("stages", "planned", "expected"),
    [
        ({}, list(STAGES), None),
        ({"stage_out": "ran"}, list(STAGES), "lower"),
        ({"stage_out": "ran", "lower": "cached"}, list(STAGES), "compile"),
        ({"stage_out": "resumed", "lower": "resumed", "compile": "ran"}, list(STAGES), "execute"),
        ({"stage_out": "ran", "lower": "failed"}, list(STAGES), "lower"),
        ({"stage_out": "ran", "lower": "ran", "compile": "ran"}, STAGES[:3], "compile"),
        ({s: "ran" for s in STAGES}, list(STAGES), "execute"),
    ],
)
def test_resume_point_is_the_first_stage_not_finished(
    stages: dict[str, str], planned: list[str], expected: str | None
) -> None:
    assert resume_point(_manifest(**stages), planned) == expected


def _attempt_dir(path: Path, **stages: str) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({**_manifest(**stages), "status": "running"}))
    return path


def test_prepare_moves_the_interrupted_attempt_aside_and_resumes_from_it(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    job = _attempt_dir(sweep / "3", stage_out="ran", lower="ran")
    first = prepare(job, sweep, 3, list(STAGES), requeued=True)
    moved = sweep / ".jaxaot" / "requeued" / "3" / "attempt-1"
    assert not job.exists() and (moved / "manifest.json").is_file()
    assert (first.number, first.resume_from, first.start_at) == (1, moved.resolve(), "compile")
    # Interrupted again before finishing any stage: resume from the older attempt that did.
    _attempt_dir(job)
    second = prepare(job, sweep, 3, list(STAGES), requeued=True)
    assert second.number == 2 and second.resume_from == moved.resolve()
    assert second.previous == (moved, moved.parent / "attempt-2")
    # A first attempt (a sweep re-run into an existing folder) never resumes by surprise.
    _attempt_dir(job, stage_out="ran")
    assert prepare(job, sweep, 3, list(STAGES), requeued=False).resume_from is None
    assert (job / "manifest.json").is_file()


def test_a_requeue_after_a_power_loss_resumes_from_the_last_stage_whose_files_are_intact(
    tmp_path: Path,
) -> None:
    """Run-dir files are not fsynced: after a node lost power the manifest may name finished
    stages whose files came back short. The requeued attempt resumes from the last stage
    whose files are as recorded, and from none when stage_out's are not."""
    sweep = tmp_path / "sweep"
    job = _attempt_dir(sweep / "5", stage_out="ran", lower="ran")
    manifest = json.loads((job / "manifest.json").read_text())
    for stage, body in (("stage_out", b"jaxpr"), ("lower", b"stablehlo")):
        (job / stage).mkdir()
        (job / stage / "a.txt").write_bytes(body)
        rec = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
        manifest["stages"][stage]["artifacts"] = {f"{stage}/a.txt": rec}
    (job / "manifest.json").write_text(json.dumps(manifest))
    (job / "lower" / "a.txt").write_bytes(b"")  # what a power loss can leave of a new file
    first = prepare(job, sweep, 5, list(STAGES), requeued=True)
    assert first.start_at == "lower"  # stage_out's files are intact, lower's are not
    moved = first.resume_from
    assert moved is not None
    (moved / "stage_out" / "a.txt").write_bytes(b"jaxpX")
    second = prepare(job, sweep, 5, list(STAGES), requeued=True)
    assert second.resume_from is None and second.start_at is None  # nothing to resume from


def test_a_file_left_by_an_attempt_killed_while_saving_does_not_stop_the_requeued_ones(
    tmp_path: Path,
) -> None:
    pytest.importorskip("submitit", reason=extra_reason("sweep"))
    from jaxaot.sweeps.slurm_launcher import discard_unsaved
    from submitit.core.utils import temporary_save_path

    result = tmp_path / "7_1_0_result.pkl"
    assert not discard_unsaved(result)  # a first attempt, or one that saved nothing
    killed = temporary_save_path(result)
    killed.__enter__().write_bytes(b"half")  # killed while saving: never renamed
    refused = pytest.raises(AssertionError, match="temporary saved file already exists")
    with refused, temporary_save_path(result):
        pass
    assert discard_unsaved(result)
    with temporary_save_path(result) as tmp:  # what submitit does with the requeued result
        tmp.write_bytes(b"result")
    assert result.read_bytes() == b"result" and list(tmp_path.iterdir()) == [result]


def test_stamp_manifest_records_the_requeue(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _attempt_dir(sweep / "0", stage_out="ran")
    attempt = prepare(sweep / "0", sweep, 0, list(STAGES), requeued=True)
    run = _attempt_dir(sweep / "0", stage_out="resumed")
    stamp_manifest(run, attempt)
    data = read_manifest(run)
    assert data["requeued"] == 1 and data["previous_attempts"] == [str(attempt.previous[0])]
    assert data["stages"] == {"stage_out": {"status": "resumed"}}  # the rest unchanged


def test_squeue_and_sacct_output_parse_to_states() -> None:
    assert _expand("7_[0-2,5%2]") == ["7_0", "7_1", "7_2", "7_5"]
    text = "7_3|RUNNING\n7_[4-5]|PENDING\n7_1|CANCELLED by 0\n7_1.batch|CANCELLED\n8|COMPLETED\n"
    states = _parse(text, "sacct")
    assert {k: v.state for k, v in states.items()} == {
        "7_3": "RUNNING",
        "7_4": "PENDING",
        "7_5": "PENDING",
        "7_1": "CANCELLED",
        "8": "COMPLETED",
    }
    assert states["7_1"].terminal and not states["7_3"].terminal
    assert states["8"].source == "sacct"


class _FakeJob:
    def __init__(self, job_id: str, folder: Path) -> None:
        self.job_id = job_id
        self.paths = type("P", (), {"result_pickle": folder / f"{job_id}_result.pkl"})()


def test_wait_all_ends_jobs_when_slurm_says_they_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result file ends a job once SLURM shows a final state (a stale one from before a
    requeue does not); without a result, two final readings and the grace must pass."""
    clock = [0.0]
    jobs = [_FakeJob(j, tmp_path) for j in ("5_0", "5_1", "5_2")]
    jobs[2].paths.result_pickle.write_bytes(b"attempt 1")  # then requeued: runs again

    def query(ids: Any) -> dict[str, JobState]:
        t = clock[0]
        if t >= 2:
            jobs[0].paths.result_pickle.write_bytes(b"x")
        seen = {
            "5_0": "RUNNING" if t < 3 else "COMPLETED",
            "5_1": ["RUNNING", "REQUEUED"][int(t)] if t < 2 else "CANCELLED",
            "5_2": "PENDING" if t < 2 else "RUNNING" if t < 4 else "COMPLETED",
        }
        return {j: JobState(j, seen[j], "squeue") for j in ids}

    monkeypatch.setattr("jaxaot.sweeps.slurm.query_states", query)
    monkeypatch.setattr(
        "jaxaot.sweeps.slurm.time.sleep", lambda s: clock.__setitem__(0, clock[0] + s)
    )
    done: list[tuple[str, str | None, float]] = []
    states = wait_all(
        jobs,
        poll_s=1.0,
        query_s=1.0,
        now=lambda: clock[0],
        on_done=lambda j, s: done.append((j.job_id, s and s.state, clock[0])),
    )
    assert done == [("5_0", "COMPLETED", 3.0), ("5_2", "COMPLETED", 4.0), ("5_1", "CANCELLED", 5.0)]
    assert [s.state if s else None for s in states] == ["COMPLETED", "CANCELLED", "COMPLETED"]


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    assert "needs root" in (slurm_cluster.unavailable() or "")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster, "_which", lambda name: None if name == "munged" else name)
    assert "missing (munged)" in (slurm_cluster.unavailable() or "")
    assert "make slurm" in (slurm_cluster.unavailable() or "")


def test_report_has_slurm_columns_only_for_slurm_jobs(tmp_path: Path) -> None:
    from jaxaot.sweeps.report import SLURM_COLUMNS, collect, to_csv, to_markdown

    def job(n: int, status: str, slurm: dict[str, str] | None, requeued: int = 0) -> None:
        d = tmp_path / str(n)
        d.mkdir()
        record = {"num": n, "overrides": [f"execute.repeats={n + 1}"], "status": status}
        if slurm is not None:
            record["slurm"] = slurm
        (d / "job.json").write_text(json.dumps(record))
        (d / "manifest.json").write_text(json.dumps({"stages": {}, "requeued": requeued}))

    job(0, "ok", None)
    assert not collect(tmp_path).slurm
    assert "slurm_state" not in to_csv(collect(tmp_path))
    job(1, "ok", {"job_id": "3_1", "state": "COMPLETED", "source": "squeue"}, requeued=1)
    job(2, "cancelled", {"job_id": "3_2", "state": "CANCELLED", "source": "sacct"})
    table = collect(tmp_path)
    assert table.slurm and all(c in table.columns for c in SLURM_COLUMNS)
    rows = {r["job"]: r for r in table.rows}
    assert (rows[1]["slurm_state"], rows[1]["slurm_state_source"], rows[1]["requeued"]) == (
        "COMPLETED",
        "squeue",
        1,
    )
    assert rows[0].get("slurm_job") is None and [r["job"] for r in table.failed] == [2]
    md = to_markdown(table)
    assert "| 3_1 COMPLETED, requeued 1x |" in md and "| 3_2 CANCELLED |" in md
    assert "**cancelled**" in md and "3 jobs: 2 ok, 1 failed." in md


def test_query_states_asks_squeue_then_sacct(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    answers = {
        ("squeue", "7,9"): None,
        ("squeue", "7"): "7_0|RUNNING\n7_1|PENDING\n",
        ("squeue", "9"): None,
        ("sacct", "9"): "9_0|CANCELLED by 0\n9_0.batch|CANCELLED\n",
    }

    def run(args: list[str]) -> str | None:
        calls.append(args)
        return answers[(args[0], args[-1])]

    monkeypatch.setattr("jaxaot.sweeps.slurm._run", run)
    states = query_states(["7_0", "7_1", "9_0", "9_1"])
    assert {j: (s.state, s.source) for j, s in states.items()} == {
        "7_0": ("RUNNING", "squeue"),
        "7_1": ("PENDING", "squeue"),
        "9_0": ("CANCELLED", "sacct"),
    }
    assert [(c[0], c[-1]) for c in calls] == [
        ("squeue", "7,9"),
        ("squeue", "7"),
        ("squeue", "9"),
        ("sacct", "9"),
    ]


def test_a_topology_job_plans_no_execute() -> None:
    """A requeued topology job resumes at most at compile: there is nothing to execute on."""
    from jaxaot.sweeps.progress import planned_stages
    from omegaconf import OmegaConf

    plain = OmegaConf.create({"stop_after": "execute", "compile": {"topology": None}})
    topo = OmegaConf.create({"stop_after": "execute", "compile": {"topology": "v5e:2x2"}})
    assert planned_stages(plain)[-1] == "execute"
    assert planned_stages(topo) == ["stage_out", "lower", "compile"]
    done = {s: {"status": "ran"} for s in ("stage_out", "lower", "compile")}
    assert resume_point({"stages": done}, planned_stages(topo)) == "compile"
