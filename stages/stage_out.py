"""Stage 1, stage out: import the target, build abstract arguments, trace to a jaxpr.

Reads ``program`` and ``stage_out`` options; writes ``jaxpr.txt`` and ``signature.json``
(input and output avals with pytree paths, static values: what
``xla_computation(return_shape=True)`` used to give).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import (
    ArraySpec,
    BoundArgs,
    Literal,
    build,
    leaves,
    specs,
    to_static_value,
)
from jaxaot.config.sections import check_indices
from jaxaot.errors import ConfigError, JaxaotError, StageError, StoreError, one_line
from jaxaot.rundir.metrics import StageOutMetrics
from jaxaot.stages import arg_table
from jaxaot.stages.adapt import adapt
from jaxaot.stages.array_limits import check_traced
from jaxaot.stages.contract import CheckFacts, Entry, Presentation, RunFacts, StageContext, Upstream
from jaxaot.stages.jax_mesh import per_replica, stacked, unbound_axis_error
from jaxaot.stages.resolving import (
    abstract_value,
    class_resolver,
    resolve_target,
)
from jaxaot.stages.resolving import describe as _describe
from jaxaot.stages.resolving import type_str as _type_str
from jaxaot.util import memo
from jaxaot.util.reprs import tree_text

if TYPE_CHECKING:
    import jax


@dataclass(frozen=True)
class StageOutConfig:
    """The ``stage_out`` section (conf/stage_out/): how the program is traced."""

    static_argnums: list[int] = field(default_factory=list)
    static_argnames: list[str] = field(default_factory=list)
    # [[axis_name, size], ...]: trace as a per-replica program with these named axes.
    axis_env: list[Any] | None = None
    # Constraints on symbolic dimensions (``f32[b,512]``), as jax.export reads them: "b >= 16".
    shape_constraints: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DerivedArgs:
    """Arguments with derived nodes (``_init_``, ``_call_``, ``_ref_``, ``_key_``): what execute
    needs to make their values with the executable's shardings."""

    evaluation: Any  # jaxaot.stages.derived_values.Evaluation (abstract): values by config path
    user_fn: Callable[..., Any]  # the program as written (adapt is called on it again)
    names: list[str] | None
    adapted: Any  # jaxaot.stages.adapt.Adapted of the abstract arguments


@dataclass(frozen=True, repr=False)
class StagedOut:
    """A traced program and everything the lower stage needs to lower it again."""

    fn: Callable[..., Any] | None  # None when resumed: execute imports it only if it must
    bound: BoundArgs
    args: tuple[Any, ...]  # abstract (ShapeDtypeStruct) or concrete static/literal values
    kwargs: dict[str, Any]
    jit_options: dict[str, Any]
    traced: jax.stages.Traced | None  # None when resumed
    signature: dict[str, Any] = field(repr=False)
    # Per-replica programs (stage_out.axis_env): the replica mesh, and the independent
    # formulation execute.check=reference runs instead of ``fn``.
    replicas: dict[str, Any] | None = None
    reference_fn: Callable[..., Any] | None = None
    derived: DerivedArgs | None = None
    # The static data closed over (jaxaot.stages.adapt): its fingerprint, or why it has none.
    fingerprint: str = ""
    unfingerprintable: str | None = None
    # Library sharding metadata by leaf path (Adapted.logical_axes), for lower.logical_axis_rules.
    logical_axes: dict[str, Any] = field(default_factory=dict)
    # ``fn`` returns (the user's output, NNX updates) (Adapted.returns_updates): lower's
    # out_shardings apply to the user's output; each update takes its Variable's input sharding.
    returns_updates: bool = False

    def __repr__(self) -> str:
        fn = getattr(self.fn, "__qualname__", None) or "None (resumed: not imported)"
        return (
            f"StagedOut(fn={fn}, args={tree_text(self.args)}, kwargs={tree_text(self.kwargs)}, "
            f"traced={self.traced is not None})"
        )


def parameter_names(fn: Callable[..., Any]) -> list[str] | None:
    """Names of positional parameters, for mapping static_argnames onto positions."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in sig.parameters.values() if p.kind in kinds]


def symbolic_scope(constraints: Sequence[str]) -> Any:
    """jax.export's scope for a run's symbolic dimensions, with ``stage_out.shape_constraints``."""
    import jax

    try:
        scope = jax.export.SymbolicScope(list(constraints))
    except Exception as exc:
        raise ConfigError(
            f"stage_out.shape_constraints: JAX refused {list(constraints)}: "
            f"{' '.join(str(exc).split())[:200]}"
        ) from None
    return scope


def _as_args(
    bound: BoundArgs, resolve: Callable[[str, str], Any], constraints: Sequence[str] = ()
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Abstract values for the traced arguments; ``resolve`` (:func:`class_resolver` of the
    run's policy) builds the named pytree containers."""
    symbolic = any(
        isinstance(leaf, ArraySpec) and leaf.symbolic
        for _, tree in bound.traced_args()
        for _, leaf in leaves(tree)
    )
    scope = symbolic_scope(constraints) if symbolic else None

    def abstract(tree: Any, where: str) -> Any:
        return build(
            tree,
            lambda _p, leaf: abstract_value(leaf, scope),
            lambda name, key: resolve(name, where + key),
        )

    args = tuple(
        to_static_value(a, f"program.args[{i}]")
        if bound.is_static(i)
        else abstract(a, f"program.args[{i}]")
        for i, a in enumerate(bound.args)
    )
    kwargs = {
        k: to_static_value(v, f"program.kwargs.{k}")
        if bound.is_static(k)
        else abstract(v, f"program.kwargs.{k}")
        for k, v in bound.kwargs.items()
    }
    return args, kwargs


def _derive(
    ctx: StageContext[StageOutConfig],
    bound: BoundArgs,
    fn: Callable[..., Any],
    names: list[str] | None,
) -> DerivedArgs:
    """The abstract arguments of a config with derived nodes (``_init_`` through eval_shape:
    nothing allocated), adapted for jax.jit (jaxaot.stages.adapt)."""
    from jaxaot.stages import derived_values as derived

    symbolic = any(leaf.symbolic for _, tree in bound.traced_args() for _, leaf in specs(tree))
    scope = symbolic_scope(ctx.opts.shape_constraints) if symbolic else None
    evaluation = derived.abstract(bound, ctx.facts.policy, ctx.facts.seed, scope)
    args, kwargs = evaluation.arguments()
    return DerivedArgs(evaluation, fn, names, adapt(fn, args, kwargs, names))


def _record_static(ctx: StageContext, signature: dict[str, Any], adapted: Any) -> None:
    """The fingerprint of the static data the traced function closes over, in signature.json
    (a resumed run re-derives it and must find the same), or why there is none."""
    if adapted.fingerprint:
        signature["static_fingerprint"] = adapted.fingerprint
    if adapted.unfingerprintable is not None:
        signature["unfingerprintable"] = str(adapted.unfingerprintable)
        ctx.warn(
            f"static data with no stable fingerprint at {adapted.unfingerprintable}: this run "
            "works, but a later run cannot resume from its stage_out or lowering"
        )


def _check_static(signature: Mapping[str, Any], adapted: Any) -> None:
    """A resumed run binds the static data the checkpoint was traced with, or is refused."""
    why = signature.get("unfingerprintable")
    if why:
        raise StoreError(
            f"resume_from: the checkpoint's arguments hold static data with no stable "
            f"fingerprint ({why}), so what it was traced with cannot be checked; start_at=stage_out"
        )
    theirs, mine = signature.get("static_fingerprint", ""), adapted.fingerprint
    if adapted.unfingerprintable is not None or theirs != mine:
        now = str(adapted.unfingerprintable) if adapted.unfingerprintable else mine[:16] or "none"
        raise StoreError(
            "resume_from: the static data in the arguments (graph definitions, static fields, "
            f"optimizer objects) differs from what the checkpoint was traced with (fingerprint "
            f"{theirs[:16] or 'none'}, here {now}); start_at=stage_out"
        )


def _typed_shardings(
    sh: Any,
    bound: BoundArgs,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: Any,
    names: Sequence[str] | None = None,
    logical_axes: Any = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """With explicit mesh axes the input shardings are part of the argument types: each traced
    ShapeDtypeStruct, positional or keyword, carries its ``lower.in_shardings`` entry, resolved
    as the lower stage resolves it (path patterns and logical-axis rules on ``args``, named by
    ``names``; keyword arguments by keyword)."""
    from jaxaot.stages.jax_inputs import carrying, resolved_with_keywords

    traced_kw = {k: v for k, v in kwargs.items() if not bound.is_static(k)}
    found = resolved_with_keywords(sh, bound, mesh, args, traced_kw, names, logical_axes)
    by_kw = dict(zip(traced_kw, found.keyword, strict=True))
    return carrying(bound, found.args, {**kwargs, **found.kwargs}, found.positional, by_kw)


def _dims(shape: Any) -> list[int | str]:
    """A shape as JSON: symbolic dimensions (shape polymorphism) by their text."""
    return [d if isinstance(d, int) else str(d) for d in shape]


def _traced_as(
    exc: BaseException,
    target: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    message: str | None = None,
) -> str:
    """The error of a failed trace (``message``, else the exception's own), with the call it
    was traced as (which arguments went where)."""
    parts = [f"args[{i}]={_describe(a)}" for i, a in enumerate(args)]
    parts += [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    call = ", ".join(parts)
    if len(call) > 160:
        call = call[:159] + "…"
    return f"{message or one_line(exc)} (while tracing {target}({call}))"


# JAX's errors for a traced value used where Python needs a concrete one (range, if, int()).
_CONCRETE_ERRORS = (
    "TracerIntegerConversionError",
    "TracerBoolConversionError",
    "ConcretizationTypeError",
)


def _first_sentence(text: str) -> str:
    """The first sentence of JAX's error text (it runs on over several, with a link)."""
    text = " ".join(text.split())
    # "... with shape int32[] The error occurred while tracing ...": JAX's first sentence
    # may lack its full stop.
    cuts = [i for i in (text.find(". "), text.find(" The error occurred")) if i >= 0]
    return text[: min(cuts)].rstrip(".") if cuts else text


def _static_hint(
    exc: BaseException, bound: BoundArgs, names: Sequence[str] | None, opts: StageOutConfig
) -> tuple[str, str] | None:
    """(JAX's error in one sentence, a hint) when a trace needed a concrete value and a
    traced argument is a Python literal (``3``, ``true``): most likely one the function uses
    in Python, which must be static. None otherwise."""
    if type(exc).__name__ not in _CONCRETE_ERRORS:
        return None
    positions = [
        i for i, a in enumerate(bound.args) if not bound.is_static(i) and isinstance(a, Literal)
    ]
    keywords = [
        k for k, v in bound.kwargs.items() if not bound.is_static(k) and isinstance(v, Literal)
    ]
    # JAX names the argument the value came from: "depends on the value of the argument n".
    named = re.search(r"value of the argument (\w+)", str(exc))
    if named is not None:
        name = named.group(1)
        at = [i for i in positions if names is not None and i < len(names) and names[i] == name]
        if at or name in keywords:
            positions, keywords = at, [k for k in keywords if k == name]
    if not positions and not keywords:
        return None
    said = [f"args[{i}] is the literal {bound.args[i].value!r}" for i in positions]
    said += [f"kwargs.{k} is the literal {bound.kwargs[k].value!r}" for k in keywords]
    fixes = []
    if positions:
        nums = sorted({*opts.static_argnums, *positions})
        fixes.append(f"stage_out.static_argnums=[{','.join(map(str, nums))}]")
    if keywords:
        kw = sorted({*opts.static_argnames, *keywords})
        fixes.append(f"stage_out.static_argnames=[{','.join(kw)}]")
    hint = (
        f"hint: {', '.join(said)}; a value the function uses in Python (range, if, shapes) "
        f"must be static: {' '.join(fixes)}"
    )
    return f"{type(exc).__name__}: {_first_sentence(str(exc))}", hint


def signature_of(traced: Any, bound: BoundArgs) -> dict[str, Any]:
    """Inputs and outputs with pytree paths, shapes and dtypes; static values by position."""
    import jax

    in_avals = list(traced.jaxpr.in_avals)
    arg_infos = jax.tree_util.tree_flatten_with_path(traced.args_info)[0]
    # args_info is (args, kwargs) without the static arguments: name each input by its position
    # in program.args (as the "static" entries below do), not by its index among traced ones.
    traced_positions = [i for i in range(len(bound.args)) if not bound.is_static(i)]

    def arg_path(path: tuple[Any, ...]) -> tuple[str, bool]:
        """(path, donated): donation is a lower option, so the trace here does not know it."""
        head, first, rest = path[0], path[1], jax.tree_util.keystr(tuple(path[2:]))
        if getattr(head, "idx", 0) == 0:
            pos = traced_positions[first.idx]
            return f"args[{pos}]{rest}", pos in bound.donate_argnums
        name = getattr(first, "key", None)
        return f"kwargs{jax.tree_util.keystr((first,))}{rest}", name in bound.donate_argnames

    inputs = []
    for (path, info), aval in zip(arg_infos, in_avals, strict=False):
        where, donated = arg_path(path)
        inputs.append(
            {
                "path": where,
                "type": _type_str(tuple(aval.shape), aval.dtype),
                "shape": _dims(aval.shape),
                "dtype": str(aval.dtype),
                "weak_type": bool(getattr(aval, "weak_type", False)),
                "donated": donated or bool(getattr(info, "donated", False)),
            }
        )
    outputs = [
        {
            "path": jax.tree_util.keystr(path),
            "type": _type_str(tuple(o.shape), o.dtype),
            "shape": _dims(o.shape),
            "dtype": str(o.dtype),
        }
        for path, o in jax.tree_util.tree_flatten_with_path(traced.out_info)[0]
    ]
    static = [
        {"path": f"args[{i}]", "value": to_static_value(bound.args[i], f"program.args[{i}]")}
        for i in bound.static_argnums
        if i < len(bound.args)
    ] + [
        {"path": f"kwargs[{k!r}]", "value": to_static_value(v, f"program.kwargs.{k}")}
        for k, v in bound.kwargs.items()
        if bound.is_static(k)
    ]
    return {
        "inputs": inputs,
        "outputs": outputs,
        "static": static,
        "in_tree": str(traced.in_tree),
        "out_tree": str(compat_jax.traced_out_tree(traced)),
    }


def _jit_options(bound: BoundArgs) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if bound.static_argnums:
        opts["static_argnums"] = bound.static_argnums
    names = tuple(n for n in bound.static_argnames if n in bound.kwargs)
    if names:
        opts["static_argnames"] = names
    return opts


def resumed(ctx: StageContext[StageOutConfig], read: Callable[[str], bytes]) -> StagedOut:
    """The record of a checkpointed stage_out, without importing the program."""
    facts = ctx.facts
    bound = facts.bound
    for name in ("jaxpr.txt", "signature.json"):
        ctx.write(name, read(name))
    arg_table.resumed(ctx, read)  # arguments.json/.txt, when the checkpoint has them
    signature = json.loads(ctx.artifacts["signature.json"].path.read_bytes())
    if signature.get("parameters") is not None:  # static/donated options through the signature
        bound = bound.through(signature["parameters"])
    resolve = class_resolver(facts.policy)
    mesh = facts.mesh
    if _uses_derived(bound):  # re-derived by eval_shape; the static data must be the same
        if signature.get("unfingerprintable"):
            _check_static(signature, None)
        user_fn = resolve_target(facts.target, policy=facts.policy)
        made = _derive(ctx, bound, user_fn, signature.get("parameters"))
        _check_static(signature, made.adapted)
        return StagedOut(
            fn=made.adapted.fn,
            bound=bound,
            args=made.adapted.args,
            kwargs=made.adapted.kwargs,
            jit_options=_jit_options(bound),
            traced=None,
            signature=signature,
            derived=made,
            fingerprint=made.adapted.fingerprint,
            logical_axes=dict(made.adapted.logical_axes),
            returns_updates=made.adapted.returns_updates,
        )
    if mesh is not None and mesh.per_replica:  # the global program's arguments, as run() made
        bound = stacked(bound, mesh.size)
        return StagedOut(
            fn=None,
            bound=bound,
            args=_as_args(bound, resolve)[0],
            kwargs={},
            jit_options={k: v for k, v in _jit_options(bound).items() if k == "static_argnums"},
            traced=None,
            signature=signature,
            replicas=mesh.to_json(),
        )
    args, kwargs = _as_args(bound, resolve, ctx.opts.shape_constraints)
    return StagedOut(
        fn=None,
        bound=bound,
        args=args,
        kwargs=kwargs,
        jit_options=_jit_options(bound),
        traced=None,
        signature=signature,
    )


def run(ctx: StageContext[StageOutConfig], upstream: None = None) -> StagedOut:
    import jax

    facts = ctx.facts
    fn = resolve_target(facts.target, policy=facts.policy)
    names = parameter_names(fn)
    bound = facts.bound.through(names)  # static/donated options through the signature
    resolve = class_resolver(facts.policy)
    jit_options = _jit_options(bound)
    mesh = facts.mesh
    env = mesh if mesh is not None and mesh.per_replica else None
    made: DerivedArgs | None = None
    if _uses_derived(bound):
        if env is not None:
            raise ConfigError(
                "stage_out.axis_env: derived arguments (_init_, _call_, _ref_, _key_) are not "
                "supported in a per-replica program; expected plain array specs"
            )
        made = _derive(ctx, bound, fn, names)
        adapted = made.adapted
        _check_derived_fit(facts, made)
    else:
        args, kwargs = _as_args(bound, resolve, ctx.opts.shape_constraints)
        adapted = adapt(fn, args, kwargs, names)
    # The traced function and arguments: positions and keyword names are the program's.
    fn, args, kwargs = adapted.fn, adapted.args, adapted.kwargs
    mesh_context: Any = contextlib.nullcontext()
    if mesh is not None and env is None:
        from jaxaot.stages.jax_mesh import abstract_mesh, has_arrays, tracing_on

        if facts.mesh_context:
            # The program sees the configured mesh while it is traced: get_abstract_mesh, bare
            # PartitionSpecs, reshard and shard_map without a mesh argument. With
            # mesh.context=false it does not (a program that builds its own mesh), as
            # jax.jit(f, in_shardings=NamedSharding(mesh, spec)) without jax.set_mesh.
            unplaced = not has_arrays(args, kwargs)
            mesh_context = tracing_on(abstract_mesh(mesh), unplaced=unplaced)
        if "explicit" in mesh.axis_types:
            args, kwargs = _typed_shardings(
                facts.shardings, bound, args, kwargs, mesh, names, adapted.logical_axes
            )
    reference_fn = None
    if env is not None:
        # Keyword arguments are all static here (jaxaot.config.mesh refuses traced ones).
        rep = per_replica(fn, env, bound, kwargs)
        fn, bound, reference_fn, jit_options = rep.fn, rep.bound, rep.reference, rep.jit_options
        args, kwargs = _as_args(bound, resolve)[0], {}
    traced_fn = fn
    if mesh is not None and env is None:
        from jaxaot.config.mesh import logical_rules
        from jaxaot.config.path_shardings import under_flax_rules

        # flax's own logical constraints see lower.logical_axis_rules, as the lower stage
        # traces the program: the jaxpr holds the constraints the lowering has.
        traced_fn = under_flax_rules(fn, logical_rules(facts.shardings, mesh))
    try:
        with mesh_context:
            traced = jax.jit(traced_fn, **jit_options).trace(*args, **kwargs)
    except JaxaotError:
        raise
    except Exception as exc:  # the program's own error: say what it was traced with
        err = unbound_axis_error(exc, mesh) if isinstance(exc, NameError) else None
        if err is not None:
            raise err from None
        from jaxaot.targets.cuda import explain_missing_library

        missing = explain_missing_library(exc)  # a cuDNN-only kernel on a host without cuDNN
        if missing is not None:
            raise StageError("stage_out", missing) from None
        static = _static_hint(exc, bound, names, ctx.opts)
        said = _traced_as(exc, facts.target, args, kwargs, static[0] if static else None)
        if static is not None:
            said += f"; {static[1]}"
        if mesh is not None and env is None and "context mesh" in str(exc):
            said += (
                "; mesh.context=true traces the program with the mesh in context: expected "
                "mesh.context=false for a program that builds its own mesh"
                if facts.mesh_context
                else "; mesh.context=false traces the program without the mesh in context: "
                "expected mesh.context=true for a program that uses the context mesh"
            )
        raise StageError("stage_out", said) from exc
    # An array XLA cannot size aborts the process at compile: refused here, in one line.
    memo.derived(traced.jaxpr, "sizes", lambda: check_traced(traced.jaxpr, bound, facts.target))
    jaxpr_text = memo.derived(traced.jaxpr, "text", lambda: str(traced.jaxpr))  # JAX caches traces
    signature = signature_of(traced, bound)
    signature["parameters"] = names
    _record_static(ctx, signature, adapted)
    if made is not None:
        ctx.metrics["derived"] = len(made.evaluation.calls)  # _init_ nodes evaluated
    if env is not None:
        signature["axis_env"] = {
            "axes": [[a, n] for a, n in zip(env.axes, env.shape, strict=True)],
            "replicas": env.size,
            "layout": "arrays carry a leading replica axis (row-major over the axes)",
        }
        ctx.metrics["replicas"] = env.size
    ctx.write("jaxpr.txt", jaxpr_text + "\n")
    ctx.write_json("signature.json", signature)
    ctx.metrics.update(
        inputs=len(signature["inputs"]),
        outputs=len(signature["outputs"]),
        static=len(signature["static"]),
        eqns=len(traced.jaxpr.jaxpr.eqns),
    )
    staged = StagedOut(
        fn=fn,
        bound=bound,
        args=args,
        kwargs=kwargs,
        jit_options=jit_options,
        traced=traced,
        signature=signature,
        replicas=env.to_json() if env is not None else None,
        reference_fn=reference_fn,
        derived=made,
        fingerprint=adapted.fingerprint,
        unfingerprintable=str(adapted.unfingerprintable) if adapted.unfingerprintable else None,
        logical_axes=dict(adapted.logical_axes),
        returns_updates=adapted.returns_updates,
    )
    # arguments.json/.txt and the summary line, with each static argument's value: the traced
    # arguments hold None where the adapters closed a value over (a str, a tuple of them).
    arg_table.record(ctx, _with_static_values(staged))
    return staged


def _with_static_values(staged: StagedOut) -> StagedOut:
    """``staged`` with each static argument's value as signature.json records it."""
    static = {e["path"]: e["value"] for e in staged.signature["static"]}
    args = tuple(static.get(f"args[{i}]", a) for i, a in enumerate(staged.args))
    kwargs = {k: static.get(f"kwargs[{k!r}]", v) for k, v in staged.kwargs.items()}
    return replace(staged, args=args, kwargs=kwargs)


def _uses_derived(bound: BoundArgs) -> bool:
    from jaxaot.config.derived import uses_derived

    return uses_derived(bound)


def _check_derived_fit(facts: RunFacts, made: DerivedArgs) -> None:
    """The derived values execute will make must fit in memory: known only now (eval_shape)."""
    from jaxaot.stages.derived_jit import check_fit

    if facts.builds_inputs:
        check_fit(made.evaluation.derived_values(), facts.platform)


def check(opts: StageOutConfig, facts: CheckFacts) -> None:
    """stage_out's options, before JAX (the argument specs are bound by the engine)."""
    check_indices("stage_out.static_argnums", opts.static_argnums)


def summarize(m: StageOutMetrics) -> str:
    """The summary line: inputs, outputs, static arguments, equations."""

    def count(n: int | None) -> int:
        return 0 if n is None else n

    text = (
        f"{count(m.inputs)} in, {count(m.outputs)} out, {count(m.static)} static; "
        f"{count(m.eqns)} eqns"
    )
    return text + (f"; {m.replicas} replicas" if m.replicas else "")


class StageOutStage:
    """Stage 1: a Stage, Loadable (a checkpoint's signature, traced again here)."""

    name: str = "stage_out"
    Options: type[StageOutConfig] = StageOutConfig
    Record: type[StagedOut] = StagedOut
    inputs: tuple[str, ...] = ()
    live_inputs: tuple[str, ...] = ()
    sections: tuple[str, ...] = (
        "program",
        "stage_out",
        "jax",
    )  # JAX's config changes what is traced
    # arguments.json/.txt: the argument table (stages/arg_table.py), read back on resume.
    artifacts: tuple[str, ...] = (
        "jaxpr.txt",
        "signature.json",
        arg_table.JSON_NAME,
        arg_table.TEXT_NAME,
    )
    show: Presentation[StageOutMetrics] = Presentation(
        verb="tracing",
        noun="traced program",
        figures=StageOutMetrics.from_metrics,
        summarize=summarize,
    )
    again: str = "computed again"
    recomputed_differs: Mapping[str, str] = MappingProxyType(
        {
            "jaxpr.txt": "the program traces to a different jaxpr than in the checkpoint (code changed?)"
        }
    )

    check = staticmethod(check)

    def run(self, ctx: StageContext[StageOutConfig], up: Upstream) -> StagedOut:
        return run(ctx)

    def load(self, ctx: StageContext[StageOutConfig], up: Upstream, entry: Entry) -> StagedOut:
        return resumed(ctx, entry.read)


STAGE_OUT = StageOutStage()


__all__ = [
    "STAGE_OUT",
    "DerivedArgs",
    "StagedOut",
    "abstract_value",
    "parameter_names",
    "resolve_target",
    "resumed",
    "run",
]
