"""Hydra compositions remembered by the ``jaxaot`` server, for the runs it forks.

Composing jaxaot's config costs ~0.2 s, a fifth of a warm run through the server. A run's
composition is a pure function of what it reads: the config name and overrides, the working
directory, the job name, and the config files on Hydra's search path. So a served run that
composes (Hydra's RUN mode) reports the result to the server under a key over all of that, and
a later run with the same key starts from a copy instead of composing.

The key covers every file and folder under every ``file://`` and ``pkg://`` source Hydra reads
(the primary config's own ``hydra.searchpath`` included, symlinks followed) by path, target,
size, inode, and modification and change times (any write to a file changes its ctime, which no
user can set back). Not remembered: a composition whose defaults list calls an OmegaConf
resolver (``- experiment: ${oc.env:PICK}``), one that copies environment variables
(``hydra.job.env_copy``), one with a source it cannot fingerprint or over 5000 files, and one
whose files changed in the last 2 s (a change within the same clock tick would look the same,
as Git's "racily clean" files). Structured configs (Hydra's ConfigStore) are registered by
jaxaot's own modules, which the server watches: it restarts when one changes. OmegaConf's
resolver cache is cleared, so no resolved value (the ``${now:...}`` of a run dir, resolved
while composing) travels from one run to another: each run resolves its own.
``tests/test_server.py`` checks a remembered composition equals Hydra's own, and that edited
files, a primary config's search path, a symlinked folder and an environment variable in a
defaults list are read again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pickle
import re
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

_RECORD = struct.Struct("!II")  # key length, payload length (0: a hit)
KEEP = 64  # compositions the server keeps, least recently used dropped


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
            files.append([source.provider, where])
            continue
        folder = _folder(where)
        tree = _tree(folder, newest) if folder is not None else None
        if tree is None:
            return None
        files.append([source.provider, where, folder, tree])
    if time.time_ns() - newest[0] < RACY_NS:
        return None
    job = OmegaConf.select(JobRuntime.instance().conf, "name")
    blob = json.dumps([config_name, parts, os.getcwd(), job, files], default=str)
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


def install(memo: OrderedDict[str, bytes], report_fd: int) -> None:
    """In a served run: Hydra's RUN-mode compositions come from ``memo`` (the server's, as
    forked) when their key is there; each one is reported to the server on ``report_fd``.
    Not on a Hydra this was not tested on (jaxaot.compat.hydra.HYDRA_KNOWN): each run composes."""
    from hydra.types import RunMode
    from jaxaot.compat.hydra import wrap_load_configuration
    from jaxaot.sweeps.compose_cache import SweepConfigLoader, apply_value_overrides
    from omegaconf import OmegaConf

    def report(key: str, payload: bytes) -> None:
        data = _RECORD.pack(len(key), len(payload)) + key.encode() + payload
        with contextlib.suppress(OSError):  # the server went away: nothing to remember
            _write_all(report_fd, data)

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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_reports(data: bytes) -> list[tuple[str, bytes]]:
    """The (key, payload) records a run reported; payload b"" for a composition it reused."""
    out: list[tuple[str, bytes]] = []
    at = 0
    while at + _RECORD.size <= len(data):
        klen, plen = _RECORD.unpack_from(data, at)
        at += _RECORD.size
        if at + klen + plen > len(data):
            break  # cut short (the run was killed while reporting): dropped
        key = data[at : at + klen].decode()
        out.append((key, data[at + klen : at + klen + plen]))
        at += klen + plen
    return out


__all__ = ["KEEP", "composition_key", "install", "read_reports"]
