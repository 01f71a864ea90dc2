"""Derived arguments: values a program's own code makes, written in ``program.args``/``kwargs``.

Tags are mappings with an underscore key, as ``_pytree_`` (jaxaot.config.argspec), and may sit
anywhere a leaf may::

    {_init_: mypkg.model:init, _args_: [{_key_: 0}], features: 128}   # init(key(0), features=128)
    {_call_: optax:adamw, learning_rate: 1.0e-3}                       # a host object, built once
    {_init_: {_call_: optax:adamw, learning_rate: 1.0e-3}, _method_: init,
     _args_: [{_ref_: program.args[0]}]}                               # adamw(...).init(params)
    {_ref_: program.args[0]}                                           # that node's value, shared
    {_key_: 0}                                                         # jax.random.key(0)
    {_get_: flax.nnx:Param}                                            # the class, not called

- ``_init_`` is a DERIVED value: ``fn(*_args_, **kwargs)``, any pytree. stage_out, lower and
  compile see only its shapes (``jax.eval_shape``, or the callable's ``jaxaot_abstract`` hook);
  execute computes it for real, placed with the executable's input shardings
  (jaxaot.stages.derived_values).
- ``_call_`` is a HOST object, built once per process and never traced (an optimizer, a module
  config, ``flax.nnx:Rngs``).
- ``_method_: name`` (with ``_init_`` or ``_call_``) calls ``getattr(target, name)``; the target
  may then be a ``_call_`` or ``_ref_`` node as well as a name.
- ``_ref_`` names another node by its config path (``program.args[N]``, ``program.kwargs.name``,
  then ``.key`` / ``[i]`` into the config tree): computed once, shared by every reference.
- ``_key_: n`` is ``jax.random.key(n)`` (a typed PRNG key, concrete even under eval_shape).
- ``_get_: pkg.mod:attr`` is the object at that import path as it is, never called (a class
  such as ``flax.nnx:Param`` for ``nnx.Optimizer(..., wrt=...)``, a filter function such as
  ``equinox:is_array``): resolved through the import policy as ``_call_``'s name is, static
  data wherever it is passed (closed over, fingerprinted).

Parsed here without importing anything; the names go through the run's import policy when they
are resolved (jaxaot.stages.derived_values).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxaot.errors import ArgSpecError

if TYPE_CHECKING:
    from jaxaot.config.argspec import BoundArgs

INIT_KEY = "_init_"
CALL_KEY = "_call_"
REF_KEY = "_ref_"
KEY_KEY = "_key_"
GET_KEY = "_get_"
METHOD_KEY = "_method_"
ARGS_KEY = "_args_"
TAGS: tuple[str, ...] = (INIT_KEY, CALL_KEY, REF_KEY, KEY_KEY, GET_KEY)
# Every tag a mapping may carry (``_pytree_`` is argspec's); any other ``_word_`` key is a typo.
KNOWN_TAGS: tuple[str, ...] = (*TAGS, "_pytree_")
_TAG_LIKE = re.compile(r"^_[A-Za-z0-9]+_$")
# One component of a config path after program.args / program.kwargs: ``.name``, ``[3]``, ``.3``.
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]|\.(\d+)")


@dataclass(frozen=True)
class InitNode:
    """``{_init_: target, _args_: [...], **kwargs}``: a derived pytree value."""

    target: Any  # "pkg.mod:fn", or a CallNode / RefNode
    method: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    tag = INIT_KEY

    def children(self, where: str) -> list[tuple[str, Any]]:
        """(config path, subtree) of the target when it is a node, the positional arguments,
        then the keyword arguments."""
        head = [] if isinstance(self.target, str) else [(f"{where}.{self.tag}", self.target)]
        return (
            head
            + [(f"{where}.{ARGS_KEY}[{i}]", a) for i, a in enumerate(self.args)]
            + [(f"{where}.{k}", v) for k, v in self.kwargs]
        )

    def with_children(self, new: list[Any]) -> Any:
        it = iter(new)
        target = self.target if isinstance(self.target, str) else next(it)
        args = tuple(next(it) for _ in self.args)
        kwargs = tuple((k, next(it)) for k, _ in self.kwargs)
        return type(self)(target, self.method, args, kwargs)

    @property
    def name(self) -> str:
        """What it calls, for messages: ``mypkg.model:init``, ``optax:adamw(...).init``."""
        base = self.target if isinstance(self.target, str) else describe(self.target)
        return f"{base}.{self.method}" if self.method else base


@dataclass(frozen=True)
class CallNode(InitNode):
    """``{_call_: target, _args_: [...], **kwargs}``: a host object, built once, never traced."""

    tag = CALL_KEY


@dataclass(frozen=True)
class RefNode:
    """``{_ref_: program.args[0]}``: the value of the node at that config path."""

    path: str  # canonical: program.args[0].params[1]

    def children(self, where: str) -> list[tuple[str, Any]]:
        return []

    def with_children(self, new: list[Any]) -> RefNode:
        return self


@dataclass(frozen=True)
class KeyNode:
    """``{_key_: n}``: ``jax.random.key(n)``."""

    seed: int

    def children(self, where: str) -> list[tuple[str, Any]]:
        return []

    def with_children(self, new: list[Any]) -> KeyNode:
        return self


@dataclass(frozen=True)
class GetNode:
    """``{_get_: pkg.mod:attr}``: the object at that import path, as it is (not called)."""

    target: str

    def children(self, where: str) -> list[tuple[str, Any]]:
        return []

    def with_children(self, new: list[Any]) -> GetNode:
        return self


DerivedNode = InitNode | CallNode | RefNode | KeyNode | GetNode
DERIVED_TYPES: tuple[type, ...] = (InitNode, CallNode, RefNode, KeyNode, GetNode)


def describe(node: Any) -> str:
    """A derived node in a few words: ``optax:adamw(...)``, ``_ref_ program.args[0]``."""
    if isinstance(node, CallNode):
        return f"{node.name}(...)"
    if isinstance(node, InitNode):
        return f"_init_ {node.name}"
    if isinstance(node, RefNode):
        return f"_ref_ {node.path}"
    if isinstance(node, KeyNode):
        return f"_key_ {node.seed}"
    if isinstance(node, GetNode):
        return node.target
    return repr(node)


def is_tagged(value: Mapping[str, Any]) -> bool:
    """Whether a mapping is a derived node (carries one of :data:`TAGS`)."""
    return any(t in value for t in TAGS)


def check_tag_keys(value: Mapping[str, Any], where: str) -> None:
    """Refuse a ``_word_`` key that is no tag (``_int_``, ``_arg_``): a typo, not an argument."""
    allowed = {ARGS_KEY, METHOD_KEY} if (INIT_KEY in value or CALL_KEY in value) else set()
    if "_pytree_" in value:
        allowed = {ARGS_KEY}
    for k in value:
        if isinstance(k, str) and _TAG_LIKE.match(k) and k not in KNOWN_TAGS and k not in allowed:
            extra = f" (with {', '.join(sorted(allowed))})" if allowed else ""
            raise ArgSpecError(
                f"{where}: unknown tag key {k!r}; expected one of {', '.join(KNOWN_TAGS)}{extra}"
            )


def canonical_ref(text: Any, where: str) -> str:
    """``program.args.0.w`` / ``program.args[0].w`` -> ``program.args[0].w``; else one line."""
    expected = (
        "expected a config path: program.args[N] or program.kwargs.NAME, then .key or [i] "
        "into the config tree (e.g. program.args[0])"
    )
    if not isinstance(text, str):
        raise ArgSpecError(f"{where}.{REF_KEY}: {expected}; found {text!r}")
    s = text.strip()
    m = re.match(r"^program\.(args|kwargs)", s)
    if not m:
        raise ArgSpecError(f"{where}.{REF_KEY}: {expected}; found {text!r}")
    out, pos = [f"program.{m.group(1)}"], m.end()
    while pos < len(s):
        part = _PATH_PART.match(s, pos)
        if not part:
            raise ArgSpecError(
                f"{where}.{REF_KEY}: cannot read {text!r} at {s[pos:]!r}; {expected}"
            )
        name, index, dotted_index = part.groups()
        out.append(f".{name}" if name is not None else f"[{index or dotted_index}]")
        pos = part.end()
    if len(out) < 2 or (m.group(1) == "args" and not out[1].startswith("[")):
        raise ArgSpecError(f"{where}.{REF_KEY}: {expected}; found {text!r}")
    if m.group(1) == "kwargs" and not out[1].startswith("."):
        raise ArgSpecError(f"{where}.{REF_KEY}: {expected}; found {text!r}")
    return "".join(out)


def parse_derived(value: Mapping[str, Any], where: str, parse: Callable[[Any, str], Any]) -> Any:
    """A tagged mapping -> InitNode / CallNode / RefNode / KeyNode; ``parse(value, where)``
    parses the children (argspec.parse_leaf_or_tree)."""
    check_tag_keys(value, where)
    tags = [t for t in (*TAGS, "_pytree_") if t in value]
    if len(tags) > 1:
        raise ArgSpecError(f"{where}: one tag per mapping; found {', '.join(tags)}")
    tag = tags[0]
    if tag == REF_KEY:
        if len(value) != 1:
            others = sorted(str(k) for k in value if k != REF_KEY)
            raise ArgSpecError(
                f"{where}: a _ref_ takes no other keys; found {others} (the value is the "
                "referenced node's, as it is)"
            )
        return RefNode(canonical_ref(value[REF_KEY], where))
    if tag == KEY_KEY:
        seed = value[KEY_KEY]
        if len(value) != 1:
            others = sorted(str(k) for k in value if k != KEY_KEY)
            raise ArgSpecError(f"{where}: a _key_ takes no other keys; found {others}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ArgSpecError(
                f"{where}.{KEY_KEY}: expected an int seed >= 0 (jax.random.key(seed)), "
                f"found {seed!r}"
            )
        return KeyNode(seed)
    if tag == GET_KEY:
        name = value[GET_KEY]
        if len(value) != 1:
            others = sorted(str(k) for k in value if k != GET_KEY)
            raise ArgSpecError(
                f"{where}: a _get_ takes no other keys; found {others} (it names an object; "
                "to call it, write _call_ or _init_)"
            )
        if not (isinstance(name, str) and ":" in name and all(name.split(":", 1))):
            raise ArgSpecError(
                f"{where}.{GET_KEY}: expected 'package.module:attribute' (e.g. flax.nnx:Param), "
                f"found {name!r}"
            )
        return GetNode(name.strip())
    raw_target = value[tag]
    if isinstance(raw_target, Mapping):
        target = parse(raw_target, f"{where}.{tag}")
        if not isinstance(target, CallNode | RefNode):
            raise ArgSpecError(
                f"{where}.{tag}: expected 'package.module:function', a _call_ or a _ref_ node, "
                f"found {dict(raw_target)!r}"
            )
    elif isinstance(raw_target, str) and ":" in raw_target and all(raw_target.split(":", 1)):
        target = raw_target.strip()
    else:
        raise ArgSpecError(
            f"{where}.{tag}: expected 'package.module:function' (or a _call_/_ref_ node with "
            f"_method_), found {raw_target!r}"
        )
    method = value.get(METHOD_KEY)
    if method is not None and not (isinstance(method, str) and method.isidentifier()):
        raise ArgSpecError(
            f"{where}.{METHOD_KEY}: expected an attribute name (e.g. init), found {method!r}"
        )
    raw_args = value.get(ARGS_KEY, [])
    if isinstance(raw_args, str | bytes) or not isinstance(raw_args, Sequence):
        raise ArgSpecError(f"{where}.{ARGS_KEY}: expected a list of arguments, found {raw_args!r}")
    args = tuple(parse(a, f"{where}.{ARGS_KEY}[{i}]") for i, a in enumerate(raw_args))
    kwargs = tuple(
        (str(k), parse(v, f"{where}.{k}"))
        for k, v in value.items()
        if k not in (tag, ARGS_KEY, METHOD_KEY)
    )
    cls = InitNode if tag == INIT_KEY else CallNode
    return cls(target, method, args, kwargs)


# --- the config tree: nodes by path, references checked --------------------------------------


def walk(tree: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(config path, node) of every node of a parsed tree, the tree itself first; a derived
    node's children (target, ``_args_``, keyword arguments) are nodes too."""
    yield where, tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk(v, f"{where}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from walk(v, f"{where}[{i}]")
    elif hasattr(tree, "children") and callable(tree.children):
        for path, child in tree.children(where):
            yield from walk(child, path)


def index(trees: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Every node of the argument trees by its config path."""
    out: dict[str, Any] = {}
    for top, tree in trees:
        out.update(walk(tree, top))
    return out


def has_derived(trees: Sequence[tuple[str, Any]]) -> bool:
    return any(isinstance(n, DERIVED_TYPES) for _, t in trees for _, n in walk(t, ""))


def bound_trees(bound: BoundArgs) -> list[tuple[str, Any]]:
    """(config path, parsed tree) of every argument, static ones too."""
    return [(f"program.args[{i}]", a) for i, a in enumerate(bound.args)] + [
        (f"program.kwargs.{k}", v) for k, v in bound.kwargs.items()
    ]


def uses_derived(bound: BoundArgs) -> bool:
    """Whether any argument holds an ``_init_``, ``_call_``, ``_ref_``, ``_key_`` or ``_get_``
    node."""
    return has_derived(bound_trees(bound))


def check_refs(trees: Sequence[tuple[str, Any]]) -> None:
    """Each ``_ref_`` names a node that exists, and no value depends on itself."""
    nodes = index(trees)
    refs = {p: n.path for p, n in nodes.items() if isinstance(n, RefNode)}
    for at, target in refs.items():
        if target not in nodes:
            near = sorted(p for p in nodes if p.startswith(target.rsplit(".", 1)[0]))[:6]
            raise ArgSpecError(
                f"{at}.{REF_KEY}: no node {target!r} in the config (a _ref_ names a node of "
                "program.args/program.kwargs, not a part of a value an _init_ returns); "
                f"paths near it: {', '.join(near) or 'none'}"
            )

    def inside(path: str) -> list[str]:  # the refs within a node's subtree (itself included)
        return [p for p in refs if p == path or p.startswith((path + ".", path + "["))]

    done: set[str] = set()

    def visit(path: str, stack: list[str]) -> None:
        if path in stack:
            cycle = " -> ".join([*stack[stack.index(path) :], path])
            raise ArgSpecError(f"{stack[-1]}: a _ref_ cycle ({cycle}); a value cannot need itself")
        if path in done:
            return
        for ref in inside(path):
            visit(refs[ref], [*stack, path] if ref == path else [*stack, path, ref])
        done.add(path)

    for top, _ in trees:
        visit(top, [])


__all__ = [
    "ARGS_KEY",
    "CALL_KEY",
    "DERIVED_TYPES",
    "GET_KEY",
    "INIT_KEY",
    "KEY_KEY",
    "METHOD_KEY",
    "REF_KEY",
    "TAGS",
    "CallNode",
    "DerivedNode",
    "GetNode",
    "InitNode",
    "KeyNode",
    "RefNode",
    "bound_trees",
    "canonical_ref",
    "check_refs",
    "check_tag_keys",
    "describe",
    "has_derived",
    "index",
    "is_tagged",
    "parse_derived",
    "uses_derived",
    "walk",
]
