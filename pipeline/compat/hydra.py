"""Every private Hydra touch of jaxaot: the ``hydra._internal`` imports and the patches of
Hydra's classes, behind the hydra-core versions they were tested on (:data:`HYDRA_KNOWN`).

Two kinds of patch, and what each does on a Hydra outside :data:`HYDRA_KNOWN`:

- speed: a sweep's compositions reused (jaxaot.sweeps.compose_cache), a served run's
  remembered compositions and the interpolation watch that decides what is remembered
  (jaxaot.cli.server.compositions), the skipped ``hydra.mode`` probe and the shared ``--help``
  repository (jaxaot.cli.main). Not applied: Hydra composes its own way, slower, same config.
- trust: the import policy (jaxaot.config.trust.hydra_guard) wraps the points where Hydra
  composes a config, imports a search-path module, resolves a ``_target_`` or a logging name.
  Those points may have moved, so :func:`require_known` refuses in one line (the installed
  version, the known range, the fix) instead of running without the policy; with the user's
  ``JAXAOT_UNTESTED_HYDRA=1`` it runs when every such point is still there.

The read-only helpers (config repository, argument parser, sweep expansion, a job's return
value) serve features that need them on any Hydra. :data:`PRIVATE_NAMES` lists every private
name this module touches; tests/test_compat_hydra.py resolves each on the installed Hydra.
Hydra is imported inside the functions: importing this module imports no Hydra.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import logging.config
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxaot.errors import ConfigError

if TYPE_CHECKING:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf

# [first, end): hydra-core releases whose internals the patches below were tested on.
HYDRA_KNOWN = ((1, 3, 2), (1, 4, 0))
PIN = "pip install 'hydra-core>=1.3.2,<1.4'"
# The user's own switch for a Hydra outside HYDRA_KNOWN (see require_known).
ENV_UNTESTED = "JAXAOT_UNTESTED_HYDRA"

_MARK = "_jaxaot_trust_guard"
log = logging.getLogger("jaxaot")


class PrivateName(NamedTuple):
    """One private Hydra name jaxaot touches: ``attribute`` (dotted under ``module``), what
    it is used for, and whether a known Hydra may lack it (the use then has a fallback)."""

    module: str
    attribute: str
    use: str
    optional: bool = False


_LOADER = "hydra._internal.config_loader_impl"
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(_LOADER, "ConfigLoaderImpl.load_configuration", "trust: composed configs"),
    PrivateName(_LOADER, "ConfigLoaderImpl._compose_config_from_defaults_list", "trust: origins"),
    PrivateName(_LOADER, "ConfigLoaderImpl._load_single_config", "trust: origins"),
    PrivateName(
        _LOADER, "ConfigLoaderImpl._parse_overrides_and_create_caching_repo", "speed: repos"
    ),
    PrivateName(_LOADER, "ConfigLoaderImpl._apply_overrides_to_config", "speed: sweeps"),
    PrivateName(_LOADER, "ConfigLoaderImpl.get_group_options", "speed: --help"),
    PrivateName(_LOADER, "get_overrides_dirname", "speed: sweeps"),
    PrivateName(
        "hydra._internal.config_repository",
        "ConfigRepository.initialize_sources",
        "trust: search-path modules",
    ),
    PrivateName(
        "hydra._internal.config_repository", "ConfigRepository", "suggestions: config names"
    ),
    PrivateName("hydra._internal.instantiate._instantiate2", "_resolve_target", "trust"),
    PrivateName(
        "hydra._internal.logging_config",
        "HydraDictConfigurator.resolve",
        "trust: logging names (else logging.config.DictConfigurator.resolve)",
        optional=True,
    ),
    PrivateName("hydra._internal.defaults_list", "Overrides", "speed: sweeps"),
    PrivateName("hydra._internal.hydra", "Hydra.get_mode", "speed: the mode probe"),
    PrivateName("hydra._internal.utils", "create_config_search_path", "suggestions"),
    PrivateName("hydra._internal.utils", "get_args_parser", "trust: the command line"),
    PrivateName("hydra._internal.core_plugins.basic_sweeper", "BasicSweeper", "sweeps: expansion"),
    PrivateName(
        "hydra._internal.core_plugins.basic_sweeper", "BasicSweeperConf", "sweeps: jaxaot_basic"
    ),
    PrivateName(
        "hydra.core.default_element",
        "InputDefault._resolve_interpolation_impl",
        "speed: served compositions",
    ),
    PrivateName("hydra.core.utils", "JobReturn._return_value", "sweeps: job outcomes"),
)


def hydra_version() -> tuple[int, ...]:
    """The running hydra-core's release numbers (``1.3.8`` -> ``(1, 3, 8)``): the imported
    module's, or before Hydra is imported, the installed distribution's metadata (no Hydra
    import; reading metadata costs ~3 ms, the imported module's attribute nothing)."""
    text = getattr(sys.modules.get("hydra"), "__version__", None)
    if not isinstance(text, str):
        try:
            text = importlib.metadata.version("hydra-core")
        except importlib.metadata.PackageNotFoundError:
            import hydra

            text = hydra.__version__
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _text(version: Sequence[int]) -> str:
    return ".".join(map(str, version))


def hydra_known() -> bool:
    """Whether the installed Hydra is one the patches were tested on (:data:`HYDRA_KNOWN`)."""
    first, end = HYDRA_KNOWN
    return first <= hydra_version() < end


def resolves(name: PrivateName) -> bool:
    """Whether ``name`` exists on the installed Hydra (importing its module)."""
    import importlib

    try:
        obj: Any = importlib.import_module(name.module)
        for part in name.attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    return True


_warned_untested: list[bool] = []


def require_known() -> None:
    """Refuse, in one line, to run the import policy on a Hydra it was not tested on, unless
    the user says so with ``JAXAOT_UNTESTED_HYDRA=1`` (their environment, never a config) and
    every point the policy wraps is still there: then one warning, and the speed patches stay
    off (:func:`hydra_known`)."""
    if hydra_known():
        return
    first, end = HYDRA_KNOWN
    found = f"hydra-core {_text(hydra_version())} is installed"
    if os.environ.get(ENV_UNTESTED) == "1":
        missing = [
            f"{n.module}.{n.attribute}"
            for n in PRIVATE_NAMES
            if n.use.startswith("trust") and not n.optional and not resolves(n)
        ]
        if missing:
            raise ConfigError(
                f"{found} and {ENV_UNTESTED}=1 is set, but the import policy cannot hook "
                f"{missing[0]} (gone in this Hydra); fix: {PIN}"
            )
        if not _warned_untested:
            _warned_untested.append(True)
            log.warning(
                "%s, outside the tested >=%s,<%s; %s=1: the import policy runs on the same "
                "hooks, Hydra composes without jaxaot's speed-ups",
                found,
                _text(first),
                _text(end),
                ENV_UNTESTED,
            )
        return
    raise ConfigError(
        f"{found}; jaxaot's import policy for _target_ and Hydra's imports is known to hold "
        f"on hydra-core >={_text(first)},<{_text(end)} only, and does not run unchecked; fix: "
        f"{PIN} (or, to run on this Hydra with the policy on the same hooks, set "
        f"{ENV_UNTESTED}=1)"
    )


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


_GUARDED = "_jaxaot_guarded"  # on a guard: (the guard's factory, what it wraps)


def _guard(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """``owner.name = make(real)``, marked; kept when the current one is a guard already (a
    wrapper installed since, such as a served run's, is wrapped again: the guard outermost)."""
    real = getattr(owner, name)
    if not getattr(real, _MARK, False):
        guard = _mark(make(real))
        setattr(guard, _GUARDED, (make, real))
        setattr(owner, name, guard)


# -- trust: the import policy's hooks ------------------------------------------------------


def guard_compositions(
    *,
    start: Callable[[], None],
    check: Callable[[Any, list[str], bool], None],
    composed: Callable[[Any, list[Any], Any], None],
    search_path: Callable[[list[tuple[str, Any]]], None],
) -> None:
    """Hydra's composition under the policy (idempotent): ``start()`` before each
    composition, ``check(cfg, overrides, from_shell)`` after it, ``composed(loader, defaults,
    repo)`` when a defaults list is composed, ``search_path([(path, provider), ...])`` with
    the config search path before Hydra reads (imports) its entries."""
    require_known()
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import ConfigRepository

    def load(real: Any) -> Callable[..., Any]:
        def load_configuration(
            self: Any,
            config_name: str | None,
            overrides: list[str],
            run_mode: Any,
            from_shell: bool = True,
            validate_sweep_overrides: bool = True,
        ) -> Any:
            start()
            cfg = real(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
            check(cfg, list(overrides), from_shell)
            return cfg

        return load_configuration

    def compose(real: Any) -> Callable[..., Any]:
        def _compose_config_from_defaults_list(self: Any, defaults: Any, repo: Any) -> Any:
            cfg = real(self, defaults, repo)
            composed(self, list(defaults), repo)
            return cfg

        return _compose_config_from_defaults_list

    def sources(real: Any) -> Callable[..., Any]:
        def initialize_sources(self: Any, config_search_path: Any) -> None:
            search_path([(str(e.path), e.provider) for e in config_search_path.get_path()])
            real(self, config_search_path)

        return initialize_sources

    _guard(ConfigLoaderImpl, "load_configuration", load)
    _guard(ConfigLoaderImpl, "_compose_config_from_defaults_list", compose)
    _guard(ConfigRepository, "initialize_sources", sources)


def guard_instantiation(
    *,
    target: Callable[[Callable[[], Any], Any, str], Any],
    logging_name: Callable[[Callable[[], Any], str], Any],
) -> None:
    """Hydra's resolution of names under the policy (idempotent): every ``_target_`` goes
    through ``target(resolve, target, full_key)`` and every name of a logging config Hydra
    applies through ``logging_name(resolve, name)``; ``resolve()`` is Hydra's own."""
    require_known()
    from hydra._internal.instantiate import _instantiate2

    def resolve_target(real: Any) -> Callable[..., Any]:
        def _resolve_target(target_: Any, full_key: str) -> Any:
            return target(lambda: real(target_, full_key), target_, full_key)

        return _resolve_target

    def resolve_name(real: Any) -> Callable[..., Any]:
        def resolve(self: Any, s: str) -> Any:
            return logging_name(lambda: real(self, s), s)

        return resolve

    _guard(_instantiate2, "_resolve_target", resolve_target)
    _guard(logging_configurator(), "resolve", resolve_name)


def logging_configurator() -> type[logging.config.DictConfigurator]:
    """The class Hydra applies its logging configs with (``hydra.job_logging``)."""
    try:
        from hydra._internal.logging_config import HydraDictConfigurator
    except ImportError:  # a Hydra 1.3 without it applies logging.config.dictConfig itself
        return logging.config.DictConfigurator
    return HydraDictConfigurator


def load_single_config(loader: Any, default: Any, repo: Any) -> Any:
    """The config file one defaults-list entry loads (a ConfigResult: ``.config``,
    ``.path``, ``.is_schema_source``), as ``loader`` loads it."""
    return loader._load_single_config(default=default, repo=repo)


def args_parser() -> Any:
    """Hydra's command-line parser (``ns.overrides``: the overrides of an argv)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


# -- read-only helpers ---------------------------------------------------------------------


def config_repository(primary: str, folders: Sequence[str] = ()) -> Any:
    """Hydra's config repository over ``primary`` (``pkg://jaxaot.conf``) with ``folders``
    prepended as ``--config-dir`` prepends them."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    search_path = create_config_search_path(primary)
    for folder in folders:
        search_path.prepend("command-line", f"file://{folder}", SearchPathQuery(provider="schema"))
    return ConfigRepository(config_search_path=search_path)


def split_sweep_arguments(overrides: Sequence[Any], max_batch_size: int | None) -> Any:
    """Parsed sweep overrides as Hydra's basic sweeper expands them: batches of lists of
    fixed overrides (``a=1,2`` -> ``[[["a=1"], ["a=2"]]]``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper.split_arguments(list(overrides), max_batch_size)


def job_return_value(job_return: Any) -> Any:
    """What a job returned or raised (JobReturn.return_value raises for a failed job)."""
    return job_return._return_value


def __getattr__(name: str) -> Any:
    """``BasicSweeper`` and ``BasicSweeperConf``: Hydra's basic sweeper and its config, the
    base of ``hydra/sweeper=jaxaot_basic``."""
    if name in ("BasicSweeper", "BasicSweeperConf"):
        from hydra._internal.core_plugins import basic_sweeper

        return getattr(basic_sweeper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- speed: applied on a known Hydra only (False: not applied, Hydra's own path) -------------


def skip_mode_probe() -> bool:
    """``Hydra.get_mode`` answers None ("RUN, or MULTIRUN under -m") without composing."""
    if not hydra_known():
        return False
    from hydra._internal.hydra import Hydra

    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    return True


def share_help_repository() -> bool:
    """``ConfigLoaderImpl.get_group_options`` builds one config repository per (loader,
    config, overrides) instead of one per call."""
    if not hydra_known():
        return False
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.object_type import ObjectType

    real = ConfigLoaderImpl._parse_overrides_and_create_caching_repo
    made: dict[tuple[int, str | None, tuple[str, ...]], Any] = {}

    def get_group_options(
        self: Any,
        group_name: str,
        results_filter: Any = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        key = (id(self), config_name, tuple(overrides or ()))
        if key not in made:
            made[key] = real(self, config_name, list(overrides or ()))[1]
        return list(made[key].get_group_options(group_name, results_filter))

    ConfigLoaderImpl.get_group_options = get_group_options  # type: ignore[method-assign]
    return True


def wrap_load_configuration(make: Callable[[Any], Callable[..., Any]]) -> bool:
    """``ConfigLoaderImpl.load_configuration = make(real)``; the replacement keeps the public
    ``ConfigLoader.load_configuration`` signature. Where the import policy's guard is installed
    it stays outermost, ``make`` going beneath it."""
    if not hydra_known():
        return False
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    current = ConfigLoaderImpl.load_configuration
    guarded = getattr(current, _GUARDED, None)
    if guarded is None:
        ConfigLoaderImpl.load_configuration = make(current)  # type: ignore[method-assign]
        return True
    # Beneath the import policy's guard, which stays outermost: it checks the composition with
    # every override, what ``make`` returns too.
    make_guard, real = guarded
    inner = make(real)
    guard = _mark(make_guard(inner))
    setattr(guard, _GUARDED, (make_guard, inner))
    ConfigLoaderImpl.load_configuration = guard  # type: ignore[method-assign]
    return True


@contextlib.contextmanager
def watch_defaults_interpolations(seen: Callable[[str | None], None]) -> Iterator[None]:
    """Inside, ``seen(value)`` for each defaults-list interpolation Hydra resolves
    (``${program}``, ``${oc.env:PICK}``). Only used on a known Hydra."""
    from hydra.core.default_element import InputDefault

    real = InputDefault._resolve_interpolation_impl

    def resolve(self: Any, known_choices: Any, val: str | None) -> str:
        seen(val)
        return real(self, known_choices, val)

    InputDefault._resolve_interpolation_impl = resolve  # type: ignore[method-assign]
    try:
        yield
    finally:
        InputDefault._resolve_interpolation_impl = real  # type: ignore[method-assign]


def makes_repos(loader: Any) -> bool:
    """Whether :func:`caching_repo` builds repositories with ``loader``: Hydra's own
    ConfigLoaderImpl on a Hydra the compose cache knows."""
    return hasattr(loader, "_parse_overrides_and_create_caching_repo") and hydra_known()


def caching_repo(loader: Any, config_name: str | None) -> Any:
    """The config repository ``loader`` (Hydra's ConfigLoaderImpl) composes ``config_name``
    from without overrides, or None where :func:`makes_repos` is false (another loader, or a
    Hydra the compose cache does not know: its own path composes)."""
    if not makes_repos(loader):
        return None
    return loader._parse_overrides_and_create_caching_repo(config_name, [])[1]


def config_overrides(repo: Any, parsed: list[Any]) -> list[Any]:
    """The overrides of ``parsed`` that Hydra applies to the composed config (values, not
    group choices); raises for an illegal group override."""
    from hydra._internal.defaults_list import Overrides

    return list(Overrides(repo, parsed).config_overrides)


def apply_overrides_to_config(overrides: list[Any], cfg: Any) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def overrides_dirname(overrides: list[Any], kv_sep: str, item_sep: str, exclude_keys: Any) -> str:
    """``hydra.job.override_dirname`` for ``overrides``, as Hydra computes it."""
    from hydra._internal.config_loader_impl import get_overrides_dirname

    return str(
        get_overrides_dirname(
            overrides=overrides, kv_sep=kv_sep, item_sep=item_sep, exclude_keys=exclude_keys
        )
    )


__all__ = [
    "HYDRA_KNOWN",
    "PIN",
    "PRIVATE_NAMES",
    "BasicSweeper",
    "BasicSweeperConf",
    "PrivateName",
    "apply_overrides_to_config",
    "args_parser",
    "caching_repo",
    "config_overrides",
    "config_repository",
    "guard_compositions",
    "guard_instantiation",
    "hydra_known",
    "hydra_version",
    "job_return_value",
    "load_single_config",
    "logging_configurator",
    "makes_repos",
    "overrides_dirname",
    "require_known",
    "resolves",
    "share_help_repository",
    "skip_mode_probe",
    "split_sweep_arguments",
    "watch_defaults_interpolations",
    "wrap_load_configuration",
]
