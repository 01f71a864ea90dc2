"""The stage lifecycle, written once: what a stage is, what it may also be, and when the runner
calls each member (pytest-hookspec style: the firing rule is the member's docstring).

Every stage is a :class:`Stage`. A stage that has more to offer implements one or more small
capability protocols, and the runner (:mod:`jaxaot.engine.runner`) branches on
``isinstance(stage, Cached)`` and the like, never on a stage's name:

* :class:`Loadable`: its record can be made from verified files (a checkpoint when the run
  starts after it; a store entry when it is also :class:`Cached`).
* :class:`Cached`: its result is worth sharing: a store key, what a stored entry must match, and
  what may not be stored.
* :class:`Ahead`: it may start on an early record of its single input, on a worker thread.
* :class:`Prepared`: it checks what it will build from the bound arguments before any work.
* :class:`OnResume`: it refuses a resume that cannot work here, and takes a default from the
  checkpoint.
* :class:`Finishing`: it adds to the run's manifest after the last stage.

Outcomes of ``load`` that steer the runner are exception types, one rule for every stage:

* On a store hit (:meth:`Cached.load_planned`) any :class:`~jaxaot.errors.StoreError`
  (:class:`~jaxaot.errors.EntryUnusable` included) drops the entry and
  :class:`~jaxaot.errors.NotLoadableHere` keeps it; either way the stage is computed. Any other
  error ends the run.
* On a resume (:meth:`Loadable.load` of a checkpoint) :class:`~jaxaot.errors.EntryUnusable` and
  :class:`~jaxaot.errors.NotLoadableHere` compute the stage instead, where its live inputs are
  computed this run; any other error (a corrupt or missing checkpoint file is a plain
  StoreError) is the user's and ends the run.

A program that does not fit is :class:`~jaxaot.errors.DoesNotFit`.

A stage reads its own options and the run's facts, never another stage's section: ``check``
gets its options and :class:`CheckFacts` (before JAX, before the arguments are bound); every
other member gets its options (``StageContext.opts`` or ``opts``) and :class:`RunFacts`, which
the engine works out once per run (:func:`jaxaot.engine.run_facts.run_facts`). A result
another stage needs travels in the record (execute runs at the sizes in ``Compiled.shapes``).

Stages write files only through :meth:`StageContext.write`, so every artifact is written
atomically and lands in the manifest with its sha256 and size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

from jaxaot.util.fsio import atomic_write_bytes, sha256_bytes
from jaxaot.util.links import LINK_MIN_BYTES, link_same

if TYPE_CHECKING:
    from jaxaot.config.argspec import BoundArgs
    from jaxaot.config.mesh import ArgShardings, MeshSpec
    from jaxaot.config.trust import ImportPolicy

log = logging.getLogger("jaxaot")

Opt = TypeVar("Opt")  # a stage's options (its config section's schema)
Opt_contra = TypeVar("Opt_contra", contravariant=True)  # options a capability only reads
R = TypeVar("R")  # a stage's record
R_co = TypeVar("R_co", covariant=True)
R_contra = TypeVar("R_contra", contravariant=True)
P = TypeVar("P")  # what a Cached stage prepares with its key (compile: the Target)
H = TypeVar("H")  # what an Ahead stage's early job returns (compile: the XLA executable)
M = TypeVar("M")  # a stage's typed metrics record (jaxaot.rundir.metrics: CompileMetrics)


@dataclass(frozen=True)
class Artifact:
    """One file a stage wrote: where, its sha256 and size."""

    path: Path
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class Presentation(Generic[M]):
    """How a stage shows itself: progress lines, the runner's messages, the run's summary."""

    verb: str  # "compiling": "still compiling (...)", "..., compiling instead"
    noun: str  # what its record is called in messages: "executable"
    # The metrics its manifest entry holds (any jaxaot's manifest) as its typed record:
    # ``CompileMetrics.from_metrics``.
    figures: Callable[[Mapping[str, Any]], M]
    summarize: Callable[[M], str]  # the stage's summary line from that record

    def line(self, metrics: Mapping[str, Any]) -> str:
        """The summary line of a manifest's ``stages.<name>.metrics``. Fires when a summary is
        rendered: the end of a run, ``jaxaot-report``."""
        return self.summarize(self.figures(metrics))


@dataclass(frozen=True)
class CheckFacts:
    """What a stage's :meth:`Stage.check` may read besides its own options: known from the
    config alone, before JAX is imported and before the arguments are bound."""

    policy: ImportPolicy  # what may be imported: trust.*, the environment, the user file


@dataclass(frozen=True)
class RunFacts:
    """What the engine works out once per run from the shared sections and the options of
    several stages together; a stage reads these and its own options (``StageContext.opts``),
    never another stage's section."""

    program: str  # program.name
    target: str  # program.target, "package.module:function"
    bound: BoundArgs  # program.args/kwargs bound (static and donated marked, specs parsed)
    policy: ImportPolicy  # what may be imported: trust.*, the environment, the user file
    backend: str  # compile.backend: where the run compiles and executes
    platform: str  # that backend's platform ("cpu", "cuda", "rocm", "tpu")
    topology: str | None  # compile.topology: compiled without devices for this topology
    num_slices: int  # compile.num_slices: slices of that topology
    mesh: MeshSpec | None  # mesh.* or stage_out.axis_env's replica mesh
    mesh_context: bool  # mesh.context: the program is traced with the mesh in context
    shardings: ArgShardings  # lower.in_shardings and lower.logical_axis_rules
    # compile.shapes: the sizes symbolic dimensions compile and run at (execute checks the
    # inputs it builds at them before JAX; compile reads its own option)
    shapes: Mapping[str, int]
    seed: int  # execute.seed: what generated and derived arguments are drawn from
    builds_inputs: bool  # execute runs and makes its inputs from the specs (no execute.inputs)


@dataclass
class StageContext(Generic[Opt]):
    """Per-stage state the runner owns: the stage's own options and the run's facts; stages
    fill ``artifacts``, ``metrics`` and ``warnings``."""

    opts: Opt  # this stage's section of the config
    facts: RunFacts
    stage: str
    out_dir: Path
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # More of this stage's manifest entry: files it has that are not artifacts (not hashed,
    # not stored), e.g. compile.dump's listing.
    extra: dict[str, Any] = field(default_factory=dict)
    # Set by the runner when a consumer is Ahead: a stage calls it with an early record (lower:
    # the module exists, the export does not yet) so that the consumer can begin on it.
    publish_early: Callable[[object], None] | None = None
    # Set by the runner while a store hit loads: file name -> the entry's verified file. A big
    # artifact with exactly those bytes is hard-linked from there, not copied.
    same_as: dict[str, Path] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget what a load that failed half-way wrote, before computing instead."""
        self.artifacts.clear()
        self.metrics.clear()
        self.extra.clear()
        self.same_as = {}

    def write(self, name: str, data: bytes | bytearray | memoryview | str) -> Artifact:
        raw = data.encode() if isinstance(data, str) else data
        path = self.out_dir / name
        src = self.same_as.get(name)
        if src is not None and len(raw) >= LINK_MIN_BYTES and link_same(src, path, raw):
            art = Artifact(path=path, sha256=sha256_bytes(raw), size=len(raw))
            self.artifacts[name] = art
            return art
        digest = atomic_write_bytes(path, raw)
        art = Artifact(path=path, sha256=digest, size=len(raw))
        self.artifacts[name] = art
        return art

    def write_json(self, name: str, obj: Any) -> Artifact:
        return self.write(name, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")

    def warn(self, message: str) -> None:
        log.warning("[%s] %s", self.stage, message)
        self.warnings.append(message)

    @contextlib.contextmanager
    def capture_warnings(self) -> Iterator[None]:
        """Record Python warnings raised inside (e.g. JAX's "Some donated buffers were not
        usable") as this stage's warnings, so they reach the manifest and the summary."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            message = f"{w.category.__name__}: {' '.join(str(w.message).split())}"
            if message not in self.warnings:  # lowering and export may both say it
                self.warn(message)


Upstream = Mapping[str, Any]  # the records of a stage's inputs, by stage name


@dataclass(frozen=True)
class Entry:
    """One stage's verified files: a store entry or a checkpoint folder, read alike."""

    label: str  # "store entry compile/1a2b3c4d5e6f", "resume_from=/runs/x"
    read: Callable[[str], bytes]  # sha256-checked; KeyError for a file it does not record
    compat: Mapping[str, Any]  # what it was made with (versions, platform)
    source: str  # "store" | "checkpoint"
    created: float | None = None  # when it was made (seconds since the epoch), if known


@dataclass(frozen=True)
class Plan(Generic[P]):
    """A :class:`Cached` stage's store key for this run, and what computing it prepared
    (``state``: handed to ``run_planned``, ``load_planned``, ``storable`` and ``begin`` so that
    nothing is prepared twice)."""

    key: str
    state: P


@dataclass(frozen=True)
class Uncached(Generic[P]):
    """A :class:`Cached` stage that cannot say what its result depends on this run (``why``,
    warned): computed from ``state`` without the store."""

    state: P
    why: str


def compat_mismatch(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """The one rule for store entries and checkpoints: every field this run requires (``mine``)
    must be what the entry was made with; None when all match."""
    diff = [k for k in sorted(mine) if theirs.get(k) != mine[k]]
    if not diff:
        return None
    return ", ".join(f"{k} {theirs.get(k)!r} (here {mine[k]!r})" for k in diff)


@runtime_checkable
class Stage(Protocol[Opt, R]):
    """What every stage has. The runner takes the stages in pipeline order
    (:data:`jaxaot.stages.NODES`); for each one this run computes it calls :meth:`run` (or
    the capabilities below say otherwise), and it records ``artifacts``, metrics and warnings
    in the manifest under ``name``."""

    name: str  # config section, run-dir folder, store namespace
    Options: type[Opt]  # the section's schema (a frozen dataclass, in the root config as ``name``)
    Record: type[R]  # what run (and load) return
    inputs: tuple[str, ...]  # earlier stages whose records ``up`` holds, by name
    # Inputs that must be computed, not loaded, when this stage runs (lower needs the traced
    # program, which a checkpoint does not hold): resuming past them computes them again.
    live_inputs: tuple[str, ...]
    sections: tuple[str, ...]  # config sections taken from the checkpoint when a later stage
    # resumes (its options, and whatever else changes what it makes)
    artifacts: tuple[str, ...]  # files it writes and a store entry holds
    show: Presentation[Any]  # verb, noun and summary line

    def check(self, opts: Opt, facts: CheckFacts) -> None:
        """Fires in :func:`jaxaot.schema.validate`, for every stage of every run, before JAX is
        imported, with this stage's options: raise :class:`~jaxaot.errors.ConfigError` naming
        the key. What spans sections is checked after every stage's check
        (:func:`jaxaot.schema.check_relations`)."""
        ...

    def run(self, ctx: StageContext[Opt], up: Upstream) -> R:
        """Fires when this run computes the stage (between ``start_at`` and ``stop_after``, or
        a live input before ``start_at``), after any store look-up missed. A
        :class:`~jaxaot.errors.JaxaotError` is the run's error as it is; any other exception
        becomes a :class:`~jaxaot.errors.StageError` naming the stage."""
        ...


@runtime_checkable
class Loadable(Protocol[Opt, R_co]):
    """A stage whose record can be made from verified files."""

    again: str  # what happens when a checkpoint's result cannot serve ("computed again")
    # Artifacts compared with the checkpoint's when the stage, before start_at, is computed
    # again as a live input: the warning when they differ.
    recomputed_differs: Mapping[str, str]

    def load(self, ctx: StageContext[Opt], up: Upstream, entry: Entry) -> R_co:
        """Fires for a stage before ``start_at`` (from ``resume_from``'s checkpoint, whose
        compatibility was checked first), and, for a stage that is not :class:`Cached`, only
        then. Raise :class:`~jaxaot.errors.EntryUnusable` (the files cannot serve this run) or
        :class:`~jaxaot.errors.NotLoadableHere` (this process cannot load them): the stage is
        computed instead where its live inputs are computed this run, else the error ends the
        run. Any other error (a plain StoreError for a corrupt or missing file) ends the run."""
        ...


@runtime_checkable
class Cached(Protocol[Opt, P, R]):
    """A stage whose result the store shares between runs. Store entries and checkpoints are
    checked by one rule, :func:`compat_mismatch` against :meth:`compat`."""

    required: tuple[str, ...]  # artifacts without which nothing is stored

    def compat(self, backend: Mapping[str, Any]) -> Mapping[str, Any]:
        """Fires before a store look-up and before a checkpoint of this stage loads: the fields
        an entry must have been made with (``backend`` is the run's: versions, platform)."""
        ...

    def plan(
        self, opts: Opt, facts: RunFacts, up: Upstream, backend: Mapping[str, Any]
    ) -> Plan[P] | Uncached[P]:
        """Fires when the stage is computed (before the store look-up, under no lock), and for
        an :class:`Ahead` stage also on the early record: the key and the prepared state, or
        :class:`Uncached` (then the store is not used). An error here is the stage's error."""
        ...

    def run_planned(self, ctx: StageContext[Opt], up: Upstream, plan: Plan[P] | Uncached[P]) -> R:
        """Fires in place of :meth:`Stage.run` after a store miss (holding the key's lock) or
        for :class:`Uncached`."""
        ...

    def load_planned(self, ctx: StageContext[Opt], up: Upstream, entry: Entry, plan: Plan[P]) -> R:
        """Fires on a store hit, in place of :meth:`Loadable.load`. Any
        :class:`~jaxaot.errors.StoreError` (:class:`~jaxaot.errors.EntryUnusable` included:
        the entry's bytes cannot serve this run) drops the entry;
        :class:`~jaxaot.errors.NotLoadableHere` (the entry is fine, this process cannot load
        it) keeps it; either way the stage is computed, warned. Any other error ends the run."""
        ...

    def storable(self, record: R, plan: Plan[P]) -> str | None:
        """Fires after :meth:`run_planned` computed a keyed result, when the store is on: why it
        must not be stored (warned), or None to store it."""
        ...


@runtime_checkable
class Ahead(Cached[Opt, P, R], Protocol[Opt, P, H, R]):
    """A :class:`Cached` stage with a single input that may start before that input is done."""

    def begin(self, opts: Opt, plan: Plan[P], out_dir: Path) -> Callable[[], H]:
        """Fires when the input publishes an early record (``StageContext.publish_early``), this
        run computes the stage, its plan has a key, no other job holds the key's lock and the
        store has no entry: the job to run on a worker thread (XLA releases the GIL).
        ``out_dir`` is the stage's run-dir folder."""
        ...

    def run_begun(self, ctx: StageContext[Opt], up: Upstream, plan: Plan[P], begun: H) -> R:
        """Fires in the stage's turn, in place of :meth:`Cached.run_planned`, when the job
        begun ahead has the key this turn's plan has: ``begun`` is what the job returned."""
        ...


@runtime_checkable
class Prepared(Protocol[Opt_contra]):
    """A stage that checks what it will build from the arguments before any work."""

    def before_run(self, opts: Opt_contra, facts: RunFacts) -> None:
        """Fires once per run for each stage between ``start_at`` and ``stop_after``, after the
        arguments are bound (``facts.bound``) and before JAX is configured (e.g. the inputs execute builds fit
        in memory): raise a :class:`~jaxaot.errors.ConfigError`."""
        ...


@runtime_checkable
class OnResume(Protocol[Opt_contra]):
    """A stage with a say in a resume."""

    def resume_default(
        self, saved: Mapping[str, Any], section: dict[str, Any], keys: set[str]
    ) -> dict[str, Any]:
        """Fires while a resume takes its options from the checkpoint, for this stage when it
        runs now on resumed inputs: its section from (the checkpoint's config, this run's
        section, the keys overridden) (e.g. compile for the platform it was lowered for)."""
        ...

    def before_resume(self, opts: Opt_contra, facts: RunFacts) -> None:
        """Fires before any stage's work, when this stage is loaded from the checkpoint:
        refuse a resume that cannot work here (raise)."""
        ...


@runtime_checkable
class Finishing(Protocol[Opt_contra, R_contra]):
    """A stage that adds to the run's manifest once every stage is done."""

    def finish(
        self,
        opts: Opt_contra,
        record: R_contra | None,
        stages: dict[str, Any],
        extra: dict[str, Any],
    ) -> None:
        """Fires after the last stage, before graphs and snapshots, with this stage's record
        (None when it was skipped), the manifest's stages and its extra fields; may raise
        :class:`~jaxaot.errors.DoesNotFit`."""
        ...


__all__ = [
    "Ahead",
    "Artifact",
    "Cached",
    "CheckFacts",
    "Entry",
    "Finishing",
    "Loadable",
    "OnResume",
    "Plan",
    "Prepared",
    "Presentation",
    "RunFacts",
    "Stage",
    "StageContext",
    "Uncached",
    "Upstream",
    "compat_mismatch",
]
