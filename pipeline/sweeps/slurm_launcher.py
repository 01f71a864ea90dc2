"""``hydra/launcher=slurm``: hydra-submitit-launcher's SLURM launcher, made to finish and resume.

Same options and the same ``sbatch`` job arrays as ``submitit_slurm``, plus:

- **Waiting without sacct**: submitit waits forever for a job that ended without a result
  (``scancel``, node failure) when the cluster has no slurmdbd; this launcher reads states from
  ``squeue`` first, then ``sacct`` (:mod:`jaxaot.sweeps.slurm`), so every sweep ends.
- **A row for every job**: a job that ended without a result gets a ``job.json`` saying so, with
  its SLURM state, and a progress line; every job's record carries its SLURM job id and state
  and where that state was read. The sweep then exits non-zero like any failed sweep.
- **Resume on requeue**: ``checkpoint`` (called by submitit on preemption or near the time
  limit, before it requeues the job) counts the attempt; the requeued job, or one SLURM
  requeued by itself (``SLURM_RESTART_COUNT``), moves the interrupted attempt aside and resumes
  from its last finished stage (:mod:`jaxaot.sweeps.requeue`).

Hydra finds it through ``hydra_plugins/jaxaot_slurm_launcher``, which imports this module only
where hydra-submitit-launcher (``jaxaot[sweep]``) is installed.
"""

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.types import TaskFunction
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from jaxaot.sweeps.overrides import short_override
from jaxaot.sweeps.progress import (
    JOB_NAME,
    JobOutcome,
    SweepPlan,
    claim_finish_slot,
    override_key,
    planned_stages,
    progress_line,
    read_json,
    relay_line,
    write_job_record,
)
from jaxaot.sweeps.requeue import Attempt, prepare, stamp_manifest
from jaxaot.sweeps.slurm import JobState, wait_all
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger("jaxaot")
# The launch lines (output dir, one per job, submitted ids): the sweep's multirun.log, and the
# screen only with -v (jaxaot.rundir.logs.LAUNCH_LOGGERS).
launch_log = logging.getLogger("jaxaot.sweeps.slurm_launcher")


@dataclass
class JaxaotSlurmLauncherConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.jaxaot_slurm_launcher.slurm_launcher.JaxaotSlurmLauncher"


ConfigStore.instance().store(
    group="hydra/launcher",
    name="jaxaot_submitit_slurm",
    node=JaxaotSlurmLauncherConf,
    provider="jaxaot",
)


def job_dir_of(config: DictConfig, job_dir_key: str) -> Path:
    """The job's output directory, as Hydra's ``run_job`` will compute it."""
    out = str(OmegaConf.select(config, job_dir_key))
    sub = OmegaConf.select(config, "hydra.sweep.subdir")
    return Path(os.path.abspath(os.path.join(out, str(sub)) if sub is not None else out))


def _restart_count() -> int:
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def discard_unsaved(saved: Path) -> bool:
    """Remove the temporary file an earlier attempt of this job left as it saved ``saved``
    (its result, or at a checkpoint the job to requeue); whether there was one.

    submitit saves those to ``<file>.save_tmp`` and renames it into place, and refuses to
    start a save when the temporary file exists (``A temporary saved file already exists``).
    After ``scontrol requeue`` the attempt's processes run on until SLURM's SIGKILL and may
    finish the job first: killed while saving, they leave the file, and the requeued attempt,
    its work done, would end FAILED without a result. SLURM starts the requeued attempt only
    once every process of the earlier one has ended, so the file is no one's."""
    unsaved = saved.with_suffix(saved.suffix + ".save_tmp")
    try:
        unsaved.unlink()
    except FileNotFoundError:
        return False
    log.warning("requeued: removed %s, which an earlier attempt left as it was killed", unsaved)
    return True


def _stamped(task: TaskFunction, attempt: Attempt) -> TaskFunction:
    """The task function, then ``requeued``/``previous_attempts`` added to its manifest."""

    def run(cfg: DictConfig) -> Any:
        from hydra.core.hydra_config import HydraConfig

        try:
            return task(cfg)
        finally:
            stamp_manifest(Path(HydraConfig.get().runtime.output_dir), attempt)

    return run


class JaxaotSlurmLauncher(SlurmLauncher):
    """``submitit_slurm`` that always ends, reports every job, and resumes requeued jobs."""

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
        attempt: int = 0,
    ) -> JobReturn:
        """Run one job on its node (the base class's, plus the requeue bookkeeping)."""
        import submitit

        requeued = attempt > 0 or _restart_count() > 0
        if requeued:  # before anything that may fail: submitit saves the error the same way
            paths = submitit.JobEnvironment().paths
            for saved in (paths.result_pickle, paths.submitted_pickle):
                discard_unsaved(saved)
        assert self.hydra_context is not None and self.config is not None
        assert self.task_function is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.id = submitit.JobEnvironment().job_id
            config.hydra.job.num = job_num
        task = self.task_function
        job_dir = job_dir_of(config, job_dir_key)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            planned = planned_stages(config)
        except ValueError:  # a bad start_at/stop_after: the runner reports it
            planned = []
        this = prepare(job_dir, sweep_dir, job_num, planned, requeued=requeued)
        if this.resume_from is not None:
            # Set in the config, not added to the overrides: the report's columns and the
            # progress line stay those of the sweep.
            with read_write(config), open_dict(config):
                config.resume_from = str(this.resume_from)
                config.start_at = this.start_at
        if this.number:
            task = _stamped(task, this)
        return run_job(
            hydra_context=self.hydra_context,
            task_function=task,
            config=config,
            job_dir_key=job_dir_key,
            job_subdir_key="hydra.sweep.subdir",
        )

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on preemption or timeout, before it requeues the job: the same
        job again, one attempt later (what to resume is read from disk when it starts)."""
        import submitit
        from jaxaot.util import exits

        # Records the run in progress as interrupted (its manifest written) before returning:
        # submitit then runs `scontrol requeue` and raises SystemExit, and SLURM kills the job
        # KillWait seconds after the requeue, maybe before the runner sees the SystemExit.
        exits.note_preempted("preempted by SLURM (submitit checkpointed and requeued the job)")
        # Once the requeue takes effect SLURM sends SIGTERM to every process of the job: to
        # `scontrol requeue` itself when it has not exited yet (submitit then raises
        # CalledProcessError into the run, which then recorded a failed stage, under load).
        # The job is ending either way, so SIGTERM is ignored from here on, by scontrol too
        # (an ignored signal stays ignored across exec; submitit's own handler only logs it in
        # this process); SIGKILL, KillWait seconds later, still ends whatever is left.
        with contextlib.suppress(ValueError):  # ValueError: not the main thread (none set)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        attempt = int(kwargs.pop("attempt", 0)) + 1
        log.warning(
            "checkpoint: job requeued (attempt %d); it resumes from its last finished stage",
            attempt + 1,
        )
        return submitit.helpers.DelayedSubmission(self, *args, attempt=attempt, **kwargs)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """Submit one job array (as ``submitit_slurm`` does), then wait with :mod:`jaxaot.sweeps.slurm`."""
        import submitit

        assert self.config is not None
        assert len(job_overrides) > 0
        params = dict(self.params)
        init_params: dict[str, Any] = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init_params["slurm_max_num_timeout"] = params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init_params)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in base else f"{self._EXECUTOR}_{k}": v
                for k, v in params.items()
                if k not in ("submitit_folder", "max_num_timeout")
            }
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        launch_log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        job_params: list[Any] = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            shown = " ".join(short_override(o) for o in filter_overrides(overrides))
            launch_log.info(f"\t#{idx} : {shown}")
            job_params.append(
                (
                    list(overrides),
                    "hydra.sweep.dir",
                    idx,
                    f"job_id_for_{idx}",
                    Singleton.get_state(),
                )
            )
        jobs = executor.map_array(self, *zip(*job_params, strict=True))
        launch_log.info(
            "submitted %d SLURM jobs: %s (logs: %s)",
            len(jobs),
            ", ".join(j.job_id for j in jobs[:8]) + (" ..." if len(jobs) > 8 else ""),
            params["submitit_folder"],
        )
        by_id = {j.job_id: p for j, p in zip(jobs, job_params, strict=True)}
        returns: dict[str, JobReturn] = {}

        def done(job: Any, state: JobState | None) -> None:
            overrides, _, num = by_id[job.job_id][:3]
            returns[job.job_id] = self._collect(job, state, list(overrides), num, sweep_dir)

        wait_all(jobs, on_done=done)
        return [returns[j.job_id] for j in jobs]

    def _collect(
        self, job: Any, state: JobState | None, overrides: list[str], num: int, sweep_dir: Path
    ) -> JobReturn:
        """The ended job's JobReturn, with its SLURM job id and state added to its job.json."""
        if not job.paths.result_pickle.exists():
            lost = state or JobState(job.job_id, "UNKNOWN", "no result file, no SLURM state")
            return self._lost(job, lost, overrides, num, sweep_dir, None)
        # The task function returned (ok or not). SLURM's own verdict, where it gave one
        # (CANCELLED if cancelled while finishing); else the result file is the evidence.
        if state is None or not state.terminal:
            state = JobState(job.job_id, "COMPLETED", "submitit result file")
        try:
            ret: JobReturn = job.results()[0]
        except Exception as exc:  # raised outside the task (submitit, this launcher)
            return self._lost(job, state, overrides, num, sweep_dir, exc)
        out = ret.hydra_cfg.hydra.runtime.output_dir if ret.hydra_cfg else None
        record = read_json(Path(str(out)) / JOB_NAME) if out is not None else None
        if record is not None:
            write_job_record(Path(str(out)), {**record, "slurm": state.to_json()})
        return ret

    def _lost(
        self,
        job: Any,
        state: JobState,
        overrides: list[str],
        num: int,
        sweep_dir: Path,
        exc: BaseException | None,
    ) -> JobReturn:
        """A job that ended without returning: a failed JobReturn, job.json and progress line."""
        assert self.hydra_context is not None and self.config is not None
        if exc is not None:
            detail = " ".join(str(exc).split())[:300]
            error = f"SLURM job {job.job_id} failed outside jaxaot: {detail}"
        else:
            error = (
                f"SLURM job {job.job_id} ended {state.state} (state from {state.source}) "
                f"without a result; log: {job.paths.stdout}"
            )
        status = "cancelled" if state.state.startswith("CANCELLED") else "failed"
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.id, config.hydra.job.num = job.job_id, num
        job_dir = job_dir_of(config, "hydra.sweep.dir")
        job_dir.mkdir(parents=True, exist_ok=True)
        record = read_json(job_dir / JOB_NAME) or {}
        write_job_record(
            job_dir,
            {
                **record,
                "num": num,
                "overrides": overrides,
                "status": status,
                "code": 2,
                "error": error,
                "host": socket.gethostname(),
                "finished": time.time(),
                "slurm": state.to_json(),
            },
        )
        plan = SweepPlan.read(sweep_dir)
        shown = [o for o in overrides if override_key(o) in plan.varying] or overrides
        n = claim_finish_slot(sweep_dir)
        relay_line(sweep_dir, n, progress_line(n, plan.total, shown, status, None, error))
        # COMPLETED with a failing JobOutcome, as the task function reports jaxaot's own
        # failures: Hydra's sweepers raise on a FAILED return and the report would never come.
        ret = JobReturn(overrides=overrides, cfg=None, hydra_cfg=None)
        ret.status = JobStatus.COMPLETED
        ret.return_value = JobOutcome(2, error)
        return ret


__all__ = ["JaxaotSlurmLauncher", "JaxaotSlurmLauncherConf", "discard_unsaved", "job_dir_of"]
