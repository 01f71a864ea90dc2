"""Whether ``snapshot.write`` and ``snapshot.verify`` can be snapshot folders: checked when a
config is validated, before any JAX work. Light (no OmegaConf): jaxaot-diff imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxaot.errors import ConfigError
from jaxaot.util.fsio import folder_problem

if TYPE_CHECKING:
    from jaxaot.config.sections import SnapshotConfig


def check_snapshot_dirs(snap: SnapshotConfig) -> None:
    """Refuse, when the config is validated (before any JAX work), a ``snapshot.write`` or
    ``snapshot.verify`` path that cannot be a snapshot folder (a regular file, ``/dev/null``, a
    symbolic link loop, a folder you cannot write where one is written), naming the key and the
    path. A golden that is not there yet is reported after the run, with how to write it."""
    for key, where, write in (
        ("snapshot.write", snap.write, True),
        ("snapshot.verify", snap.verify, snap.update),
    ):
        if not where:
            continue
        problem = folder_problem(where, write=write, create=write)
        if problem is not None:
            raise ConfigError(
                f"{key}={where}: expected a folder for a golden snapshot "
                f"{'(new, empty, or holding one)' if write else 'holding one'}, but {problem}; "
                "choose another folder"
            )


__all__ = ["check_snapshot_dirs"]
