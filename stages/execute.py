"""Stage 4, execute: run the executable on real inputs, time it, check it, save outputs.

Reads ``execute`` options; writes ``outputs.npz`` (+ ``outputs.json`` with each output's pytree
path, dtype, shape and whether it is finite) and ``timings.json`` (min/median/mean/stddev per
call, achieved FLOP/s and bytes/s from the compile stage's cost analysis). ``check=reference``
runs the program through plain ``jax.jit`` on one device (a per-replica program through nested
``jax.vmap`` over its named axes) on the same inputs and fails the run when the results differ
by more than the tolerance.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.config.argspec import check_inputs_fit
from jaxaot.errors import BackendError, CheckError, ConfigError, InputTypeError, JaxaotError
from jaxaot.rundir.metrics import ExecuteMetrics
from jaxaot.stages import profile, roofline
from jaxaot.stages.compile import Compiled
from jaxaot.stages.contract import CheckFacts, Presentation, RunFacts, StageContext, Upstream
from jaxaot.stages.inputs import spec_inputs, user_inputs
from jaxaot.stages.jax_mesh import replica_reference
from jaxaot.stages.stage_out import StagedOut
from jaxaot.util.humanize import human_bytes, human_count, human_seconds
from jaxaot.util.reprs import tree_text

if TYPE_CHECKING:
    import numpy as np
    from jaxaot.config.mesh import MeshSpec

CHECKS: tuple[str, ...] = ("none", "reference")  # execute.check


@dataclass(frozen=True)
class ExecuteConfig:
    """The ``execute`` section (conf/execute/): inputs, timing, the reference check."""

    seed: int = 0
    inputs: Any = None
    warmup: int = 1
    repeats: int = 5
    check: str = "none"
    rtol: float | None = None
    atol: float | None = None
    save_outputs: bool = True
    # A jax.profiler trace of the timed calls into execute/profile/, per-op time in
    # execute/profile.json.
    profile: bool = False
    # This run against the device's roofline (peaks calibrated here) in execute/roofline.json.
    roofline: bool = False


# Default (rtol, atol) by the output's dtype when execute.rtol/atol are null.
_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-9, 1e-12),
    "complex128": (1e-9, 1e-12),
    "float32": (1e-4, 1e-5),
    "complex64": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


# Dtypes narrower than a byte (see _put).
_SUB_BYTE = frozenset({"int2", "int4", "uint2", "uint4", "float4_e2m1fn"})


@dataclass(frozen=True, repr=False)
class Executed:
    outputs: Any  # pytree of host arrays
    timings: dict[str, Any]
    check: dict[str, Any] | None

    def __repr__(self) -> str:
        t = self.timings
        median = t.get("median_s")
        timed = f"median {human_seconds(median)} over {t.get('calls')} calls" if median else ""
        check = f", check={'ok' if self.check.get('ok') else 'failed'}" if self.check else ""
        return f"Executed(outputs={tree_text(self.outputs)}, {timed}{check})"


def _place(
    compiled: Any, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """Put host inputs on the executable's devices with its input shardings."""
    import jax

    try:
        arg_sh, kw_sh = input_targets(compiled)
        return (
            [_put(a, s) for a, s in zip(args, arg_sh, strict=True)],
            {k: _put(v, kw_sh[k]) for k, v in kwargs.items()},
        )
    except (ValueError, KeyError, TypeError):
        # Structure mismatch: leave the values as they are and let the call report it.
        return [jax.tree_util.tree_map(_as_device, a) for a in args], dict(kwargs)


def _fresh(tree: Any) -> Any:
    """A copy of the JAX arrays in ``tree`` (a donated call consumes them; NumPy leaves are
    put on the device afresh anyway)."""
    import jax

    return jax.tree_util.tree_map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)


def _as_device(x: Any) -> Any:
    import jax
    import numpy as np

    return jax.device_put(x) if isinstance(x, np.ndarray) else x


def input_targets(compiled: Any) -> Any:
    """Where each input goes: ``compiled.input_formats`` (sharding with its memory kind, and
    layout) where the executable gives them, else its ``input_shardings``."""
    try:
        return compiled.input_formats
    except Exception:  # an executable (backend) that cannot say its layouts
        return compiled.input_shardings


def _relaid(x: Any, fmt: Any) -> Any:
    """``x`` in the layout of ``fmt`` (a Format): moved only when its own layout differs (a
    compiled ``auto`` or major-to-minor layout that is not the device's default)."""
    import jax

    layout_class = compat_jax.layout_class()
    layout = compat_jax.format_layout(fmt)
    if not isinstance(layout, layout_class) or not isinstance(x, jax.Array):
        return x
    own = compat_jax.format_layout(getattr(x, "format", None))
    if isinstance(own, layout_class):
        mine, theirs = compat_jax.layout_fields(own), compat_jax.layout_fields(layout)
        if (
            mine["major_to_minor"] == theirs["major_to_minor"]
            # no tiling: None from a user, () from XLA
            and (mine["tiling"] or ()) == (theirs["tiling"] or ())
            and mine["sub_byte_element_size_in_bits"] == theirs["sub_byte_element_size_in_bits"]
        ):
            return x
    return jax.device_put(x, fmt)


def _put(value: Any, sharding: Any) -> Any:
    import jax
    import numpy as np
    from jax.experimental.layout import Format

    def put(x: Any, s: Any) -> Any:
        fmt = s if isinstance(s, Format) else None
        if fmt is not None:
            s = fmt.sharding
        if isinstance(x, jax.Array) and isinstance(s, jax.sharding.Sharding):
            # A value made on other devices (an _init_ whose leaves jit placed): where the
            # executable takes it; an executable refuses a committed array sharded otherwise
            # (in another memory kind too).
            same = x.sharding.is_equivalent_to(s, x.ndim) and x.sharding.memory_kind == (
                s.memory_kind
            )
            return _relaid(x if same else jax.device_put(x, s), fmt)
        if isinstance(x, np.ndarray) and s is not None:
            if tuple(x.shape) != tuple(getattr(s, "shape", x.shape) or x.shape):
                return jax.device_put(x)
            if x.dtype.name in _SUB_BYTE:
                # jax 0.10: device_put(x, sharding) of a sub-byte array gives an unpacked layout
                # that the executable rejects ("layouts that disagree"), on one device or a mesh
                # (so does device_put to the executable's input format); the executable's own
                # transfer of the host array is packed, so it is left to the call.
                return x
            return _relaid(jax.device_put(x, s), fmt)
        return x

    try:
        return jax.tree_util.tree_map(put, value, sharding)
    except (ValueError, TypeError):
        return jax.tree_util.tree_map(_as_device, value)


def _type_mismatch(exc: Exception) -> InputTypeError:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return InputTypeError("execute: " + " ".join(lines))


def _stats(samples: list[float]) -> dict[str, float]:
    return {
        "min_s": min(samples),
        "median_s": statistics.median(samples),
        "mean_s": statistics.fmean(samples),
        "stddev_s": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "max_s": max(samples),
    }


def _host(tree: Any) -> Any:
    import jax
    import numpy as np

    return jax.tree_util.tree_map(np.asarray, tree)


def _all_finite(arr: np.ndarray) -> bool:
    import numpy as np

    if arr.dtype.kind in "fc":
        return bool(np.isfinite(arr).all())
    if arr.dtype.kind == "V":  # ml_dtypes (bfloat16, float8_*, int4, ...): check as float32
        return bool(np.isfinite(arr.astype(np.float32)).all())
    return True


def _is_numpy_dtype(dtype: np.dtype[Any]) -> bool:
    """A dtype NumPy itself defines (``.npz`` keeps it); ml_dtypes' (bfloat16, float8_*, int4,
    ...) are not, whatever their kind (float8_e5m2 says 'f', with a descriptor '<f1' that
    ``np.load`` refuses)."""

    return dtype.type.__module__ == "numpy" and dtype.kind in "biufc"


# The summary lists at most this many outputs (outputs.json has them all).
SHOWN_OUTPUTS = 8
# Outputs with at most this many elements have their values in outputs.json and the summary.
SHOWN_ELEMENTS = 8


def _shown_value(arr: np.ndarray) -> Any:
    """A small output's values as JSON-ready Python (nan/inf as strings), else None."""
    import numpy as np

    if arr.size > SHOWN_ELEMENTS:
        return None
    host = arr if arr.dtype.kind in "biufc" else arr.astype(np.float32)  # ml_dtypes -> float
    if host.dtype.kind == "c":
        return np.vectorize(lambda z: str(complex(z)), otypes=[object])(host).tolist()
    if host.dtype.kind == "f":
        return np.vectorize(
            lambda x: float(x) if np.isfinite(x) else str(float(x)), otypes=[object]
        )(host).tolist()
    return host.tolist()


def _savez(ctx: StageContext, outputs: Any) -> list[dict[str, Any]]:
    """``outputs.npz`` and ``outputs.json`` (the on-disk format):

    - ``out<i>``: output leaf ``i`` (pytree order), as NumPy numbers. A leaf of an ml_dtypes
      type is stored converted to float32 (exact: every such type is a subset of float32, NaN
      payloads aside), readable with plain ``np.load``;
    - ``outputs.bits.npz`` (only when there are such leaves): ``out<i>``, their very bits as
      unsigned integers of the dtype's width (``view``), so that :func:`load_outputs` gives
      back the original array bit for bit;
    - ``outputs.json``: per leaf ``key``, pytree ``path``, ``dtype`` (the original name),
      ``stored_dtype`` (of ``out<i>``), ``bits`` (true when ``outputs.bits.npz`` holds it),
      ``shape``, ``finite``.
    """
    import jax
    import numpy as np

    arrays: dict[str, Any] = {}
    bits: dict[str, Any] = {}
    described: list[dict[str, Any]] = []
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(outputs)[0]):
        arr = np.asarray(leaf)
        native = _is_numpy_dtype(arr.dtype)
        stored = arr if native else arr.astype(np.float32)
        arrays[f"out{i}"] = stored
        if not native:
            bits[f"out{i}"] = arr.view(f"u{arr.dtype.itemsize}")
        described.append(
            {
                "key": f"out{i}",
                "path": jax.tree_util.keystr(path),
                "dtype": str(arr.dtype),
                "stored_dtype": str(stored.dtype),
                "bits": not native,
                "shape": list(arr.shape),
                "finite": _all_finite(arr),
            }
        )
        value = _shown_value(arr)
        if value is not None:
            described[-1]["value"] = value
    if ctx.opts.save_outputs:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        ctx.write("outputs.npz", buf.getvalue())
        if bits:
            buf = io.BytesIO()
            np.savez(buf, **bits)
            ctx.write("outputs.bits.npz", buf.getvalue())
        ctx.write_json("outputs.json", described)
    return described


def load_outputs(execute_dir: str | Path) -> dict[str, np.ndarray]:
    """A run's saved outputs by pytree path, each with its original dtype, bit for bit
    (``<run>/execute``: outputs.npz + outputs.json, see :func:`_savez`)."""
    import numpy as np
    from jaxaot.stages.inputs import np_dtype

    folder = Path(execute_dir)
    described = json.loads((folder / "outputs.json").read_text())
    out: dict[str, np.ndarray] = {}
    raw: dict[str, np.ndarray] = {}
    if any(d.get("bits") for d in described):
        with np.load(folder / "outputs.bits.npz", allow_pickle=False) as z:
            raw = {k: z[k] for k in z.files}
    with np.load(folder / "outputs.npz", allow_pickle=False) as z:
        for d in described:
            key = d["key"]
            out[d["path"]] = raw[key].view(np_dtype(d["dtype"])) if d.get("bits") else z[key]
    return out


def _reference(
    ctx: StageContext, staged: StagedOut, args: list[Any], kwargs: dict[str, Any]
) -> Any:
    import jax
    from jaxaot.stages.resolving import resolve_target

    facts = ctx.facts
    fn = staged.fn if staged.fn is not None else resolve_target(facts.target, policy=facts.policy)
    full, it = [], iter(args)
    for i, a in enumerate(staged.args):
        full.append(a if staged.bound.is_static(i) else next(it))
    full_kw = {**{k: v for k, v in staged.kwargs.items() if staged.bound.is_static(k)}, **kwargs}
    if staged.replicas is not None:  # a per-replica program: its vmap formulation
        ref = staged.reference_fn or replica_reference(fn, staged)  # fn: resolved when resumed
        static = {k: v for k, v in staged.jit_options.items() if k.startswith("static_")}
        return jax.jit(ref, **static)(*full)
    from jaxaot.stages.jax_mesh import concrete_mesh

    mesh = facts.mesh
    if mesh is None:
        return jax.jit(fn, **staged.jit_options)(*full, **full_kw)
    # The run's mesh on the backend's first devices, as the executable runs.
    concrete = concrete_mesh(mesh, jax.devices(facts.backend))
    if not facts.mesh_context:
        # The mesh only places the arguments, as jax.jit(f, in_shardings=NamedSharding(mesh,
        # spec))(x) without jax.set_mesh: the program may build a mesh of its own.
        full, full_kw = _placed_on(ctx, staged, mesh, concrete, full, full_kw)
        return jax.jit(fn, **staged.jit_options)(*full, **full_kw)
    # The program sees the run's mesh, as it did when traced.
    with compat_jax.set_mesh(concrete):
        return jax.jit(fn, **staged.jit_options)(*full, **full_kw)


def _placed_on(
    ctx: StageContext,
    staged: StagedOut,
    spec: MeshSpec,
    mesh: Any,
    full: list[Any],
    full_kw: dict[str, Any],
) -> tuple[list[Any], dict[str, Any]]:
    """The traced arguments of ``full`` and ``full_kw`` put with the shardings the lowering
    gave them (``lower.in_shardings``, keyword arguments by keyword) on ``mesh`` (``spec``
    over concrete devices; a jax.jit given committed arrays uses their shardings as its
    in_shardings)."""
    import jax
    from jax.sharding import NamedSharding
    from jaxaot.stages.arg_table import input_shardings

    positional, keyword, _ = input_shardings(ctx, staged, spec)

    def put(value: Any, shardings: Any) -> Any:  # abstract-mesh shardings, here on ``mesh``
        return jax.device_put(value, jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings))

    it = iter(positional)
    args = [a if staged.bound.is_static(i) else put(a, next(it)) for i, a in enumerate(full)]
    kwargs = {k: put(v, keyword[k]) if k in keyword else v for k, v in full_kw.items()}
    return args, kwargs


def _derived_inputs(
    ctx: StageContext, staged: StagedOut, exe: Any
) -> tuple[list[Any], dict[str, Any]]:
    """The traced arguments of a config with derived nodes: each ``_init_`` made with the
    executable's input shardings for its leaves, then adapted as stage_out adapted the abstract
    ones (the static data must be the same)."""
    from jaxaot.stages import derived_values as derived
    from jaxaot.stages.adapt import adapt

    made, bound = staged.derived, staged.bound
    assert made is not None
    if ctx.opts.inputs is not None:
        raise ConfigError(
            "execute.inputs: the arguments hold derived values (_init_, _call_, _ref_, _key_), "
            "which execute makes itself; expected execute.inputs=null"
        )
    derived.check_fit(made.evaluation.derived_values(), ctx.facts.platform)
    traced = [i for i in range(len(bound.args)) if not bound.is_static(i)]
    abstract_traced = (
        [made.adapted.args[i] for i in traced],
        {k: v for k, v in made.adapted.kwargs.items() if not bound.is_static(k)},
    )
    try:
        arg_sh, kw_sh = exe.input_shardings
        by_id = derived.leaf_shardings(abstract_traced, (list(arg_sh), dict(kw_sh)))
    except (AttributeError, TypeError, ValueError):
        by_id = {}
    evaluation = derived.concrete(
        bound,
        ctx.facts.policy,
        ctx.opts.seed,
        made.evaluation.pure,
        lambda _path, leaves: derived.out_shardings(by_id, leaves),
    )
    args, kwargs = evaluation.arguments()
    adapted = adapt(made.user_fn, args, kwargs, made.names)
    # Static data with no stable fingerprint gets a fingerprint of its own per call: not compared.
    opaque = adapted.unfingerprintable is not None or made.adapted.unfingerprintable is not None
    if not opaque and adapted.fingerprint != made.adapted.fingerprint:
        raise JaxaotError(
            "execute: the static data of the arguments made for real differs from what was "
            f"traced (fingerprint {adapted.fingerprint[:16] or 'none'}, traced with "
            f"{made.adapted.fingerprint[:16] or 'none'}): an init whose non-array parts depend "
            "on its values?"
        )
    ctx.metrics["derived_calls"] = sum(evaluation.calls.values())
    return (
        [adapted.args[i] for i in traced],
        {k: v for k, v in adapted.kwargs.items() if not bound.is_static(k)},
    )


def _errors(got: Any, want: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(abs diff, |want|, equal) in float64 (complex128 for complex outputs).

    Equal values (the same inf, or nan in both) count as no error, as in
    ``np.testing.assert_allclose``; a nan or inf on one side only is an infinite error.
    """
    import numpy as np

    g, w = np.asarray(got), np.asarray(want)
    if g.dtype.kind == "V" or w.dtype.kind == "V":  # ml_dtypes: compare as float32
        g, w = g.astype(np.float32), w.astype(np.float32)
    wide = np.complex128 if "c" in (g.dtype.kind, w.dtype.kind) else np.float64
    g64, w64 = g.astype(wide), w.astype(wide)
    equal = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(equal, 0.0, np.abs(g64 - w64))
    diff = np.where(np.isnan(diff), np.inf, diff)
    return diff, np.abs(w64), equal


def _compare(ctx: StageContext, got: Any, want: Any) -> dict[str, Any]:
    import jax
    import numpy as np

    cfg = ctx.opts
    g_leaves, w_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    worst: dict[str, Any] = {
        "max_abs_err": 0.0,
        "max_rel_err": 0.0,
        "ok": True,
        "failures": [],
        "passed_by": "exact",
    }
    bounds: list[str] = []
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves, strict=True)):
        rtol, atol = _TOLERANCES.get(str(np.asarray(w).dtype), (0.0, 0.0))
        rtol = cfg.rtol if cfg.rtol is not None else rtol
        atol = cfg.atol if cfg.atol is not None else atol
        diff, scale, equal = _errors(g, w)
        abs_err = float(diff.max(initial=0.0))
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(equal, 0.0, diff / np.maximum(scale, 1e-30))
        rel_err = float(np.where(np.isnan(rel), np.inf, rel).max(initial=0.0))
        worst["max_abs_err"] = max(worst["max_abs_err"], abs_err)
        worst["max_rel_err"] = max(worst["max_rel_err"], rel_err)
        # An infinite error never passes, even against an infinite tolerance (rtol * |inf|).
        passed = equal | (np.isfinite(diff) & (diff <= atol + rtol * scale))
        if np.all(passed) and abs_err > 0:
            # Which bound let it pass: every element within rtol * |want| alone is a relative
            # pass; otherwise the absolute term was needed (e.g. an error near a zero).
            by_rel = bool(np.all(equal | (np.isfinite(diff) & (diff <= rtol * scale))))
            bounds.append(
                f"rel err {rel_err:.2g} <= rtol {rtol:g}"
                if by_rel
                else f"abs err {abs_err:.2g} <= atol {atol:g} + rtol {rtol:g} x |ref|"
            )
        if not np.all(passed):
            worst["ok"] = False
            worst["failures"].append(
                f"output {i}: max abs err {abs_err:.3g}, max rel err {rel_err:.3g} "
                f"(rtol={rtol:g}, atol={atol:g})"
            )
    if bounds:  # the loosest-looking bound shown: an absolute pass if any output needed one
        worst["passed_by"] = next((b for b in bounds if b.startswith("abs")), bounds[0])
    return worst


def _record_profile(ctx: StageContext, exe: Any, calls: int) -> None:
    """profile.json (per-op time of this executable), the metrics the summary and the sweep
    report show, and the trace's files in the manifest."""
    folder = ctx.out_dir / profile.PROFILE_DIR
    ops = profile.op_times(folder, exe.as_text() or "", calls)
    ctx.write_json("profile.json", ops)
    top = ops["ops"][0] if ops["ops"] else None
    ctx.metrics.update(
        profile_ops=ops["n_ops"],
        profile_op_s=ops["op_seconds_per_call"],
        profile_top_op=top["op"] if top else None,
        profile_top_share=top["share"] if top else None,
    )
    ctx.extra["profile"] = {
        "dir": f"{ctx.stage}/{profile.PROFILE_DIR}",
        "files": profile.trace_files(folder),
        "open": profile.how_to_open(folder),
    }


def _record_roofline(ctx: StageContext, compiled: Compiled, median_s: float) -> None:
    """execute.roofline: intensity and achieved rates against this device's calibrated peaks
    (cached per machine: :func:`jaxaot.stages.roofline.calibrate`) and the working set's size
    against the sizes calibrated."""
    import jax

    devices = jax.devices(compiled.backend)
    which = (devices[0].platform, devices[0].device_kind, len(devices), compiled.backend)
    working_set = roofline.working_set_bytes(compiled.memory)
    peaks = roofline.calibrate(*which)
    roof = roofline.analyse(compiled.cost, median_s, peaks, working_set)
    if (
        roof.get("above_calibrated_peak")
        and peaks["cached"]
        and not roof["cache_resident"]  # no stream calibrated bounds it: measuring cannot help
        and roofline.bounding_peak(roof) not in peaks.get("settled", ())
    ):
        # A measured peak is reachable, so the cached one is too low: measure again, once.
        peaks = roofline.calibrate(*which, recalibrate=True)
        roof = roofline.analyse(compiled.cost, median_s, peaks, working_set)
    if roof.get("above_calibrated_peak"):
        ctx.warn(roof["above_calibrated_peak"])
    ctx.write_json("roofline.json", roof)
    ctx.metrics.update(
        intensity=roof["intensity"],
        roofline_fraction=roof.get("fraction_of_roof"),
        roofline_bound=roof.get("bound"),
        peak_flops=roof["peak_flops"],
        peak_bytes_per_s=roof["peak_bytes_per_s"],
    )


def run(ctx: StageContext, compiled: Compiled, staged: StagedOut | None) -> Executed:
    import jax

    cfg = ctx.opts
    if staged is None:
        raise JaxaotError("execute: no program arguments available (stage_out did not run)")
    if compiled.shapes:  # a polymorphic program runs at the sizes it was compiled at
        from jaxaot.config.argspec import concrete_bound

        staged = replace(staged, bound=concrete_bound(staged.bound, compiled.shapes))
    exe = compiled.compiled
    if exe is None:  # a topology's executable, loaded off its TPU host (refused before this)
        raise BackendError(f"execute: no executable to run on this host ({compiled.backend})")
    if staged.derived is not None:
        host_args, host_kwargs = _derived_inputs(ctx, staged, exe)
    elif cfg.inputs is not None:
        host_args, host_kwargs = user_inputs(staged.bound, cfg.inputs)
    else:
        from jaxaot.stages.resolving import class_resolver

        host_args, host_kwargs = spec_inputs(
            staged.bound, cfg.seed, class_resolver(ctx.facts.policy)
        )
    # What the lowering donated: on platforms none of which donate, JAX drops what
    # lower.donate_argnums/donate_argnames asked for, and nothing is consumed.
    donated = set(compiled.lowered.donate_argnums)
    donated_kw = {k for k in compiled.lowered.donate_argnames if k in host_kwargs}
    dev_args, dev_kwargs = _place(exe, host_args, host_kwargs)
    targets = input_targets(exe)

    def call() -> tuple[Any, float, list[Any]]:
        # A donated buffer is gone after a call: put a fresh copy before each one (untimed).
        args = [
            _put(_fresh(host_args[i]), targets[0][i]) if i in donated else a
            for i, a in enumerate(dev_args)
        ]
        kwargs = {
            k: _put(_fresh(host_kwargs[k]), targets[1][k]) if k in donated_kw else v
            for k, v in dev_kwargs.items()
        }
        t0 = time.perf_counter()
        try:
            out = exe(*args, **kwargs)
        except TypeError as exc:
            if "Argument types differ" in str(exc) or "compiled with" in str(exc):
                raise _type_mismatch(exc) from None
            raise
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        gone = [(f"args[{i}]", args[i]) for i in sorted(donated)]
        return out, dt, gone + [(f"kwargs[{k!r}]", kwargs[k]) for k in sorted(donated_kw)]

    out = None
    for _ in range(cfg.warmup):
        out, _, _ = call()
    samples = []
    consumed: list[tuple[str, Any]] = []
    trace = profile.trace(ctx.out_dir / profile.PROFILE_DIR) if cfg.profile else None
    with trace or contextlib.nullcontext():
        for _ in range(cfg.repeats):
            out, dt, consumed = call()
            samples.append(dt)
    if cfg.profile:
        _record_profile(ctx, exe, len(samples))
    outputs = _host(out)
    described = _savez(ctx, outputs)
    timings: dict[str, Any] = {"calls": len(samples), "warmup": cfg.warmup, **_stats(samples)}
    if compiled.cost:
        med = timings["median_s"]
        if (compiled.cost.get("flops") or 0) > 0:  # XLA's -2 means "unknown", not a count
            timings["flops_per_s"] = compiled.cost["flops"] / med
        if (compiled.cost.get("bytes accessed") or 0) > 0:
            timings["bytes_per_s"] = compiled.cost["bytes accessed"] / med
    # Each donated leaf, by input path, and whether the call consumed its buffer: XLA reuses a
    # donated buffer only where an output can take it, so a donated pytree may be consumed in
    # part (as under plain jax.jit).
    leaves = {
        top + jax.tree_util.keystr(path): bool(getattr(a, "is_deleted", lambda: False)())
        for top, value in consumed
        for path, a in jax.tree_util.tree_flatten_with_path(value)[0]
    }
    timings["donated_leaves_consumed"] = leaves if donated or donated_kw else None
    timings["donated_inputs_consumed"] = all(leaves.values()) if donated or donated_kw else None
    timings["samples_s"] = samples
    ctx.write_json("timings.json", timings)
    if cfg.roofline:
        _record_roofline(ctx, compiled, timings["median_s"])
    nonfinite = [d["path"] or "<root>" for d in described if not d["finite"]]
    if nonfinite:
        ctx.warn(f"non-finite values (nan/inf) in output(s) {', '.join(nonfinite)}")
    ctx.metrics.update(
        # shape, dtype and (when small) values of each output: the summary shows them
        outputs=[
            {k: d[k] for k in ("path", "dtype", "shape", "value") if k in d}
            for d in described[:SHOWN_OUTPUTS]
        ],
        median_s=timings["median_s"],
        stddev_s=timings["stddev_s"],
        flops_per_s=timings.get("flops_per_s"),
        bytes_per_s=timings.get("bytes_per_s"),
    )
    check = None
    if cfg.check == "reference":
        ref = _host(_reference(ctx, staged, host_args, host_kwargs))
        check = _compare(ctx, outputs, ref)
        ctx.write_json("check.json", check)
        ctx.metrics.update(
            check="ok" if check["ok"] else "failed",
            max_abs_err=check["max_abs_err"],
            max_rel_err=check["max_rel_err"],
            check_passed_by=check["passed_by"],
        )
        if not check["ok"]:
            raise CheckError(
                "execute.check=reference: outputs differ from plain jax.jit beyond tolerance: "
                + "; ".join(check["failures"][:3])
                + " (loosen with execute.rtol/execute.atol)"
            )
    return Executed(outputs=outputs, timings=timings, check=check)


def check(ex: ExecuteConfig, facts: CheckFacts) -> None:
    """execute's options, before JAX."""
    if ex.seed < 0:  # numpy's generators take non-negative seeds only
        raise ConfigError(f"execute.seed: expected an int >= 0, found {ex.seed}")
    if ex.check not in CHECKS:
        raise ConfigError(f"execute.check: expected one of {', '.join(CHECKS)}, found {ex.check!r}")
    if ex.warmup < 0:
        raise ConfigError(f"execute.warmup: expected >= 0, found {ex.warmup}")
    if ex.repeats < 1:
        raise ConfigError(f"execute.repeats: expected >= 1, found {ex.repeats}")
    for key, tol in (("execute.rtol", ex.rtol), ("execute.atol", ex.atol)):
        # nan compares false with everything (``tol < 0`` let it through, and then no element
        # passed); an infinite tolerance is no check, which execute.check=none says plainly.
        if tol is not None and not (math.isfinite(tol) and tol >= 0):
            raise ConfigError(
                f"{key}: expected a finite number >= 0 or null, found {tol}; null takes the "
                "output dtype's default, execute.check=none skips the comparison"
            )


def summarize(m: ExecuteMetrics) -> str:
    """The summary line: timing, achieved FLOP/s, the check and which tolerance held."""
    parts = []
    if m.median_s is not None:
        parts.append(f"median {human_seconds(m.median_s)} (sd {human_seconds(m.stddev_s)})")
    if m.flops_per_s:
        parts.append(human_count(m.flops_per_s, "FLOP/s"))
    if m.roofline_bound:
        parts.append(
            f"roofline: {m.intensity:.3g} FLOP/B, {m.roofline_bound}-bound, "
            f"{m.roofline_fraction:.0%} of roof (peaks {human_count(m.peak_flops, 'FLOP/s')}, "
            f"{human_bytes(m.peak_bytes_per_s)}/s calibrated)"
        )
    if m.profile_top_op:
        parts.append(
            f"profiled: {m.profile_ops} ops, top {m.profile_top_op} "
            f"{m.profile_top_share:.0%} (execute/profile.json)"
        )
    abs_err = 0 if m.max_abs_err is None else m.max_abs_err
    rel_err = 0 if m.max_rel_err is None else m.max_rel_err
    if m.check == "ok":
        # Which tolerance passed: "max rel err 1.4" alone reads as a failure when the
        # absolute bound is what held (an error next to a zero).
        passed = m.check_passed_by or f"max rel err {rel_err:.2g}"
        parts.append(f"check ok ({passed})")  # older manifests have no check_passed_by: the rel err
    elif m.check:
        parts.append(f"check {m.check} (max abs err {abs_err:.2g}, max rel err {rel_err:.2g})")
    return "; ".join(parts)


class ExecuteStage:
    """Stage 4: a Stage, Prepared (the inputs it builds fit in memory)."""

    name: str = "execute"
    Options: type[ExecuteConfig] = ExecuteConfig
    Record: type[Executed] = Executed
    inputs: tuple[str, ...] = ("compile", "stage_out")
    live_inputs: tuple[str, ...] = ()
    sections: tuple[str, ...] = ("execute",)
    check = staticmethod(check)
    show: Presentation[ExecuteMetrics] = Presentation(
        verb="executing", noun="result", figures=ExecuteMetrics.from_metrics, summarize=summarize
    )
    artifacts: tuple[str, ...] = (
        "outputs.npz",
        "outputs.bits.npz",
        "outputs.json",
        "timings.json",
        "check.json",
        "profile.json",
        "roofline.json",
    )

    def run(self, ctx: StageContext[ExecuteConfig], up: Upstream) -> Executed:
        return run(ctx, up["compile"], up["stage_out"])

    def before_run(self, opts: ExecuteConfig, facts: RunFacts) -> None:
        from jaxaot.config.argspec import concrete_bound

        # Derived values (_init_) are sized by eval_shape and checked there (stage_out); the
        # array specs among their arguments are counted here: the inputs this stage builds, a
        # polymorphic program's at the sizes it runs at (compile.shapes), each also refused
        # when XLA could not size it.
        check_inputs_fit(concrete_bound(facts.bound, facts.shapes))


EXECUTE = ExecuteStage()


__all__ = ["EXECUTE", "Executed", "load_outputs", "run"]
