"""What Hydra reads when it composes, fingerprinted: every file and folder under each config
source (Hydra's ``file://`` and ``pkg://`` search-path entries, symlinks followed) by path,
target, size, inode, and modification and change times (any write to a file changes its ctime,
which no user can set back), and every ConfigStore entry by identity (storing a config makes a
new entry). Two fingerprints taken at different times are equal while nothing was written,
except for a change within the same clock tick as the first: so a fingerprint whose newest
change is less than :data:`RACY_NS` old is not trusted (as Git's "racily clean" files).
jaxaot.sweeps.remembered keys compositions with it, jaxaot.sweeps.compose_cache keeps config
repositories by it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

MAX_FILES = 5000  # a search path this big (`--config-dir .` over a run tree) is not remembered
RACY_NS = 2_000_000_000  # files changed this recently may change again unseen (coarse clocks)


def _tree(root: str, newest: list[int]) -> list[Any] | None:
    """Every folder and file under ``root`` (symlinks followed; compiled Python aside) by path,
    where it leads, size, inode, mtime and ctime; None past :data:`MAX_FILES`. ``newest[0]``
    becomes the latest mtime/ctime seen. A folder reached again (a second link to it, a link
    loop) is recorded by path and target, its files once, where first reached."""
    out: list[Any] = []
    seen: set[tuple[int, int]] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        try:
            st = os.stat(folder)
        except OSError:
            continue
        again = (st.st_dev, st.st_ino) in seen
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = [] if again else sorted(dirs)
        # Hydra reads YAML: the bytecode Python writes under a package's __pycache__ is not read.
        names = [] if again else sorted(f for f in files if not f.endswith((".pyc", ".pyo")))
        real_folder = os.path.realpath(folder)
        if os.path.basename(folder) == "__pycache__":
            # By path and target alone: Python writing bytecode here changes its times.
            out.append([folder, real_folder])
            paths = [os.path.join(folder, name) for name in names]
        else:
            paths = [folder, *(os.path.join(folder, name) for name in names)]
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                out.append([path, None])
                continue
            newest[0] = max(newest[0], st.st_mtime_ns, st.st_ctime_ns)
            if path == folder:
                real = real_folder
            elif os.path.islink(path):
                real = os.path.realpath(path)
            else:  # a file that is no link is where its folder leads
                real = os.path.join(real_folder, os.path.basename(path))
            out.append([path, real, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
        if len(out) > MAX_FILES:
            return None
    return out


def _folder(search_path: str) -> str | None:
    """The folder a ``file://`` or ``pkg://`` search-path entry reads; None for others."""
    scheme, _, rest = search_path.partition("://")
    if not rest:  # a bare folder, as initialize_config_dir gives it: a file:// one
        return os.path.abspath(search_path)
    if scheme == "file":
        return os.path.abspath(rest)
    if scheme == "pkg":
        try:
            spec = importlib.util.find_spec(rest.replace("/", "."))
        except (ImportError, ValueError):  # Hydra reports the missing package itself
            return None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return locations[0] if len(locations) == 1 else None
    return None


def source_files(sources: list[Any]) -> tuple[list[Any], int] | None:
    """What Hydra reads from ``sources`` (its ConfigSources): every file and folder under each
    ``file://`` and ``pkg://`` source by path, target, size, inode, mtime and ctime, every
    ConfigStore entry by identity; and the latest mtime/ctime seen. None for a source it cannot
    fingerprint or past :data:`MAX_FILES` files."""
    files: list[Any] = []
    newest = [0]
    for source in sources:
        where = f"{source.scheme()}://{source.path}"
        if source.scheme() == "structured":
            files.append([source.provider, where, _config_store()])
            continue
        folder = _folder(where)
        tree = _tree(folder, newest) if folder is not None else None
        if tree is None:
            return None
        files.append([source.provider, where, folder, tree])
    return files, newest[0]


_NODES: list[Any] = []  # every ConfigStore entry a key named: alive, so no id is reused


def _config_store() -> list[Any]:
    """Every ConfigStore entry by group path, name and identity."""
    from hydra.core.config_store import ConfigStore

    out: list[Any] = []
    seen = {id(n) for n in _NODES}

    def walk(tree: dict[str, Any], path: str) -> None:
        for name in sorted(tree):
            node = tree[name]
            if isinstance(node, dict):
                walk(node, f"{path}/{name}")
                continue
            if id(node) not in seen:
                _NODES.append(node)
                seen.add(id(node))
            out.append([f"{path}/{name}", id(node)])

    walk(ConfigStore.instance().repo, "")
    return out


__all__ = ["MAX_FILES", "RACY_NS", "source_files"]
