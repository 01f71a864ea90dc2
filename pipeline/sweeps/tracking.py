"""MLflow tracking as a Hydra callback: ``+tracking=mlflow`` (``conf/tracking/mlflow.yaml``).

Every run, and every job of a sweep, becomes one MLflow run, logged when the job ends (what is
logged: :mod:`jaxaot.sweeps.tracking_record`). A sweep is a parent run, created when the
multirun starts in the launching process; its id goes into ``mlflow_parent.json`` in the sweep
dir, which each job reads wherever it runs (a joblib worker, a submitit process, a SLURM node on
the shared file system) to nest under it. When the sweep ends the parent gets the sweep report,
its plots and the job counts.

The tracking URI is the callback's ``uri``, else ``MLFLOW_TRACKING_URI``, else MLflow's own
default: ``sqlite:///mlflow.db`` in the launch directory (``./mlruns`` where that already holds
MLflow data), which ``mlflow ui`` started in the same directory opens.

Tracking never changes a run's outcome: MLflow's client runs with bounded retries and request
timeouts (``MLFLOW_HTTP_REQUEST_*`` set around jaxaot's own calls only) within one time budget
per run, and any failure (server down or slow, missing package) is one warning line on stderr,
after which this process logs nothing more for the run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from jaxaot.compat.hydra import job_return_value
from jaxaot.errors import EXIT_DOES_NOT_FIT, ConfigError, MissingDependencyError
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.sweeps.progress import JobOutcome, SweepPlan, override_key, print_error, read_json
from jaxaot.sweeps.tracking_record import (
    LINKS_NAME,
    PARAM_CHARS,
    Record,
    run_record,
    sweep_record,
)
from omegaconf import DictConfig, OmegaConf

PARENT_NAME = "mlflow_parent.json"  # in the sweep dir: the parent run's id and tracking URI
_KEY = "hydra.callbacks.tracking"
# MLflow's request limits per call (log_batch).
_PARAMS_PER_CALL = 100
_TAGS_PER_CALL = 100
_METRICS_PER_CALL = 1000
# Loggers that would print each retry: quiet while jaxaot's calls run (the one warning says it).
_QUIET_LOGGERS = ("urllib3", "mlflow", "alembic")


class TrackingFailed(Exception):
    """A tracking call failed or ran out of time: the run is logged no further."""


def _mlflow() -> Any:
    try:
        import mlflow.tracking
    except ImportError:
        raise MissingDependencyError(
            "+tracking=mlflow needs mlflow, which is not installed; "
            "install it with: pip install 'jaxaot[tracking]'"
        ) from None
    return mlflow.tracking


def _mlflow_client(uri: str) -> Any:
    return _mlflow().MlflowClient(tracking_uri=uri)


_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")


def _database_store(uri: str) -> None:
    """Refuse a database URI where MLflow's database store cannot load: mlflow-skinny (the
    ``tracking`` extra) leaves out SQLAlchemy, which the full mlflow brings with ``mlflow ui``."""
    from importlib.util import find_spec

    scheme = uri.split(":", 1)[0].split("+", 1)[0]
    if scheme in _DATABASES and (find_spec("sqlalchemy") is None or find_spec("alembic") is None):
        raise TrackingFailed(
            f"the tracking URI {uri} is a database, which needs the full mlflow (pip install "
            "mlflow, which also brings `mlflow ui`); or track to a server: MLFLOW_TRACKING_URI="
            "http://host:port"
        )


def default_uri() -> str:
    """MLflow's own default tracking URI, a relative sqlite path or folder made absolute so
    that every job of a sweep (wherever its working directory) writes to the same one."""
    uri = str(_mlflow().get_tracking_uri())
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


@dataclass
class Session:
    """jaxaot's MLflow calls for one run or sweep: bounded retries and timeouts, one budget."""

    uri: str
    timeout_s: int
    max_retries: int
    budget_s: float

    def __post_init__(self) -> None:
        self._deadline = time.monotonic() + self.budget_s
        self._client: Any = None

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[None]:
        env = {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(self.max_retries),
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.timeout_s),
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.2",
        }
        saved_env = {k: os.environ.get(k) for k in env}
        levels = {n: logging.getLogger(n).level for n in _QUIET_LOGGERS}
        os.environ.update(env)
        for n in _QUIET_LOGGERS:
            logging.getLogger(n).setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)

    def call(self, what: str, fn: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<fn>(*args, **kwargs)``; TrackingFailed naming ``what`` on any failure or
        once the budget is spent."""
        if time.monotonic() > self._deadline:
            raise TrackingFailed(f"{what}: out of time ({self.budget_s:g} s for this run)")
        with self._bounded():
            try:
                if self._client is None:
                    _database_store(self.uri)
                    self._client = _mlflow_client(self.uri)
                return getattr(self._client, fn)(*args, **kwargs)
            except (MissingDependencyError, TrackingFailed):
                raise
            except Exception as exc:
                text = " ".join(str(exc).split())
                raise TrackingFailed(f"{what}: {type(exc).__name__}: {text[:300]}") from None

    def experiment_id(self, name: str) -> str:
        found = self.call("finding the experiment", "get_experiment_by_name", name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.call("creating the experiment", "create_experiment", name))
        except TrackingFailed:  # another job created it at the same moment
            found = self.call("finding the experiment", "get_experiment_by_name", name)
            if found is None:
                raise
            return str(found.experiment_id)

    def start(self, experiment_id: str, record: Record, parent: str | None) -> str:
        tags = {"mlflow.source.name": "jaxaot", "mlflow.source.type": "LOCAL"}
        if parent:
            tags["mlflow.parentRunId"] = parent
        started = record.started if record.started is not None else time.time()
        run = self.call(
            "creating the run",
            "create_run",
            experiment_id,
            start_time=int(started * 1000),
            tags=tags,
            run_name=record.name,
        )
        return str(run.info.run_id)

    def log(self, run_id: str, record: Record) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        params = [Param(k, v) for k, v in record.params.items()]
        tags = [RunTag(k, v) for k, v in record.tags.items()]
        metrics = [Metric(k, v, now, 0) for k, v in record.metrics.items()]
        n = _PARAMS_PER_CALL
        for i in range(0, len(params), n):
            self.call("logging parameters", "log_batch", run_id, params=params[i : i + n])
        n = _TAGS_PER_CALL
        for i in range(0, len(tags), n):
            self.call("logging tags", "log_batch", run_id, tags=tags[i : i + n])
        n = _METRICS_PER_CALL
        for i in range(0, len(metrics), n):
            self.call("logging metrics", "log_batch", run_id, metrics=metrics[i : i + n])
        for path, folder in record.files:
            self.call(f"uploading {path.name}", "log_artifact", run_id, str(path), folder or None)
        if record.links:
            with tempfile.TemporaryDirectory(prefix="jaxaot-mlflow-") as tmp:
                links = Path(tmp) / LINKS_NAME
                header = "# files over the upload limit: path in the run dir, bytes, where\n"
                links.write_text(header + "\n".join(record.links) + "\n")
                self.call("uploading the links", "log_artifact", run_id, str(links))

    def end(self, run_id: str, record: Record, failed: bool) -> None:
        ended = time.time()
        if record.started is not None and record.wall_s is not None:
            ended = record.started + record.wall_s
        status = "FAILED" if failed else "FINISHED"
        self.call("ending the run", "set_terminated", run_id, status, int(ended * 1000))


def _outcome(job_return: JobReturn | None) -> tuple[str, str | None]:
    """(status, error) of a job from what it returned, for a job that wrote no manifest."""
    if job_return is None:
        return "failed", None
    if job_return.status != JobStatus.COMPLETED:
        exc = job_return_value(job_return)
        return "failed", f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    value = job_return_value(job_return)
    if isinstance(value, JobOutcome):
        status = {0: "ok", EXIT_DOES_NOT_FIT: "does_not_fit"}.get(value.code, "failed")
        return status, value.error
    code = value if isinstance(value, int) else 0
    return ("ok" if code == 0 else "failed"), None


def _plain_config(config: DictConfig) -> dict[str, Any]:
    """The job's config as plain data, less Hydra's section (for a run that wrote no manifest)."""
    body = {k: v for k, v in config.items() if k != "hydra"}
    try:
        plain = OmegaConf.to_container(OmegaConf.create(body), resolve=True)
    except Exception:  # an interpolation that does not resolve: the values as written
        plain = OmegaConf.to_container(OmegaConf.create(body), resolve=False)
    return {str(k): v for k, v in plain.items()} if isinstance(plain, dict) else {}


def _check(name: str, value: Any, minimum: int, *, integer: bool = True) -> Any:
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or value < minimum:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{_KEY}.{name}: expected {what} >= {minimum}, found {value!r}")
    return value


# Single runs begun and not yet logged: (callback, config) by run dir.
_pending: dict[str, tuple[MlflowTracking, DictConfig]] = {}
_atexit_registered = False


def _log_pending() -> None:
    """Log the single runs that ended with sys.exit (failed, or did not fit) and so never
    reached on_job_end; one refused before it began (no manifest) is no run to log."""
    while _pending:
        run_dir, (callback, config) = _pending.popitem()
        if (Path(run_dir) / MANIFEST_NAME).is_file():
            callback._log_job(config, None)


class MlflowTracking(Callback):
    """Logs each run and each sweep job as an MLflow run, a sweep as their parent."""

    def __init__(
        self,
        uri: str | None = None,
        experiment: str = "jaxaot",
        max_artifact_bytes: int = 10 * 2**20,
        timeout_s: int = 10,
        max_retries: int = 2,
        budget_s: float = 60.0,
    ) -> None:
        if uri is not None and not isinstance(uri, str):
            raise ConfigError(f"{_KEY}.uri: expected a tracking URI or null, found {uri!r}")
        if not isinstance(experiment, str) or not experiment:
            raise ConfigError(
                f"{_KEY}.experiment: expected an experiment name, found {experiment!r}"
            )
        self.uri = uri
        self.experiment = experiment
        self.max_artifact_bytes = _check("max_artifact_bytes", max_artifact_bytes, 0)
        self.timeout_s = _check("timeout_s", timeout_s, 1)
        self.max_retries = _check("max_retries", max_retries, 0)
        self.budget_s = float(_check("budget_s", budget_s, 1, integer=False))
        self.off = False  # mlflow is not installed: said once, nothing tracked

    def _uri(self) -> str:
        if self.uri:
            return self.uri
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if env:
            return env
        return default_uri()

    def _session(self, uri: str) -> Session:
        return Session(uri, self.timeout_s, self.max_retries, self.budget_s)

    def _warn(self, uri: str, what: str, exc: Exception) -> None:
        print_error(f"jaxaot: tracking: {what} not logged to MLflow at {uri} ({exc})")

    def _installed(self) -> bool:
        """Whether mlflow imports; else one line naming the extra, and nothing is tracked."""
        try:
            _mlflow()
        except MissingDependencyError as exc:
            print_error(f"jaxaot: tracking: {exc} (this run is not tracked)")
            self.off = True
        return not self.off

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._installed()

    # --- a sweep: the parent run --------------------------------------------------------------

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        parent: dict[str, Any] = {"uri": None, "experiment_id": None, "run_id": None}
        uri = "(unknown)"
        try:
            if not self._installed():
                return
            uri = self._uri()
            parent["uri"] = uri
            session = self._session(uri)
            experiment_id = session.experiment_id(self.experiment)
            overrides = [str(o) for o in config.hydra.overrides.task]
            record = Record(name=f"sweep {sweep_dir.name}", status="running", started=time.time())
            record.params = {
                override_key(o): o.split("=", 1)[1][:PARAM_CHARS] for o in overrides if "=" in o
            }
            for key, value in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items():
                record.params.setdefault(str(key), str(value))
            record.tags = {
                "jaxaot.kind": "sweep",
                "jaxaot.sweep_dir": str(sweep_dir.resolve()),
                "jaxaot.overrides": " ".join(overrides),
            }
            program = OmegaConf.select(config, "program.name", default=None)
            if program:
                record.tags["jaxaot.program"] = str(program)
            run_id = session.start(experiment_id, record, None)
            session.log(run_id, record)
            parent.update(experiment_id=experiment_id, run_id=run_id)
        except TrackingFailed as exc:
            self._warn(uri, "the sweep", exc)
        finally:  # a job finding no run id here logs nothing: the warning was given here
            (sweep_dir / PARENT_NAME).write_text(json.dumps(parent) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep = self._sweep_callback(config)
        if sweep is not None:
            from jaxaot.sweeps.callbacks import after_report

            # Hydra ends callbacks in reverse order: the sweep report is written after this
            # hook, so the parent's artifacts are logged once it is.
            after_report(sweep_dir, self._end_sweep)
        else:
            self._end_sweep(sweep_dir)

    @staticmethod
    def _sweep_callback(config: DictConfig) -> str | None:
        """The key of jaxaot's sweep callback when Hydra ends it after this one."""
        callbacks = OmegaConf.select(config, "hydra.callbacks") or {}
        keys = list(callbacks.keys())
        for key in keys:
            target = OmegaConf.select(callbacks[key], "_target_", default=None)
            if target == "jaxaot.sweeps.callbacks.SweepCallback":
                mine = [
                    k
                    for k in keys
                    if OmegaConf.select(callbacks[k], "_target_", default=None)
                    == f"{__name__}.{MlflowTracking.__name__}"
                ]
                if mine and keys.index(key) < keys.index(mine[0]):
                    return str(key)
        return None

    def _end_sweep(self, sweep_dir: Path) -> None:
        parent = read_json(sweep_dir / PARENT_NAME) or {}
        run_id, uri = parent.get("run_id"), str(parent.get("uri"))
        if not run_id:
            return
        try:
            record = sweep_record(
                sweep_dir, name=f"sweep {sweep_dir.name}", max_bytes=self.max_artifact_bytes
            )
            session = self._session(uri)
            session.log(run_id, record)
            session.call(
                "ending the sweep",
                "set_terminated",
                run_id,
                "FAILED" if record.status == "failed" else "FINISHED",
            )
        except TrackingFailed as exc:
            self._warn(uri, "the sweep's report", exc)

    # --- each run or job ----------------------------------------------------------------------

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.off or config.hydra.mode == RunMode.MULTIRUN:
            return  # a sweep's job returns its outcome: Hydra always calls on_job_end
        # A single run that fails or does not fit ends with sys.exit inside the job, which
        # skips Hydra's on_job_end: it is logged as the process exits instead.
        global _atexit_registered
        _pending[str(config.hydra.runtime.output_dir)] = (self, config)
        if not _atexit_registered:
            atexit.register(_log_pending)
            _atexit_registered = True

    def on_job_end(
        self, config: DictConfig, job_return: JobReturn | None = None, **kwargs: Any
    ) -> None:
        _pending.pop(str(config.hydra.runtime.output_dir), None)
        if not self.off:
            self._log_job(config, job_return)

    def _log_job(self, config: DictConfig, job_return: JobReturn | None) -> None:
        run_dir = Path(str(config.hydra.runtime.output_dir))
        multirun = config.hydra.mode == RunMode.MULTIRUN
        parent_id: str | None = None
        uri = "(unknown)"
        experiment_id: str | None = None
        if multirun:
            parent = read_json(Path(str(config.hydra.sweep.dir)) / PARENT_NAME)
            if parent is not None:  # the launching process created the parent (or warned)
                if not parent.get("run_id"):
                    return
                parent_id, uri = str(parent["run_id"]), str(parent["uri"])
                experiment_id = str(parent["experiment_id"])
        overrides = [str(o) for o in config.hydra.overrides.task]
        what = f"job {config.hydra.job.num}" if multirun else "the run"
        try:
            if parent_id is None:
                uri = self._uri()
            session = self._session(uri)
            if experiment_id is None:
                experiment_id = session.experiment_id(self.experiment)
            resolved = _plain_config(config)
            record = run_record(
                run_dir,
                name=self._run_name(config, overrides, multirun),
                overrides=overrides,
                config=resolved,
                fallback=_outcome(job_return),
                max_bytes=self.max_artifact_bytes,
            )
            if multirun:
                record.tags["jaxaot.job"] = str(config.hydra.job.num)
            run_id = session.start(experiment_id, record, parent_id)
            session.log(run_id, record)
            session.end(run_id, record, failed=record.status not in ("ok", "does_not_fit"))
        except (TrackingFailed, MissingDependencyError) as exc:
            self._warn(uri, what, exc)

    @staticmethod
    def _run_name(config: DictConfig, overrides: list[str], multirun: bool) -> str:
        program = str(OmegaConf.select(config, "program.name", default="run"))
        if not multirun:
            return f"{program} {Path(str(config.hydra.runtime.output_dir)).name}"
        plan = SweepPlan.read(Path(str(config.hydra.sweep.dir)))
        shown = [o for o in overrides if override_key(o) in plan.varying]
        return f"{config.hydra.job.num}: {' '.join(shown) or program}"


__all__ = ["PARENT_NAME", "MlflowTracking", "Session", "TrackingFailed", "default_uri"]
