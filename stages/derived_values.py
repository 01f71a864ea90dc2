"""Evaluating arguments with derived nodes (jaxaot.config.derived): abstract and concrete.

One :class:`Evaluation` per run and mode computes each node of ``program.args``/``kwargs`` once,
by config path, so a ``_ref_`` shares its target's value and an ``_init_`` feeding another runs
once.

- ``abstract`` (stage_out, and a resumed run re-deriving its arguments): array specs become
  ShapeDtypeStructs, an ``_init_`` is ``jax.eval_shape`` of its function (or the callable's
  ``jaxaot_abstract`` hook): nothing is allocated.
- ``concrete`` (execute): array specs are drawn from the seed (each numbered by its place in the
  config, as :func:`jaxaot.stages.inputs.spec_inputs` numbers them), an ``_init_`` runs under
  ``jax.jit(fn, out_shardings=...)`` with the executable's input shardings for its leaves (or the
  ``jaxaot_materialize(shardings, ...)`` hook), so a sharded value is made on its devices.
  ``shardings`` is a list with one sharding per array leaf of the value, in the order
  ``jax.tree_util.tree_leaves`` gives them (of ``jaxaot.stages.adapt.purify(value)`` for
  library objects), or None where a leaf is no input of the executable as it is.

``_call_`` objects are built from values (never abstract) once per process, a ``_get_`` is the
object at its import path (never called), and ``_key_`` is a
real ``jax.random.key`` in both modes. Non-array leaves of an ``_init_``'s arguments and result
(Python numbers, functions, objects) stay static, as ``equinox.filter_eval_shape`` keeps them.

Every ``_init_`` and ``_call_`` runs inside :func:`jaxaot.models.nnx.lazy_sharding`: a Flax 0.12
Variable created with logical sharding names (``nnx.with_partitioning``, ``out_sharding``) keeps
them as metadata (the rules of ``lower.logical_axis_rules`` place it) instead of asking for a
mesh whose axes are those names at creation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.config.argspec import (
    PYTREE_KEY,
    ArraySpec,
    BoundArgs,
    Given,
    Literal,
    PytreeNode,
    to_static_value,
)
from jaxaot.config.derived import (
    DERIVED_TYPES,
    CallNode,
    GetNode,
    InitNode,
    KeyNode,
    RefNode,
    bound_trees,
    describe,
    index,
    uses_derived,
    walk,
)
from jaxaot.errors import ArgSpecError, JaxaotError, TargetError, one_line
from jaxaot.models.nnx import lazy_sharding
from jaxaot.stages.derived_jit import (
    check_fit,
    eval_shape,
    eval_shape_leaves,
    leaf_shardings,
    materialize,
    out_shardings,
    pure_leaves,
    total_bytes,
)
from jaxaot.stages.inputs import _build, weakly_typed
from jaxaot.stages.resolving import abstract_value, resolve_object, resolve_target
from jaxaot.stages.resolving import describe as describe_value

# _call_ objects built in this process, by their node (one without references): the same object
# when stage_out and execute (or a sweep's jobs) name the same call.
_HOST_OBJECTS: dict[str, Any] = {}


def spec_numbers(bound: BoundArgs) -> dict[str, int]:
    """Each traced array spec's number (1, 2, ...) for its seeded generator, by config path: the
    order :func:`jaxaot.stages.inputs.spec_inputs` draws in (dict keys and fields sorted), an
    ``_init_``'s target, arguments and sorted keywords in their place."""
    numbers: dict[str, int] = {}

    def go(node: Any, where: str) -> None:
        if isinstance(node, ArraySpec):
            numbers[where] = len(numbers) + 1
        elif isinstance(node, dict):
            for k in sorted(node):
                go(node[k], f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                go(v, f"{where}[{i}]")
        elif isinstance(node, PytreeNode):
            children = node.children(where)
            n = len(node.args)
            for p, c in children[:n] + sorted(children[n:], key=lambda pc: pc[0]):
                go(c, p)
        elif isinstance(node, InitNode):  # CallNode too
            children = node.children(where)
            head = len(children) - len(node.kwargs)
            for p, c in children[:head] + sorted(children[head:], key=lambda pc: pc[0]):
                go(c, p)

    for path, tree in bound.traced_args():
        go(tree, path)
    return numbers


def _call_text(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    parts = [describe_value(a) for a in args] + [
        f"{k}={describe_value(v)}" for k, v in kwargs.items()
    ]
    text = ", ".join(parts)
    return f"{name}({text if len(text) <= 160 else text[:159] + '…'})"


def _placed(exc: JaxaotError, where: str) -> JaxaotError:
    """jaxaot's own error from a derived node's callable (a jaxaot.models hook), its class
    kept, led by the node's config path unless it names one already."""
    text = str(exc)
    if not text.startswith("program."):
        exc.args = (f"{where}: {text}",)
    return exc


@dataclass
class Evaluation:
    """The values of a run's argument nodes, each computed once (by config path)."""

    bound: BoundArgs
    mode: str  # "abstract" | "concrete"
    # (name, config key[, get=True: any object]) -> the callable (import policy)
    resolve: Callable[..., Any]
    leaf: Callable[[str, Any], Any]  # (path, ArraySpec | Literal | Given) -> value
    host_leaf: Callable[[str, Any], Any]  # the same, concrete (a _call_'s arguments)
    # concrete: (path, abstract array leaves) -> out_shardings of an _init_'s array leaves
    shardings: Callable[[str, Any], list[Any] | None] | None = None
    # abstract: each _init_'s array leaves as eval_shape gave them (concrete: the abstract
    # evaluation's), in the order its jit returns them
    pure: dict[str, list[Any]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    host_values: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # _init_ calls made, by path (tests)

    def __post_init__(self) -> None:
        self.nodes = index(bound_trees(self.bound))
        self._active: list[str] = []

    # -- the arguments ---------------------------------------------------------------------
    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Every argument in its position: static ones as their values, traced ones built."""
        b = self.bound
        args = tuple(
            to_static_value(a, f"program.args[{i}]")
            if b.is_static(i)
            else self.value(f"program.args[{i}]")
            for i, a in enumerate(b.args)
        )
        kwargs = {
            k: to_static_value(v, f"program.kwargs.{k}")
            if b.is_static(k)
            else self.value(f"program.kwargs.{k}")
            for k, v in b.kwargs.items()
        }
        return args, kwargs

    def derived_values(self) -> dict[str, Any]:
        """The value of every ``_init_``, ``_call_`` and ``_key_`` node computed, by path."""
        return {
            p: v
            for p, v in self.values.items()
            if isinstance(self.nodes.get(p), DERIVED_TYPES)
            and not isinstance(self.nodes.get(p), RefNode)
        }

    # -- one node ------------------------------------------------------------------------
    def value(self, path: str, host: bool = False) -> Any:
        # A _call_ object or a key is the same value whoever asks (one object, not two).
        shared = isinstance(self.nodes.get(path), CallNode | KeyNode | GetNode)
        memo = self.host_values if host and not shared else self.values
        if path in memo:
            return memo[path]
        if path in self._active:  # bind refuses cycles; a guard, never a hang
            raise ArgSpecError(f"{path}: a _ref_ cycle ({' -> '.join([*self._active, path])})")
        self._active.append(path)
        try:
            memo[path] = self._compute(self.nodes[path], path, host)
        finally:
            self._active.pop()
        return memo[path]

    def _compute(self, node: Any, where: str, host: bool) -> Any:
        if isinstance(node, dict):
            return {k: self.value(f"{where}.{k}", host) for k in node}
        if isinstance(node, list):
            return [self.value(f"{where}[{i}]", host) for i in range(len(node))]
        if isinstance(node, PytreeNode):
            children = [self.value(p, host) for p, _ in node.children(where)]
            n = len(node.args)
            if node.cls == "tuple":
                return tuple(children)
            cls = self.resolve(node.cls, f"{where}.{PYTREE_KEY}")
            fields = {k: v for (k, _), v in zip(node.fields, children[n:], strict=True)}
            try:
                return cls(*children[:n], **fields)
            except TypeError as exc:
                raise ArgSpecError(f"{where}: cannot build {node.cls} ({exc})") from None
        if isinstance(node, RefNode):
            return self.value(node.path, host)
        if isinstance(node, KeyNode):
            import jax

            return jax.random.key(node.seed)
        if isinstance(node, GetNode):
            return self.resolve(node.target, f"{where}._get_", get=True)
        if isinstance(node, CallNode):
            return self._host_object(node, where)
        if isinstance(node, InitNode):
            if host:
                raise ArgSpecError(
                    f"{where}: an _init_ value (derived arrays) where a _call_ object is built "
                    "from values; make the _call_ an _init_ (its value is then derived too)"
                )
            return self._init(node, where)
        return (self.host_leaf if host else self.leaf)(where, node)

    def _callable(self, node: InitNode, where: str, host: bool) -> tuple[Any, str]:
        tag = node.tag
        if isinstance(node.target, str):
            fn: Any = self.resolve(node.target, f"{where}.{tag}")
        else:
            fn = self.value(f"{where}.{tag}", host=True)
        name = node.name
        if node.method:
            if not hasattr(fn, node.method):
                public = sorted(n for n in dir(fn) if not n.startswith("_"))[:12]
                named = node.target if isinstance(node.target, str) else describe(node.target)
                hint = (
                    f"; to call a method of what {named} returns, make the target a _call_: "
                    f"{{{tag}: {{_call_: {named}, ...}}, _method_: {node.method}}}"
                    if isinstance(node.target, str)
                    else ""
                )
                raise TargetError(
                    f"{where}._method_: {named} ({type(fn).__name__}) has no attribute "
                    f"{node.method!r} (it has: {', '.join(public)}){hint}"
                )
            fn = getattr(fn, node.method)
        if not callable(fn):
            raise TargetError(f"{where}: {name} is a {type(fn).__name__}, not a callable")
        return fn, name

    def _children(self, node: InitNode, where: str, host: bool) -> tuple[list[Any], dict[str, Any]]:
        start = 0 if isinstance(node.target, str) else 1
        children = node.children(where)[start:]
        args = [self.value(p, host) for p, _ in children[: len(node.args)]]
        kwargs = {
            k: self.value(p, host)
            for (k, _), (p, _) in zip(node.kwargs, children[len(node.args) :], strict=True)
        }
        return args, kwargs

    def _host_object(self, node: CallNode, where: str) -> Any:
        key = repr(node)
        shared = not any(isinstance(n, RefNode) for _, n in walk(node, where))
        if shared and key in _HOST_OBJECTS:
            return _HOST_OBJECTS[key]
        fn, name = self._callable(node, where, host=True)
        args, kwargs = self._children(node, where, host=True)
        try:
            with lazy_sharding():
                obj = fn(*args, **kwargs)
        except JaxaotError as exc:
            raise _placed(exc, where) from None
        except Exception as exc:
            raise ArgSpecError(
                f"{where}: {_call_text(name, args, kwargs)} raised {one_line(exc)}"
            ) from None
        if shared:
            _HOST_OBJECTS[key] = obj
        return obj

    def _init(self, node: InitNode, where: str) -> Any:
        fn, name = self._callable(node, where, host=False)
        args, kwargs = self._children(node, where, host=False)
        self.calls[where] = self.calls.get(where, 0) + 1
        try:
            with lazy_sharding():
                return self._init_value(fn, args, kwargs, where)
        except JaxaotError as exc:
            raise _placed(exc, where) from None
        except Exception as exc:
            how = "under jax.eval_shape" if self.mode == "abstract" else "for its values"
            raise ArgSpecError(
                f"{where}: {_call_text(name, args, kwargs)} raised {one_line(exc)} (called {how})"
            ) from None

    def _init_value(self, fn: Any, args: list[Any], kwargs: dict[str, Any], where: str) -> Any:
        """An ``_init_``'s value: its shapes (abstract) or its values placed (concrete)."""
        if self.mode == "abstract":
            hook = getattr(fn, "jaxaot_abstract", None)
            if hook is None:
                value, self.pure[where] = eval_shape_leaves(fn, args, kwargs)
                return value
            value = hook(*args, **kwargs)
            leaves, dyn, _ = pure_leaves(value)
            self.pure[where] = [leaves[i] for i in dyn]
            return value
        assert self.shardings is not None
        shardings = self.shardings(where, self.pure.get(where))
        hook = getattr(fn, "jaxaot_materialize", None)
        if hook is not None:
            return hook(shardings, *args, **kwargs)
        return materialize(fn, args, kwargs, shardings)


def resolver(policy: Any) -> Callable[..., Any]:
    """``resolve(name, key)``: a callable (or a class, for ``_pytree_``) by import path, through
    the run's import policy; ``resolve(name, key, get=True)``: any object (a ``_get_``)."""

    @functools.cache
    def resolve(name: str, key: str, get: bool = False) -> Any:
        if name == "tuple" and not get:
            return tuple
        return (resolve_object if get else resolve_target)(name, key, policy)

    return resolve


def abstract(bound: BoundArgs, policy: Any, seed: int, scope: Any = None) -> Evaluation:
    """The abstract evaluation of a run's arguments (stage_out; a resumed run)."""

    def leaf(_path: str, spec: Any) -> Any:
        if isinstance(spec, Given):
            import jax

            v = spec.value
            return jax.ShapeDtypeStruct(v.shape, v.dtype, weak_type=getattr(v, "weak_type", False))
        return abstract_value(spec, scope)

    return Evaluation(
        bound=bound,
        mode="abstract",
        resolve=resolver(policy),
        leaf=leaf,
        host_leaf=_concrete_leaf(bound, seed),
    )


def _concrete_leaf(bound: BoundArgs, seed: int) -> Callable[[str, Any], Any]:
    numbers = spec_numbers(bound)

    def leaf(path: str, spec: Any) -> Any:
        if isinstance(spec, Given):
            return spec.value
        if isinstance(spec, Literal):
            return spec.value
        n = numbers.get(path, len(numbers) + 1)  # every traced spec is numbered
        value = _build(spec, seed, [n - 1], path)
        return weakly_typed(value) if spec.weak_type else value

    return leaf


def concrete(
    bound: BoundArgs,
    policy: Any,
    seed: int,
    abstract_pure: Mapping[str, list[Any]],
    shardings: Callable[[str, Any], list[Any] | None],
) -> Evaluation:
    """The concrete evaluation (execute): ``shardings(path, abstract leaves)`` gives an
    ``_init_``'s out_shardings (``abstract_pure``: the abstract evaluation's ``pure``)."""
    leaf = _concrete_leaf(bound, seed)
    return Evaluation(
        bound=bound,
        mode="concrete",
        resolve=resolver(policy),
        leaf=leaf,
        host_leaf=leaf,
        shardings=shardings,
        pure=dict(abstract_pure),
    )


__all__ = [
    "Evaluation",
    "abstract",
    "bound_trees",
    "check_fit",
    "concrete",
    "eval_shape",
    "leaf_shardings",
    "materialize",
    "out_shardings",
    "spec_numbers",
    "total_bytes",
    "uses_derived",
]
