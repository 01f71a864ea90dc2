"""The import policy one run imports under, and the two checks every imported name passes.

:func:`check_name` judges the string before anything is imported; :func:`check_resolved`
judges what it resolved to: every module its attribute path went through and the object's own
``__module__.__qualname__`` (through ``functools.partial`` too), so ``mypkg:os.system``,
``jax.numpy:save`` (NumPy's) or a module-level alias of ``eval`` is refused although its name
looks allowed. A name the user allowed explicitly is trusted with whatever it resolves to.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxaot.config.trust.rules import (
    ALL,
    BUILTIN_RULES,
    TARGET,
    Location,
    Rule,
    locate,
    user_code_rule,
)
from jaxaot.errors import ConfigError, TargetError

ALLOW_KEY = "trust.allow_imports"
DENY_KEY = "trust.deny_imports"
ENV_ALLOW = "JAXAOT_ALLOW_IMPORTS"


def dotted(name: str) -> str:
    """``pkg.mod:attr.path`` -> ``pkg.mod.attr.path`` (rules and names compare dotted)."""
    return name.strip().replace(":", ".")


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: Rule | None  # the deciding rule; None: no rule matched (refused by default)
    location: Location | None = None  # where the top-level module is, when no rule matched


@dataclass(frozen=True)
class ImportPolicy:
    """The built-in rules plus the user's own (command line, environment, user file)."""

    rules: tuple[Rule, ...] = ()
    # For a refusal's fix line: the allow rules the command line and the environment hold.
    command_line_allow: tuple[str, ...] = ()
    env_allow: tuple[str, ...] = ()

    @property
    def allow_all(self) -> bool:
        """``'*'`` among the user's allow rules: only the user's own deny rules remain."""
        return any(r.allow and r.prefix == ALL for r in self.rules)

    def decide(self, name: str, scope: str = TARGET) -> Decision:
        candidates = [r for r in self.rules if r.matches(name)]
        top = name.split(".", 1)[0]
        location = None
        if not self.allow_all:
            candidates += [
                r for r in BUILTIN_RULES if r.scope in ("any", scope) and r.matches(name)
            ]
            # The user's-code rule is as long as the top-level name: a longer rule decides alone.
            if not any(len(r.prefix) >= len(top) for r in candidates if r.prefix != ALL):
                location = locate(top)
                if location.user:
                    candidates.append(user_code_rule(top, location))
        if not candidates:
            return Decision(False, None, location or locate(top))
        best = max(candidates, key=Rule.rank)
        return Decision(best.allow, best)

    def explicitly_allowed(self, name: str, scope: str = TARGET) -> bool:
        """Allowed by one of the user's own rules naming it (not by ``'*'``)."""
        return _explicit(self.decide(name, scope))

    def allow_line(self, name: str) -> str:
        """The exact line that lets ``name`` in, from the user's side."""
        cmd = ",".join(dict.fromkeys([*self.command_line_allow, name]))
        env = ",".join(dict.fromkeys([*self.env_allow, name]))
        return f"add {ALLOW_KEY}=[{cmd}] to the command line or set {ENV_ALLOW}={env}"


def _explicit(d: Decision) -> bool:
    return d.allowed and d.rule is not None and d.rule.user and d.rule.prefix != ALL


DEFAULT_POLICY = ImportPolicy()


def make_policy(
    allow: Iterable[str] = (), deny: Iterable[str] = (), source: str = "command line"
) -> ImportPolicy:
    """The built-in rules plus ``allow``/``deny`` given by the user (``source`` names where)."""
    allowed, denied = [dotted(str(r)) for r in allow], [dotted(str(r)) for r in deny]
    label = {True: ALLOW_KEY, False: DENY_KEY} if source == "command line" else None
    rules = tuple(
        Rule(p, a, label[a] if label else source, user=True)
        for a, prefixes in ((True, allowed), (False, denied))
        for p in prefixes
    )
    return ImportPolicy(rules, command_line_allow=tuple(allowed))


def refusal(
    policy: ImportPolicy,
    key: str,
    target: str,
    name: str,
    decision: Decision,
    *,
    resolved: bool = False,
    origin: str | None = None,
) -> str:
    """One line: the key and name, where it came from, why it is refused, the allowing line."""
    head = f"{key}={target!r}{f' (from {origin})' if origin else ''}"
    head += f" {'resolves to' if resolved else 'imports'} {name!r}"
    rule = decision.rule
    if rule is not None and rule.user:  # the user's own deny rule: nothing to suggest
        return f"{head}, which {rule.source} refuses (rule {rule.prefix!r})"
    if rule is None:
        kind = decision.location.kind() if decision.location is not None else "unknown"
        why = (
            f"which the import policy does not allow: {name.split('.', 1)[0]!r} is {kind}, "
            "neither the JAX ecosystem nor this project's own code"
        )
    else:
        why = f"which the import policy refuses (rule {rule.prefix!r}: {rule.why})"
    return f"{head}, {why}; if you trust it, {policy.allow_line(dotted(target))}"


def check_name(
    target: str,
    key: str,
    policy: ImportPolicy,
    scope: str = TARGET,
    origin: Callable[[], str | None] | None = None,
) -> None:
    """Refuse an import path (``pkg.mod:attr`` or dotted) before anything is imported.
    ``origin`` says where the name was set (a config file, the command line); it is asked only
    for a refusal's message (finding a config file's origin reloads the config files)."""
    name = dotted(target)
    decision = policy.decide(name, scope)
    if not decision.allowed:
        location = decision.location
        if decision.rule is None and location is not None and not location.found:
            return  # nothing by that name to import: the import itself says so
        raise ConfigError(
            refusal(policy, key, target, name, decision, origin=origin() if origin else None)
        )
    if _explicit(decision):
        return
    for part in name.split("."):
        if part.startswith("__") and part.endswith("__"):
            raise ConfigError(
                f"{key}={target!r} reaches through the dunder attribute {part!r}, which the "
                f"import policy refuses; if you trust it, {policy.allow_line(name)}"
            )


def _home(obj: Any, depth: int = 0) -> list[str]:
    """``module.qualname`` of a function or class (and of what a partial wraps)."""
    out: list[str] = []
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        out.append(f"{module}.{qualname}")
    if isinstance(obj, functools.partial) and depth < 8:
        out += _home(obj.func, depth + 1)
    return out


def resolved_names(modules: Iterable[types.ModuleType], obj: Any) -> list[str]:
    return [m.__name__ for m in modules] + _home(obj)


def check_resolved(
    target: str,
    key: str,
    policy: ImportPolicy,
    modules: Sequence[types.ModuleType],
    obj: Any,
    scope: str = TARGET,
) -> None:
    """Refuse a name whose path went through, or whose object lives in, a refused module.

    ``modules`` are the module objects the attribute path passed (the imported one first);
    ``obj`` is what it resolved to.
    """
    if policy.explicitly_allowed(dotted(target), scope):
        return
    for name in resolved_names(modules, obj):
        decision = policy.decide(name, scope)
        if not decision.allowed:
            raise TargetError(refusal(policy, key, target, name, decision, resolved=True))


__all__ = [
    "ALLOW_KEY",
    "DEFAULT_POLICY",
    "DENY_KEY",
    "ENV_ALLOW",
    "Decision",
    "ImportPolicy",
    "check_name",
    "check_resolved",
    "dotted",
    "make_policy",
    "refusal",
    "resolved_names",
]
