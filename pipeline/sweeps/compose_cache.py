"""Sweep jobs composed once per defaults list, not once per job (and twice, as Hydra does).

Hydra composes every sweep job from scratch, twice: the sweeper validates the whole batch, then
the launcher composes each job again. One composition of jaxaot's config costs ~0.3 s (the
defaults tree and OmegaConf merges over ~30 files), which dominated an execute-only sweep.

A job's config depends on its overrides in two separable ways, and Hydra composes in that order:
*group* overrides (``program=mlp``, ``hydra/launcher=joblib``) select the defaults list, and
*config* overrides (``execute.seed=3``, ``+x=1``, ``~y``) are applied to the composed config
afterwards, one by one (``ConfigLoaderImpl._load_configuration_impl``). So the composed config
for the group overrides alone is cached, per sweep, and each job gets a copy with its config
overrides applied and the ``hydra`` fields that depend on the override list recomputed, exactly
as Hydra does after its own composition. ``tests/test_compose_cache.py`` checks the result equals
Hydra's own composition key for key, for group, value, append and delete overrides.

Per loader, the config repository that classifies overrides (group or config) is built once,
and the sweepers' validation of a batch keeps the configs it composed (up to ``_MAX_KEPT``), so
an in-process launcher takes them instead of composing each job a second time.

Overrides that could change the defaults list in other ways (``hydra.searchpath``,
``hydra.job.env_*``), overrides of the ``hydra`` fields Hydra sets after applying the overrides
(``hydra.runtime.*``, ``hydra.overrides``, ``hydra.job.config_name``, or a key above one),
lines that call ``shuffle`` (Hydra draws from ``random`` as it parses one) and loaders other
than Hydra's own take Hydra's path unchanged; so does
every composition on a Hydra outside the versions this was tested on
(jaxaot.compat.hydra.HYDRA_KNOWN), where the sweepers validate and launch as Hydra's do.
"""

from __future__ import annotations

import copy
import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.config_loader import ConfigLoader
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.errors import ConfigCompositionException
from hydra.plugins.config_source import ConfigSource
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

_MAX_ENTRIES = 16  # distinct defaults lists kept per sweep (each is one composed config)
_MAX_KEPT = 64  # validated job configs kept for the launcher (~0.2 MB each)
_STATS = {"composed": 0, "reused": 0}
_MAX_REPOS = 8  # config repositories kept per process, by config name and search path
# Each with what it was built from (jaxaot.sweeps.config_sources.source_files of its sources).
_REPOS: OrderedDict[tuple[Any, ...], tuple[Any, list[Any]]] = OrderedDict()


_MAX_PARSED = 512  # override lines kept parsed per process
_PARSED: OrderedDict[str, Override] = OrderedDict()


def parse_overrides(lines: Sequence[str]) -> list[Override]:
    """Hydra's parse of each override line (``OverridesParser.parse_overrides``, no config
    loader), kept per line in this process: a line parses the same whatever composes it, and
    Hydra's ANTLR parser costs ~2.5 ms a line. Each call gets its own copies; a line Hydra
    refuses raises Hydra's error, as it would in a list, and is not kept. Nor is one naming
    ``shuffle``: Hydra shuffles a list as it parses it (Python's ``random``), anew each time."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out, parser = [], None
    for line in lines:
        found = _PARSED.get(line)
        if found is None:
            parser = parser or OverridesParser.create()
            [found] = parser.parse_overrides(overrides=[line])
            if SHUFFLE.search(line):
                out.append(found)
                continue
            _PARSED[line] = found
            while len(_PARSED) > _MAX_PARSED:
                _PARSED.popitem(last=False)
        out.append(copy.deepcopy(found))
    return out


# Keys Hydra sets after it applies the overrides (an override of one is what Hydra's own path
# makes of it), and keys that change where and how it reads the files.
_HYDRAS_OWN = (
    "hydra.searchpath",
    "hydra.job.env_",
    "hydra.runtime.",
    "hydra.overrides",
    "hydra.job.config_name",
)


# Hydra's shuffle(): it draws from Python's random each time Hydra parses the line.
SHUFFLE = re.compile(r"shuffle\s*\(")


def _takes_slow_path(override: Override) -> bool:
    key = override.get_key_element().lstrip("+~")
    above = any(own.startswith(f"{key}.") for own in _HYDRAS_OWN)  # hydra.job={...}, hydra=...
    return override.is_sweep_override() or key.startswith(_HYDRAS_OWN) or above


class SweepConfigLoader(ConfigLoader):
    """A ConfigLoader that reuses compositions across sweep jobs; delegates all else to Hydra's.

    It is picklable (joblib and submitit ship the Hydra context to their workers); the cache is
    one sweep's (a sweeper makes one loader), so a second sweep in the same process reads the
    config files as they are then, and starts empty in each worker.
    """

    def __init__(self, inner: ConfigLoader) -> None:
        self.inner = inner
        self._repos: dict[str | None, Any] = {}
        self._validated: dict[tuple[int, tuple[str, ...]], DictConfig] = {}
        self._bases: OrderedDict[tuple[Any, ...], DictConfig] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner}  # caches stay in the process that built them

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"])  # type: ignore[misc]

    def validate_batch(self, master_config: DictConfig, batch: Sequence[Sequence[str]]) -> None:
        """Compose every job of ``batch``, raising as Hydra's validation does.

        The composed configs (the first ``_MAX_KEPT``) are kept for this batch only: a launcher
        in this process gets them from ``load_sweep_config``; a launcher in other processes
        composes its own, and the next batch drops them. None are kept on a Hydra this cache
        does not know (which fields Hydra fills from the process at launch may differ).
        """
        from jaxaot.compat.hydra import hydra_known

        self._validated.clear()
        keep = _MAX_KEPT if hydra_known() else 0
        for overrides in batch:
            cfg = self.load_sweep_config(master_config, list(overrides))
            if len(self._validated) < keep:
                self._validated[(id(master_config), tuple(overrides))] = cfg

    def load_configuration(
        self,
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        return self.inner.load_configuration(
            config_name, overrides, run_mode, from_shell, validate_sweep_overrides
        )

    def load_sweep_config(
        self, master_config: DictConfig, sweep_overrides: list[str]
    ) -> DictConfig:
        kept = self._validated.pop((id(master_config), tuple(sweep_overrides)), None)
        if kept is not None:
            _refresh_runtime(kept)  # the working directory and environment of now
            return kept
        lines = [*map(str, master_config.hydra.overrides.hydra), *sweep_overrides]
        config_name = master_config.hydra.job.config_name
        split = self.split(config_name, lines)
        if split is None:
            return self.inner.load_sweep_config(master_config, sweep_overrides)
        cfg = self._base(config_name, split.groups)
        apply_value_overrides(cfg, split)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        return cfg

    def split(self, config_name: str | None, lines: list[str]) -> Split | None:
        """``lines`` parsed and split into group and value overrides, or None where Hydra's
        own path must compose (sweep syntax, ``hydra.searchpath``, another loader, an illegal
        group override: Hydra reports it)."""
        from jaxaot.compat.hydra import config_overrides

        # A shuffle() line draws from random each time Hydra parses it: left to Hydra, whose
        # one parse draws once, and never remembered.
        if any(SHUFFLE.search(line) for line in lines):
            return None
        parsed = parse_overrides(lines)
        if any(_takes_slow_path(o) for o in parsed):
            return None
        # Without a hydra.searchpath override, the repository depends on the config name only.
        # A sweep's jobs take this loader's own (read is then taken by whoever needs it).
        repo, read = self._repos.get(config_name), None
        if repo is None:
            built = repository_for(self.inner, config_name)
            if built is None:  # not Hydra's ConfigLoaderImpl, or not a known Hydra: its way
                return None
            repo, read = built
            self._repos[config_name] = repo
        try:
            return Split(parsed, config_overrides(repo, parsed), repo, read)
        except Exception:  # an illegal group override: Hydra's own path reports it
            return None

    def _base(self, config_name: str | None, group_overrides: list[Override]) -> DictConfig:
        key = (
            config_name,
            tuple(o.input_line for o in group_overrides),
            tuple(str(p) for p in self.inner.get_search_path().get_path()),
        )
        base = self._bases.get(key)
        if base is None:
            base = self.inner.load_configuration(
                config_name=config_name,
                overrides=[str(o.input_line) for o in group_overrides],
                run_mode=RunMode.RUN,
            )
            self._bases[key] = base
            while len(self._bases) > _MAX_ENTRIES:
                self._bases.popitem(last=False)
            _STATS["composed"] += 1
        else:
            self._bases.move_to_end(key)
            _STATS["reused"] += 1
        return copy.deepcopy(base)

    def get_search_path(self) -> Any:
        return self.inner.get_search_path()

    def get_sources(self) -> list[ConfigSource]:
        return self.inner.get_sources()

    def list_groups(self, parent_name: str) -> list[str]:
        return self.inner.list_groups(parent_name)

    def get_group_options(
        self,
        group_name: str,
        results_filter: Any = None,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        return self.inner.get_group_options(group_name, results_filter, config_name, overrides)

    def compute_defaults_list(
        self, config_name: str | None, overrides: list[str], run_mode: RunMode
    ) -> Any:
        return self.inner.compute_defaults_list(config_name, overrides, run_mode)


def repository_for(inner: Any, config_name: str | None) -> tuple[Any, Any] | None:
    """Hydra's config repository for composing ``config_name`` with ``inner`` (its loader),
    and :func:`~jaxaot.sweeps.config_sources.source_files` of its sources; None where Hydra's own
    path composes.

    Building one (the primary config parsed for its ``hydra.searchpath``, Hydra's repository
    deep-copied) costs ~40 ms, most of a remembered composition; so one is kept per config
    name and search path and taken again while every file and folder it reads is as it was
    when it was built, by the same fingerprint as a remembered composition's key (path,
    target, size, inode, mtime, ctime). Not kept: one whose loader's own sources (where the
    primary config comes from) changed while it was built, or less than 2 s before (a change
    within the same clock tick would look the same), and one whose primary config's
    ``hydra.searchpath`` holds an interpolation (``file://${oc.env:CONF}``: it may lead
    elsewhere next time, which no file shows).
    """
    from jaxaot.compat.hydra import caching_repo, makes_repos
    from jaxaot.sweeps import config_sources

    if not makes_repos(inner):
        return None
    key = (config_name, tuple(str(p) for p in inner.get_search_path().get_path()))
    kept = _REPOS.get(key)
    if kept is not None:
        repo, files = kept
        read = config_sources.source_files(repo.get_sources())
        if read is not None and read[0] == files:
            _REPOS.move_to_end(key)
            return repo, read
        _REPOS.pop(key, None)
    started = time.time_ns()
    before = config_sources.source_files(inner.get_sources())
    repo = caching_repo(inner, config_name)
    if repo is None:
        return None
    read = config_sources.source_files(repo.get_sources())
    if (
        read is not None
        and before is not None
        and read[1] < started - config_sources.RACY_NS
        and all(entry in read[0] for entry in before[0])
        and not _interpolated_search_path(repo, config_name)
    ):
        _REPOS[key] = (repo, read[0])
        while len(_REPOS) > _MAX_REPOS:
            _REPOS.popitem(last=False)
    return repo, read


def _interpolated_search_path(repo: Any, config_name: str | None) -> bool:
    """Whether the primary config's ``hydra.searchpath`` (as written: the repository holds it
    loaded) has an interpolation."""
    import json

    loaded = repo.load_config(config_name) if config_name is not None else None
    if loaded is None or not OmegaConf.is_dict(loaded.config):
        return False
    written = OmegaConf.to_container(loaded.config, resolve=False)
    hydra = written.get("hydra") if isinstance(written, dict) else None
    search = hydra.get("searchpath") if isinstance(hydra, dict) else None
    return "${" in json.dumps(search, default=str)


@dataclass(frozen=True)
class Split:
    """A job's overrides as Hydra composes them: ``values`` (``execute.seed=3``, ``+x=1``,
    ``~y``) are applied one by one to the config that the others (``groups``: the defaults
    list) compose; ``repo`` is the config repository that told them apart (its sources are
    what the composition reads)."""

    parsed: list[Override]
    values: list[Override]
    repo: Any
    # jaxaot.sweeps.config_sources.source_files of the repository's sources, read as it was taken
    read: tuple[list[Any], int] | None = None

    @property
    def groups(self) -> list[Override]:
        later = {id(o) for o in self.values}
        return [o for o in self.parsed if id(o) not in later]


def apply_value_overrides(cfg: DictConfig, split: Split) -> None:
    """What ``ConfigLoaderImpl._load_configuration_impl`` does after composing: the value
    overrides applied to ``cfg`` (the groups' composition, changed in place) and the ``hydra``
    fields that depend on the override list recomputed; errors reported as Hydra reports them."""
    try:
        _apply(cfg, split.parsed, split.values)
    except OmegaConfBaseException as exc:
        raise ConfigCompositionException().with_traceback(exc.__traceback__) from exc


def _apply(cfg: DictConfig, parsed: Sequence[Override], config_overrides: list[Override]) -> None:
    from jaxaot.compat.hydra import apply_overrides_to_config, overrides_dirname

    values = {id(o) for o in config_overrides}
    groups = [o for o in parsed if id(o) not in values]
    # Hydra appends each override's line to the lists the config files give: the groups'
    # composition has its lines there, after the files' own.
    for name, hydras in (("hydra", True), ("task", False)):
        listed = cfg.hydra.overrides[name]
        appended = sum(o.is_hydra_override() == hydras for o in groups)
        del listed[len(listed) - appended :]  # the files' own entries kept as written
    apply_overrides_to_config(config_overrides, cfg)
    app_overrides = [o for o in parsed if not o.is_hydra_override()]
    for o in parsed:
        cfg.hydra.overrides["hydra" if o.is_hydra_override() else "task"].append(o.input_line)
    _refresh_runtime(cfg)
    dirname = cfg.hydra.job.config.override_dirname
    cfg.hydra.job.override_dirname = overrides_dirname(
        app_overrides, dirname.kv_sep, dirname.item_sep, dirname.exclude_keys
    )


def _refresh_runtime(cfg: DictConfig) -> None:
    """The fields Hydra fills from the process at composition: copied env vars and the cwd."""
    with open_dict(cfg.hydra):
        for key in cfg.hydra.job.env_copy:
            cfg.hydra.job.env_set[key] = os.environ[key]
    cfg.hydra.runtime.cwd = os.getcwd()


def with_sweep_loader(hydra_context: HydraContext) -> HydraContext:
    """``hydra_context`` whose config loader reuses compositions (idempotent); unchanged on
    a Hydra this cache was not tested on (jaxaot.compat.hydra.HYDRA_KNOWN)."""
    from jaxaot.compat.hydra import hydra_known

    loader = hydra_context.config_loader
    if isinstance(loader, SweepConfigLoader) or not hydra_known():
        return hydra_context
    return HydraContext(config_loader=SweepConfigLoader(loader), callbacks=hydra_context.callbacks)


def stats() -> dict[str, int]:
    """How many compositions this process ran and reused (for tests and benchmarks)."""
    return dict(_STATS)


def clear() -> None:
    _REPOS.clear()
    _STATS.update(composed=0, reused=0)


class LaunchingSweeper(Sweeper):
    """What jaxaot's own sweepers (Optuna, fit search) share: jobs launched with the configured
    launcher, each job's config composed once (:func:`with_sweep_loader`)."""

    config: DictConfig | None = None
    hydra_context: HydraContext | None = None
    launcher: Any = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from jaxaot.util.console import unescape_launch_lines

        unescape_launch_lines()  # "#0 : program.args.1=f32[8,256]", as written
        hydra_context = with_sweep_loader(hydra_context)
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.config is not None and self.hydra_context is not None
        loader = self.hydra_context.config_loader
        if isinstance(loader, SweepConfigLoader):
            loader.validate_batch(self.config, batch)
        else:  # a Hydra this cache does not know: Hydra's own validation
            super().validate_batch_is_legal(batch)


__all__ = [
    "LaunchingSweeper",
    "Split",
    "SweepConfigLoader",
    "apply_value_overrides",
    "clear",
    "parse_overrides",
    "repository_for",
    "stats",
    "with_sweep_loader",
]
