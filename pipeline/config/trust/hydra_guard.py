"""Hydra's own import points, put under the import policy. What is checked is here; the
patches of Hydra's classes that call it are jaxaot.compat.hydra's, which refuses to install
them on a Hydra outside the versions they were tested on (``HYDRA_KNOWN``).

Composition (installed by ``jaxaot`` and by :func:`jaxaot.compose`):

- ``ConfigLoaderImpl.load_configuration``: each composed config is checked
  (jaxaot.config.trust.composed) before Hydra configures logging or instantiates anything
  from it; ``_compose_config_from_defaults_list`` is watched so a refusal can name the config
  file a value came from;
- ``ConfigRepository.initialize_sources``: a ``pkg://`` or ``structured://`` search-path entry
  is a module Hydra imports (``pkg://antigravity`` opens a browser): its name goes through the
  policy before Hydra reads it.

Instantiation (installed by ``jaxaot``, in its process and in the launcher workers and SLURM
jobs that import its task function):

- ``_instantiate2._resolve_target``: every ``_target_`` Hydra resolves, at any depth, for
  callbacks, sweepers, launchers and their nested parameters, string or class;
- ``HydraDictConfigurator.resolve``: every ``class``, ``()`` factory and ``ext://`` name of a
  logging config Hydra applies;
- ``logging.config.DictConfigurator.configure_handler``: a handler's ``filename`` ends in
  ``.log`` (checked resolved, as the handler would open it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jaxaot.compat.hydra import guard_compositions, guard_instantiation, load_single_config
from jaxaot.config.trust.composed import (
    check_cuda_data_dir,
    check_env_set,
    check_hydra_names,
    check_launcher,
    check_log_files,
    check_store_bucket,
    check_sweep_parameters,
    check_trust_values,
    check_user_file_location,
    log_file_refusal,
)
from jaxaot.config.trust.policy import check_name, check_resolved, dotted
from jaxaot.config.trust.rules import HYDRA, LOGGING
from jaxaot.config.trust.sources import (
    ENV_COMMAND_LINE,
    STORE_KEY,
    CommandLine,
    command_line,
    hydra_policy,
    parse_overrides,
    user_policy,
)
from jaxaot.errors import ConfigError

_MARK = "_jaxaot_trust_guard"
# (loader, defaults, repository) of the latest composition in this process, for origins.
_LAST: list[Any] = [None]


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


def _is_guard(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))


def _override_key(line: str) -> str:
    return line.lstrip("+~").split("=", 1)[0].split("@", 1)[0].strip()


def origin_finder(overrides: list[str]) -> Callable[[str], str | None]:
    """``origin(key)``: the override or config file that set ``key`` in the latest composition
    ("the command line (...)", "experiment/open.yaml in file:///..."), or None if unknown."""
    from omegaconf import OmegaConf

    keys = [(_override_key(line), line) for line in overrides]
    last = _LAST[0]

    def origin(key: str) -> str | None:
        for k, line in keys:
            if k and (key == k or key.startswith(k + ".") or k.startswith(key + ".")):
                return f"the command line: {line if len(line) <= 60 else k + '=...'}"
        if last is None:
            return None
        loader, defaults, repo = last
        for default in reversed(defaults):
            try:
                loaded = load_single_config(loader, default, repo)
                found = OmegaConf.select(
                    loaded.config, key, default=_MARK, throw_on_resolution_failure=False
                )
            except Exception:
                continue
            if found is not _MARK and not getattr(loaded, "is_schema_source", False):
                return f"{default.config_path}.yaml in {loaded.path}"
        return None

    return origin


def _same_as_command_line(given: CommandLine, cl: CommandLine, overrides: list[str]) -> None:
    """The trust overrides a composition got (a sweep job's: the command line's plus its
    sweep parameters) are the ``jaxaot`` command line's."""
    for key, mine, theirs in (
        ("trust.allow_imports", given.allow, cl.allow),
        ("trust.deny_imports", given.deny, cl.deny),
        (STORE_KEY, given.store_trust, cl.store_trust),
    ):
        if mine is not None and mine != theirs:
            line = next((o for o in overrides if _override_key(o) == key), key)
            raise ConfigError(
                f"{line!r} is an override of this job that the jaxaot command line did not "
                "give (a sweep parameter?); the import policy comes from your command line only"
            )


def check_composition(
    cfg: Any, overrides: list[str], origin: Callable[[str], str | None], from_shell: bool = True
) -> None:
    """Everything jaxaot.config.trust.composed checks, for one composed config of jaxaot's.
    ``overrides`` are its command line (Hydra's compose API: :func:`jaxaot.compose`'s, with
    ``from_shell`` False), or for ``jaxaot``'s own compositions the command line's plus a
    sweep job's parameters, whose trust settings must then be the command line's."""
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "trust", default=None) is None:
        return  # not jaxaot's config (another Hydra app in the same process)
    given = parse_overrides(overrides)
    if from_shell and os.environ.get(ENV_COMMAND_LINE):
        cl = command_line()
        _same_as_command_line(given, cl, overrides)
        given = CommandLine(given.allow, given.deny, given.store_trust, given.env_set + cl.env_set)
    check_trust_values(cfg, given, origin)
    check_cuda_data_dir(cfg, overrides, origin)
    check_store_bucket(cfg, overrides, origin)
    if OmegaConf.select(cfg, "hydra", default=None) is None:
        return
    check_env_set(cfg, given, origin)
    check_log_files(cfg, origin)
    check_launcher(cfg, overrides, origin)
    check_sweep_parameters(cfg, origin)
    sources = OmegaConf.select(cfg, "hydra.runtime.config_sources", default=None) or []
    check_user_file_location([(str(s.path), str(s.schema)) for s in sources])
    check_hydra_names(cfg, user_policy(given.allow or (), given.deny or ()), origin)


def _set_last(loader: Any, defaults: list[Any], repo: Any) -> None:
    _LAST[0] = (loader, defaults, repo)


def _search_path(entries: list[tuple[str, Any]]) -> None:
    """A ``pkg://`` or ``structured://`` search-path entry is a module Hydra imports."""
    policy = hydra_policy()
    for path, provider in entries:
        scheme, _, module = path.partition("://")
        if module and scheme in ("pkg", "structured"):
            key = f"hydra.searchpath entry {path!r} ({provider})"
            check_name(module.replace("/", ".").strip("."), key, policy, HYDRA)


def _check_composed(cfg: Any, overrides: list[str], from_shell: bool) -> None:
    check_composition(cfg, overrides, origin_finder(overrides), from_shell)


def install_composition_guards() -> None:
    """Check every composed config, and every module a config search path names (idempotent;
    re-wraps a loader another wrapper replaced since, so this check runs outermost). On a Hydra
    the guards were not tested on, refuses in one line (jaxaot.compat.hydra.require_known)."""
    guard_compositions(
        start=lambda: _LAST.__setitem__(0, None),
        check=_check_composed,
        composed=_set_last,
        search_path=_search_path,
    )


def _resolve(call: Callable[[], Any], target: Any, key: str, scope: str) -> Any:
    policy = hydra_policy()
    if isinstance(target, str):
        check_name(target, key, policy, scope)
    obj = call()
    if isinstance(target, str):
        check_resolved(target, key, policy, [], obj, scope)
    else:  # a class or callable given as is (Hydra's plugins): judged by where it lives
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(name, str):
            check_name(dotted(f"{module}.{name}"), key, policy, scope)
    return obj


def _target(call: Callable[[], Any], target: Any, full_key: str) -> Any:
    key = f"Hydra _target_{f' at {full_key}' if full_key else ''}"
    return _resolve(call, target, key, HYDRA)


def _logging_name(call: Callable[[], Any], name: str) -> Any:
    key = "a Hydra logging config (hydra.job_logging or hydra.hydra_logging)"
    return _resolve(call, name, key, LOGGING)


def install_instantiation_guards() -> None:
    """Every ``_target_`` Hydra resolves and every name a Hydra logging config resolves go
    through the policy of this ``jaxaot`` command line (idempotent); refused in one line on a
    Hydra the guards were not tested on."""
    guard_instantiation(target=_target, logging_name=_logging_name)

    import logging.config

    real_handler = logging.config.DictConfigurator.configure_handler
    if not _is_guard(real_handler):

        def configure_handler(self: Any, config: Any) -> Any:
            filename = config.get("filename") if hasattr(config, "get") else None
            if filename is not None and not str(filename).endswith(".log"):
                key = "a Hydra logging config's handler filename"
                raise ConfigError(log_file_refusal(key, str(filename), "a logging config"))
            return real_handler(self, config)

        logging.config.DictConfigurator.configure_handler = _marked(configure_handler)  # type: ignore[method-assign]


def install_guards() -> None:
    install_composition_guards()
    install_instantiation_guards()


__all__ = [
    "check_composition",
    "install_composition_guards",
    "install_guards",
    "install_instantiation_guards",
    "origin_finder",
]
