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
import json
import os
import pickle
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from jaxaot.sweeps import config_sources

KEEP = 64  # compositions kept, least recently used dropped


def composition_key(
    sources: list[Any],
    config_name: str | None,
    parts: list[Any],
    read: tuple[list[Any], int] | None = None,
) -> str | None:
    """The key of a composition read from ``sources`` (Hydra's ConfigSources, the primary
    config's own ``hydra.searchpath`` included), or None when it is not one to remember: a
    source it cannot fingerprint, too many files, or a file changed in the last 2 s (a later
    change within the same clock tick would look the same). ``read``:
    :func:`jaxaot.sweeps.config_sources.source_files` of ``sources`` taken just before, if the
    caller has it."""
    from hydra.core.utils import JobRuntime
    from omegaconf import OmegaConf

    if read is None:
        read = config_sources.source_files(sources)
    if read is None:
        return None
    files, newest = read
    if time.time_ns() - newest < config_sources.RACY_NS:
        return None
    from hydra import version

    job = OmegaConf.select(JobRuntime.instance().conf, "name")
    base = version.getbase()  # the version_base Hydra composes under (a Version, or unset)
    base_text = str(base) if hasattr(base, "major") else None
    blob = json.dumps([config_name, parts, os.getcwd(), job, base_text, files], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# A reference to another choice (${program}, ${hydra/launcher}); any other interpolation in a
# defaults list calls a resolver (${oc.env:X}, ${pick-env:}, ${${name}:x}).
_CHOICE = re.compile(r"\$\{\s*[\w./-]+\s*\}")


@contextlib.contextmanager
def _defaults_resolvers() -> Iterator[list[str]]:
    """Defaults-list entries resolved with an OmegaConf resolver while composing inside
    (``- experiment: ${oc.env:PICK}``: the choice depends on more than the files): such a
    composition is not remembered. Interpolations of other choices (``${program}``) depend on
    the files alone."""
    from jaxaot.compat.hydra import watch_defaults_interpolations

    found: list[str] = []

    def seen(val: str | None) -> None:
        if val is not None and "${" in _CHOICE.sub("", val):
            found.append(val)

    with watch_defaults_interpolations(seen):
        yield found


def remember(memo: OrderedDict[str, bytes], report: Callable[[str, bytes], None]) -> bool:
    """Hydra's RUN-mode compositions come from ``memo`` when their key is there; each is
    reported with ``report(key, payload)`` (payload b"" for one taken from ``memo``). Not on
    a Hydra this was not tested on (jaxaot.compat.hydra.HYDRA_KNOWN): each composes. Whether
    it was installed."""
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
                split.read,
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

    return wrap_load_configuration(remembered)


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
    """:func:`remember` with this process's own memo (:data:`KEEP` compositions), once it
    could be installed (not while the Hydra in use is one this was not tested on)."""
    if _installed:
        return

    def report(key: str, payload: bytes) -> None:
        if payload:
            _LOCAL[key] = payload
        if key in _LOCAL:
            _LOCAL.move_to_end(key)
        while len(_LOCAL) > KEEP:
            _LOCAL.popitem(last=False)

    if remember(_LOCAL, report):
        _installed.append(True)


def forget() -> None:
    """Drop this process's remembered compositions."""
    _LOCAL.clear()


__all__ = [
    "KEEP",
    "composition_key",
    "drop_last_hit",
    "forget",
    "remember",
    "remember_in_process",
]
