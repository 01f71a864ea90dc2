"""Hydra compositions remembered by the ``jaxaot`` server, for the runs it forks (issue 19).

Composing jaxaot's config costs ~0.2 s, a fifth of a warm run through the server. A run's
composition is a pure function of what it reads: the config name and overrides, the working
directory, the job name, and the config files on Hydra's search path. So a served run that
composes (Hydra's RUN mode) reports the result to the server under a key over all of that, and
a later run with the same key starts from a copy instead of composing.

The key covers every file under every ``file://`` and ``pkg://`` search-path folder by path,
size, inode, and modification and change times (any write to a file changes its ctime, which no
user can set back); search-path kinds it cannot fingerprint, and compositions that copy
environment variables (``hydra.job.env_copy``), are never remembered. Structured configs
(Hydra's ConfigStore) are registered by jaxaot's own modules, which the server watches: it
restarts when one changes. OmegaConf's resolver cache is cleared both ways, so no resolved
value (a timestamp) travels from one run to another. ``tests/test_server.py`` checks a
remembered composition equals Hydra's own, and that an edited config file is read again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pickle
import struct
import zlib
from collections import OrderedDict
from typing import Any

_RECORD = struct.Struct("!II")  # key length, payload length (0: a hit)
KEEP = 64  # compositions the server keeps, least recently used dropped


def _tree(root: str) -> list[Any]:
    """Every file under ``root`` (Python caches aside) as path, size, inode, mtime, ctime."""
    out: list[Any] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.stat(path)
                out.append([path, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _folder(search_path: str) -> str | None:
    """The folder a ``file://`` or ``pkg://`` search-path entry reads; None for others."""
    scheme, _, rest = search_path.partition("://")
    if not rest:  # a bare folder, as initialize_config_dir gives it: a file:// one
        return os.path.abspath(search_path)
    if scheme == "file":
        return os.path.abspath(rest)
    if scheme == "pkg":
        spec = importlib.util.find_spec(rest.replace("/", "."))
        locations = list(spec.submodule_search_locations or []) if spec else []
        return locations[0] if len(locations) == 1 else None
    return None


def composition_key(loader: Any, config_name: str | None, parts: list[Any]) -> str | None:
    """The key of a composition, or None when it is not one to remember."""
    from hydra.core.utils import JobRuntime
    from omegaconf import OmegaConf

    files: list[Any] = []
    for element in loader.get_search_path().get_path():
        if element.path.startswith("structured://"):
            files.append([element.provider, element.path])
            continue
        folder = _folder(element.path)
        if folder is None:
            return None
        files.append([element.provider, element.path, folder, _tree(folder)])
    job = OmegaConf.select(JobRuntime.instance().conf, "name")
    blob = json.dumps([config_name, parts, os.getcwd(), job, files], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def install(memo: OrderedDict[str, bytes], report_fd: int) -> None:
    """In a served run: Hydra's RUN-mode compositions come from ``memo`` (the server's, as
    forked) when their key is there; each one is reported to the server on ``report_fd``."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode
    from jaxaot.sweeps.compose_cache import SweepConfigLoader
    from jaxaot.sweeps.compose_cache import _apply as apply_overrides
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    real = ConfigLoaderImpl.load_configuration

    def report(key: str, payload: bytes) -> None:
        data = _RECORD.pack(len(key), len(payload)) + key.encode() + payload
        with contextlib.suppress(OSError):  # the server went away: nothing to remember
            _write_all(report_fd, data)

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
        split = SweepConfigLoader(self)._split(config_name, list(overrides))
        if run_mode != RunMode.RUN or split is None:
            return real(self, *args)
        parsed, values = split
        later = {id(o) for o in values}
        groups = [str(o.input_line) for o in parsed if id(o) not in later]
        key = composition_key(self, config_name, [groups, from_shell, validate_sweep_overrides])
        kept = memo.get(key) if key is not None else None
        if kept is not None:
            cfg = pickle.loads(zlib.decompress(kept))
            report(key, b"")  # type: ignore[arg-type]
        else:
            cfg = real(self, config_name, groups, run_mode, from_shell, validate_sweep_overrides)
            if key is not None and not cfg.hydra.job.get("env_copy"):
                base = pickle.loads(pickle.dumps(cfg))
                OmegaConf.clear_cache(base)  # no resolved value (a timestamp) is remembered
                # Compressed: one report stays well inside a pipe's buffer (~4 of 64 KiB).
                report(key, zlib.compress(pickle.dumps(base, protocol=pickle.HIGHEST_PROTOCOL)))
        try:
            apply_overrides(cfg, parsed, values)
        except OmegaConfBaseException as exc:  # as Hydra's load_configuration reports it
            raise ConfigCompositionException().with_traceback(exc.__traceback__) from exc
        return cfg

    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]


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
