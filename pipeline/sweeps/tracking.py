"""MLflow tracking as a Hydra callback: ``+tracking=mlflow`` (``conf/tracking/mlflow.yaml``).

Every run, and every job of a sweep, becomes one MLflow run, logged when the job ends (what is
logged: :mod:`jaxaot.sweeps.tracking_record`). A sweep is a parent run, created when the
multirun starts in the launching process; its id goes into ``mlflow_parent.json`` in the sweep
dir, which each job reads wherever it runs (a joblib worker, a submitit process, a SLURM node on
the shared file system) to nest under it. When the sweep ends the parent gets the sweep report,
its plots and the job counts.

Where a run's data goes is the user's call, never a config's: tracking is switched on, and its
``uri`` and ``max_artifact_bytes`` set, only on the command line (``+tracking=mlflow``,
``hydra.callbacks.tracking.uri=...``); a config group file, a preset, ``--config-dir`` or a
sweep parameter that does is refused in one line naming the key and the file, and nothing is
tracked (Hydra turns a callback's error into a warning, so the run itself goes on). The
tracking URI is the command line's ``uri``, else ``MLFLOW_TRACKING_URI``, else MLflow's own
default: ``sqlite:///mlflow.db`` in the launch directory (``./mlruns`` where that already holds
MLflow data), which ``mlflow ui`` started in the same directory opens. A sqlite database is
created under a file lock (built in a temporary file, renamed into place); one whose first use
was interrupted is refused, naming the file to delete. A run with tracking on prints
``tracking: runs to <uri>``.

Tracking never changes a run's outcome: MLflow's client runs with bounded retries and request
timeouts within one time budget per run: each request's timeout and retries shrink to what is
left of it (whole seconds, at least one), so one run's tracking takes at most ``budget_s``
plus one second, and a few more for the last request marking a run FAILED or KILLED. A timeout
bounds each wait for the server, not an upload that keeps moving: a large artifact on a slow
link can take longer. MLflow reads its limits from the environment only
(``MLFLOW_HTTP_REQUEST_*``; its client takes no per-client timeout), so they are set around
jaxaot's own calls, one call at a time (a lock); another thread's MLflow calls made meanwhile
see them too. Any failure (server down or slow, missing package) is one warning line on
stderr, after which this process logs nothing more for the run, except one last request
marking the MLflow run FAILED. A run or sweep ended by Ctrl-C or SIGTERM is logged KILLED (one
request each, a few seconds at most).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from jaxaot.compat.hydra import job_return_value
from jaxaot.config.trust.composed import override_value
from jaxaot.errors import EXIT_DOES_NOT_FIT, ConfigError, MissingDependencyError
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.sweeps.progress import JobOutcome, SweepPlan, override_key, print_error, read_json
from jaxaot.sweeps.tracking_record import (
    LINKS_NAME,
    NAME_CHARS,
    PARAM_CHARS,
    TAG_CHARS,
    Record,
    clip,
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
_BACKOFF_S = 1  # urllib3's backoff factor: waits of about 1, 2, 4 ... s between retries
_LOCK = threading.Lock()  # MLflow's request limits are process environment: one call at a time
DEFAULT_MAX_ARTIFACT_BYTES = 10 * 2**20
# The keys only the user's side may set (where a run's data goes, and how much of it).
_USER_KEYS = {"uri": None, "max_artifact_bytes": DEFAULT_MAX_ARTIFACT_BYTES}
_STATUS = {"ok": "FINISHED", "does_not_fit": "FINISHED", "interrupted": "KILLED"}


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
    """Refuse a database URI where MLflow's database store cannot load: mlflow-skinny (enough
    with a tracking server) leaves out SQLAlchemy, which the full mlflow (the ``tracking``
    extra) brings with ``mlflow ui``."""
    from importlib.util import find_spec

    scheme = uri.split(":", 1)[0].split("+", 1)[0]
    if scheme in _DATABASES and (find_spec("sqlalchemy") is None or find_spec("alembic") is None):
        raise TrackingFailed(
            f"the tracking URI {uri} is a database, which needs the full mlflow (pip install "
            "mlflow, which also brings `mlflow ui`); or track to a server: MLFLOW_TRACKING_URI="
            "http://host:port"
        )


def _half_built(db: Path) -> bool:
    """An MLflow database whose schema set-up stopped halfway: tables and no schema version."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not names:
                return False
            if "alembic_version" not in names:
                return True
            return con.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 0
    except sqlite3.Error:
        return True


def ensure_sqlite(uri: str) -> None:
    """Create the sqlite database ``uri`` names once, under a file lock: MLflow builds its
    schema in a temporary file that is renamed into place, so that two first users do not race
    and an interrupted first use leaves no half-built database. One found half-built is
    refused in one line."""
    import fcntl

    db = Path(uri[len("sqlite:///") :])
    if db.is_file() and db.stat().st_size > 0:
        if _half_built(db):
            raise TrackingFailed(
                f"{db} is a half-built MLflow database (its first use was interrupted); "
                "delete it, and the next tracked run creates it again"
            )
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if db.is_file() and db.stat().st_size > 0:
            return
        tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
        try:
            client = _mlflow_client(f"sqlite:///{tmp}")
            client.search_experiments(max_results=1)  # builds the schema
            _dispose(client)
            os.replace(tmp, db)
        finally:
            tmp.unlink(missing_ok=True)


def _dispose(client: Any) -> None:
    """Close a database client's connections (its file is renamed next)."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    engine = getattr(store, "engine", None)
    if engine is not None:
        engine.dispose()


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

    def limits(self, left: float) -> tuple[int, int]:
        """(timeout, retries) of one request with ``left`` seconds of the budget: the most
        retries whose attempts and backoff waits fit, each attempt's timeout at most ``left``."""
        timeout = max(1, min(self.timeout_s, int(left)))
        retries = self.max_retries
        while retries > 0:
            waits = sum(_BACKOFF_S * 1.2 * 2**i for i in range(retries))
            if (retries + 1) * timeout + waits <= left:
                break
            retries -= 1
        return timeout, retries

    @contextlib.contextmanager
    def _bounded(self, timeout: int, retries: int) -> Iterator[None]:
        env = {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout),
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(_BACKOFF_S),
            "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.2",
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # "View run ... at: ..."
        }
        # bounded: an interrupt's last request must not wait on a lock an interrupted one held
        if not _LOCK.acquire(timeout=timeout + 1):
            raise TrackingFailed("another MLflow request of this process did not finish")
        saved_env = {k: os.environ.get(k) for k in env}
        levels = {n: logging.getLogger(n).level for n in _QUIET_LOGGERS}
        try:
            os.environ.update(env)
            for n in _QUIET_LOGGERS:
                logging.getLogger(n).setLevel(logging.CRITICAL)
            yield
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)
            _LOCK.release()

    def call(self, what: str, fn: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<fn>(*args, **kwargs)``; TrackingFailed naming ``what`` on any failure or
        once the budget is spent."""
        left = self._deadline - time.monotonic()
        if left < 1:
            raise TrackingFailed(f"{what}: out of time ({self.budget_s:g} s for this run)")
        with self._bounded(*self.limits(left)):
            try:
                if self._client is None:
                    _database_store(self.uri)
                    if self.uri.startswith("sqlite:///"):
                        ensure_sqlite(self.uri)
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

    def end(self, run_id: str, record: Record) -> None:
        ended = time.time()
        if record.started is not None and record.wall_s is not None:
            ended = record.started + record.wall_s
        status = _STATUS.get(record.status, "FAILED")
        self.call("ending the run", "set_terminated", run_id, status, int(ended * 1000))

    def give_up(self, run_id: str, status: str = "FAILED") -> None:
        """One last request, outside the budget (a few seconds, no retry): mark the run
        ``status`` rather than leave it RUNNING; a failure here is not reported again."""
        self._deadline = time.monotonic() + 4
        self.timeout_s, self.max_retries = min(self.timeout_s, 3), 0
        with contextlib.suppress(TrackingFailed, MissingDependencyError):
            self.call("ending the run", "set_terminated", run_id, status)


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


def _check(
    name: str, value: Any, minimum: int, maximum: int | None = None, *, integer: bool = True
) -> Any:
    kind = int if integer else int | float
    bad = isinstance(value, bool) or not isinstance(value, kind) or value < minimum
    if bad or (maximum is not None and value > maximum):
        what = "an integer" if integer else "a number"
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ConfigError(
            f"{_KEY}.{name}: expected {what} {bounds}, found {value!r}; a tracking server that "
            "is down must never stall a run for long"
        )
    return value


def _overrides(config: DictConfig, which: str) -> list[str]:
    """``hydra.overrides.<which>`` as written: an ``${oc.env:...}`` in one stays unresolved."""
    node = OmegaConf.select(config, f"hydra.overrides.{which}", default=None)
    if node is None:
        return []
    return [str(o) for o in OmegaConf.to_container(node, resolve=False) or []]


def _origin(config: DictConfig, key: str) -> str:
    """The config file that set ``key`` in this composition, where the trust package can tell."""
    try:
        from jaxaot.config.trust.hydra_guard import origin_finder

        found = origin_finder(_overrides(config, "task") + _overrides(config, "hydra"))(key)
    except Exception:
        found = None
    return found or "a config file, not the command line"


def check_user_side(config: DictConfig) -> None:
    """Tracking is on, and its ``uri`` and ``max_artifact_bytes`` set, by the command line only
    (or MLFLOW_TRACKING_URI for the URI); a config file, preset or sweep parameter that does is
    refused naming the key and where it came from."""
    task, hydra = _overrides(config, "task"), _overrides(config, "hydra")
    keys = [override_key(o) for o in task + hydra]
    callbacks = OmegaConf.select(config, "hydra.callbacks") or {}
    for name in callbacks:
        node = callbacks[name]
        target = OmegaConf.select(node, "_target_", default=None)
        if target != f"{__name__}.{MlflowTracking.__name__}":
            continue
        at = f"hydra.callbacks.{name}"
        # the group's choice, or the callback's own target: overriding another of its options
        # (e.g. its experiment) does not switch on a callback a config added
        if "tracking" not in keys and f"{at}._target_" not in keys and at not in keys:
            raise ConfigError(
                f"{at} (from {_origin(config, at + '._target_')}) switches MLflow tracking on, which sends "
                "the run's files to a server: that is your call, never a config's; give "
                "+tracking=mlflow on the command line"
            )
        for key, default in _USER_KEYS.items():
            value = OmegaConf.select(node, key, default=default)
            if value == default:
                continue
            given = [override_value(o) for o in hydra if override_key(o) == f"{at}.{key}"]
            if given and given[-1] == value:
                continue
            env = " or set MLFLOW_TRACKING_URI" if key == "uri" else ""
            raise ConfigError(
                f"{at}.{key}={value!r} comes from {_origin(config, f'{at}.{key}')}: where a run's "
                f"files go, and how much of them, is your call, never a config's; give "
                f"{at}.{key}=... on the command line{env}"
            )
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    for key in params:
        bare = str(key).lstrip("+~")
        if bare == "tracking" or bare.startswith("hydra.callbacks"):
            raise ConfigError(
                f"hydra.sweeper.params.{key} (from {_origin(config, 'hydra.sweeper.params')}) "
                "sweeps over tracking settings: where a run's files go is your call, never a "
                "config's; give them on the command line"
            )


# Single runs begun and not yet logged: (callback, config) by run dir.
_pending: dict[str, tuple[MlflowTracking, DictConfig]] = {}
_atexit_registered = False
# Sweeps begun and not yet ended in this process: (uri, parent run id) by sweep dir.
_open_sweeps: dict[str, tuple[str, str]] = {}


def _log_pending() -> None:
    """Log the single runs that ended with sys.exit (failed, or did not fit) and so never
    reached on_job_end; one refused before it began (no manifest) is no run to log."""
    while _pending:
        run_dir, (callback, config) = _pending.popitem()
        if (Path(run_dir) / MANIFEST_NAME).is_file():
            callback._log_job(config, None)


def end_interrupted() -> None:
    """On Ctrl-C or SIGTERM (the process then ends with os._exit, which skips atexit): log the
    single run in progress as KILLED, and mark each open sweep's parent run KILLED; one
    request each, a few seconds at most."""
    while _pending:
        run_dir, (callback, config) = _pending.popitem()
        callback.budget_s = min(callback.budget_s, 5.0)
        callback.max_retries = 0
        callback.timeout_s = min(callback.timeout_s, 3)
        if (Path(run_dir) / MANIFEST_NAME).is_file():
            with contextlib.suppress(Exception):  # the process ends next, whatever happens here
                callback._log_job(config, None, interrupted=True)
    while _open_sweeps:
        _sweep_dir, (uri, run_id) = _open_sweeps.popitem()
        with contextlib.suppress(Exception):
            Session(uri, 3, 0, 5.0).give_up(run_id, "KILLED")


class MlflowTracking(Callback):
    """Logs each run and each sweep job as an MLflow run, a sweep as their parent."""

    def __init__(
        self,
        uri: str | None = None,
        experiment: str = "jaxaot",
        max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES,
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
        self.timeout_s = _check("timeout_s", timeout_s, 1, 60)
        self.max_retries = _check("max_retries", max_retries, 0, 5)
        self.budget_s = float(_check("budget_s", budget_s, 1, 600, integer=False))
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

    def _announce(self, config: DictConfig) -> str:
        """Say where runs go: ``tracking: runs to <uri>``."""
        uri = self._uri()
        print(f"tracking: runs to {uri}", flush=True)
        return uri

    def _allowed(self, config: DictConfig) -> bool:
        """Whether the user's side switched tracking on and set where it goes; else one line
        (Hydra turns a callback's exception into a warning and runs on: nothing is tracked)."""
        try:
            check_user_side(config)
        except ConfigError as exc:
            print_error(f"jaxaot: error: {exc} (nothing is tracked)")
            self.off = True
        return not self.off

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self._allowed(config) and self._installed():
            self._announce(config)

    # --- a sweep: the parent run --------------------------------------------------------------

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        parent: dict[str, Any] = {"uri": None, "experiment_id": None, "run_id": None}
        uri = "(unknown)"
        try:
            if not self._allowed(config) or not self._installed():
                return
            uri = self._announce(config)
            parent["uri"] = uri
            parent["max_artifact_bytes"] = self.max_artifact_bytes
            session = self._session(uri)
            experiment_id = session.experiment_id(self.experiment)
            overrides = _overrides(config, "task")
            record = Record(
                name=clip(f"sweep {sweep_dir.name}", NAME_CHARS),
                status="running",
                started=time.time(),
            )
            record.params = {
                override_key(o): clip(o.split("=", 1)[1], PARAM_CHARS)
                for o in overrides
                if "=" in o
            }
            sweep_params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
            plain = OmegaConf.to_container(sweep_params, resolve=False) if sweep_params else {}
            for key, value in (plain if isinstance(plain, dict) else {}).items():
                record.params.setdefault(override_key(str(key)), clip(str(value), PARAM_CHARS))
            record.tags = {
                "jaxaot.kind": "sweep",
                "jaxaot.sweep_dir": str(sweep_dir.resolve()),
                "jaxaot.overrides": clip(" ".join(overrides), TAG_CHARS),
            }
            program = OmegaConf.select(config, "program.name", default=None)
            if program:
                record.tags["jaxaot.program"] = str(program)
            run_id = session.start(experiment_id, record, None)
            # saved before logging: the jobs nest under it whatever happens to the logging
            parent.update(experiment_id=experiment_id, run_id=run_id)
            (sweep_dir / PARENT_NAME).write_text(json.dumps(parent) + "\n")
            _open_sweeps[str(sweep_dir)] = (uri, run_id)
            session.log(run_id, record)
        except TrackingFailed as exc:
            # A parent that exists keeps its id: its jobs nest under it, and the sweep's end
            # (or an interrupt) ends it.
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
        _open_sweeps.pop(str(sweep_dir), None)
        parent = read_json(sweep_dir / PARENT_NAME) or {}
        run_id, uri = parent.get("run_id"), str(parent.get("uri"))
        if not run_id:
            return
        session = self._session(uri)
        try:
            record = sweep_record(
                sweep_dir,
                name=clip(f"sweep {sweep_dir.name}", NAME_CHARS),
                max_bytes=int(parent.get("max_artifact_bytes", self.max_artifact_bytes)),
            )
            session.log(run_id, record)
            session.call(
                "ending the sweep",
                "set_terminated",
                run_id,
                "FAILED" if record.status == "failed" else "FINISHED",
            )
        except TrackingFailed as exc:
            self._warn(uri, "the sweep's report", exc)
            session.give_up(str(run_id))

    # --- each run or job ----------------------------------------------------------------------

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.off:
            return
        # A single run that fails or does not fit ends with sys.exit inside the job, which
        # skips Hydra's on_job_end: it is logged as the process exits instead. A sweep's job
        # returns its outcome (Hydra calls on_job_end), unless an interrupt ends the process
        # (end_interrupted logs it).
        global _atexit_registered
        _pending[str(config.hydra.runtime.output_dir)] = (self, config)
        if config.hydra.mode == RunMode.MULTIRUN:
            return
        if not _atexit_registered:
            atexit.register(_log_pending)
            _atexit_registered = True

    def on_job_end(
        self, config: DictConfig, job_return: JobReturn | None = None, **kwargs: Any
    ) -> None:
        _pending.pop(str(config.hydra.runtime.output_dir), None)
        if not self.off:
            self._log_job(config, job_return)

    def _log_job(
        self, config: DictConfig, job_return: JobReturn | None, *, interrupted: bool = False
    ) -> None:
        run_dir = Path(str(config.hydra.runtime.output_dir))
        multirun = config.hydra.mode == RunMode.MULTIRUN
        parent_id: str | None = None
        uri = "(unknown)"
        experiment_id: str | None = None
        max_bytes = self.max_artifact_bytes
        if multirun:
            # The launching process checked the user's side and created the parent (or warned):
            # no parent run, nothing logged.
            parent = read_json(Path(str(config.hydra.sweep.dir)) / PARENT_NAME)
            if parent is None or not parent.get("run_id"):
                return
            parent_id, uri = str(parent["run_id"]), str(parent["uri"])
            experiment_id = str(parent["experiment_id"])
            max_bytes = int(parent.get("max_artifact_bytes", max_bytes))
        overrides = _overrides(config, "task")
        what = f"job {config.hydra.job.num}" if multirun else "the run"
        session: Session | None = None
        run_id: str | None = None
        try:
            if parent_id is None:
                uri = self._uri()
            session = self._session(uri)
            if experiment_id is None:
                experiment_id = session.experiment_id(self.experiment)
            resolved = _plain_config(config)
            record = run_record(
                run_dir,
                name=self._run_name(config, run_dir, overrides, multirun),
                overrides=overrides,
                config=resolved,
                fallback=("interrupted", None) if interrupted else _outcome(job_return),
                max_bytes=max_bytes,
            )
            if interrupted:
                record.status = "interrupted"
            if multirun:
                record.tags["jaxaot.job"] = str(config.hydra.job.num)
            run_id = session.start(experiment_id, record, parent_id)
            session.log(run_id, record)
            session.end(run_id, record)
        except (TrackingFailed, MissingDependencyError) as exc:
            self._warn(uri, what, exc)
            if session is not None and run_id is not None:
                session.give_up(run_id, "KILLED" if interrupted else "FAILED")

    @staticmethod
    def _run_name(config: DictConfig, run_dir: Path, overrides: list[str], multirun: bool) -> str:
        """``<program> <run dir>`` (the program the run's manifest names: a resumed run's, not
        the composed default), or for a sweep job ``<job>: <its varying overrides>``."""
        manifest = read_json(run_dir / MANIFEST_NAME) or {}
        program = ((manifest.get("config") or {}).get("program") or {}).get("name")
        if not program:
            program = OmegaConf.select(config, "program.name", default="run")
        if not multirun:
            return clip(f"{program} {run_dir.name}", NAME_CHARS)
        plan = SweepPlan.read(Path(str(config.hydra.sweep.dir)))
        shown = [o for o in overrides if override_key(o) in plan.varying]
        return clip(f"{config.hydra.job.num}: {' '.join(shown) or program}", NAME_CHARS)


__all__ = [
    "PARENT_NAME",
    "MlflowTracking",
    "Session",
    "TrackingFailed",
    "check_user_side",
    "default_uri",
    "end_interrupted",
    "ensure_sqlite",
]
