"""A program whose function was changed keeps no arguments from the program it replaced.

``jaxaot program.target=mypkg.model:loss`` keeps every other field of the default program,
``program.args`` and ``program.kwargs`` included: the transformer's parameters and tokens,
which ``loss`` then fails on while tracing, far from the cause. So when the composed target
differs from that of the shipped program option whose arguments were composed unchanged, the
arguments came from nowhere the user chose, and the run is refused in one line naming the
function's parameters and the spelling to fill in: a placeholder per parameter
(``'program.args=[<w>,<x>,<n>]'``), nothing guessed. A parameter annotated ``str``, ``int``,
``float`` or ``bool`` is a Python value: its placeholder says so (a string quoted) and its index
goes in ``stage_out.static_argnums``. Not refused: a function that takes none of the
arguments left out (it gets none), and ``program=<option>`` on the command line, which asks
for that option's arguments (``program=transformer program.target=mypkg:forward_unrolled``).

The function's parameters are read with :func:`inspect.signature`, the function imported
through the run's import policy (jaxaot.stages.resolving); when it cannot be, the run is still
refused, leading with why (the import's own error), then the arguments left out.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxaot.errors import ConfigError
from omegaconf import DictConfig, OmegaConf

# Annotations that make a parameter a Python value (static), by their name as written.
_PYTHON_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
# What a placeholder stands for, after the command to fill in.
_FILL_IN = (
    "with each <...> an array spec such as f32[256,256] or a literal such as 3, and a "
    "parameter used as a Python value (a string, range(n)) in stage_out.static_argnums"
)
_REQUIRED_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@functools.cache
def _shipped_programs(conf_dir: str) -> tuple[tuple[str, Any, Any, Any], ...]:
    """(option, target, args, kwargs) of every shipped ``conf/program/*.yaml``."""
    out = []
    for path in sorted(Path(conf_dir, "program").glob("*.yaml")):
        doc: Any = OmegaConf.load(path)
        out.append(
            (
                path.stem,
                doc.get("target"),
                _plain(doc.get("args")) or [],
                _plain(doc.get("kwargs")) or {},
            )
        )
    return tuple(out)


def _names_a_program(overrides: Sequence[str]) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0].split("@", 1)[0] == "program" for o in overrides)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node


def _gives(key: str, overrides: Sequence[str]) -> bool:
    """Whether ``overrides`` set ``key`` or a part of it (``program.args.0=...``)."""
    names = (o.lstrip("+~").split("=", 1)[0] for o in overrides)
    return any(n == key or n.startswith(key + ".") for n in names)


def _source(
    target: str, args: Any, kwargs: Any, user_args: bool, user_kwargs: bool
) -> tuple[str, str, bool, bool] | None:
    """(option, its target, args from it, kwargs from it) for the shipped program option whose
    arguments were composed unchanged under another target, or None."""
    import jaxaot.conf

    for option, own_target, own_args, own_kwargs in _shipped_programs(
        str(Path(jaxaot.conf.__file__).parent)
    ):
        # Arguments given on the command line are the user's, even where equal to an option's.
        same_args = args == own_args and not user_args
        same_kwargs = kwargs == own_kwargs and not user_kwargs
        if own_target == target or not same_args:
            continue
        if own_args or (own_kwargs and same_kwargs):
            return option, str(own_target), same_args, same_kwargs and bool(own_kwargs)
    return None


def _parameters(fn: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def _shown(params: list[inspect.Parameter]) -> str:
    """``(params, tokens, n)``; ``(subscripts, *operands, ...)`` when some have defaults."""
    shown: list[str] = []
    starred = False
    for p in params:
        if p.kind == inspect.Parameter.VAR_POSITIONAL:
            shown.append(f"*{p.name}")
            starred = True
        elif p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is p.empty:
            if not starred:
                shown.append("*")
                starred = True
            shown.append(p.name)
        elif p.kind in _REQUIRED_POSITIONAL and p.default is p.empty:
            shown.append(p.name)
    if any(p.default is not p.empty or p.kind == p.VAR_KEYWORD for p in params):
        shown.append("...")
    return f"({', '.join(shown)})"


def _python_type(p: inspect.Parameter) -> str | None:
    """``str``/``int``/``float``/``bool`` when ``p``'s annotation is one (a string annotation,
    as ``from __future__ import annotations`` leaves it, included), else None."""
    ann = p.annotation
    for name, tp in _PYTHON_TYPES.items():
        if ann is tp or ann == name:
            return name
    return None


def _placeholder(p: inspect.Parameter) -> str:
    """``<x>``; ``"<mode>"`` for a str; ``<n:int>`` for another Python type; ``<*operands>``."""
    if p.kind == inspect.Parameter.VAR_POSITIONAL:
        return f"<*{p.name}>"
    kind = _python_type(p)
    if kind == "str":
        return f'"<{p.name}>"'
    return f"<{p.name}:{kind}>" if kind else f"<{p.name}>"


def _example(
    target: str, positional: list[inspect.Parameter], keywords: list[inspect.Parameter]
) -> str:
    """The command to fill in: one placeholder per parameter left out, the Python values static."""
    parts = [f"program.target={target}"]
    if positional:
        parts.append(f"'program.args=[{','.join(_placeholder(p) for p in positional)}]'")
    parts += [f"'+program.kwargs.{p.name}={_placeholder(p)}'" for p in keywords]
    static = [str(i) for i, p in enumerate(positional) if _python_type(p)]
    if static:
        parts.append(f"stage_out.static_argnums=[{','.join(static)}]")
    names = [p.name for p in keywords if _python_type(p)]
    if names:
        parts.append(f"stage_out.static_argnames=[{','.join(names)}]")
    return " ".join(parts)


def _fill_in(params: Sequence[inspect.Parameter]) -> str:
    variadic = next((p for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL), None)
    many = f" (<*{variadic.name}>: any number of them)" if variadic else ""
    return f" {_FILL_IN}{many}"


def check_own_arguments(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse a ``program.target`` override whose arguments are still another program's; a
    function that needs none of them gets none (``program.args=[]``, ``program.kwargs={}``).

    Only a target given in ``overrides`` (the command line, compose's list) is checked: a config
    file that swaps the target (an experiment with ``override /program: transformer``) chose
    its program's arguments with it."""
    target = OmegaConf.select(cfg, "program.target")
    if not isinstance(target, str) or _names_a_program(overrides):
        return
    if not _gives("program.target", overrides):
        return
    args, kwargs = _plain(cfg.program.get("args")), _plain(cfg.program.get("kwargs"))
    source = _source(
        target,
        args,
        kwargs,
        _gives("program.args", overrides),
        _gives("program.kwargs", overrides),
    )
    if source is None:
        return
    option, own_target, args_from_option, kwargs_from_option = source
    given = "program=" + option
    key = "program.args" if args_from_option else "program.kwargs"
    composed = f"the arguments composed are {given}'s, for {own_target}"
    alternative = f"; or {given} to keep its arguments"
    try:
        from jaxaot.config.trust.sources import user_policy
        from jaxaot.stages.jaxenv import _without_plugin_noise
        from jaxaot.stages.resolving import resolve_target

        trust = cfg.get("trust") or {}
        policy = user_policy(trust.get("allow_imports") or (), trust.get("deny_imports") or ())
        # The target's module imports JAX: quietly, as a run's first JAX import is.
        with _without_plugin_noise():
            params = _parameters(resolve_target(target, "program.target", policy))
    except Exception as exc:
        # What stops the run first is the import (a module not found, a policy's refusal).
        why = " ".join(str(exc).split()) or type(exc).__name__
        spelled = (
            "'program.args=[<one per parameter>]'"
            if args_from_option
            else ("'+program.kwargs.<name>=<...>'")
        )
        raise ConfigError(
            f"{why}{'' if why.endswith(('?', '.')) else '.'} {key} was not given either "
            f"({composed}). "
            f"Fix: program.target={target} {spelled}{_fill_in([])}{alternative}"
        ) from None
    positional = [p for p in params if p.kind in _REQUIRED_POSITIONAL and p.default is p.empty]
    keywords = [
        p for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is p.empty
    ]
    given_kwargs = {} if kwargs_from_option or not isinstance(kwargs, dict) else kwargs
    missing = [p for p in keywords if p.name not in given_kwargs]
    needs_args = args_from_option and bool(positional)
    if not needs_args and not missing:
        # Nothing the function needs is left out: it gets no arguments from the other program.
        if args_from_option:
            cfg.program.args = []
        if kwargs_from_option:
            cfg.program.kwargs = {}
        return
    key = "program.args" if needs_args else "program.kwargs"
    if args_from_option:
        # A variadic parameter's place is after the required ones: any number of arguments.
        positional += [p for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL]
    else:
        positional = []
    raise ConfigError(
        f"{key}: {target} takes {_shown(params)} and {key} was not given; {composed}. "
        f"Fix: {_example(target, positional, missing)}{_fill_in(positional)}{alternative}"
    )


# compose()'s refusals, held until run(): the caller may still set program.args in Python
# (``cfg.program.args = [jax.ShapeDtypeStruct(...)]``). id(cfg) -> (the config, weakly; the
# arguments it was refused with; the refusal).
_DEFERRED: dict[int, tuple[weakref.ref[Any], Any, Any, str]] = {}


def defer_own_arguments(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """:func:`check_own_arguments` for ``jaxaot.compose``: a refusal is raised by
    :func:`check_deferred` when ``cfg`` runs with the arguments it was composed with."""
    for key in [k for k, (ref, *_) in _DEFERRED.items() if ref() is None]:
        del _DEFERRED[key]
    try:
        check_own_arguments(cfg, overrides)
    except ConfigError as exc:
        args, kwargs = _plain(cfg.program.get("args")), _plain(cfg.program.get("kwargs"))
        _DEFERRED[id(cfg)] = (weakref.ref(cfg), args, kwargs, str(exc))


def check_deferred(cfg: Any) -> None:
    """Raise compose()'s refusal for ``cfg`` if its program still has the arguments it was
    composed with (another program's); nothing once the caller set its own."""
    entry = _DEFERRED.get(id(cfg))
    if entry is None:
        return
    ref, args, kwargs, refusal = entry
    composed: Any = ref()
    if composed is None or composed is not cfg:
        return
    program = composed.program
    if (_plain(program.get("args")), _plain(program.get("kwargs"))) == (args, kwargs):
        raise ConfigError(refusal)


__all__ = ["check_deferred", "check_own_arguments", "defer_own_arguments"]
