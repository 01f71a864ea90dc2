"""After a sweep, a non-zero exit when any job's snapshot did not verify.

``jaxaot -m program=mlp,transformer 'snapshot.verify=golden/${program.name}'`` is a CI suite:
each job prints its own verdict and diff, and the sweep as a whole must fail when one of them
failed. Jobs may run in other processes (joblib, submitit), so the verdict is read back from
the manifests in the sweep directory rather than from return values; :func:`exit_status` is
what the ``jaxaot`` entry point exits with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from jaxaot.rundir.manifest import MANIFEST_NAME
from omegaconf import DictConfig

_failed: list[str] = []


def failed_jobs(sweep_dir: Path) -> list[str]:
    """``<job dir>: <why>`` for each job under ``sweep_dir`` that asked for a snapshot and did
    not get a good verdict (a mismatch, or a run that failed before the snapshot step)."""
    from jaxaot.snapshots.snapshot import (
        OK_STATUSES,  # here, not at import: every run instantiates callbacks
    )

    out = []
    for path in sorted(Path(sweep_dir).rglob(MANIFEST_NAME)):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        asked = manifest.get("config", {}).get("snapshot", {})
        if not (asked.get("verify") or asked.get("write")):
            continue
        status = manifest.get("snapshot", {}).get("status")
        if status not in OK_STATUSES:
            why = manifest.get("error") or f"snapshot status {status!r}"
            out.append(f"{path.parent}: {why}")
    return out


class SnapshotSweepCheck(Callback):
    """Hydra callback (``hydra.callbacks.snapshot_check`` in conf/config.yaml)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = failed_jobs(Path(str(config.hydra.sweep.dir)))
        _failed[:] = failed
        if failed:
            lines = "\n  ".join(failed)
            print(
                f"jaxaot: error: snapshot: {len(failed)} sweep job(s) failed:\n  {lines}",
                file=sys.stderr,
                flush=True,
            )


def exit_status() -> int:
    """1 when the last sweep in this process had a job whose snapshot did not verify."""
    return 1 if _failed else 0


__all__ = ["SnapshotSweepCheck", "exit_status", "failed_jobs"]
