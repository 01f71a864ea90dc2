"""Hydra compositions remembered and reused, by the ``jaxaot`` server for the runs it forks
(jaxaot.cli.server.compositions) and by :func:`jaxaot.compose` within one process.

A composition is a pure function of what it reads: the config name and overrides, the working
directory, the job name, the config files on Hydra's search path and the structured configs in
Hydra's ConfigStore. :func:`composition_key` is a key over all of that, or None for one not to
remember. The key covers every file and folder under every ``file://`` and ``pkg://`` source
Hydra reads (the primary config's own ``hydra.searchpath`` included, symlinks followed) by path,
target, size, inode, and modification and change times (any write to a file changes its ctime,
which no user can set back), and every ConfigStore entry by identity (storing a config makes a
new entry). Not remembered: a composition whose defaults list calls an OmegaConf resolver
(``- experiment: ${oc.env:PICK}``), one that copies environment variables
(``hydra.job.env_copy``), one with a source it cannot fingerprint or over 5000 files, and one
whose files changed in the last 2 s (a change within the same clock tick would look the same,
as Git's "racily clean" files). The group overrides pick the defaults list, whose composition
is what is remembered; the value overrides are applied to a copy as Hydra applies them
(jaxaot.sweeps.compose_cache). OmegaConf's resolver cache is cleared, so no resolved value (the
``${now:...}`` of a run dir) travels from one composition to another.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pickle
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

KEEP = 64  # compositions kept, least recently used dropped

MAX_FILES = 5000  # a search path this big (`--config-dir .` over a run tree) is not remembered
RACY_NS = 2_000_000_000  # files changed this recently may change again unseen (coarse clocks)


def _tree(root: str, newest: list[int]) -> list[Any] | None:
    """Every folder and file under ``root`` (symlinks followed, Python caches aside) by path,
    where it leads, size, inode, mtime and ctime; None past :data:`MAX_FILES`. ``newest[0]``
    becomes the latest mtime/ctime seen."""
    out: list[Any] = []
    seen: set[tuple[int, int]] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        try:
            st = os.stat(folder)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:  # a link loop: walked already
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for path in [folder, *(os.path.join(folder, name) for name in sorted(files))]:
            try:
                st = os.stat(path)
            except OSError:
                out.append([path, None])
                continue
            newest[0] = max(newest[0], st.st_mtime_ns, st.st_ctime_ns)
            real = os.path.realpath(path)
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


def composition_key(sources: list[Any], config_name: str | None, parts: list[Any]) -> str | None:
    """The key of a composition read from ``sources`` (Hydra's ConfigSources, the primary
    config's own ``hydra.searchpath`` included), or None when it is not one to remember: a
    source it cannot fingerprint, too many files, or a file changed in the last 2 s (a later
    change within the same clock tick would look the same)."""
    from hydra.core.utils import JobRuntime
    from omegaconf import OmegaConf

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
    if time.time_ns() - newest[0] < RACY_NS:
        return None
    from hydra import version

    job = OmegaConf.select(JobRuntime.instance().conf, "name")
    base = version.getbase()  # the version_base Hydra composes under (a Version, or unset)
    base_text = str(base) if hasattr(base, "major") else None
    blob = json.dumps([config_name, parts, os.getcwd(), job, base_text, files], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


_RESOLVER = re.compile(r"\$\{\s*[\w.]+\s*:")  # ${oc.env:X}, ${now:%H}: not ${program}


@contextlib.contextmanager
def _defaults_resolvers() -> Iterator[list[str]]:
    """Defaults-list entries resolved with an OmegaConf resolver while composing inside
    (``- experiment: ${oc.env:PICK}``: the choice depends on more than the files): such a
    composition is not remembered. Interpolations of other choices (``${program}``) depend on
    the files alone."""
    from jaxaot.compat.hydra import watch_defaults_interpolations

    found: list[str] = []

    def seen(val: str | None) -> None:
        if val is not None and _RESOLVER.search(val):
            found.append(val)

    with watch_defaults_interpolations(seen):
        yield found


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


def remember(memo: OrderedDict[str, bytes], report: Callable[[str, bytes], None]) -> None:
    """Hydra's RUN-mode compositions come from ``memo`` when their key is there; each is
    reported with ``report(key, payload)`` (payload b"" for one taken from ``memo``). Not on
    a Hydra this was not tested on (jaxaot.compat.hydra.HYDRA_KNOWN): each composes."""
    from hydra.types import RunMode
    from jaxaot.compat.hydra import wrap_load_configuration
    from jaxaot.sweeps.compose_cache import SweepConfigLoader, apply_value_overrides
    from omegaconf import OmegaConf

    def remembered(real: Any) -> Any:
        def load_configuration(
            self: Any,
            config_name: str | None,
            overrides: list[str],
            run_mode: RunMode,
            from_shell: bool = True,
            validate_sweep_overrides: bool = True,
        ) -> Any:
            args = (config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
            _HIT[0] = None
            # As a sweep job is composed (jaxaot.sweeps.compose_cache): the group overrides pick
            # the defaults list, whose composition is what is remembered; the value overrides
            # (hydra.run.dir=..., execute.seed=3) are applied to a copy as Hydra applies them.
            if run_mode != RunMode.RUN:
                return real(self, *args)
            split = SweepConfigLoader(self).split(config_name, list(overrides))
            if split is None:
                return real(self, *args)
            groups = [str(o.input_line) for o in split.groups]
            key = composition_key(
                split.repo.get_sources(),
                config_name,
                [groups, from_shell, validate_sweep_overrides],
            )
            if key is not None and (kept := memo.get(key)) is not None:
                cfg = pickle.loads(zlib.decompress(kept))
                _HIT[0] = (memo, key)
                report(key, b"")
            else:
                with _defaults_resolvers() as called:
                    cfg = real(
                        self, config_name, groups, run_mode, from_shell, validate_sweep_overrides
                    )
                if key is not None and not called and not cfg.hydra.job.get("env_copy"):
                    base = pickle.loads(pickle.dumps(cfg))
                    OmegaConf.clear_cache(base)  # no resolved value (a timestamp) is remembered
                    # Compressed: one report stays well inside a pipe's buffer (~4 of 64 KiB).
                    report(key, zlib.compress(pickle.dumps(base, protocol=pickle.HIGHEST_PROTOCOL)))
            apply_value_overrides(cfg, split)
            return cfg

        return load_configuration

    wrap_load_configuration(remembered)


# The memo and key of the last composition taken from a memo (None: the last one composed).
_HIT: list[tuple[OrderedDict[str, bytes], str] | None] = [None]


def drop_last_hit() -> bool:
    """Drop the composition the last one was taken from, so that the next composes afresh;
    whether there was one. A refusal of a remembered composition cannot say which config file
    set the refused value (nothing was composed): composing again lets it."""
    hit, _HIT[0] = _HIT[0], None
    if hit is None:
        return False
    memo, key = hit
    memo.pop(key, None)
    return True


_LOCAL: OrderedDict[str, bytes] = OrderedDict()
_installed: list[bool] = []


def remember_in_process() -> None:
    """:func:`remember` with this process's own memo (:data:`KEEP` compositions), once."""
    if _installed:
        return
    _installed.append(True)

    def report(key: str, payload: bytes) -> None:
        if payload:
            _LOCAL[key] = payload
        if key in _LOCAL:
            _LOCAL.move_to_end(key)
        while len(_LOCAL) > KEEP:
            _LOCAL.popitem(last=False)

    remember(_LOCAL, report)


def forget() -> None:
    """Drop this process's remembered compositions."""
    _LOCAL.clear()


__all__ = ["KEEP", "composition_key", "drop_last_hit", "forget", "remember", "remember_in_process"]
