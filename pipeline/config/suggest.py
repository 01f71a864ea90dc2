"""Did you mean: the closest names for a mistyped config group, option or key, in one line.

Hydra answers ``progam=mlp`` and ``execute.repeat=3`` with "To append to your config use
+progam=mlp", which only moves the typo into the config, and lists an unknown option's group
with its internal schemas (``base_program``). Here the names a run can use are gathered once
(:class:`Names`: the config groups and their options from Hydra's config repository, the keys
from the schema dataclasses) and a composition error becomes one line naming the closest ones::

    unknown config group 'progam' (did you mean program=mlp? groups: compile, execute, ...)
    unknown key 'execute.repeat' (did you mean execute.repeats?)
    program=mpl: no such option (did you mean mlp? options: attention, axpy, ...)
    program=base_program: base_program is an internal schema, not an option (options: ...)

Schemas registered as ``base_<name>`` (jaxaot.schema) hold types, not values: never listed,
never selectable. Nothing here imports JAX; Hydra and the schema are imported when names are
gathered, which happens only on the way to an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INTERNAL_PREFIX = "base_"
# A key tree: section name -> its keys; a leaf is None; FREE is a mapping that takes any key
# (compile.compiler_options, program.kwargs, hydra.job_logging, ...).
FREE = "*"
KeyTree = Mapping[str, Any]

_NOT_FOUND = re.compile(r"In '([^']*)': Could not find '([^']+)'")
_OVERRIDE = re.compile(
    r"Could not override '([^']+)'\.\s*To append to your config use \+[^=]*=(.*)$", re.M
)
_DELETE = re.compile(r"Could not delete from config\. '([^']+)' does not exist")
_NOT_IN = re.compile(r"Key '[^']+' not in '")
_CHOICE = re.compile(r"^[+~]*([A-Za-z0-9_/]+)(?:@[^=]*)?=(.*)$")


@dataclass(frozen=True)
class Names:
    """What a command line can name: groups (path -> options, internal schemas left out) and
    the key tree of the composed config (``hydra`` included)."""

    groups: Mapping[str, tuple[str, ...]]
    keys: KeyTree

    def top_groups(self) -> list[str]:
        return sorted(g for g in self.groups if "/" not in g)


def is_internal(option: str, group: str | None = None) -> bool:
    """Whether ``option`` of ``group`` is one of jaxaot's schemas (``base_program``, registered
    in Hydra's ConfigStore by jaxaot.schema), not a config a user can choose. A user's own
    ``base_small.yaml`` (``--config-dir``) is an option like any other."""
    if not option.startswith(INTERNAL_PREFIX):
        return False
    if group is None:
        return True
    from hydra.core.config_store import ConfigStore

    node: Any = ConfigStore.instance().repo
    for part in group.split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return True  # no schema registered for the group (yet): the name is all there is
    return f"{option}.yaml" in node


def closest(word: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The candidates nearest ``word`` (difflib's ratio), best first; a case-only difference
    wins outright."""
    pool = sorted(set(candidates))
    same_case = [c for c in pool if c.lower() == word.lower()]
    if same_case:
        return same_case[:1]
    near = difflib.get_close_matches(word, pool, n=n, cutoff=0.6)
    if near:
        return near
    # A mistyped tail of a prefixed name: optuan -> jaxaot_optuna.
    scored = sorted((-max(_ratio(word, tail) for tail in _tails(c)), c) for c in pool if "_" in c)
    return [c for score, c in scored[:n] if -score >= 0.75]


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _tails(name: str) -> list[str]:
    parts = name.split("_")
    return ["_".join(parts[i:]) for i in range(1, len(parts))]


def keys_of(schema: Any) -> dict[str, Any]:
    """The key tree of a dataclass schema: nested dataclasses are sections, mappings take any
    key (FREE), everything else is a leaf (lists included: their items are values)."""
    hints = typing.get_type_hints(schema)
    tree: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        tree[f.name] = _node_of(hints.get(f.name, Any))
    return tree


def _node_of(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: X's node
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _node_of(args[0]) if len(args) == 1 else None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return keys_of(tp)
    if tp is dict or typing.get_origin(tp) in (dict, Mapping) or tp is Any:
        return FREE
    return None


def _parts(path: str) -> list[str]:
    return [p for p in re.split(r"\.|\[(\d+)\]", path) if p]


def _walk(path: str, tree: KeyTree) -> tuple[list[str], Any] | None:
    """(the known prefix, the section where ``path`` leaves the tree), or None when every part
    of ``path`` is known (or lands in a mapping that takes any key, or in a leaf's value)."""
    node: Any = tree
    done: list[str] = []
    for part in _parts(path):
        if not isinstance(node, Mapping):
            return None  # FREE or a leaf (a list's index): any name goes
        if part not in node:
            return done, node
        done.append(part)
        node = node[part]
    return None


def key_exists(path: str, tree: KeyTree) -> bool:
    return _walk(path, tree) is None


def fix_key(path: str, tree: KeyTree) -> str | None:
    """``execute.repeat`` -> ``execute.repeats``: each unknown part replaced by its closest
    sibling, or None when some part has none."""
    parts = _parts(path)
    node: Any = tree
    fixed: list[str] = []
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            return ".".join(fixed + parts[i:])
        if part not in node:
            best = closest(part, node)
            if not best:
                return None
            part = best[0]
        fixed.append(part)
        node = node[part]
    return ".".join(fixed)


def _listed(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (", ..." if len(names) > limit else "")


def _choice(group: str, value: str | None, names: Names) -> str:
    """``group=option`` when ``value`` is (or is close to) one of the group's options."""
    options = names.groups.get(group, ())
    if value and value in options:
        return f"{group}={value}"
    near = closest(value, options, 1) if value else []
    return f"{group}={near[0]}" if near else group


def unknown_name(path: str, value: str | None, names: Names) -> str:
    """One line for a name the config does not have: a group (``progam=mlp``,
    ``hydra/launchr=joblib``) or a key at any depth (``stop_afer``, ``execute.repeat``)."""
    if "/" in path:
        groups = sorted(names.groups)
        near = closest(path, groups, 1)
        hint = f"did you mean {_choice(near[0], value, names)}? " if near else ""
        return f"unknown config group '{path}' ({hint}groups: {_listed(groups, 40)})"
    if "." not in path and "[" not in path:
        top = names.top_groups()
        keys = sorted(names.keys)
        near = closest(path, [*top, *keys], 1)
        if near and near[0] in top:
            hint = f"did you mean {_choice(near[0], value, names)}? "
            return f"unknown config group '{path}' ({hint}groups: {_listed(top, 40)})"
        if near:
            return f"unknown key '{path}' (did you mean {near[0]}?)"
        return (
            f"unknown key or config group '{path}' (top-level keys: {_listed(keys, 40)}; "
            f"groups: {_listed(top, 40)})"
        )
    fixed = fix_key(path, names.keys)
    if fixed and fixed != path:
        return f"unknown key '{path}' (did you mean {fixed}?)"
    where = _walk(path, names.keys)
    if where is None:
        return f"unknown key '{path}'"
    done, section = where
    owner = ".".join(done) or "the top level"
    return f"unknown key '{path}' ({owner} has {_listed(sorted(section), 40)})"


def unknown_option(
    group: str, option: str, options: Iterable[str], where: str = "", names: Names | None = None
) -> str:
    """``program=mpl: no such option (did you mean mlp? options: ...)``; an internal schema is
    refused as such. ``where``: the config file that selected it, when not the command line.
    ``names``: the other groups, for an option of a group with the same last name
    (``sweeper=jaxaot_optuna``: did you mean ``hydra/sweeper=jaxaot_optuna``?)."""
    shown = sorted(o for o in options if not is_internal(o, group))
    head = f"{group}={option}" + (f" (in {where})" if where else "")
    if is_internal(option, group):
        return (
            f"{head}: {option} is an internal schema, not an option (options: {_listed(shown, 40)})"
        )
    near = closest(option, shown)
    namesake = _namesake(group, option, names) if names is not None and not near else None
    if namesake:
        hint = f"did you mean {namesake}? "
    else:
        hint = f"did you mean {' or '.join(near)}? " if near else ""
    return f"{head}: no such option ({hint}options: {_listed(shown, 40)})"


def _namesake(group: str, option: str, names: Names) -> str | None:
    """``hydra/sweeper=jaxaot_optuna`` for ``sweeper=jaxaot_optuna``: the option (or the closest
    one) in another group whose path ends with the same name, or None."""
    last = group.rsplit("/", 1)[-1]
    others = sorted(g for g in names.groups if g != group and g.rsplit("/", 1)[-1] == last)
    for other in others:
        if option in names.groups[other]:
            return f"{other}={option}"
    for other in others:
        near = closest(option, names.groups[other], 1)
        if near:
            return f"{other}={near[0]}"
    return None


def internal_choices(overrides: Sequence[str], names: Names | None = None) -> str | None:
    """The refusal for an override selecting an internal schema (``program=base_program``),
    or None. ``names`` are gathered only when some override needs them."""
    for override in overrides:
        m = _CHOICE.match(override.strip())
        if m is None or "." in m.group(1) or not is_internal(m.group(2).strip(), m.group(1)):
            continue
        names = names or config_names()
        group, option = m.group(1), m.group(2).strip()
        if group in names.groups:
            return unknown_option(group, option, names.groups[group], names=names)
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    node: BaseException | None = exc
    seen: set[int] = set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        yield node
        node = node.__cause__ or node.__context__


def suggestion(exc: BaseException, names: Names) -> str | None:
    """One line with the closest names for a Hydra composition error about a name (unknown
    group, option or key), or None for any other error. ``names``: what the run can name
    (:func:`config_names`)."""
    chain = list(_chain(exc))
    text = " ".join(str(e) for e in chain)
    found = _NOT_FOUND.search(text)
    if found:
        where, path = found.groups()
        group, _, option = path.rpartition("/")
        options = getattr(chain[0], "options", None) or names.groups.get(group)
        if not group:
            return None  # a primary config not found: Hydra's message says so
        source = "" if where in ("config", "hydra/config") else where
        if not options:
            return unknown_name(group, option, names) + (f" (in {source})" if source else "")
        return unknown_option(group, option, options, source, names)
    over = next((m for e in chain if (m := _OVERRIDE.search(str(e)))), None)
    if over and _NOT_IN.search(text):
        return unknown_name(over.group(1), over.group(2).strip() or None, names)
    gone = _DELETE.search(text)
    if gone:
        return unknown_name(gone.group(1), None, names)
    return None


# Lines of Hydra's and OmegaConf's messages that are not about the user's config.
_NOISE = ("full_key:", "object_type=", "reference_type=", "Set the environment variable")


def one_line(exc: BaseException, names: Names | None) -> str:
    """A composition error (Hydra's several lines, and their causes) as one line: the closest
    names for a mistyped group, option or key (:func:`suggestion`), else the messages of the
    error and up to two of its causes, Hydra's search path and OmegaConf's key dump left out.
    ``names``: what the run can name, or None when they could not be gathered."""
    try:
        line = suggestion(exc, names) if names is not None else None
    except Exception:  # naming the closest names must never hide the error itself
        line = None
    if line:
        return line
    parts: list[str] = []
    for node in _chain(exc):
        if len(parts) == 3:
            break
        lines = [ln.strip() for ln in str(node).splitlines()]
        text = " ".join(ln for ln in lines if ln and not ln.startswith(_NOISE))
        text = text.split(" Config search path:", 1)[0]  # Hydra appends its search path
        if text and text != "None" and "$VALUE" not in text and all(text not in p for p in parts):
            parts.append(text)
    return " (".join(parts) + ")" * (len(parts) - 1) if parts else type(exc).__name__


def config_names(config_dirs: Sequence[str] = (), *, schema: Any = None) -> Names:
    """The groups and keys of the shipped config (plus ``config_dirs``, as ``--config-dir``
    adds them): Hydra's config repository, and the key tree of ``schema`` (jaxaot's root
    config, jaxaot.schema.JaxaotConfig; None: Hydra's keys only) with Hydra's own under
    ``hydra``."""
    from hydra.conf import HydraConf
    from hydra.core.object_type import ObjectType
    from jaxaot.compat.hydra import config_repository

    repo = config_repository("pkg://jaxaot.conf", [os.path.abspath(d) for d in config_dirs])
    groups: dict[str, tuple[str, ...]] = {}

    def walk(parent: str) -> None:
        for sub in repo.get_group_options(parent, ObjectType.GROUP):
            path = f"{parent}/{sub}" if parent else sub
            options = tuple(
                o
                for o in repo.get_group_options(path, ObjectType.CONFIG)
                if not is_internal(o, path)
            )
            if options and path != "hydra":  # hydra/config is Hydra's own primary config
                groups[path] = options
            walk(path)

    walk("")
    own = keys_of(schema) if schema is not None else {}
    return Names(groups=groups, keys={**own, "hydra": keys_of(HydraConf)})


def config_dirs_of(argv: Sequence[str]) -> list[str]:
    """The ``--config-dir``/``-cd`` folders of a command line (Hydra adds them to its path)."""
    dirs: list[str] = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
    return [d for d in dirs if os.path.isdir(d)]


__all__ = [
    "FREE",
    "INTERNAL_PREFIX",
    "Names",
    "closest",
    "config_dirs_of",
    "config_names",
    "fix_key",
    "internal_choices",
    "is_internal",
    "key_exists",
    "keys_of",
    "one_line",
    "suggestion",
    "unknown_name",
    "unknown_option",
]
