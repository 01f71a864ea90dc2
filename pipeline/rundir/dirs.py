"""Run directories that are never shared: every run writes into a directory no other run used.

Two rules:

- A directory jaxaot names (Hydra's time-stamped ``outputs/<date>/<time>``, a sweep's
  ``outputs/multirun/<date>/<time>``) is made unique when it is created: the ``unique_dir``
  resolver in ``conf/config.yaml`` creates ``<stamp>``, or ``<stamp>-1``, ``<stamp>-2``, ... with
  ``os.mkdir``, which succeeds for exactly one process, so two runs started in the same second
  get two directories.
- A directory the user names (``hydra.run.dir=...``, ``hydra.sweep.dir=...``,
  ``jaxaot.run(..., run_dir=...)``) is used as given or refused, never changed: a script that
  names its directory and reads ``manifest.json`` from it must not read an earlier run's. A run
  claims its directory by publishing its first ``manifest.json`` there with a hard link, which
  fails if one exists (atomic, also between processes); a directory that holds a manifest is
  refused with a one-line error that says how to go on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from jaxaot.errors import ConfigError, RunDirError
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.util.fsio import folder_problem

RESOLVER = "unique_dir"
SWEEP_MARKERS = ("multirun.yaml", ".jaxaot")  # what a sweep leaves in hydra.sweep.dir
HYDRA_SUBDIR = ".hydra"  # hydra.output_subdir: the composed config Hydra saves in a run dir
# What a sweep that launched no job leaves in its dir: Hydra's multirun.yaml, the launchers'
# multirun.log (jaxaot.rundir.logs) and .jaxaot/ holding the plan (jaxaot.sweeps.progress).
SWEEP_STATE, SWEEP_PLAN = ".jaxaot", "sweep.json"
_UNLAUNCHED_SWEEP = ("multirun.yaml", "multirun.log", SWEEP_STATE)

# Folders this process created for its runs (absolute): a run dir made by unique_dir, the
# parents it made for it, and a hydra.run.dir named on the command line that did not exist
# before the run. Only these may be removed by remove_unstarted.
_created: set[str] = set()
_runs: set[str] = set()  # of those, the run (or sweep) dirs themselves


def unique_dir(path: str) -> str:
    """Create ``path``, or the first free ``path-1``, ``path-2``, ...; return the one created.

    ``os.mkdir`` is atomic: of several processes asking for one name, one gets it and the others
    move on to the next suffix. Registered as the OmegaConf resolver ``${unique_dir:...}`` with
    its result cached in the config, so a run (and every job of a sweep, which Hydra composes
    with the sweep's resolver cache) resolves it to the same directory.
    """
    base = Path(path)
    for n in range(100_000):
        candidate = base if n == 0 else base.with_name(f"{base.name}-{n}")
        try:
            _mkdir_noting_parents(candidate)
        except FileExistsError:
            continue
        _created.add(os.path.abspath(candidate))
        _runs.add(os.path.abspath(candidate))
        return str(candidate)
    raise ConfigError(f"hydra.run.dir: no free name next to {str(base)!r} (tried 100000)")


def _mkdir_noting_parents(folder: Path) -> None:
    """``folder.mkdir()``, its missing parents first; the parents made here are noted as this
    process's. A parent removed meanwhile (an empty date folder that another process's failed
    run removed) is made again."""
    for _ in range(10):
        missing = [
            p for p in reversed(folder.parents) if str(p) not in ("", ".") and not p.exists()
        ]
        for parent in missing:
            with contextlib.suppress(FileExistsError):
                parent.mkdir()
                _created.add(os.path.abspath(parent))
        try:
            folder.mkdir()
            return
        except FileNotFoundError:
            continue
    folder.mkdir()


# The CLI's run-dir pattern (conf/config.yaml hydra.run.dir); jaxaot.run from Python uses it too.
RUN_DIR_PATTERN = "outputs/%Y-%m-%d/%H-%M-%S"
OUTPUTS_ROOT = RUN_DIR_PATTERN.split("/", 1)[0]  # where runs and sweeps go unless named


def default_run_dir() -> Path:
    """A fresh ``outputs/<date>/<time>`` (or ``-1``, ``-2``, ...), created now: the layout and
    root ``jaxaot`` gives a run, for runs started from Python."""
    return Path(unique_dir(time.strftime(RUN_DIR_PATTERN)))


_create = [True]  # False: resolve ${unique_dir:p} to p, creating nothing (see print_only)


def _resolve(path: str) -> str:
    return unique_dir(path) if _create[0] else path


def register_resolver() -> None:
    """Register ``${unique_dir:...}`` (idempotent); before Hydra composes ``conf/config.yaml``."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve, use_cache=True)


def print_only() -> None:
    """For ``jaxaot --cfg hydra --resolve``, which prints the config and runs nothing: show the
    time-stamped dirs without creating them."""
    _create[0] = False


def taken_reason(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot take a new run (it holds an earlier run's manifest), or None."""
    if (run_dir / MANIFEST_NAME).exists():
        return f"holds an earlier run ({MANIFEST_NAME})"
    return None


def _refusal(run_dir: Path, key: str, why: str) -> ConfigError:
    how = (
        "leave hydra.run.dir unset for a fresh outputs/<date>/<time>/"
        if key == "hydra.run.dir"
        else "leave hydra.sweep.dir unset for a fresh outputs/multirun/<date>/<time>/"
        if key == "hydra.sweep.dir"
        else "pass a new run_dir (or none, for a fresh outputs/<date>/<time>/)"
    )
    return ConfigError(
        f"{key}={str(run_dir)!r} {why}; a run never reuses another run's directory: "
        f"remove it to replace that run, or {how}"
    )


def claim(run_dir: Path, first_manifest: dict[str, Any], *, key: str) -> None:
    """Publish ``first_manifest`` as ``run_dir/manifest.json``, or refuse if the dir is taken.

    The manifest is written to a temporary file and hard-linked into place: ``link`` fails when
    the name exists, so of two runs given one directory exactly one claims it, and a reader
    never sees a partial file. Where hard links are not supported, an exclusive create does it.
    ``key`` names where the directory came from, for the error.
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = folder_problem(run_dir, write=True) or f"it cannot be created ({exc.strerror})"
        raise ConfigError(
            f"{key}={str(run_dir)!r}: expected a folder for the run (new or empty), but "
            f"{problem}; choose another"
        ) from None
    why = taken_reason(run_dir)
    if why is not None:
        raise _refusal(run_dir, key, why)
    target = run_dir / MANIFEST_NAME
    data = (json.dumps(first_manifest, indent=2, sort_keys=True, default=str) + "\n").encode()
    tmp = run_dir / f".tmp-{MANIFEST_NAME}.{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_bytes(data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise _refusal(run_dir, key, f"holds an earlier run ({MANIFEST_NAME})") from None
        except OSError:  # no hard links on this file system: an exclusive create
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                raise _refusal(run_dir, key, f"holds an earlier run ({MANIFEST_NAME})") from None
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:  # never leave a torn manifest that would claim the directory
                with contextlib.suppress(OSError):
                    os.unlink(target)
                raise
    except OSError as exc:
        raise RunDirError(
            f"{key}={str(run_dir)!r}: cannot write {MANIFEST_NAME} ({exc.strerror or exc}); "
            "the run did not start; free space on that file system (or choose a folder on "
            "another one) and run again"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def check_user_dirs(overrides: list[str], multirun: bool) -> None:
    """Refuse, before Hydra writes ``.hydra/`` there, a run or sweep dir named on the command
    line that holds an earlier run (values with interpolations are checked by the run itself)."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = None
    for o in overrides:
        k, sep, v = o.partition("=")
        if sep and k.lstrip("+") == key:
            value = v.strip().strip("'\"")
    if not value or "${" in value:
        return
    path = Path(value)
    if not os.path.lexists(path):
        # Made by Hydra for this run or sweep (with its missing parents): removable if it does
        # not start.
        here = Path(os.path.abspath(path))
        _created.update(str(p) for p in (here, *here.parents) if not os.path.lexists(p))
        _runs.add(str(here))
    if multirun:
        found = next((m for m in SWEEP_MARKERS if (path / m).exists()), None)
        # A fit search run again in its own sweep dir resumes from the fit.json it left there.
        fit_search = any(o.lstrip("+") == "hydra/sweeper=jaxaot_fit" for o in overrides)
        if found is not None and not (fit_search and (path / "fit.json").exists()):
            raise _refusal(path, key, f"holds an earlier sweep ({found})")
    else:
        why = taken_reason(path)
        if why is not None:
            raise _refusal(path, key, why)


def _log_files(run_dir: Path) -> set[str]:
    """Names of the log files this process's logging writes directly in ``run_dir``
    (Hydra's ``<hydra.job.name>.log``)."""
    here = os.path.abspath(run_dir)
    return {
        os.path.basename(h.baseFilename)
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) and os.path.dirname(h.baseFilename) == here
    }


def remove_unstarted(run_dir: Path | str | None) -> bool:
    """Remove the folder of a run that ended before it started (a config error, a refused
    import, raised before the run wrote its manifest): only a folder this process created for
    the run, holding nothing but Hydra's ``.hydra/`` and the run's log file; then the empty
    parents this process created for it (``outputs/<date>/``). Whether it was removed.

    A sweep refused before its first job (a mistyped key or option, found as Hydra composes
    that job) leaves only its plan and Hydra's ``multirun.yaml`` (and ``multirun.log``): its
    folder goes the same way. A folder the user named that existed before the run, a sweep's
    job folder and a folder holding anything else (a manifest: the run began and recorded how
    it ended; a job folder) are kept.
    """
    if run_dir is None:
        return False
    here = os.path.abspath(run_dir)
    if here not in _created:
        return False
    folder = Path(here)
    allowed = {HYDRA_SUBDIR, "jaxaot.log", *_log_files(folder), *_UNLAUNCHED_SWEEP}
    try:
        names = set(os.listdir(folder))
    except OSError:
        return False
    if not names <= allowed or (HYDRA_SUBDIR in names and not (folder / HYDRA_SUBDIR).is_dir()):
        return False
    if SWEEP_STATE in names:  # a sweep's: its plan only, no job finished or relayed a line
        try:
            if set(os.listdir(folder / SWEEP_STATE)) - {SWEEP_PLAN}:
                return False
        except OSError:
            return False
    try:
        shutil.rmtree(folder)
    except OSError:
        return False
    _created.discard(here)
    _runs.discard(here)
    for parent in folder.parents:  # deepest first; one that is not empty ends it
        if str(parent) not in _created:
            break
        try:
            parent.rmdir()
        except OSError:
            break
        _created.discard(str(parent))
    return True


def remove_unstarted_runs() -> None:
    """:func:`remove_unstarted` for every run dir this process made: after an error that
    ended the command before or around a run (Hydra's own, a refused logging config)."""
    for run_dir in sorted(_runs):
        remove_unstarted(run_dir)


__all__ = [
    "HYDRA_SUBDIR",
    "OUTPUTS_ROOT",
    "RESOLVER",
    "check_user_dirs",
    "claim",
    "register_resolver",
    "remove_unstarted",
    "remove_unstarted_runs",
    "taken_reason",
    "unique_dir",
]
