"""Which importable names a config may name: one check for every target jaxaot imports.

A config names Python callables by import path (``program.target``,
``lower.scoped_metadata[i].target``) and jaxaot imports and calls them, static arguments and
all: ``program.target=os:system 'program.args=["rm -rf ~"]'`` would run a shell command while
tracing. Configs travel (experiment presets, sweep files, CI jobs), so the names they may reach
are limited: process control, code execution, deserialization, raw files and sockets are
refused unless ``trust.allow_imports`` lets them in.

A rule is a dotted prefix that matches whole components: ``os`` matches ``os``, ``os.path``
and ``os:system`` (written ``os.system`` here), not ``osmosis``. ``module:attr`` may be written
for ``module.attr``. The longest matching rule decides; an allow rule beats a deny rule of the
same length, so ``trust.allow_imports=[os.path]`` lets ``os.path:join`` in and keeps
``os:system`` out. ``trust.allow_imports=['*']`` drops the built-in deny list (a config's own
``trust.deny_imports`` still apply).

The check runs twice: on the string at validation (before anything is imported), and on what
the string resolved to (every module it went through and the callable's own
``__module__.__qualname__``), so ``some_pkg:os.system`` or an alias of ``eval`` is refused too.
An explicitly allowed name is trusted with whatever it resolves to. Nothing here imports JAX.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxaot.errors import ConfigError, TargetError

if TYPE_CHECKING:
    from jaxaot.schema import JaxaotConfig

ALLOW_KEY = "trust.allow_imports"
DENY_KEY = "trust.deny_imports"
ALLOW_ALL = "*"

# Refused unless trust.allow_imports names them (module prefixes, or module.attr for one name).
DEFAULT_DENIED: tuple[str, ...] = (
    # processes, exits, signals, the interpreter itself
    "os",
    "posix",
    "nt",
    "subprocess",
    "_posixsubprocess",
    "pty",
    "signal",
    "_signal",
    "sys",
    "multiprocessing",
    "_multiprocessing",
    "concurrent",
    "threading",
    "_thread",
    "asyncio",
    "atexit",
    "resource",
    "gc",
    "faulthandler",
    # running or loading code: eval/exec/compile/open/__import__, importers, debuggers
    "builtins",
    "_sitebuiltins",
    "importlib",
    "runpy",
    "code",
    "codeop",
    "pdb",
    "bdb",
    "inspect",
    "pydoc",
    "webbrowser",
    "ctypes",
    "_ctypes",
    # deserializers that run code
    "pickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "numpy.load",
    "jax.numpy.load",
    "jax.experimental.serialize_executable",
    # files and the network
    "shutil",
    "io",
    "_io",
    "tempfile",
    "pathlib",
    "socket",
    "_socket",
)


def dotted(name: str) -> str:
    """``pkg.mod:attr.path`` -> ``pkg.mod.attr.path`` (rules and targets compare dotted)."""
    return name.strip().replace(":", ".")


def _matches(rule: str, name: str) -> bool:
    return rule == ALLOW_ALL or name == rule or name.startswith(rule + ".")


@dataclass(frozen=True)
class ImportPolicy:
    """The rules one config imports under: allowed and denied dotted prefixes."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()  # the config's own (trust.deny_imports)
    builtin: tuple[str, ...] = DEFAULT_DENIED  # () when allow has "*"

    def rule_for(self, name: str) -> tuple[bool, str | None]:
        """(allowed, the deciding rule or None when none matched) for a dotted name."""
        best: tuple[int, bool, str | None] = (-1, True, None)
        for allowed, rules in ((False, self.builtin + self.deny), (True, self.allow)):
            for rule in rules:
                if _matches(rule, name):
                    rank = (len(rule) if rule != ALLOW_ALL else 0, allowed, rule)
                    if rank[:2] > best[:2]:
                        best = rank
        return best[1], best[2]

    def explicitly_allowed(self, name: str) -> bool:
        allowed, rule = self.rule_for(name)
        return allowed and rule is not None


DEFAULT_POLICY = ImportPolicy()


def make_policy(allow: Iterable[str], deny: Iterable[str]) -> ImportPolicy:
    """The built-in deny list (dropped by ``'*'``) plus a config's own rules."""
    allowed = tuple(dotted(str(r)) for r in allow)
    return ImportPolicy(
        allow=allowed,
        deny=tuple(dotted(str(r)) for r in deny),
        builtin=() if ALLOW_ALL in allowed else DEFAULT_DENIED,
    )


def policy_of(cfg: JaxaotConfig) -> ImportPolicy:
    """The policy of a typed config (its ``trust`` rules)."""
    return make_policy(cfg.trust.allow_imports, cfg.trust.deny_imports)


def _refusal(
    policy: ImportPolicy, key: str, target: str, name: str, rule: str, resolved: bool = False
) -> str:
    what = f"resolves to {name!r}, which" if resolved else f"imports {name!r}, which"
    if rule not in policy.deny:
        return (
            f"{key}={target!r} {what} the built-in import deny list refuses (rule {rule!r}: "
            f"process control, code execution, file access); if this config is trusted, allow "
            f"it with trust.allow_imports=[{dotted(target)}]"
        )
    return f"{key}={target!r} {what} {DENY_KEY} refuses (rule {rule!r})"


def check_name(target: str, key: str, policy: ImportPolicy) -> None:
    """Refuse a ``package.module:attr`` string the policy denies, before importing anything."""
    name = dotted(target)
    allowed, rule = policy.rule_for(name)
    if not allowed:
        assert rule is not None
        raise ConfigError(_refusal(policy, key, target, name, rule))
    if policy.explicitly_allowed(name):
        return
    _, _, attr_path = target.partition(":")
    for part in attr_path.split("."):
        if part.startswith("__") and part.endswith("__"):
            raise ConfigError(
                f"{key}={target!r} reaches through the dunder attribute {part!r}, which the "
                f"import policy refuses; if this config is trusted, allow it with "
                f"trust.allow_imports=[{name}]"
            )


def _resolved_names(modules: Iterable[types.ModuleType], obj: Any) -> list[str]:
    names = [m.__name__ for m in modules]
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        names.append(f"{module}.{qualname}")
    return names


def check_resolved(
    target: str, key: str, policy: ImportPolicy, modules: Sequence[types.ModuleType], obj: Any
) -> None:
    """Refuse a target whose path went through, or whose callable lives in, a denied module.

    ``modules`` are the module objects the attribute path passed (the imported one first);
    ``obj`` is what it resolved to. A name the policy allows explicitly is trusted as is.
    """
    if policy.explicitly_allowed(dotted(target)):
        return
    for name in _resolved_names(modules, obj):
        allowed, rule = policy.rule_for(name)
        if not allowed:
            assert rule is not None
            raise TargetError(_refusal(policy, key, target, name, rule, resolved=True))


def check_imports(cfg: JaxaotConfig) -> None:
    """Validation: every importable name in the config passes the policy (strings only)."""
    for key in (ALLOW_KEY, DENY_KEY):
        rules = getattr(cfg.trust, key.split(".", 1)[1])
        for rule in rules:
            if not isinstance(rule, str) or not rule.strip() or " " in rule.strip():
                raise ConfigError(
                    f"{key}: expected dotted module prefixes (e.g. os.path or numpy:load), "
                    f"found {rule!r}"
                )
    both = {dotted(r) for r in cfg.trust.allow_imports} & {
        dotted(r) for r in cfg.trust.deny_imports
    }
    if both:
        raise ConfigError(
            f"{ALLOW_KEY} and {DENY_KEY} both list {sorted(both)}; expected each rule in one of them"
        )
    policy = policy_of(cfg)
    check_name(cfg.program.target, "program.target", policy)
    for key, name in _pytree_tags(cfg.program.args, "program.args"):
        check_name(name, key, policy)
    for key, name in _pytree_tags(cfg.program.kwargs, "program.kwargs"):
        check_name(name, key, policy)


def _pytree_tags(tree: Any, where: str) -> Iterable[tuple[str, str]]:
    """(key, class) of every ``_pytree_: pkg.mod:Class`` tag in an argument tree
    (pipeline/config/argspec.py: pytree containers named by import path)."""
    if isinstance(tree, dict):
        tag = tree.get("_pytree_")
        if isinstance(tag, str) and tag != "tuple":
            yield f"{where}._pytree_", tag
        for k, v in tree.items():
            yield from _pytree_tags(v, f"{where}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _pytree_tags(v, f"{where}[{i}]")


def check_hydra_callbacks(config: Any) -> None:
    """``hydra.callbacks.<name>._target_`` under the same policy, before Hydra instantiates it.

    Hydra instantiates callbacks itself, before jaxaot's task function runs, under its own
    target policy (which lets ``os.system`` or ``subprocess.run`` through); this puts jaxaot's
    rules in front of it. The ``trust`` node is read from the raw composed config.
    """
    from omegaconf import OmegaConf

    callbacks = OmegaConf.select(config, "hydra.callbacks")
    if not callbacks:
        return
    allow = OmegaConf.select(config, ALLOW_KEY, default=None) or []
    deny = OmegaConf.select(config, DENY_KEY, default=None) or []
    policy = make_policy(allow, deny)
    for name, params in callbacks.items():
        target = OmegaConf.select(params, "_target_") if OmegaConf.is_dict(params) else None
        if isinstance(target, str):
            check_name(target, f"hydra.callbacks.{name}._target_", policy)


def guard_hydra_callbacks() -> None:
    """Make Hydra check every callback ``_target_`` with :func:`check_hydra_callbacks` first."""
    from hydra._internal import callbacks as hydra_callbacks

    cls: Any = hydra_callbacks.Callbacks
    if getattr(cls.__init__, "_jaxaot_guarded", False):
        return
    original = cls.__init__

    def __init__(self: Any, config: Any = None) -> None:
        if config is not None:
            check_hydra_callbacks(config)
        original(self, config)

    __init__._jaxaot_guarded = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


__all__ = [
    "ALLOW_KEY",
    "DEFAULT_DENIED",
    "DEFAULT_POLICY",
    "DENY_KEY",
    "ImportPolicy",
    "check_hydra_callbacks",
    "check_imports",
    "check_name",
    "check_resolved",
    "dotted",
    "guard_hydra_callbacks",
    "make_policy",
    "policy_of",
]
