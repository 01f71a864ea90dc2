"""Waiting for a sweep's SLURM jobs, and what SLURM says about each: clusters without sacct too.

submitit waits for a job by polling its result file and, for jobs that end without one (a
``scancel``, a node failure, an out-of-memory kill), by asking ``sacct``. Without slurmdbd
(many small clusters, and the test cluster) ``sacct`` only says "accounting storage is
disabled", submitit sees the state ``UNKNOWN`` and waits forever for a cancelled job. Here
the state comes from ``squeue`` first (slurmctld keeps finished jobs for ``MinJobAge``, 300 s
by default), then ``sacct``; each state is recorded with where it came from.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("jaxaot")

# Job states after which no result file will come (squeue/sacct spelling; sacct adds
# "CANCELLED by <uid>").
TERMINAL = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
# A job that ended without a result file: how long to wait for the file to appear anyway
# (NFS attribute caches; the job wrote it just before it ended), or for a preempted job to be
# requeued (PreemptMode=REQUEUE shows PREEMPTED before REQUEUED). A state also counts as the
# end only when two queries in a row show it.
RESULT_GRACE_S = {"COMPLETED": 15.0, "PREEMPTED": 30.0}
DEFAULT_GRACE_S = 3.0
# Not in squeue nor sacct for this long: the job is gone (purged after MinJobAge, no sacct).
GONE_AFTER_S = 60.0


@dataclass(frozen=True)
class JobState:
    """One job's SLURM state and where it was read: squeue, sacct or submitit's result file."""

    job_id: str
    state: str
    source: str

    @property
    def terminal(self) -> bool:
        return self.state.split()[0] in TERMINAL if self.state else False

    def to_json(self) -> dict[str, str]:
        return {"job_id": self.job_id, "state": self.state, "source": self.source}


def _run(args: Sequence[str]) -> str | None:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("%s: %s", args[0], exc)
        return None
    if proc.returncode != 0:
        log.debug("%s: rc=%d %s", args[0], proc.returncode, proc.stderr.strip())
        return None
    return proc.stdout


def _expand(job_id: str) -> list[str]:
    """``5_[1-3,7]`` (a pending array's compressed form) -> ``5_1 5_2 5_3 5_7``."""
    if "_[" not in job_id:
        return [job_id]
    base, rest = job_id.split("_[", 1)
    out = []
    for part in rest.rstrip("]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out += [f"{base}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _parse(text: str | None, source: str) -> dict[str, JobState]:
    states: dict[str, JobState] = {}
    for line in (text or "").splitlines():
        jid, _, state = line.strip().partition("|")
        if not jid or "." in jid:  # sacct's job steps (5_0.batch)
            continue
        for one in _expand(jid):
            states[one] = JobState(one, state.strip().split()[0] if state.strip() else "", source)
    return states


def query_states(job_ids: Iterable[str]) -> dict[str, JobState]:
    """The SLURM state of each job id (``<array>_<task>`` or plain), from squeue, else sacct.

    One squeue call (one per array where one of them is no longer known) and at most one sacct
    call; ids neither knows are missing.
    """
    wanted = set(job_ids)
    if not wanted:
        return {}
    arrays = sorted({j.split("_")[0] for j in wanted})
    squeue = ["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j"]
    text = _run([*squeue, ",".join(arrays)])
    if text is None and len(arrays) > 1:  # one id purged already fails the whole call
        text = "\n".join(t for a in arrays if (t := _run([*squeue, a])) is not None)
    found = _parse(text, "squeue")
    missing = sorted({j.split("_")[0] for j in wanted if j not in found})
    if missing:
        sacct = _run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(missing)])
        found.update({k: v for k, v in _parse(sacct, "sacct").items() if k not in found})
    return {j: found[j] for j in wanted if j in found}


@dataclass
class _Watch:
    job: Any  # a submitit Job
    state: JobState | None = None
    terminal_since: float | None = None
    terminal_seen: int = 0
    unseen_since: float | None = None
    done: bool = False


def wait_all(
    jobs: Sequence[Any],
    *,
    poll_s: float = 1.0,
    query_s: float | None = None,
    on_done: Callable[[Any, JobState | None], None] | None = None,
    now: Callable[[], float] = time.monotonic,
) -> list[JobState | None]:
    """Wait until SLURM says every submitit job has ended; each job's last state.

    A job has ended when SLURM shows a final state and it either wrote its result file or two
    readings and a grace period went by without one. A result file alone is not the end: a
    job requeued while finishing (its processes outlived ``scontrol requeue``) runs again and
    writes a newer one. A job that neither squeue nor sacct knows any more for
    ``GONE_AFTER_S`` has ended too (state ``UNKNOWN``). ``on_done(job, state)`` is called as
    each ends, in that order. SLURM is asked every ``query_s`` seconds (default: every 2 s at
    first, less often as the sweep goes on, at most every 30 s; every second while a job that
    wrote its result has not ended).
    """
    watches = [_Watch(j) for j in jobs]
    last_query = float("-inf")
    t0 = now()
    while True:
        pending = [w for w in watches if not w.done]
        if not pending:
            return [w.state for w in watches]
        t = now()
        every = query_s if query_s is not None else min(30.0, max(2.0, (t - t0) / 10))
        if any(_has_result(w.job) for w in pending):
            every = min(every, 1.0)
        if t - last_query >= every:
            last_query = t
            states = query_states(w.job.job_id for w in pending)
            for w in pending:
                _observe(w, states.get(w.job.job_id), t)
        for w in pending:
            if _ended(w, t):
                w.done = True
                if on_done is not None:
                    on_done(w.job, w.state)
        if any(not w.done for w in watches):
            time.sleep(poll_s)


def _ended(w: _Watch, t: float) -> bool:
    if w.unseen_since is not None and t - w.unseen_since >= GONE_AFTER_S:
        w.state = JobState(w.job.job_id, "UNKNOWN", "not in squeue nor sacct")
        return True
    if w.terminal_since is None or w.state is None:
        return False
    if _has_result(w.job):
        return True
    grace = RESULT_GRACE_S.get(w.state.state, DEFAULT_GRACE_S)
    return w.terminal_seen >= 2 and t - w.terminal_since >= grace


def _has_result(job: Any) -> bool:
    return bool(job.paths.result_pickle.exists())


def _observe(w: _Watch, state: JobState | None, t: float) -> None:
    if state is None:
        w.unseen_since = w.unseen_since if w.unseen_since is not None else t
        return
    w.unseen_since = None
    w.state = state
    if state.terminal:
        w.terminal_since = w.terminal_since if w.terminal_since is not None else t
        w.terminal_seen += 1
    else:  # e.g. REQUEUED -> PENDING after a preemption: not over
        w.terminal_since, w.terminal_seen = None, 0


__all__ = ["TERMINAL", "JobState", "query_states", "wait_all"]
