"""A requeued sweep job picks up where its interrupted attempt stopped.

When SLURM preempts a job or its time limit nears, submitit calls the job's ``checkpoint`` and
requeues it; SLURM may also requeue a job on its own (``scontrol requeue``, a node failure,
``PreemptMode=REQUEUE``). The requeued job gets the same Hydra job directory, which already
holds the interrupted attempt's ``manifest.json`` (rewritten after every stage, so it lists
exactly the stages that finished). Run directories are never reused in place, so:

1. the old attempt is moved aside, whole, to ``<sweep dir>/.jaxaot/requeued/<job num>/attempt-<k>``
   (an atomic rename on the sweep's file system; the report skips ``.jaxaot``);
2. the new attempt runs in a fresh job directory with ``resume_from=<that attempt>`` and
   ``start_at=<the first planned stage that did not finish>``: the finished stages are loaded
   with their hashes verified, the rest run;
3. its manifest gets ``requeued`` (how many attempts came before) and ``previous_attempts``
   (their directories, oldest first) next to the runner's ``resumed_from``.

An attempt that finished no stage leaves nothing to resume: the new one starts over (still in a
fresh directory, still counted).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import RunMetrics
from jaxaot.sweeps.progress import STATE_DIR, read_json
from jaxaot.util.fsio import atomic_write_json, sha256_file
from jaxaot.util.verified import FileRecord

log = logging.getLogger("jaxaot")

REQUEUED_DIR = "requeued"
FINISHED = ("ran", "cached", "resumed")


@dataclass(frozen=True)
class Attempt:
    """This attempt of a sweep job: how many came before, and what it resumes from."""

    number: int  # 0 for the first attempt
    previous: tuple[Path, ...]  # earlier attempts' run directories, oldest first
    resume_from: Path | None  # the attempt whose finished stages this one loads
    start_at: str | None  # the first stage this attempt runs (None: as configured)

    def stamp(self) -> dict[str, Any]:
        """What the manifest records about requeueing."""
        return {"requeued": self.number, "previous_attempts": [str(p) for p in self.previous]}


def _intact(run_dir: Path, record: Any) -> bool:
    """Whether every file a stage's manifest entry records is on disk as recorded (size and
    sha256): run-dir files are not fsynced, so a node that lost power may leave a manifest
    that names a finished stage whose files came back short."""
    artifacts = record.get("artifacts") if isinstance(record, dict) else None
    for path, rec in (artifacts or {}).items():
        want = FileRecord.from_json(rec)
        file = run_dir / path
        try:
            if want is None or file.stat().st_size != want.size or sha256_file(file) != want.sha256:
                return False
        except OSError:
            return False
    return True


def resume_point(
    manifest: dict[str, Any] | None, planned: list[str], run_dir: Path | None = None
) -> str | None:
    """The stage a new attempt starts at, from the interrupted attempt's manifest.

    The first planned stage not finished (ran, cached or resumed), provided every stage before
    it finished; the last planned stage when all did (it runs again: cheap, and a store hit for
    compile). None when nothing finished: there is nothing to resume from. With ``run_dir``, a
    stage counts as finished only when its files are there as its entry records them.
    """
    run = RunMetrics.from_manifest(manifest)
    stages = (manifest or {}).get("stages") or {}
    done = 0
    for s in STAGES:
        if run.run(s).status not in FINISHED:
            break
        if run_dir is not None and not _intact(run_dir, stages.get(s)):
            log.warning("requeued: %s's files in %s are not as its manifest records", s, run_dir)
            break
        done += 1
    if done == 0:
        return None
    nxt = STAGES[min(done, len(STAGES) - 1)]
    last = planned[-1] if planned else STAGES[-1]
    if STAGES.index(nxt) > STAGES.index(last):
        return last
    return nxt


def set_aside(job_dir: Path, sweep_dir: Path, job_num: int) -> Path:
    """Move an interrupted attempt's directory under ``.jaxaot/requeued/<num>/``; its new path.

    ``os.rename`` onto a name that does not exist yet: two attempts can never claim one name
    (``attempt-<k>`` is taken with the first free k).
    """
    folder = Path(sweep_dir) / STATE_DIR / REQUEUED_DIR / str(job_num)
    folder.mkdir(parents=True, exist_ok=True)
    k = 1
    while True:
        target = folder / f"attempt-{k}"
        if not target.exists():
            try:
                os.rename(job_dir, target)
                return target
            except FileExistsError:
                pass
            except OSError as exc:
                if not target.exists():
                    raise
                log.debug("attempt-%d taken meanwhile (%s)", k, exc)
        k += 1


def previous_attempts(sweep_dir: Path, job_num: int) -> tuple[Path, ...]:
    folder = Path(sweep_dir) / STATE_DIR / REQUEUED_DIR / str(job_num)
    found = [p for p in folder.glob("attempt-*") if p.name.split("-", 1)[1].isdigit()]
    return tuple(sorted(found, key=lambda p: int(p.name.split("-", 1)[1])))


def prepare(
    job_dir: Path, sweep_dir: Path, job_num: int, planned: list[str], requeued: bool
) -> Attempt:
    """Set up this attempt of a sweep job, before Hydra creates its job directory.

    ``requeued``: whether SLURM or submitit says this job ran before (submitit's checkpoint
    count, ``SLURM_RESTART_COUNT``). A first attempt leaves everything as it is, so re-running
    a sweep into an existing folder never resumes by surprise.
    """
    if not requeued:
        return Attempt(0, (), None, None)
    job_dir = Path(job_dir)
    if job_dir.exists():
        moved = set_aside(job_dir, sweep_dir, job_num)
        log.warning("requeued: the interrupted attempt of job %d is now %s", job_num, moved)
    previous = previous_attempts(sweep_dir, job_num)
    if not previous:
        return Attempt(0, (), None, None)  # requeued before it ever started
    for attempt in reversed(previous):  # the newest attempt that finished a stage
        start = resume_point(read_json(attempt / MANIFEST_NAME), planned, attempt)
        if start is not None:
            log.warning("requeued: job %d resumes at %s from %s", job_num, start, attempt)
            return Attempt(len(previous), previous, attempt.resolve(), start)
    return Attempt(len(previous), previous, None, None)


def stamp_manifest(run_dir: Path, attempt: Attempt) -> None:
    """Add the attempt's ``requeued`` count and earlier attempts to the run's manifest."""
    path = Path(run_dir) / MANIFEST_NAME
    data = read_json(path)
    if data is None:
        return  # the run failed before writing one: job.json carries the error
    data.update(attempt.stamp())
    atomic_write_json(path, data)


__all__ = ["REQUEUED_DIR", "Attempt", "prepare", "resume_point", "set_aside", "stamp_manifest"]
