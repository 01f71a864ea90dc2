"""Where the checkpoint store is, and whether that path can be one (:mod:`jaxaot.util.store_root`,
which config validation uses too)."""

from __future__ import annotations

from jaxaot.util.store_root import (
    ENV_STORE_DIR,
    check_store_dir,
    default_store_dir,
    resolve_store_root,
)

__all__ = ["ENV_STORE_DIR", "check_store_dir", "default_store_dir", "resolve_store_root"]
