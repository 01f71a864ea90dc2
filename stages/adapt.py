"""Library objects in arguments, made plain for jax.jit: the seam between built arguments and
the traced function (see the module docstring of each adapter in jaxaot.models).

``adapt(fn, args, kwargs, names)`` returns the function and arguments jax.jit traces: every
argument replaced by a pytree of arrays only, in the same positions and keywords, and the
static data closed over in ``fn`` with a fingerprint that keys it.

Which leaves are traced, as jax.jit and eqx.filter_jit decide:

- a jax.Array, np.ndarray or ShapeDtypeStruct, anywhere;
- a Python or NumPy number, except inside an Equinox module (eqx.filter_jit keeps those static);
- everything else (functions, optimizer objects, strings, a linen module instance) is static:
  closed over in ``fn``, listed in ``static_leaves`` and fingerprinted.

Containers keep their form where they hold no static data (a dict of arrays is passed through
as it is, the very object). A registered pytree class that holds static data (a
``TrainState``'s ``apply_fn`` and ``tx``, an Equinox module's activation) becomes a
``jaxaot.models.record.Record`` of its fields, in the class's order (a list for a class without
field names), and a subtree with no traced leaf at all is
static as a whole (``state/tx``). NNX graph nodes become the plain dict of their state
(jaxaot.models.nnx); linen partition boxes and NNX Variables become their value, their axis
names going to ``logical_axes``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxaot.config.tree_paths import key_text, top_names
from jaxaot.errors import ArgSpecError
from jaxaot.models import equinox as _eqx
from jaxaot.models import linen as _linen
from jaxaot.models import nnx as _nnx
from jaxaot.models.fingerprint import NoFingerprint, digest, fingerprint


@dataclass(frozen=True)
class Unfingerprintable:
    """Static data with no stable fingerprint: the run works, but is neither stored nor resumable."""

    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}: {self.why}"


@dataclass(frozen=True)
class Adapted:
    """``fn`` traced on ``args``/``kwargs`` computes what the user's function computes.

    ``returns_updates``: the arguments hold NNX graph nodes, and ``fn`` returns
    ``(user_output, updates)`` where ``updates`` maps an NNX argument's leaf path (``model``,
    ``optimizer``) to a nested dict of the Variables the call changed (new values); ``{}`` when
    it changed none. Otherwise ``fn`` returns the user's output as it is.
    ``fingerprint``: sha256 of the static data; ``""`` when there is none; when some static
    data has no stable fingerprint, ``unfingerprintable`` names it and the fingerprint is unique
    to this call (it never matches another run's).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    fingerprint: str = ""  # stable text of the static data closed over ("" when none)
    static_leaves: list[tuple[str, str]] = field(default_factory=list)
    logical_axes: dict[str, tuple[str | None, ...] | None] = field(default_factory=dict)
    unfingerprintable: Unfingerprintable | None = None
    returns_updates: bool = False

    def split_output(self, out: Any) -> tuple[Any, dict[str, Any]]:
        """(the user's output, the NNX updates) from what ``fn`` returned."""
        return (out[0], out[1]) if self.returns_updates else (out, {})


def adapt(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    names: Sequence[str] | None = None,
) -> Adapted:
    """``fn`` and its arguments as jax.jit traces them (see the module docstring)."""
    walk = _Walk()
    tops = top_names(len(args), names)
    with walk.split_context():
        pure_args = []
        arg_rbs = []
        for top, value in zip(tops, args, strict=True):
            pure, rb = walk.walk(value, top, False)
            pure_args.append(pure)
            arg_rbs.append(rb)
        pure_kwargs = {}
        kw_rbs = {}
        for name, value in kwargs.items():
            pure_kwargs[name], kw_rbs[name] = walk.walk(value, name, False)
    if all(isinstance(rb, _Keep) for rb in [*arg_rbs, *kw_rbs.values()]):
        adapted_fn = fn  # nothing to rebuild: the very function
    else:
        adapted_fn = _rebuilding(fn, arg_rbs, kw_rbs, walk.splits)
    fp, unfp = walk.fingerprint()
    return Adapted(
        fn=adapted_fn,
        args=tuple(pure_args),
        kwargs=pure_kwargs,
        fingerprint=fp,
        static_leaves=walk.static_leaves,
        logical_axes=walk.logical_axes,
        unfingerprintable=unfp,
        returns_updates=bool(walk.splits),
    )


def purify(tree: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``tree`` as adapt passes it (NNX graph nodes as their state dicts, shared Variables
    once; static leaves as None) and the function that rebuilds the objects from such a pure
    tree (with other leaves of the same structure: ShapeDtypeStructs, sharded arrays).

    For a derived argument's init: ``jax.eval_shape``/``jax.jit`` return the pure tree (they
    cannot return functions, and flattening an NNX Module as a pytree copies shared Variables),
    and the objects are rebuilt outside the trace.
    """
    walk = _Walk(listing=False)
    with walk.split_context():
        pure, rb = walk.walk(tree, "value", False)
    splits = walk.splits

    def rebuild(values: Any) -> Any:
        if not splits:
            return rb.rebuild(values, _Env(None, splits))
        from flax import nnx

        with nnx.merge_context() as ctx:
            return rb.rebuild(values, _Env(ctx, splits))

    return pure, rebuild


class _Keep:
    """The pure value is the user's value."""

    def rebuild(self, pure: Any, env: _Env) -> Any:
        return pure


@dataclass
class _Static:
    value: Any

    def rebuild(self, pure: Any, env: _Env) -> Any:
        return self.value


@dataclass
class _Node:
    """A pytree node: child i is ``pure[access[i]]``, put back with the one-level treedef."""

    treedef: Any
    access: list[Any]
    children: list[Any]

    def rebuild(self, pure: Any, env: _Env) -> Any:
        values = [
            rb.rebuild(pure[a], env) for a, rb in zip(self.access, self.children, strict=True)
        ]
        return self.treedef.unflatten(values)


@dataclass
class _Box:
    """A box around one value (a linen Partitioned, an NNX Variable): the pure form is the value."""

    treedef: Any
    child: Any

    def rebuild(self, pure: Any, env: _Env) -> Any:
        return self.treedef.unflatten([self.child.rebuild(pure, env)])


@dataclass
class _Graph:
    index: int

    def rebuild(self, pure: Any, env: _Env) -> Any:
        node = _nnx.merge(env.ctx, env.splits[self.index], pure)
        env.merged.append((self.index, node, pure))
        return node


@dataclass
class _Env:
    ctx: Any
    splits: list[_nnx.Split]
    merged: list[tuple[int, Any, Any]] = field(default_factory=list)


def _rebuilding(
    fn: Callable[..., Any],
    arg_rbs: list[Any],
    kw_rbs: dict[str, Any],
    splits: list[_nnx.Split],
) -> Callable[..., Any]:
    import contextlib

    def adapted(*pure_args: Any, **pure_kwargs: Any) -> Any:
        ctx_manager: Any = contextlib.nullcontext()
        if splits:
            from flax import nnx

            ctx_manager = nnx.merge_context()
        with ctx_manager as ctx:
            env = _Env(ctx, splits)
            args = [rb.rebuild(p, env) for rb, p in zip(arg_rbs, pure_args, strict=True)]
            # In the order they were split (jax.jit hands kwargs back sorted by name).
            kwargs = {k: rb.rebuild(pure_kwargs[k], env) for k, rb in kw_rbs.items()}
        out = _pure_output(fn(*args, **kwargs))
        if not splits:
            return out
        from flax import nnx

        updates: dict[str, Any] = {}
        with nnx.split_context() as split_ctx:  # shared Variables counted once, as before
            for index, node, before in env.merged:
                changed = _nnx.updates(split_ctx, node, before)
                if changed:
                    updates[splits[index].path] = changed
        return out, updates

    adapted.__name__ = getattr(fn, "__name__", "adapted")
    adapted.__qualname__ = getattr(fn, "__qualname__", adapted.__name__)
    adapted.__wrapped__ = fn  # type: ignore[attr-defined]
    return adapted


def _pure_output(out: Any) -> Any:
    """The output with registered classes that hold static data (a TrainState, an Equinox
    module) as Records of their traced leaves and static leaves as None: what jax.export
    serializes (eqx.filter_jit would hand the static leaves back; an AOT executable cannot)."""
    return _Walk(output=True).walk(out, "out", False)[0]


def _is_array(x: Any) -> bool:
    import jax
    import numpy as np

    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_number(x: Any) -> bool:
    import numpy as np

    return type(x) in (bool, int, float, complex) or isinstance(x, np.number | np.bool_)


def _is_literal_aux(aux: Any) -> bool:
    """Aux data jaxaot's export registration stores (a Python literal) and no function."""
    import ast

    if aux is None:
        return True
    text = repr(aux)
    try:
        return bool(ast.literal_eval(text) == aux)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


class _Walk:
    def __init__(self, output: bool = False, listing: bool = True) -> None:
        self.output = output  # walking the function's output: no graph split
        self.listing = listing and not output  # list static leaves and fingerprint them
        self.static_leaves: list[tuple[str, str]] = []
        self.fp_items: list[tuple[str, Any]] = []
        self.logical_axes: dict[str, tuple[str | None, ...] | None] = {}
        self.splits: list[_nnx.Split] = []
        self.unfp: Unfingerprintable | None = None
        self._ctx: Any = None

    def split_context(self) -> Any:
        import contextlib

        nnx = _nnx._nnx()
        if nnx is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def opened() -> Any:
            with nnx.split_context() as ctx:
                self._ctx = ctx
                yield
            self._ctx = None

        return opened()

    def add_fp(self, path: str, value: Any) -> None:
        if self.unfp is not None or not self.listing:
            return
        try:
            self.fp_items.append((path, fingerprint(value, path)))
        except NoFingerprint as exc:
            self.unfp = Unfingerprintable(exc.path, exc.why)

    def add_static(self, path: str, value: Any) -> None:
        if not self.listing:
            return
        self.static_leaves.append((path, _describe(value)))
        self.add_fp(path, value)

    def add_node_static(
        self, x: Any, path: str, node_type: type, aux: Any, children: list[str]
    ) -> None:
        """The static half of a registered class: a dataclass's non-pytree fields (a
        TrainState's ``apply_fn`` and ``tx``, an Equinox module's static fields) listed and
        fingerprinted by name; any other class's aux data as one entry. The aux data is
        fingerprinted whole in both cases (a class may keep more there than its fields)."""
        import dataclasses

        self.add_fp(path + "<node>", node_type)
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if f.name not in children and hasattr(x, f.name):
                    self.add_static(f"{path}/{f.name}", getattr(x, f.name))
        elif self.listing and not _is_literal_aux(aux):
            self.static_leaves.append((path + "<aux>", f"static data of {_describe(x)}"))
        self.add_fp(path + "<aux>", aux)

    def fingerprint(self) -> tuple[str, Unfingerprintable | None]:
        if self.unfp is not None:
            return f"unfingerprintable:{uuid.uuid4().hex}", self.unfp
        return (digest(self.fp_items) if self.fp_items else ""), None

    def traced(self, in_eqx: bool) -> Callable[[Any], bool]:
        return lambda x: _is_array(x) or (not in_eqx and _is_number(x))

    def walk(self, x: Any, path: str, in_eqx: bool) -> tuple[Any, Any]:
        """(pure value, rebuilder) of ``x`` at leaf path ``path``."""
        import jax

        if self.traced(in_eqx)(x):
            return x, _Keep()
        if x is None:
            return None, _Keep()
        if not self.output and _nnx.is_graph_node(x):
            sp = _nnx.split(self._ctx, x, path, self.traced(False))
            self.splits.append(sp)
            self.logical_axes.update(sp.axes)
            type_name = f"{type(x).__module__}.{type(x).__qualname__}"
            if self.listing:
                self.static_leaves.append((path, f"{type_name} graph (flax.nnx GraphDef)"))
            self.add_fp(path, sp.graphdef)
            for leaf_path, value in sp.statics:
                self.add_static(leaf_path, value)
            return sp.pure, _Graph(len(self.splits) - 1)
        treedef: Any
        kids, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # not a pytree node: static
            self.add_static(path, x)
            return None, _Static(x)
        node_type, aux = treedef.node_data()
        if _linen.is_box(x) or _nnx.is_variable(x):
            axes = _linen.box_axes(x) if _linen.is_box(x) else _nnx.variable_axes(x)
            if len(kids) == 1:
                pure, rb = self.walk(kids[0][1], path, in_eqx)
                if isinstance(rb, _Static):  # a box around static data: static as a whole
                    self._drop_under(path, self_too=True)
                    self.add_static(path, x)
                    return None, _Static(x)
                self.logical_axes[path] = axes
                self.add_fp(path + "<box>", [node_type, aux])
                return pure, _Box(treedef, rb)
        child_eqx = in_eqx or _eqx.is_module(x)
        accesses = [key_text(kp[0]) for kp, _ in kids]
        walked = [
            self.walk(child, f"{path}/{a}", child_eqx)
            for a, (_, child) in zip(accesses, kids, strict=True)
        ]
        builtin = node_type in (dict, list, tuple) or (
            issubclass(node_type, tuple) and hasattr(node_type, "_fields")
        )
        plain_aux = builtin or _is_literal_aux(aux)
        if plain_aux and all(isinstance(rb, _Keep) for _, rb in walked):
            if not builtin and aux is not None:
                self.add_fp(path + "<node>", [node_type, aux])
            return x, _Keep()
        if not _has_traced(walked):  # static as a whole: one entry, one fingerprint
            self._drop_under(path)
            self.add_static(path, x)
            return None, _Static(x)
        pures = [p for p, _ in walked]
        children = [rb for _, rb in walked]
        if builtin:
            if node_type is dict:
                keys = [kp[0].key for kp, _ in kids]
                return dict(zip(keys, pures, strict=True)), _Node(treedef, keys, children)
            pure_seq = node_type(pures) if node_type in (list, tuple) else node_type(*pures)
            return pure_seq, _Node(treedef, list(range(len(kids))), children)
        if aux is not None:
            self.add_node_static(x, path, node_type, aux, accesses)
        if all(key_text(kp[0]) == str(i) for i, (kp, _) in enumerate(kids)):
            return pures, _Node(treedef, list(range(len(kids))), children)
        if len(set(accesses)) != len(accesses):
            raise ArgSpecError(
                f"argument {path}: a {node_type.__qualname__} has two children with the same "
                f"name ({accesses}); expected distinct keys; give its fields distinct names"
            )
        from jaxaot.models.record import Record

        return Record(accesses, pures), _Node(treedef, accesses, children)

    def _drop_under(self, path: str, self_too: bool = False) -> None:
        """Forget the entries the children of ``path`` added: the subtree is listed once."""
        inside = (path + "/", path + "<")
        if self_too:
            self.static_leaves = [(p, d) for p, d in self.static_leaves if p != path]
            self.fp_items = [(p, f) for p, f in self.fp_items if p != path]
        self.static_leaves = [(p, d) for p, d in self.static_leaves if not p.startswith(inside)]
        self.fp_items = [(p, f) for p, f in self.fp_items if not p.startswith(inside)]
        here = self.unfp is not None and (self_too and self.unfp.path == path)
        if self.unfp is not None and (here or self.unfp.path.startswith(inside)):
            self.unfp = None  # fingerprinted again below, as one value


def _has_traced(walked: list[tuple[Any, Any]]) -> bool:
    import jax

    for pure, rb in walked:
        if isinstance(rb, _Static):
            continue
        if isinstance(rb, _Graph) or jax.tree_util.tree_leaves(pure):
            return True
    return False


def _describe(x: Any) -> str:
    """One line for the argument table; never a repr that names a memory address."""
    from jaxaot.models.fingerprint import _ADDRESS

    cls = type(x)
    qual = getattr(x, "__qualname__", None)
    mod = getattr(x, "__module__", None)
    if callable(x) and isinstance(qual, str) and isinstance(mod, str):
        return f"{cls.__name__} {mod}.{qual}"
    if isinstance(x, (str, bool, int, float, complex)) or x is None:
        text = repr(x)
        return f"{cls.__name__} {text if len(text) <= 60 else text[:57] + '...'}"
    text = repr(x)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if len(text) <= 60 and not _ADDRESS.search(text) and "\n" not in text:
        return f"{name} {text}"
    return name
