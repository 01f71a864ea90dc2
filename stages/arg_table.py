"""The argument table: every traced leaf jax.jit sees, with its size whole and per device.

stage_out writes it once it has the abstract arguments (``arguments.json``, ``arguments.txt``)
and logs one summary line before anything is lowered or compiled::

    [stage_out] arguments: params 7.5 B (14.0 GiB), tokens 512.0 KiB, targets 512.0 KiB,
    lr 4 B; total 14.0 GiB, per device 56.4 MiB over fsdp=32 x model=8

(``experiment=decoder_8b``). With several arguments it names each; a lone argument (a
TrainState) is named by its parts; the element count is given for parameter trees
(:data:`PARAMETER_NAMES`).

A leaf's sharding is the input sharding the run resolves from ``lower.in_shardings`` with a
mesh (:func:`input_shardings`, as the lower stage resolves it), else its own ``.sharding`` (a
ShapeDtypeStruct given with one, an orbax checkpoint's saved shardings). Per-device bytes use ``sharding.shard_shape(shape)``; without a mesh
a device holds the whole argument. Symbolic dimensions have no size: such a leaf counts as
"symbolic" and the totals say so.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import human_size, short_name
from jaxaot.config.tree_paths import SEP, leaf_paths, top_names

if TYPE_CHECKING:
    from jaxaot.config.mesh import MeshSpec
    from jaxaot.stages.contract import StageContext
    from jaxaot.stages.stage_out import StagedOut

log = logging.getLogger("jaxaot")

# arguments.json format history:
#   1 (2026-11-25): {format_version, mesh, arguments[{path, shape, dtype, sharding, by,
#                   elements, bytes, shard_shape, bytes_per_device}], subtrees[{name, leaves,
#                   elements, bytes, bytes_per_device, symbolic, children[...]}], total{...},
#                   static[{path, value}], shardings_note, summary}. Sizes are null where a
#                   dimension is symbolic; per-device ones where the shardings are not known.
FORMAT_VERSION = 1
JSON_NAME = "arguments.json"
TEXT_NAME = "arguments.txt"
# Top-level subtrees whose element count the summary gives ("params 7.5 B (13.9 GiB)"): the
# ones that hold a model's parameters under the names JAX libraries give them.
PARAMETER_NAMES = frozenset({"params", "param", "parameters", "weights", "variables", "model"})
_MAX_GROUPS = 6  # subtrees named in the summary line; the rest are counted together


@dataclass(frozen=True)
class Row:
    """One traced leaf. Sizes are None when a dimension is symbolic."""

    path: str
    shape: tuple[Any, ...]
    dtype: str
    sharding: str | None  # "P('fsdp', None)", "replicated", or None (no mesh / not known)
    elements: int | None
    bytes: int | None
    shard_shape: tuple[int, ...] | None
    bytes_per_device: int | None
    by: str | None = None  # the path pattern or logical-axis rule that gave the sharding

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": [d if isinstance(d, int) else str(d) for d in self.shape],
            "dtype": self.dtype,
            "sharding": self.sharding,
            "elements": self.elements,
            "bytes": self.bytes,
            "shard_shape": list(self.shard_shape) if self.shard_shape is not None else None,
            "bytes_per_device": self.bytes_per_device,
            "by": self.by,
        }


@dataclass(frozen=True)
class Total:
    """Sums over a group of rows; ``symbolic`` counts the leaves with no size."""

    name: str
    leaves: int
    elements: int
    bytes: int
    bytes_per_device: int | None  # None when the shardings are not known
    symbolic: int
    children: tuple[Total, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "leaves": self.leaves,
            "elements": self.elements,
            "bytes": self.bytes,
            "bytes_per_device": self.bytes_per_device,
            "symbolic": self.symbolic,
        }
        if self.children:
            out["children"] = [c.to_json() for c in self.children]
        return out


@dataclass(frozen=True)
class ArgTable:
    """The rows, the totals per top-level argument and overall, and the summary line."""

    rows: tuple[Row, ...]
    subtrees: tuple[Total, ...]
    total: Total
    mesh: dict[str, int] | None = None  # axis -> size, when the run has a mesh
    static: tuple[tuple[str, str], ...] = ()  # (path, short value) of non-traced arguments
    shardings_note: str = ""  # why the sharding columns are empty with a mesh
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "mesh": self.mesh,
            "arguments": [r.to_json() for r in self.rows],
            "subtrees": [t.to_json() for t in self.subtrees],
            "total": self.total.to_json(),
            "static": [{"path": p, "value": v} for p, v in self.static],
            "shardings_note": self.shardings_note or None,
            "summary": self.summary,
        }


# -- one leaf --------------------------------------------------------------------------------------
def _aval(leaf: Any) -> tuple[tuple[Any, ...], Any, bool]:
    """(shape, dtype, weak) of a traced leaf: a ShapeDtypeStruct, an array, a Python number."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), leaf.dtype, bool(getattr(leaf, "weak_type", False))
    import jax

    aval = jax.typeof(leaf)  # a Python scalar: traced as a weakly-typed 0-d array
    return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def _itemsize(dtype: Any) -> int:
    # Typed PRNG keys (key<fry>) report the bytes of their key data (8 for threefry).
    return int(dtype.itemsize)


def spec_text(sharding: Any) -> str | None:
    """A sharding as a JAX user writes it: ``P('fsdp', None)``, or ``replicated``."""
    if sharding is None:
        return None
    spec = getattr(sharding, "spec", None)
    if getattr(sharding, "is_fully_replicated", False) or (
        spec is not None and all(e is None for e in spec)
    ):
        return "replicated"
    return compat_jax.spec_text(spec) if spec is not None else str(sharding)


def _shard_shape(sharding: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``sharding.shard_shape(shape)``; for a dimension the mesh axes do not divide (JAX
    refuses it there, jax 0.10), the padded shard XLA would allocate: ceil(dim / devices)."""
    try:
        return tuple(sharding.shard_shape(shape))
    except ValueError:
        sizes = dict(sharding.mesh.shape)
        out = []
        for i, d in enumerate(shape):
            entry = sharding.spec[i] if i < len(sharding.spec) else None
            axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
            out.append(-(-d // math.prod(sizes[a] for a in axes)))
        return tuple(out)


def row(path: str, leaf: Any, sharding: Any = None, unknown: bool = False) -> Row:
    """The row of one leaf with ``sharding``, the input sharding resolved for it (what jax.jit
    gets as in_shardings, which wins), else the leaf's own. ``unknown``: the run has a mesh
    but its shardings were not resolved (no bytes per device then)."""
    shape, dtype, weak = _aval(leaf)
    if sharding is None:
        sharding = getattr(leaf, "sharding", None)
    dt = short_name(str(dtype)) + (" (weak)" if weak else "")
    if not all(isinstance(d, int) for d in shape):
        return Row(path, shape, dt, spec_text(sharding), None, None, None, None)
    elements = math.prod(shape)
    nbytes = elements * _itemsize(dtype)
    if sharding is None and unknown:
        return Row(path, shape, dt, None, elements, nbytes, None, None)
    local = _shard_shape(sharding, shape) if sharding is not None else shape
    per_device = math.prod(local) * _itemsize(dtype)
    return Row(path, shape, dt, spec_text(sharding), elements, nbytes, local, per_device)


# -- the table -------------------------------------------------------------------------------------
def _sum(name: str, rows: Sequence[Row], children: tuple[Total, ...] = ()) -> Total:
    # Per device is unknown when a sized leaf's is (shardings not resolved at stage_out).
    unknown = any(r.bytes is not None and r.bytes_per_device is None for r in rows)
    return Total(
        name=name,
        leaves=len(rows),
        elements=sum(r.elements or 0 for r in rows),
        bytes=sum(r.bytes or 0 for r in rows),
        bytes_per_device=None if unknown else sum(r.bytes_per_device or 0 for r in rows),
        symbolic=sum(r.bytes is None for r in rows),
        children=children,
    )


def _groups(rows: Sequence[Row], depth: int) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(SEP.join(r.path.split(SEP)[:depth]), []).append(r)
    return out


def _subtrees(rows: Sequence[Row]) -> tuple[Total, ...]:
    """Totals per top-level argument, each with the totals of its children."""
    out = []
    for name, members in _groups(rows, 1).items():
        kids = _groups(members, 2)
        children = () if list(kids) == [name] else tuple(_sum(k, v) for k, v in kids.items())
        out.append(_sum(name, members, children))
    return tuple(out)


@dataclass(frozen=True)
class _Held:
    """A sharding spread over a subtree (None, "not specified", is no pytree leaf to JAX)."""

    sharding: Any


def _per_leaf(sharding: Any, tree: Any, n: int) -> list[Any]:
    """One sharding per leaf of ``tree`` from a sharding, a prefix tree of them, or None."""
    import jax

    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return [sharding] * n

    def spread(s: Any, sub: Any) -> Any:  # one sharding stands for its whole subtree
        return jax.tree.map(lambda _leaf: _Held(s), sub)

    held = jax.tree.leaves(jax.tree.map(spread, sharding, tree, is_leaf=lambda x: x is None))
    if len(held) != n:
        raise ValueError(f"{len(held)} input shardings for {n} leaves")
    return [h.sharding for h in held]


def build(
    arguments: Iterable[tuple[str, Any]],
    shardings: dict[str, Any] | None = None,
    *,
    mesh: dict[str, int] | None = None,
    static: Sequence[tuple[str, str]] = (),
    shardings_note: str = "",
    sources: Mapping[str, str] | None = None,
) -> ArgTable:
    """The table of ``arguments``: (top-level name, abstract pytree) pairs, in call order.

    ``shardings`` maps a top-level name to its input sharding: one ``Sharding`` for the whole
    argument or a tree of them matching it (a pytree prefix, as jax.jit's in_shardings); a
    leaf without one keeps its own ``.sharding``, if any. ``sources``: leaf path -> the rule that
    gave its sharding."""

    rows: list[Row] = []
    for top, tree in arguments:
        leaves = leaf_paths(tree, top)
        shards = _per_leaf((shardings or {}).get(top), tree, len(leaves))
        unknown = bool(shardings_note)
        rows.extend(row(p, leaf, s, unknown) for (p, leaf), s in zip(leaves, shards, strict=True))
    if sources:
        rows = [replace(r, by=sources.get(r.path)) for r in rows]
    table = ArgTable(
        rows=tuple(rows),
        subtrees=_subtrees(rows),
        total=_sum("total", rows),
        mesh=dict(mesh) if mesh else None,
        static=tuple(static),
        shardings_note=shardings_note,
    )
    return replace(table, summary=summary_line(table))


# -- text --------------------------------------------------------------------------------------------
def human_number(n: int) -> str:
    """A parameter count: ``7.5 B``, ``350.2 M``, ``12.0 K``, ``42``."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


def _phrase(t: Total) -> str:
    last = t.name.split(SEP)[-1]
    if last in PARAMETER_NAMES and not t.symbolic:
        return f"{t.name} {human_number(t.elements)} ({_tail_size(t)})"
    return f"{t.name} {_tail_size(t)}"


def _tail_size(t: Total, per_device: bool = False) -> str:
    """A total's size, or ``symbolic`` when no leaf of it has one (``-``: not known)."""
    if t.symbolic == t.leaves and t.leaves:
        return "symbolic"
    n = t.bytes_per_device if per_device else t.bytes
    if n is None:
        return "-"
    text = human_size(n)
    return text + (" + symbolic" if t.symbolic else "")


def summary_line(table: ArgTable) -> str:
    """``params 7.5 B (13.9 GiB), opt_state 27.9 GiB, tokens 512 KiB; total 41.8 GiB, per
    device 0.9 GiB over fsdp=32 x model=8``: the top-level subtrees (the parts of a lone
    argument, such as a TrainState's), the total, and with a mesh the bytes per device."""
    groups = list(table.subtrees)
    if len(groups) == 1 and groups[0].children:
        groups = list(groups[0].children)
    shown = [_phrase(g) for g in groups[:_MAX_GROUPS]]
    rest = groups[_MAX_GROUPS:]
    if rest:
        more = Total(
            "",
            sum(g.leaves for g in rest),
            0,
            sum(g.bytes for g in rest),
            None,
            sum(g.symbolic for g in rest),
        )
        shown.append(f"{len(rest)} more {_tail_size(more)}")
    tail = [f"total {_tail_size(table.total)}"] if len(groups) > 1 else []
    if table.mesh:
        over = " x ".join(f"{a}={n}" for a, n in table.mesh.items())
        if table.shardings_note:
            tail.append(f"per device not known before lower ({table.shardings_note})")
        else:
            tail.append(f"per device {_tail_size(table.total, per_device=True)} over {over}")
    text = ", ".join(shown) or "no traced arguments"
    return text + ("; " + ", ".join(tail) if tail else "")


def _cell_size(n: int | None, symbolic: bool = True) -> str:
    return human_size(n) if n is not None else "symbolic" if symbolic else "-"


def _total_cells(label: str, t: Total) -> tuple[str, ...]:
    leaves = f"{t.leaves} leaf" if t.leaves == 1 else f"{t.leaves} leaves"
    elements = f"{human_number(t.elements)} element" + ("" if t.elements == 1 else "s")
    return (label, leaves, elements, "", _tail_size(t), _tail_size(t, per_device=True))


def to_text(table: ArgTable) -> str:
    """``arguments.txt``: the rows as aligned columns, the subtree totals, then the summary."""
    by = any(r.by for r in table.rows)  # a column for the rule, where rules decided
    head: tuple[str, ...] = ("path", "shape", "dtype", "sharding", "bytes", "per device")
    body: list[tuple[str, ...]] = [
        (
            r.path,
            "[" + ",".join(map(str, r.shape)) + "]",
            r.dtype,
            r.sharding or "-",
            _cell_size(r.bytes),
            _cell_size(r.bytes_per_device, symbolic=r.bytes is None),
            *([r.by or "-"] if by else []),
        )
        for r in table.rows
    ]
    body += [_total_cells(f"= {t.name}", t) + (("",) if by else ()) for t in table.subtrees]
    body.append(_total_cells("= total", table.total) + (("",) if by else ()))
    head += ("by",) if by else ()
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [head, *body]
    ]
    if table.mesh:
        lines.append("mesh: " + " x ".join(f"{a}={n}" for a, n in table.mesh.items()))
    if table.shardings_note:
        lines.append(f"shardings: {table.shardings_note}")
    lines += [f"static {path} = {value}" for path, value in table.static]
    lines.append(f"summary: {table.summary}")
    return "\n".join(lines) + "\n"


# -- the stage_out artifact ----------------------------------------------------------------------
def input_shardings(
    ctx: StageContext, staged: StagedOut, mesh: MeshSpec
) -> tuple[list[Any], dict[str, Any], dict[str, str]]:
    """The input sharding of each traced positional argument and of each traced keyword
    argument (by keyword), each a Sharding or a prefix tree of them, as the lowering gets them,
    and how each leaf's was decided (path -> rule, for path patterns and logical-axis rules):
    the per-replica program's own, else ``lower.in_shardings`` resolved as the lower stage
    resolves it (:func:`jaxaot.stages.jax_inputs.resolved_with_keywords`; keyword arguments named by
    keyword in the mapping form and with path patterns, replicated or their own sharding under
    the positional list)."""
    if "in_shardings" in staged.jit_options:  # stage_out.axis_env: the replica-split program
        return list(staged.jit_options["in_shardings"]), {}, {}
    from jaxaot.stages.jax_inputs import resolved_with_keywords  # the lower stage's own rule

    bound = staged.bound
    names = staged.signature.get("parameters")
    traced_kw = {k: v for k, v in staged.kwargs.items() if not bound.is_static(k)}
    found = resolved_with_keywords(
        ctx.facts.shardings, bound, mesh, staged.args, traced_kw, names, staged.logical_axes
    )
    sources = dict(found.resolution.sources) if found.resolution is not None else {}
    return list(found.positional), dict(zip(traced_kw, found.keyword, strict=True)), sources


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _static_leaves(staged: StagedOut) -> list[tuple[str, str]]:
    """(path, description) of the non-array data the adapters closed over."""
    adapted = getattr(getattr(staged, "derived", None), "adapted", None)
    return [(str(p), str(d)) for p, d in getattr(adapted, "static_leaves", None) or ()]


def record(ctx: StageContext, staged: StagedOut) -> ArgTable:
    """Write ``arguments.json`` and ``arguments.txt`` for the arguments stage_out traced, log the
    summary line and return the table. The shardings are resolved from the same inputs as the
    lower stage's (``staged``'s bound and abstract arguments, parameter names, logical axes)."""
    bound, args, kwargs = staged.bound, staged.args, staged.kwargs
    names = staged.signature.get("parameters")
    tops = top_names(len(args), names)
    traced = [(tops[i], a) for i, a in enumerate(args) if not bound.is_static(i)]
    traced += [(k, kwargs[k]) for k in sorted(kwargs) if not bound.is_static(k)]
    static = [(tops[i], _short(a)) for i, a in enumerate(args) if bound.is_static(i)]
    static += [(k, _short(v)) for k, v in kwargs.items() if bound.is_static(k)]
    static += _static_leaves(staged)
    mesh = ctx.facts.mesh
    sizes = mesh.sizes if mesh is not None else None
    table, note = None, ""
    if mesh is not None:
        try:
            specs, keyword, sources = input_shardings(ctx, staged, mesh)
            positional = [tops[i] for i in range(len(args)) if not bound.is_static(i)]
            shardings = dict(zip(positional, specs, strict=True)) | keyword
            table = build(traced, shardings, mesh=sizes, static=static, sources=sources)
        except Exception as exc:  # the lower stage resolves them again and reports the error
            why = " ".join(str(exc).split())[:120]
            note = f"lower.in_shardings not resolved at stage_out: {why}"
    if table is None:
        table = build(traced, mesh=sizes, static=static, shardings_note=note)
    ctx.write_json(JSON_NAME, table.to_json())
    ctx.write(TEXT_NAME, to_text(table))
    ctx.metrics.update(
        argument_bytes=table.total.bytes, argument_bytes_per_device=table.total.bytes_per_device
    )
    log.info("[%s] arguments: %s", ctx.stage, table.summary)
    return table


def resumed(ctx: StageContext, read: Callable[[str], bytes]) -> None:
    """A resumed stage_out's table: the checkpoint's files (its lower stage is resumed too, with
    the same shardings), and its summary line logged again. A checkpoint from before the
    table has none."""
    try:
        raw = read(JSON_NAME)
        text = read(TEXT_NAME)
    except (KeyError, FileNotFoundError):
        return
    ctx.write(JSON_NAME, raw)
    ctx.write(TEXT_NAME, text)
    log.info("[%s] arguments: %s", ctx.stage, json.loads(raw).get("summary", ""))


__all__ = [
    "FORMAT_VERSION",
    "JSON_NAME",
    "TEXT_NAME",
    "ArgTable",
    "Row",
    "Total",
    "build",
    "human_number",
    "input_shardings",
    "record",
    "resumed",
    "row",
    "spec_text",
    "summary_line",
    "to_text",
]
