"""Where the checkpoint store is, and whether that location can be one: a folder
(:mod:`jaxaot.util.store_root`, which config validation uses too) or a bucket URL
(:mod:`jaxaot.store.bucket`) with its local cache folder."""

from __future__ import annotations

import os

from jaxaot.errors import ConfigError
from jaxaot.util.fsio import folder_problem
from jaxaot.util.store_root import (
    ENV_STORE_DIR,
    default_store_dir,
    make_private_dirs,
    resolve_store_root,
)
from jaxaot.util.store_root import check_store_dir as check_store_folder


def check_store_dir(
    configured: str | None,
    enabled: bool = True,
    cache_dir: str | None = None,
    lease_s: float | None = None,
) -> None:
    """Refuse a store location that cannot be one, in one line naming the key: a folder as
    :func:`jaxaot.util.store_root.check_store_dir` says; a bucket URL that is malformed, of an
    unknown scheme or whose library is not installed (naming the extra), or whose cache folder
    (``store.cache_dir``, default the local store) cannot be one. Nothing is asked of the bucket
    here: one that is unreachable costs a warning when the run first uses it."""
    if lease_s is not None and not 1 <= lease_s <= 600:
        raise ConfigError(
            f"store.lease_s: expected seconds from 1 to 600, found {lease_s}; a claim's holder "
            "renews it every lease_s / 4 seconds, and waiters take it over after lease_s"
        )
    if not enabled:
        return
    from jaxaot.store.bucket import is_bucket_url

    env = os.environ.get(ENV_STORE_DIR, "")
    where = configured if configured is not None and str(configured) != "" else env
    if not is_bucket_url(where):
        check_store_folder(configured, enabled)
        return
    from jaxaot.store.bucket import SCHEMES, parse_bucket_url

    url = parse_bucket_url(str(where), "store.dir" if where == configured else ENV_STORE_DIR)
    module = SCHEMES[url.scheme][1]
    import importlib.util

    if importlib.util.find_spec(module) is None:
        from jaxaot.errors import MissingDependencyError

        raise MissingDependencyError(
            f"store.dir={url.url} needs {module}, which is not installed; install it with: "
            f"pip install 'jaxaot[{url.extra}]'"
        )
    if cache_dir:
        problem = folder_problem(cache_dir, write=False)
        if problem is not None:
            raise ConfigError(
                f"store.cache_dir={cache_dir}: expected a folder for the bucket store's local "
                f"cache (or a path where one can be created), but {problem}; point "
                "store.cache_dir at such a folder"
            )
    elif not is_bucket_url(env):
        check_store_folder(None, enabled)  # the local store ($JAXAOT_STORE_DIR or the default)
    else:
        default = default_store_dir()
        problem = folder_problem(default, write=False)
        if problem is None and not os.path.lexists(default):
            try:
                make_private_dirs(default)
            except OSError as exc:
                problem = f"it cannot be created ({exc.strerror or exc})"
        if problem is not None:
            raise ConfigError(
                f"store.cache_dir (unset, so the default {default}): expected a folder for the "
                f"bucket store's local cache, but {problem}; set store.cache_dir to such a folder"
            )


__all__ = [
    "ENV_STORE_DIR",
    "check_store_dir",
    "default_store_dir",
    "resolve_store_root",
]
