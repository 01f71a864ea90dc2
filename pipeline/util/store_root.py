"""Where the checkpoint store is (``store.dir``, else ``$JAXAOT_STORE_DIR``, else
``$XDG_CACHE_HOME/jaxaot/store``) and whether that path can be one: checked when a config is
validated, before any JAX work.

The default is per user, not per directory: every run of a user, from any folder, shares one
store. ``$XDG_CACHE_HOME`` is used only when it is an absolute path, else ``~/.cache`` (as the
XDG Base Directory specification says); jaxaot's other per-user caches (the roofline's
calibration, :mod:`jaxaot.stages.roofline`) live beside the store in :func:`user_cache_dir`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxaot.errors import ConfigError
from jaxaot.util.fsio import ENV_TRUST, folder_problem

ENV_STORE_DIR = "JAXAOT_STORE_DIR"
ENV_CACHE_HOME = "XDG_CACHE_HOME"
# Folders the default locations create are private: 0700, as the XDG specification asks of
# $XDG_CACHE_HOME, and a per-user cache holds nothing for other users.
PRIVATE_DIR_MODE = 0o700


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/jaxaot`` when that variable is an absolute path, else
    ``~/.cache/jaxaot``: where jaxaot keeps what it caches per user."""
    xdg = os.environ.get(ENV_CACHE_HOME, "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "jaxaot"
    try:
        home = Path.home()
    except RuntimeError as exc:  # no $HOME and no password entry
        raise ConfigError(
            f"store.dir: expected a home folder for the default store ~/.cache/jaxaot/store, but "
            f"{exc}; set store.dir, ${ENV_STORE_DIR} or ${ENV_CACHE_HOME} to a folder"
        ) from exc
    return home / ".cache" / "jaxaot"


def default_store_dir() -> Path:
    """The store root when neither ``store.dir`` nor ``$JAXAOT_STORE_DIR`` is set."""
    return user_cache_dir() / "store"


def resolve_store_root(configured: str | Path | None = None) -> Path:
    """The store root: ``configured`` if set, else ``$JAXAOT_STORE_DIR``, else
    :func:`default_store_dir`."""
    if configured is not None and str(configured) != "":
        return Path(configured).expanduser()
    env = os.environ.get(ENV_STORE_DIR, "")
    return Path(env).expanduser() if env else default_store_dir()


_SCHEME_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)")
# Schemes that name one service: gs:// and gcs:// are both Google Cloud Storage.
_SAME_SERVICE = {"gcs": "gs"}


def is_scheme_url(location: object) -> bool:
    """Whether ``location`` (store.dir) is ``<scheme>://...`` (a bucket), not a folder."""
    return isinstance(location, str) and _SCHEME_URL.fullmatch(location.strip()) is not None


def _url_parts(url: str) -> tuple[str, list[str]] | None:
    m = _SCHEME_URL.fullmatch(url.strip())
    if m is None:
        return None
    scheme = m.group(1).lower()
    return _SAME_SERVICE.get(scheme, scheme), [p for p in m.group(2).split("/") if p]


def bucket_trusted_by_env(url: str) -> bool:
    """Whether ``$JAXAOT_TRUST_STORE`` names the bucket URL ``url`` or a prefix of it, in
    whole path segments (``s3://team/jaxaot`` covers ``s3://team/jaxaot/x``, not
    ``s3://team/jaxaot2``); several are separated by commas or spaces. Its ``1``/``true``
    form is about folders and names no bucket."""
    want = _url_parts(url)
    if want is None or not want[1]:
        return False
    for token in re.split(r"[,\s]+", os.environ.get(ENV_TRUST, "")):
        given = _url_parts(token) if token else None
        if given is None or not given[1] or given[0] != want[0]:
            continue
        if want[1][: len(given[1])] == given[1]:
            return True
    return False


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each mode :data:`PRIVATE_DIR_MODE` (the umask can
    only narrow it); folders that exist are left as they are."""
    missing = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            continue


def check_store_dir(configured: str | Path | None, enabled: bool = True) -> None:
    """Refuse a store root that cannot be one, naming ``store.dir`` and the path: called when the
    config is validated, before any JAX work. The default root (neither ``store.dir`` nor
    ``$JAXAOT_STORE_DIR`` set) is created here when missing, private (:func:`make_private_dirs`);
    one that is set is created by its first put, with the umask's modes (a team store).

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
    env = os.environ.get(ENV_STORE_DIR, "")
    if is_scheme_url(configured if configured is not None and str(configured) != "" else env):
        return  # a bucket: jaxaot.store.root.check_store_dir checks it and its cache folder
    root = resolve_store_root(configured)
    problem = folder_problem(root, write=False)
    default = not (configured is not None and str(configured) != "") and not os.environ.get(
        ENV_STORE_DIR, ""
    )
    if problem is None and default and not os.path.lexists(root):
        try:
            make_private_dirs(root)
        except OSError as exc:
            problem = f"it cannot be created ({exc.strerror or exc})"
    if problem is None:
        return
    if configured is not None and str(configured) != "":
        key = f"store.dir={configured}"
    elif os.environ.get(ENV_STORE_DIR, ""):
        key = f"store.dir (unset, so ${ENV_STORE_DIR}={os.environ[ENV_STORE_DIR]})"
    else:
        key = f"store.dir (unset, so the default {root})"
    raise ConfigError(
        f"{key}: expected a folder for the checkpoint store (or a path where one can be "
        f"created), but {problem}; point store.dir at such a folder, or set "
        "store.enabled=false to run without the store"
    )


__all__ = [
    "ENV_CACHE_HOME",
    "ENV_STORE_DIR",
    "PRIVATE_DIR_MODE",
    "bucket_trusted_by_env",
    "check_store_dir",
    "default_store_dir",
    "is_scheme_url",
    "make_private_dirs",
    "resolve_store_root",
    "user_cache_dir",
]
