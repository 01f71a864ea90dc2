"""``latest`` on the command lines of jaxaot-diff, jaxaot-graph and jaxaot-report, and the one
line for a path that is not there.

``latest`` means what ``resume_from=latest`` finds (jaxaot.engine.resume.latest_run): the run
under ``./outputs`` started last, by its manifest's start time, single runs and sweep jobs
alike, of those that finished at least stage_out (a run refused or failed before that has
nothing to compare or draw). For jaxaot-report it is the sweep folder under
``./outputs/multirun`` started last (by Hydra's ``multirun.yaml``). A folder named ``latest``
is given as ``./latest``.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxaot.config.order import STAGES
from jaxaot.errors import ConfigError
from jaxaot.rundir.dirs import OUTPUTS_ROOT, SWEEP_MARKERS

LATEST = "latest"  # as resume_from=latest (jaxaot.engine.resume.LATEST)
SWEEP_ROOT = Path(OUTPUTS_ROOT) / "multirun"  # conf/config.yaml's hydra.sweep.dir
_SWEEP_YAML = SWEEP_MARKERS[0]  # multirun.yaml: Hydra writes it when the sweep starts


def existing(text: str, expected: str) -> Path:
    """``text`` as a path that exists, else a ConfigError naming it and what was expected."""
    path = Path(text)
    if not os.path.lexists(path):
        raise ConfigError(f"{text}: no such file or directory; expected {expected}")
    return path


def run_or_path(text: str, expected: str, root: Path | str = OUTPUTS_ROOT) -> Path:
    """A run directory, snapshot or file named on the command line; ``latest``: the newest run
    under ``root`` that finished stage_out."""
    if text != LATEST:
        return existing(text, expected)
    from jaxaot.engine.resume import latest_run  # the engine's imports: only for latest

    try:
        return latest_run(STAGES[1], root)  # every stage before lower: stage_out
    except ConfigError:
        where = os.path.abspath(root)
        raise ConfigError(
            f"latest: expected a run under {where} that finished {STAGES[0]}, found none; "
            f"run one first (jaxaot) or name its folder instead of latest"
        ) from None


def sweep_dir(text: str, root: Path | str = SWEEP_ROOT) -> Path:
    """A sweep folder named on the command line; ``latest``: the one under ``root`` whose
    sweep started last."""
    if text != LATEST:
        return existing(text, "a sweep folder (hydra.sweep.dir)")
    found = []
    for marker in Path(root).glob(f"*/*/{_SWEEP_YAML}"):
        try:
            found.append((marker.stat().st_mtime, marker.parent))
        except OSError:
            continue  # removed meanwhile
    if not found:
        raise ConfigError(
            f"latest: expected a sweep folder under {os.path.abspath(root)} (one holding "
            f"{_SWEEP_YAML}), found none; run a sweep first (jaxaot -m ...) or name its folder"
        )
    return max(found)[1]


__all__ = ["LATEST", "existing", "run_or_path", "sweep_dir"]
