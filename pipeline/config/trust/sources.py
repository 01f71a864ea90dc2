"""Where the user's import rules come from: the command line, the environment, a user file.

Never from a config: a config travels (presets, ``--config-dir``, sweep files, a resumed run's
``.hydra/``), so what it may import cannot be its own say. The user's side is:

- the command line: ``trust.allow_imports=[...]``, ``trust.deny_imports=[...]`` and
  ``store.trust=true`` as overrides of ``jaxaot`` (or of :func:`jaxaot.compose`). The
  ``jaxaot`` command reads them from its argv before Hydra starts and hands them to the
  processes it starts (launcher workers, SLURM jobs) in ``JAXAOT_TRUST_COMMAND_LINE``;
- the environment: ``JAXAOT_ALLOW_IMPORTS=a.b,c`` and ``JAXAOT_TRUST_STORE=1``;
- ``${XDG_CONFIG_HOME:-~/.config}/jaxaot/trust.yaml`` (``allow_imports:``/``deny_imports:``
  lists), refused when it lies inside a config search path.

The composed config's ``trust`` section then only mirrors the command line (it is recorded in
the manifest); jaxaot.config.trust.composed refuses one that says anything else.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.config.trust.policy import (
    ALLOW_KEY,
    DENY_KEY,
    ENV_ALLOW,
    ImportPolicy,
    check_name,
    dotted,
)
from jaxaot.config.trust.rules import Rule
from jaxaot.errors import ConfigError

if TYPE_CHECKING:
    from jaxaot.config.sections import ProgramConfig, TrustConfig

STORE_KEY = "store.trust"
ENV_STORE = "JAXAOT_TRUST_STORE"
ENV_COMMAND_LINE = "JAXAOT_TRUST_COMMAND_LINE"
_RULE = re.compile(r"\*|[A-Za-z_]\w*(?:[.:][A-Za-z_]\w*)*")
# Overrides that may set a trust key (the parser, ~5 ms to build, sees only these).
_MAY_SET = re.compile(r"^[+~]*\s*(trust\b|store\.trust\b|hydra\.job\.env_set\b)")


def check_rules(key: str, rules: Any) -> tuple[str, ...]:
    """A list of dotted prefixes (``os.path``, ``numpy:load``, ``'*'``), or a ConfigError."""
    if isinstance(rules, str) or not isinstance(rules, Sequence):
        raise ConfigError(f"{key}: expected a list of dotted module prefixes, found {rules!r}")
    for rule in rules:
        if not isinstance(rule, str) or not _RULE.fullmatch(rule.strip()):
            raise ConfigError(
                f"{key}: expected dotted module prefixes (e.g. os.path or numpy:load), "
                f"found {rule!r}"
            )
    return tuple(dotted(r) for r in rules)


@dataclass(frozen=True)
class CommandLine:
    """The trust settings a command line gives (None: not given)."""

    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] | None = None
    store_trust: bool | None = None
    env_set: tuple[str, ...] = field(default=())  # hydra.job.env_set.<NAME> it sets

    def value(self, key: str) -> Any:
        """What the composed config must hold at ``key`` (its schema default when not given)."""
        if key == STORE_KEY:
            return bool(self.store_trust)
        given = self.allow if key == ALLOW_KEY else self.deny
        return list(given or ())


def parse_overrides(overrides: Iterable[str]) -> CommandLine:
    """The trust settings among Hydra overrides; a sweep over one is refused. Overrides Hydra
    cannot parse are left to Hydra, which reports them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    lines = [line for line in overrides if _MAY_SET.match(line.strip())]
    if not lines:
        return CommandLine()
    parser = OverridesParser.create()
    found: dict[str, Any] = {}
    env_set: list[str] = []
    for line in lines:
        try:
            ov = parser.parse_override(line)
        except (HydraException, ValueError):
            continue
        key = ov.key_or_group
        if key.startswith("hydra.job.env_set"):
            value = ov.value() if key == "hydra.job.env_set" else None
            names = list(value) if isinstance(value, dict) else [key.rpartition(".")[2]]
            env_set += [str(n) for n in names]
            continue
        if key not in (ALLOW_KEY, DENY_KEY, STORE_KEY) or ov.is_delete():
            continue
        if ov.is_sweep_override():
            raise ConfigError(
                f"{key}: one value on the command line, not a sweep ({line!r}); the import "
                "policy is the same for every job of a sweep"
            )
        value = ov.value()
        if key == STORE_KEY:
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: expected true or false, found {value!r}")
            found[key] = value
        else:
            found[key] = check_rules(key, value)
    return CommandLine(
        found.get(ALLOW_KEY), found.get(DENY_KEY), found.get(STORE_KEY), tuple(env_set)
    )


def parse_argv(args: Sequence[str]) -> CommandLine:
    """The trust settings of a ``jaxaot`` command line (its Hydra overrides)."""
    from jaxaot.compat.hydra import args_parser

    try:
        ns, _ = args_parser().parse_known_args(list(args))
    except SystemExit:  # a malformed flag: Hydra reports it when it parses the same argv
        return CommandLine()
    return parse_overrides(ns.overrides or [])


def install_command_line(args: Sequence[str]) -> CommandLine:
    """Record this ``jaxaot`` command line's trust settings for this process and the ones it
    starts (launcher workers and SLURM jobs inherit the environment)."""
    cl = parse_argv(args)
    os.environ[ENV_COMMAND_LINE] = json.dumps(asdict(cl))
    return cl


def command_line() -> CommandLine:
    """The trust settings of the ``jaxaot`` command line this process runs for (none when it
    is not one: Python's :func:`jaxaot.compose` passes its overrides instead)."""
    raw = os.environ.get(ENV_COMMAND_LINE)
    if not raw:
        return CommandLine()
    try:
        data = json.loads(raw)
        return CommandLine(
            tuple(data["allow"]) if data.get("allow") is not None else None,
            tuple(data["deny"]) if data.get("deny") is not None else None,
            data.get("store_trust"),
            tuple(data.get("env_set") or ()),
        )
    except (ValueError, TypeError, KeyError):
        raise ConfigError(
            f"{ENV_COMMAND_LINE}: not what jaxaot writes there ({raw[:80]!r}); unset it"
        ) from None


def env_allow() -> tuple[str, ...]:
    raw = os.environ.get(ENV_ALLOW, "")
    return check_rules(ENV_ALLOW, [r for r in re.split(r"[,\s]+", raw) if r])


def store_trusted_by_env() -> bool:
    return os.environ.get(ENV_STORE, "").strip().lower() in ("1", "true", "yes")


def user_file() -> Path:
    """``${XDG_CONFIG_HOME:-~/.config}/jaxaot/trust.yaml`` (a relative XDG_CONFIG_HOME is
    ignored, as the XDG spec says)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "jaxaot" / "trust.yaml"


_FILE_CACHE: dict[tuple[str, int, int], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def file_rules() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(allow, deny) of the user file; empty when there is none."""
    path = user_file()
    try:
        st = path.stat()
    except OSError:
        return (), ()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _FILE_CACHE:
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read it ({' '.join(str(exc).split())})") from None
        if not isinstance(data, dict) or set(data) - {"allow_imports", "deny_imports"}:
            raise ConfigError(
                f"{path}: expected a mapping with allow_imports and/or deny_imports lists, "
                f"found {data!r}"
            )
        _FILE_CACHE[key] = (
            check_rules(f"{path}: allow_imports", data.get("allow_imports") or []),
            check_rules(f"{path}: deny_imports", data.get("deny_imports") or []),
        )
    return _FILE_CACHE[key]


def user_policy(allow: Iterable[str] = (), deny: Iterable[str] = ()) -> ImportPolicy:
    """The built-in rules plus the user's: ``allow``/``deny`` from the command line, then
    ``JAXAOT_ALLOW_IMPORTS`` and the user file."""
    allow = check_rules(ALLOW_KEY, list(allow))
    deny = check_rules(DENY_KEY, list(deny))
    both = set(allow) & set(deny)
    if both:
        raise ConfigError(
            f"{ALLOW_KEY} and {DENY_KEY} both list {sorted(both)}; expected each rule in one of them"
        )
    env = env_allow()
    file_allow, file_deny = file_rules()
    where = str(user_file())
    rules = (
        [Rule(p, True, ALLOW_KEY, user=True) for p in allow]
        + [Rule(p, False, DENY_KEY, user=True) for p in deny]
        + [Rule(p, True, ENV_ALLOW, user=True) for p in env]
        + [Rule(p, True, f"allow_imports in {where}", user=True) for p in file_allow]
        + [Rule(p, False, f"deny_imports in {where}", user=True) for p in file_deny]
    )
    return ImportPolicy(tuple(rules), command_line_allow=allow, env_allow=env)


def policy_of(trust: TrustConfig) -> ImportPolicy:
    """The policy a run imports under: its ``trust`` section (the command line's, which
    composition checked) plus the environment and the user file."""
    return user_policy(trust.allow_imports, trust.deny_imports)


def hydra_policy() -> ImportPolicy:
    """The policy for what Hydra instantiates: this ``jaxaot`` command line's rules plus the
    environment and the user file."""
    cl = command_line()
    return user_policy(cl.allow or (), cl.deny or ())


def check_imports(program: ProgramConfig, trust: TrustConfig) -> None:
    """Validation: the rules are well formed and every name in the program section passes the
    policy as a string (nothing is imported)."""
    policy = policy_of(trust)
    check_name(program.target, "program.target", policy)
    for key, name in pytree_tags(program.args, "program.args"):
        check_name(name, key, policy)
    for key, name in pytree_tags(program.kwargs, "program.kwargs"):
        check_name(name, key, policy)


def pytree_tags(tree: Any, where: str) -> Iterable[tuple[str, str]]:
    """(key, class) of every ``_pytree_: pkg.mod:Class`` tag in an argument tree
    (pipeline/config/argspec/leaf_types.py: pytree containers named by import path)."""
    if isinstance(tree, dict):
        tag = tree.get("_pytree_")
        if isinstance(tag, str) and tag != "tuple":
            yield f"{where}._pytree_", tag
        for k, v in tree.items():
            yield from pytree_tags(v, f"{where}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from pytree_tags(v, f"{where}[{i}]")


__all__ = [
    "ENV_COMMAND_LINE",
    "ENV_STORE",
    "STORE_KEY",
    "CommandLine",
    "check_imports",
    "check_rules",
    "command_line",
    "env_allow",
    "file_rules",
    "hydra_policy",
    "install_command_line",
    "parse_argv",
    "parse_overrides",
    "policy_of",
    "pytree_tags",
    "store_trusted_by_env",
    "user_file",
    "user_policy",
]
