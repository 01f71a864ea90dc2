"""Where the checkpoint store is (``store.dir``, ``$JAXAOT_STORE_DIR``, ``outputs/store``) and
whether that path can be one: checked when a config is validated, before any JAX work."""

from __future__ import annotations

import os
from pathlib import Path

from jaxaot.errors import ConfigError
from jaxaot.util.fsio import folder_problem

ENV_STORE_DIR = "JAXAOT_STORE_DIR"
DEFAULT_STORE_DIR = Path("outputs/store")


def resolve_store_root(configured: str | Path | None = None) -> Path:
    """The store root: ``configured`` if set, else ``$JAXAOT_STORE_DIR``, else ``outputs/store``."""
    if configured is not None and str(configured) != "":
        return Path(configured).expanduser()
    env = os.environ.get(ENV_STORE_DIR, "")
    return Path(env).expanduser() if env else DEFAULT_STORE_DIR


def check_store_dir(configured: str | Path | None, enabled: bool = True) -> None:
    """Refuse a store root that cannot be one, naming ``store.dir`` and the path: called when the
    config is validated, before any JAX work.

    Which store problems fail a run and which only cost caching:

    - A root that is unusable when the run starts (``store.dir=/dev/null``, a regular file, a
      symbolic link loop or a dangling link, a folder you cannot read, a path that cannot be
      created) is a :class:`~jaxaot.errors.ConfigError`, also when it comes from
      ``$JAXAOT_STORE_DIR`` or the default: running on uncached would hide the mistake in a
      shared config and recompile on every run.
    - An existing folder you may read but not write is a read-only store: hits are served and
      puts are skipped, with one warning (:meth:`jaxaot.store.cache.Store.put`).
    - A store that becomes unusable while a run goes on (a full disk or quota, a file system
      remounted read-only, its root removed or no longer writable) costs one warning, and the
      run goes on uncached.
    - One entry that cannot be removed or placed (a folder inside the store you may not write)
      costs one warning naming it; that entry is skipped and the rest of the store is used.
    """
    if not enabled:
        return
    root = resolve_store_root(configured)
    problem = folder_problem(root, write=False)
    if problem is None:
        return
    if configured is not None and str(configured) != "":
        key = f"store.dir={configured}"
    elif os.environ.get(ENV_STORE_DIR, ""):
        key = f"store.dir (unset, so ${ENV_STORE_DIR}={os.environ[ENV_STORE_DIR]})"
    else:
        key = f"store.dir (unset, so the default {DEFAULT_STORE_DIR})"
    raise ConfigError(
        f"{key}: expected a folder for the checkpoint store (or a path where one can be "
        f"created), but {problem}; point store.dir at such a folder, or set "
        "store.enabled=false to run without the store"
    )


__all__ = ["DEFAULT_STORE_DIR", "ENV_STORE_DIR", "check_store_dir", "resolve_store_root"]
