"""Typed records of the figures a run's manifest holds for each stage, and the one list of
metric names and units.

A stage writes its figures into ``manifest.json`` as ``stages.<stage>.metrics``, a flat JSON
object. The summary, the result repr, the sweep report, the progress lines and the autotune
objective read them back through the frozen records here (:class:`RunMetrics` holds one per
stage), so a misspelt figure is an attribute error that mypy reports, never a silent None.

Each record field is the manifest key of the same name, and its ``unit`` (field metadata) says
what it counts. Reading tolerates every manifest jaxaot has written: a key that is missing (a
stage that failed early, a manifest older than the figure, a backend that does not give it)
or holds a value of another kind reads as None (``()`` for lists). Numbers are kept as
written (an int stays an int, XLA's negative "unknown" sentinels stay negative), so reports
built from the records print what the manifest says. Nothing here writes a manifest: the
on-disk format is :mod:`jaxaot.rundir.manifest`'s.

Report columns and autotune objectives are named ``<stage>.<metric>`` (``execute.median_s``)
or ``<stage>.seconds`` (a stage's wall time); :func:`objective` turns such a name into a
:class:`Metric` or refuses it with one line naming the allowed names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Self, cast

from jaxaot.errors import ConfigError
from jaxaot.util.humanize import human_bytes, human_seconds, measured

# What a figure counts. "text", "flag", "names", "sizes" and "outputs" are not figures: never
# an objective or a plot axis.
Unit = Literal[
    "s",  # seconds
    "bytes",
    "bytes/s",
    "FLOP",
    "FLOP/s",
    "FLOP/B",  # arithmetic intensity
    "share",  # a fraction in [0, 1]
    "count",
    "number",  # a plain number (an error bound)
    "text",
    "flag",  # true or false
    "names",  # a list of names
    "sizes",  # name -> size (compile.shapes: the symbolic dimensions' sizes compiled at)
    "outputs",  # execute's outputs as the summary shows them
]
NUMERIC_UNITS: frozenset[str] = frozenset(
    {"s", "bytes", "bytes/s", "FLOP", "FLOP/s", "FLOP/B", "share", "count", "number"}
)

# Where a figure shows in a sweep report: every sweep ("report"), only sweeps with a
# compile.topology job ("topology"), or nowhere (None).
Column = Literal["report", "topology"] | None


def _figure(unit: Unit, column: Column = None, *, objective: bool | None = None) -> Any:
    """A record field: its unit, its report column, and whether an autotune search may
    optimise it (by default: every numeric report column)."""
    if objective is None:
        objective = column == "report" and unit in NUMERIC_UNITS
    default: Any = () if unit in ("names", "outputs") else None
    return field(default=default, metadata={"unit": unit, "column": column, "objective": objective})


def _number(value: Any) -> Any:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()


def _sizes(value: Any) -> Mapping[str, Any] | None:
    return dict(value) if isinstance(value, Mapping) else None


@dataclass(frozen=True)
class OutputFigure:
    """One output as the summary shows it (``execute.metrics.outputs``): its pytree path,
    dtype, shape and, for a small output, its values (``has_value``; a value may be null)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    value: Any = None
    has_value: bool = False

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        shape = data.get("shape")
        return cls(
            path=str(data.get("path") or ""),
            dtype=str(data.get("dtype")),
            shape=tuple(shape) if isinstance(shape, list | tuple) else (),
            value=data.get("value"),
            has_value="value" in data,
        )


def _outputs(value: Any) -> tuple[OutputFigure, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(OutputFigure.from_json(o) for o in value if isinstance(o, Mapping))


_READERS: dict[str, Callable[[Any], Any]] = {
    **{unit: _number for unit in NUMERIC_UNITS},
    "text": _text,
    "flag": _flag,
    "names": _names,
    "sizes": _sizes,
    "outputs": _outputs,
}


class _Figures:
    """Reading a record from a stage's flat metrics object (see the module docstring)."""

    @classmethod
    def from_metrics(cls, metrics: Any) -> Self:
        m: Mapping[str, Any] = metrics if isinstance(metrics, Mapping) else {}
        values: dict[str, Any] = {}
        for f in fields(cast(Any, cls)):
            nested = f.metadata.get("record")
            if nested is not None:  # a record over the same flat object (a fit verdict)
                values[f.name] = nested.from_metrics(m)
            else:
                values[f.name] = _READERS[f.metadata["unit"]](m.get(f.name))
        return cls(**values)

    @classmethod
    def from_manifest(cls, stage_entry: Any) -> Self:
        """The record of a manifest's ``stages.<stage>`` entry (None or {}: every figure None)."""
        entry: Mapping[str, Any] = stage_entry if isinstance(stage_entry, Mapping) else {}
        return cls.from_metrics(entry.get("metrics"))


@dataclass(frozen=True)
class StageOutMetrics(_Figures):
    """stage_out: the traced program."""

    STAGE: ClassVar[str] = "stage_out"

    inputs: int | None = _figure("count")
    outputs: int | None = _figure("count")
    static: int | None = _figure("count")
    eqns: int | None = _figure("count")  # the jaxpr's equations
    replicas: int | None = _figure("count")  # program.axis_env's size
    derived: int | None = _figure("count")  # _init_ nodes evaluated
    argument_bytes: int | None = _figure("bytes")
    argument_bytes_per_device: int | None = _figure("bytes")


@dataclass(frozen=True)
class LowerMetrics(_Figures):
    """lower: the exported module."""

    STAGE: ClassVar[str] = "lower"

    platforms: tuple[str, ...] = _figure("names")
    mesh: str | None = _figure("text")
    devices: int | None = _figure("count")
    flops: float | None = _figure("FLOP")  # before XLA's optimisations
    bytes_accessed: float | None = _figure("bytes")
    disabled_checks: tuple[str, ...] = _figure("names")


@dataclass(frozen=True)
class FitVerdict(_Figures):
    """compile.topology's verdict (:mod:`jaxaot.stages.fit_verdict`) and roofline estimate,
    flat in compile's metrics: all None for a compile without a topology. Device memory (less
    the reserve) and host memory apart; ``headroom_bytes`` is negative when it does not fit."""

    topology: str | None = _figure("text", "topology")
    fits: bool | None = _figure("flag", "topology")
    hbm_bytes_needed: float | None = _figure("bytes", "topology", objective=True)
    hbm_bytes_available: float | None = _figure("bytes", "topology")
    headroom_bytes: float | None = _figure("bytes", "topology")
    hbm_fits: bool | None = _figure("flag", "topology")
    hbm_reserve_bytes: float | None = _figure("bytes", "topology")
    host_bytes_needed: float | None = _figure("bytes", "topology", objective=True)
    host_bytes_available: float | None = _figure("bytes", "topology")
    host_fits: bool | None = _figure("flag", "topology")
    est_step_s: float | None = _figure("s", "topology", objective=True)  # roofline estimate
    collectives: int | None = _figure("count", "topology")
    collective_bytes: float | None = _figure("bytes", "topology")
    est_bound: str | None = _figure("text")  # "compute" | "memory" | ...
    autotuned: bool | None = _figure("flag")  # false: a CUDA target compiled without a GPU

    @property
    def known(self) -> bool:
        """Whether the compile had a verdict (compiled for a topology)."""
        return self.fits is not None


@dataclass(frozen=True)
class CompileMetrics(_Figures):
    """compile: XLA's cost and memory analyses, the peak's live buffers, the compile trace's
    breakdown, the mesh's shardings, and a topology's verdict."""

    STAGE: ClassVar[str] = "compile"

    flops: float | None = _figure("FLOP", "report")  # -2 or below: XLA does not know
    bytes_accessed: float | None = _figure("bytes", "report")
    argument_bytes: int | None = _figure("bytes", "report")
    output_bytes: int | None = _figure("bytes", "report")
    temp_bytes: int | None = _figure("bytes", "report")
    code_bytes: int | None = _figure("bytes", "report")
    peak_bytes: int | None = _figure("bytes", "report")
    peak_top: str | None = _figure("text", "report")  # the buffers live at the peak
    breakdown_threads_s: float | None = _figure("s", "report")
    breakdown_top: str | None = _figure("text", "report")
    breakdown_top_s: float | None = _figure("s")
    flops_xla: float | None = _figure("FLOP")  # XLA's own: loop bodies counted once
    bytes_accessed_xla: float | None = _figure("bytes")
    loops: int | None = _figure("count")
    loops_unknown_trip_count: int | None = _figure("count")
    xla_dump_files: int | None = _figure("count")
    mesh: str | None = _figure("text")
    devices: int | None = _figure("count")
    sharded_inputs: int | None = _figure("count")
    inputs: int | None = _figure("count")
    sharded_outputs: int | None = _figure("count")
    outputs: int | None = _figure("count")
    # The sizes a polymorphic lowering's symbolic dimensions were compiled at (those of
    # compile.shapes it uses); None for a lowering without symbolic dimensions.
    shapes: Mapping[str, Any] | None = _figure("sizes")
    verdict: FitVerdict = field(default_factory=FitVerdict, metadata={"record": FitVerdict})


@dataclass(frozen=True)
class ExecuteMetrics(_Figures):
    """execute: timing, the roofline, the profile's top op, the check against plain jax.jit."""

    STAGE: ClassVar[str] = "execute"

    median_s: float | None = _figure("s", "report")
    stddev_s: float | None = _figure("s", "report")
    flops_per_s: float | None = _figure("FLOP/s", "report")
    intensity: float | None = _figure("FLOP/B", "report")
    roofline_fraction: float | None = _figure("share", "report")
    peak_flops: float | None = _figure("FLOP/s", "report")
    peak_bytes_per_s: float | None = _figure("bytes/s", "report")
    profile_top_op: str | None = _figure("text", "report")
    profile_top_share: float | None = _figure("share", "report")
    bytes_per_s: float | None = _figure("bytes/s")
    roofline_bound: str | None = _figure("text")
    profile_ops: int | None = _figure("count")
    profile_op_s: float | None = _figure("s")
    check: str | None = _figure("text")  # "ok" | "failed" (execute.check=reference)
    check_passed_by: str | None = _figure("text")  # which tolerance held
    max_abs_err: float | None = _figure("number")
    max_rel_err: float | None = _figure("number")
    derived_calls: int | None = _figure("count")
    outputs: tuple[OutputFigure, ...] = _figure("outputs")


StageMetrics = StageOutMetrics | LowerMetrics | CompileMetrics | ExecuteMetrics
# Each stage's record, in run order (jaxaot.config.order.STAGES).
RECORDS: dict[str, type[StageOutMetrics | LowerMetrics | CompileMetrics | ExecuteMetrics]] = {
    r.STAGE: r for r in (StageOutMetrics, LowerMetrics, CompileMetrics, ExecuteMetrics)
}


@dataclass(frozen=True)
class Metric:
    """One figure as a report column or an objective: ``<stage>.<name>``, and its unit.
    ``name`` is ``seconds`` for a stage's wall time (the manifest entry's, not a metric)."""

    stage: str
    name: str
    unit: Unit
    verdict: bool = False  # a field of compile's FitVerdict

    @property
    def column(self) -> str:
        return f"{self.stage}.{self.name}"

    @property
    def numeric(self) -> bool:
        return self.unit in NUMERIC_UNITS

    def human(self, value: float) -> str:
        """The figure for people: a time as ``389.3 us``, a size (and a bandwidth, as its
        bytes) as ``1.5 MiB``, any other figure with six significant digits."""
        if self.unit == "s":
            return human_seconds(value)
        if self.unit in ("bytes", "bytes/s"):
            return human_bytes(value)
        return f"{value:.6g}"


def _figures() -> Iterator[tuple[Metric, Mapping[str, Any]]]:
    """Every figure of every stage record, in field order (a fit verdict's own figures where
    the record holds one), with its field's metadata (unit, column, objective)."""
    for stage, record in RECORDS.items():
        for f in fields(record):
            if "record" in f.metadata:
                for g in fields(f.metadata["record"]):
                    yield Metric(stage, g.name, g.metadata["unit"], verdict=True), g.metadata
            else:
                yield Metric(stage, f.name, f.metadata["unit"]), f.metadata


def _catalogue(column: Column) -> tuple[Metric, ...]:
    return tuple(m for m, meta in _figures() if meta["column"] == column)


def _objectives() -> tuple[Metric, ...]:
    figures = [m for m, meta in _figures() if meta["objective"]]
    # Report columns first (their order in the report), then the verdict's figures.
    figures.sort(key=lambda m: m.verdict)
    return (*(Metric(stage, "seconds", "s") for stage in RECORDS), *figures)


# The figures every sweep report has as columns, in column order.
REPORT_METRICS: tuple[Metric, ...] = _catalogue("report")
# compile.topology's verdict columns: only in sweeps with a topology job.
TOPOLOGY_METRICS: tuple[Metric, ...] = _catalogue("topology")
# What an autotune search may optimise: each stage's seconds, then every numeric figure.
OBJECTIVES: tuple[Metric, ...] = _objectives()
OBJECTIVE_BY_NAME: dict[str, Metric] = {m.column: m for m in OBJECTIVES}


def objective(name: str, key: str = "hydra.sweeper.objective") -> Metric:
    """The figure an autotune objective names; ConfigError naming ``key`` and the allowed
    names when it names none."""
    found = OBJECTIVE_BY_NAME.get(name)
    if found is None:
        raise ConfigError(f"{key}: expected one of {', '.join(OBJECTIVE_BY_NAME)}, found {name!r}")
    return found


@dataclass(frozen=True)
class StageRun:
    """A manifest's ``stages.<stage>`` entry less its files: status and wall time."""

    status: str | None = None  # ran | cached | resumed | skipped | failed | ...
    seconds: float | None = None

    @classmethod
    def from_manifest(cls, stage_entry: Any) -> Self:
        entry: Mapping[str, Any] = stage_entry if isinstance(stage_entry, Mapping) else {}
        return cls(status=_text(entry.get("status")), seconds=_number(entry.get("seconds")))


@dataclass(frozen=True)
class RunMetrics:
    """Every stage's figures from one manifest (a stage it has no entry for: every figure
    None, status None)."""

    stage_out: StageOutMetrics = field(default_factory=StageOutMetrics)
    lower: LowerMetrics = field(default_factory=LowerMetrics)
    compile: CompileMetrics = field(default_factory=CompileMetrics)
    execute: ExecuteMetrics = field(default_factory=ExecuteMetrics)
    runs: Mapping[str, StageRun] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: Any) -> Self:
        """The figures of a manifest (None or {}: a job that wrote none)."""
        data: Mapping[str, Any] = manifest if isinstance(manifest, Mapping) else {}
        stages = data.get("stages")
        entries: Mapping[str, Any] = stages if isinstance(stages, Mapping) else {}
        return cls(
            stage_out=StageOutMetrics.from_manifest(entries.get(StageOutMetrics.STAGE)),
            lower=LowerMetrics.from_manifest(entries.get(LowerMetrics.STAGE)),
            compile=CompileMetrics.from_manifest(entries.get(CompileMetrics.STAGE)),
            execute=ExecuteMetrics.from_manifest(entries.get(ExecuteMetrics.STAGE)),
            runs={s: StageRun.from_manifest(e) for s, e in entries.items()},
        )

    def stage(self, name: str) -> StageMetrics | None:
        """The record of the stage named ``name``; None for a stage this jaxaot does not
        know (a manifest from another version)."""
        records: dict[str, StageMetrics] = {
            r.STAGE: r for r in (self.stage_out, self.lower, self.compile, self.execute)
        }
        return records.get(name)

    def run(self, stage: str) -> StageRun:
        return self.runs.get(stage) or StageRun()

    def value(self, metric: Metric) -> Any:
        """The figure ``metric`` names (a catalogued one: :data:`REPORT_METRICS`,
        :data:`TOPOLOGY_METRICS`, :data:`OBJECTIVES`)."""
        if metric.name == "seconds":
            return self.run(metric.stage).seconds
        record: Any = self.stage(metric.stage)
        if metric.verdict:
            record = record.verdict
        return getattr(record, metric.name)

    def figure(self, metric: Metric) -> Any:
        """:meth:`value`, less XLA's "unknown" sentinels (``flops: -2``, any negative count,
        size or rate: None). A verdict's figures are kept as they are: its headroom is
        negative when the program does not fit."""
        value = self.value(metric)
        return value if metric.verdict or not metric.numeric else measured(value)


__all__ = [
    "NUMERIC_UNITS",
    "OBJECTIVES",
    "OBJECTIVE_BY_NAME",
    "RECORDS",
    "REPORT_METRICS",
    "TOPOLOGY_METRICS",
    "CompileMetrics",
    "ExecuteMetrics",
    "FitVerdict",
    "LowerMetrics",
    "Metric",
    "OutputFigure",
    "RunMetrics",
    "StageMetrics",
    "StageOutMetrics",
    "StageRun",
    "Unit",
    "objective",
]
