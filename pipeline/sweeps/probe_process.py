"""A sweep job's task in a process of its own, so that a native crash is the job's result.

libtpu and XLA can die of a signal while compiling (SIGSEGV, SIGABRT); in the process that runs
a fit search that ends the search with no result. :class:`IsolatedTask` stands in for the task
function a launcher calls: Hydra's ``run_job`` still prepares the job (its folder, logging,
callbacks) in the launching process, and the task itself runs in a fresh Python
(``python -m jaxaot.sweeps.probe_process <spec>``) with the same job config, Hydra config,
``sys.path`` and environment. Its return value (or exception) comes back through a file; a
child that dies instead becomes ``JobOutcome(128 + signal, "crashed: SIGSEGV in the
compiler")``, the stage read from the job's manifest (rewritten after every stage). Python's
stacks at the crash (faulthandler) are kept in the job folder as ``crash.txt``.

The task function is found again in the child by its module and qualified name (for
``@hydra.main`` functions, the function under the decorator), so it must be importable.

Interrupts end both processes with one line, the CLI's (``jaxaot: terminated by SIGTERM``):
the launching process, interrupted (SIGTERM: :class:`jaxaot.util.exits.Terminated`, or
Ctrl-C), sends the child the same signal, gives it :data:`_GRACE_S` to record its run as
interrupted, then kills it, and raises on. The child takes the first SIGTERM or SIGINT (from
the launching process, or from ``timeout``/a terminal, which signal the whole process group)
as the CLI does, ignores any later one (so the second copy cannot cut its record short),
prints nothing more (the launching process prints the line) and exits ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from jaxaot.errors import ConfigError

CRASHED = "crashed"  # a JobOutcome error starting with this: the child died of a signal
TIMED_OUT = "timed out"  # ... or was killed at hydra.sweeper.timeout_s
CRASH_FILE = "crash.txt"
_GRACE_S = 10.0  # a child still running when the launching process is interrupted gets this


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)


def where_it_stopped(run_dir: Path, task_cfg: Any) -> str:
    """``in the compiler`` / ``while tracing (stage_out)``: the stage a job was in when it
    died, from its manifest (each finished stage is in it) and the stages its config plans."""
    from jaxaot.stages import NODES
    from jaxaot.sweeps.progress import planned_stages, read_json

    manifest = read_json(run_dir / "manifest.json")
    if manifest is None:
        return "before its first stage"
    done = set(manifest.get("stages", {}))
    try:
        stages = planned_stages(task_cfg)
    except (ValueError, AttributeError):
        stages = [n.name for n in NODES]
    stage = next((s for s in stages if s not in done), None)
    if stage is None:
        return "after its last stage"
    if stage == "compile":
        return "in the compiler"
    verb = {n.name: n.show.verb for n in NODES}.get(stage) or "in"
    return f"while {verb} ({stage})"


@dataclass(frozen=True)
class IsolatedTask:
    """A picklable task function that runs ``module:qualname`` in a child process."""

    module: str
    qualname: str
    timeout_s: float = 0.0

    @classmethod
    def of(cls, task_function: Callable[..., Any], timeout_s: float = 0.0) -> IsolatedTask:
        module = getattr(task_function, "__module__", None)
        qualname = getattr(task_function, "__qualname__", "")
        try:
            found = _resolve(str(module), qualname) if module and "<" not in qualname else None
        except (ImportError, AttributeError):
            found = None
        if found is not inspect.unwrap(task_function):
            raise ConfigError(
                f"hydra.sweeper.isolate=true: expected a task function importable by name to run "
                f"each probe in its own process, found {module}:{qualname}; define it at module "
                "level, or set hydra.sweeper.isolate=false to run probes in this process"
            )
        return cls(str(module), qualname, float(timeout_s))

    def __call__(self, cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from jaxaot.sweeps.progress import JobOutcome
        from omegaconf import OmegaConf, read_write

        full: Any = copy.deepcopy(HydraConfig.instance().cfg)  # the job's, with its hydra node
        assert full is not None, "IsolatedTask runs inside Hydra's run_job"
        # Interpolations of the launching process (${now:...}, ${unique_dir:...}) must not be
        # evaluated again, later, in the child.
        with read_write(full), read_write(full.hydra):
            OmegaConf.resolve(full.hydra)
        run_dir = Path(str(full.hydra.runtime.output_dir))
        with tempfile.TemporaryDirectory(prefix="jaxaot-probe-") as tmp:
            spec, result = Path(tmp) / "spec.pkl", Path(tmp) / "result.pkl"
            with spec.open("wb") as f:
                pickle.dump(
                    {
                        "module": self.module,
                        "qualname": self.qualname,
                        "cfg": cfg,
                        "hydra": full,
                        "sys_path": list(sys.path),
                        "result": str(result),
                        "crash_file": str(run_dir / CRASH_FILE),
                    },
                    f,
                )
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxaot.sweeps.probe_process", str(spec)]
            )
            try:
                code = proc.wait(timeout=self.timeout_s or None)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                where = where_it_stopped(run_dir, cfg)
                return JobOutcome(124, f"{TIMED_OUT} after {self.timeout_s:g} s {where}")
            except BaseException as exc:
                _stop(proc, exc)
                raise
            finally:
                if proc.poll() is None:  # interrupted again while stopping it
                    proc.kill()
                    proc.wait()
            outcome = _read_result(result)
        crash = run_dir / CRASH_FILE
        stacks = crash.exists() and crash.stat().st_size > 0
        if not stacks:
            with contextlib.suppress(OSError):
                crash.unlink()
        if outcome is not None:
            kind, value = outcome
            if kind == "raise":
                raise value
            return value
        where = where_it_stopped(run_dir, cfg)
        note = f" (Python's stacks: {crash})" if stacks else ""
        if code < 0:
            name = _signal_name(-code)
            return JobOutcome(128 - code, f"{CRASHED}: {name} {where}{note}")
        return JobOutcome(code or 2, f"{CRASHED}: exit status {code} {where}, no result{note}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _stop(proc: subprocess.Popen[bytes], exc: BaseException) -> None:
    """The launching process is interrupted: send the child the same signal, give it time to
    record its run as interrupted, then kill it."""
    from jaxaot.util.exits import Terminated

    if proc.poll() is not None:
        return
    if isinstance(exc, Terminated):
        signum = exc.signum
    else:
        signum = signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)
    try:
        proc.wait(timeout=_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """The child's handler for SIGTERM and SIGINT: the first is raised as the CLI raises it;
    later ones are ignored, and the child's output goes nowhere from now on."""
    from jaxaot.util import exits

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    if signum == signal.SIGINT:
        exits.raise_interrupted(signum, frame)
    exits.raise_terminated(signum, frame)


def _read_result(path: Path) -> tuple[str, Any] | None:
    try:
        with path.open("rb") as f:
            kind, value = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return str(kind), value


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def child(spec_path: str) -> int:
    """The child's side: set Hydra up as ``run_job`` did, run the task, leave its result."""
    from jaxaot.util.exits import exit_code, raise_pending

    # Before anything heavy is imported, as the CLI's main() does.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _interrupted)
    try:
        return _child(spec_path, raise_pending)
    except KeyboardInterrupt as exc:  # its run recorded it; the launching process says so
        return exit_code(exc)


def _child(spec_path: str, raise_pending: Callable[[], None]) -> int:
    import faulthandler

    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    sys.path[:] = spec["sys_path"]
    crash_file = open(spec["crash_file"], "w")  # noqa: SIM115 (open for the process' life)
    faulthandler.enable(crash_file, all_threads=True)
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log

    full = spec["hydra"]
    HydraConfig.instance().set_config(full)
    configure_log(full.hydra.job_logging, full.hydra.verbose)
    task = _resolve(spec["module"], spec["qualname"])
    try:
        out: tuple[str, Any] = ("return", task(spec["cfg"]))
    except Exception as exc:
        out = ("raise", _portable(exc))
    raise_pending()  # an interrupt that became another error (a half-imported module)
    tmp = Path(spec["result"] + ".tmp")
    with tmp.open("wb") as f:
        pickle.dump(out, f)
    os.replace(tmp, spec["result"])
    faulthandler.disable()
    crash_file.close()
    return 0


__all__ = ["CRASHED", "CRASH_FILE", "TIMED_OUT", "IsolatedTask", "child", "where_it_stopped"]


if __name__ == "__main__":
    sys.exit(child(sys.argv[1]))
