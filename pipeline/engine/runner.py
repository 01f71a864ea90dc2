"""The stage graph and its runner: stage_out -> lower -> compile -> execute.

The runner owns ordering, ``start_at``/``stop_after``, resume, the store, timing, the manifest
and the summary; stages own their JAX work (``stages/``). Everything checkable without JAX is
checked by :func:`jaxaot.schema.validate` and :func:`jaxaot.config.argspec.bind` before JAX is
imported.

Stage statuses in the manifest: ``ran`` (computed here), ``cached`` (served from the store),
``resumed`` (loaded from ``resume_from``), ``skipped`` (after ``stop_after``), ``failed``,
``interrupted`` (Ctrl-C, SIGTERM or a job system's preemption while it ran). A target that
calls ``sys.exit`` or ``os._exit`` fails its stage instead of ending the process
(jaxaot.util.exits).

A run that fails before it claims its folder with a manifest (a config error, a refused
import) leaves no folder behind when jaxaot made that folder for it
(jaxaot.rundir.dirs.remove_unstarted): the error line is its whole record. Later, the manifest
records how the run ended.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from jaxaot.config.argspec import BoundArgs, bind_config
from jaxaot.config.mesh import devices_to_start, mesh_spec
from jaxaot.config.order import STAGES
from jaxaot.engine.own_args import check_deferred
from jaxaot.engine.resume import Checkpoint, resolve_resume_from
from jaxaot.engine.run_facts import run_facts
from jaxaot.errors import (
    DoesNotFit,
    EntryUnusable,
    JaxaotError,
    NotLoadableHere,
    StageError,
    StoreError,
    one_line,
)
from jaxaot.rundir.dirs import claim, remove_unstarted
from jaxaot.rundir.manifest import Manifest
from jaxaot.schema import JaxaotConfig, check_sections, to_container, typed_config, validated
from jaxaot.stages import NODES
from jaxaot.stages.contract import (
    Ahead,
    Cached,
    Entry,
    Finishing,
    Loadable,
    OnResume,
    Plan,
    Prepared,
    RunFacts,
    Stage,
    StageContext,
    Uncached,
    Upstream,
    compat_mismatch,
)
from jaxaot.store.locks import KeyLock
from jaxaot.store.root import check_store_dir
from jaxaot.util import exits
from omegaconf import DictConfig

if TYPE_CHECKING:
    from jaxaot.stages import Compiled, Executed, Lowered, StagedOut

log = logging.getLogger("jaxaot")


@dataclass(frozen=True, repr=False)
class RunResult:
    """What a run produced: its directory, the manifest and each stage's record."""

    run_dir: Path
    manifest: dict[str, Any]
    records: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        """A few lines: status, program, run dir, each stage's status and key figures."""
        from jaxaot.engine.result_repr import result_repr

        return result_repr(self)

    @property
    def ok(self) -> bool:
        return bool(self.manifest.get("status") == "ok")

    @overload
    def __getitem__(self, stage: Literal["stage_out"]) -> StagedOut: ...
    @overload
    def __getitem__(self, stage: Literal["lower"]) -> Lowered: ...
    @overload
    def __getitem__(self, stage: Literal["compile"]) -> Compiled: ...
    @overload
    def __getitem__(self, stage: Literal["execute"]) -> Executed: ...
    @overload
    def __getitem__(self, stage: str) -> Any: ...
    def __getitem__(self, stage: str) -> Any:
        """A stage's record: ``result["compile"].cost``, typed per stage name."""
        return self.records[stage]


def default_run_dir() -> Path:
    """Hydra's run directory when called from a Hydra app, else the CLI's default layout.

    From Python (``jaxaot.run`` outside Hydra) this is the folder the command line would make,
    ``outputs/<date>/<time>`` (``-1``, ``-2``, ... when taken; jaxaot.rundir.dirs.default_run_dir),
    so scripts and the CLI share one layout and one root. Either is new for this run.
    """
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    from jaxaot.rundir.dirs import default_run_dir as fresh

    return fresh()


def _run_dir_key(run_dir: Path | str | None) -> str:
    """Where a run's directory came from, for the error that refuses a taken one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if run_dir is not None:
        return "run_dir"
    if HydraConfig.initialized():
        sweep = HydraConfig.get().mode == RunMode.MULTIRUN
        return "hydra.sweep.dir" if sweep else "hydra.run.dir"
    return "run_dir"


def _hydra_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _hydra_run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return None


def run(
    cfg: DictConfig | JaxaotConfig | dict[str, Any],
    *,
    run_dir: Path | str | None = None,
    print_summary: bool = False,
    overrides: Sequence[str] | None = None,
) -> RunResult:
    """Run the pipeline for ``cfg`` and return the typed stage records.

    ``overrides`` (default: the Hydra command line's) are checked against a resumed
    checkpoint's options. Raises :class:`JaxaotError` (a :class:`StageError` naming the stage
    for unexpected failures); the manifest records the failure, or, for a run refused before
    it wrote one, a folder jaxaot made for it is removed (jaxaot.rundir.dirs.remove_unstarted).
    """
    chosen: list[Path] = []  # the run dir, once this run has chosen it
    try:
        return _run(cfg, run_dir, print_summary, overrides, chosen)
    except Exception:
        # Refused before claiming its folder (a config error): Hydra's `.hydra/` and the log
        # file may be there already, and nothing else.
        if not chosen:
            remove_unstarted(Path(run_dir) if run_dir is not None else _hydra_run_dir())
        raise


def _run(
    cfg: DictConfig | JaxaotConfig | dict[str, Any],
    run_dir: Path | str | None,
    print_summary: bool,
    overrides: Sequence[str] | None,
    chosen: list[Path],
) -> RunResult:
    check_deferred(cfg)  # compose()'s refusal: program.target given, program.args another's
    typed = typed_config(cfg)
    checkpoint = None
    checked_store = None
    given = _hydra_overrides() if overrides is None else overrides
    if typed.resume_from:
        # The user's own config first, so that a bad key is named before a checkpoint's
        # problem: each section alone, and the store folder (never taken from a checkpoint).
        # What spans sections is checked on the config the run resumes with, below.
        check_sections(typed)
        check_store_dir(
            typed.store.dir, typed.store.enabled, typed.store.cache_dir, typed.store.lease_s
        )
        checked_store = typed.store
        typed = resolve_resume_from(typed, given)  # resume_from=latest: the run it means
        if STAGES.index(typed.start_at) > 0 and typed.resume_from:
            checkpoint = Checkpoint(typed.resume_from)
            typed = checkpoint.apply(typed, given)  # the sections it resumes with
    # Checked once, as the run runs; the arguments bound once (by the mesh checks, or here),
    # all before JAX is imported.
    typed, checked_bound = validated(typed)
    # A bucket store's URL, library and cache folder (validation checked a folder store);
    # a resumed run checked its store above, and a checkpoint never changes it.
    if typed.store != checked_store:
        check_store_dir(
            typed.store.dir, typed.store.enabled, typed.store.cache_dir, typed.store.lease_s
        )
    bound = (
        checked_bound
        if checked_bound is not None
        else bind_config(typed.program, typed.stage_out, typed.lower)
    )
    facts = run_facts(typed, bound)
    opts = {n.name: getattr(typed, n.name) for n in NODES}  # each stage's own section
    first, last = STAGES.index(typed.start_at), STAGES.index(typed.stop_after)
    for node in NODES[first : last + 1]:
        if isinstance(node, Prepared):
            node.before_run(opts[node.name], facts)  # e.g. the inputs execute builds fit
    # What each node does in this run: resumed from the checkpoint (before start_at; computed
    # again when the first node needs it live), run, or skipped (after stop_after).
    live = set(NODES[first].live_inputs) if first > 0 else set()
    plan = [
        ("recompute" if n.name in live else "resume")
        if i < first
        else "run"
        if i <= last
        else "skip"
        for i, n in enumerate(NODES)
    ]
    computed = {n.name for n, how in zip(NODES, plan, strict=True) if how in ("run", "recompute")}
    from jaxaot.stages import jaxenv

    exits.clear_pending()  # one from before this run (a sweep's earlier job) is not its
    # JAX options this run changed (jax.config), put back after it. The first stage imports
    # program.target: when this run computes it, JAX is configured and the target imported
    # now, so a target that cannot be imported is refused in one line before the run has a
    # folder (from compile on, no Python code of the program is needed).
    configured = STAGES[0] in computed
    restore = _import_target(typed, bound) if configured else {}
    out = Path(run_dir) if run_dir is not None else default_run_dir()
    chosen.append(out)
    manifest = Manifest(run_dir=out, config=to_container(typed))
    if checkpoint is not None:
        manifest.extra["resumed_from"] = str(checkpoint.run_dir.resolve())
    t_start = time.perf_counter()
    current: str | None = None  # the stage in progress, for an exit or interrupt
    phase, t_stage = "set-up", t_start
    claimed = False  # the run directory is this run's: its manifest may be written

    def interrupted() -> tuple[str | None, str, float]:
        """The stage an interrupt or a preemption ended, the phase for its message, and when
        that stage began here: ``current``; or, when ``current`` is recorded already (between
        two stages) and the next one is computing ahead on a worker thread (compile, begun
        while lower finished), that next one."""
        if current is None or current not in manifest.stages:
            return current, phase, t_stage
        todo = [n.name for n, how in zip(NODES, plan, strict=True) if how != "skip"]
        later = todo[todo.index(current) + 1 :] if current in todo else []
        if later and runner.computing_ahead(later[0]):
            return later[0], f"stage {later[0]!r}", time.perf_counter()
        return current, phase, t_stage

    def record_preempted(why: str) -> None:
        """The job system is ending this run (exits.note_preempted, from submitit's signal
        handler, before it requeues the job): record it as interrupted now, unless it has
        ended already (ok or failed). Whatever the handler interrupted may be iterating
        ``manifest.stages``: a new dict replaces it."""
        if not claimed or manifest.status != "running":
            return
        stage, during, t0 = interrupted()
        manifest.stages = dict(manifest.stages)
        _record_unfinished(manifest, stage, "interrupted", t0)
        manifest.status, manifest.error = "interrupted", f"{why} during {during}"
        manifest.extra = {**manifest.extra, "wall_seconds": round(time.perf_counter() - t_start, 6)}
        manifest.write()

    with (
        exits.recording_preemption(record_preempted),
        exits.signals_raise(),
        exits.guard_os_exit(),
    ):
        try:
            claim(out, manifest.to_json(), key=_run_dir_key(run_dir))  # new, or refused
            claimed = True
            from jaxaot.store.tiered import open_store

            store = open_store(
                typed.store.dir,
                typed.store.cache_dir,
                enabled=typed.store.enabled,
                trust=typed.store.trust or None,
                lease_s=typed.store.lease_s,
            )
        except BaseException:
            jaxenv.restore_config(restore)
            raise
        records: dict[str, Any] = {}
        runner = _Runner(facts, opts, out, manifest, store, checkpoint, records, running=computed)
        try:
            try:
                if not configured:
                    restore = _configure_jax(typed, bound)
                manifest.versions = jaxenv.versions()
                manifest.environment = jaxenv.environment()  # what the compile key sees
                if any(isinstance(n, Cached) and n.name in computed for n in NODES):
                    store.check_trusted()  # a store others can write to: one line, before work
                for n, how in zip(NODES, plan, strict=True):
                    if how == "resume" and isinstance(n, OnResume):
                        n.before_resume(opts[n.name], facts)  # e.g. a TPU host's executable
                if any(isinstance(n, Cached) for n in NODES[: last + 1]):
                    manifest.backend = jaxenv.run_backend(typed.compile)
                for node, how in zip(NODES, plan, strict=True):
                    current, t_stage = node.name, time.perf_counter()
                    phase = f"stage {node.name!r}"
                    if how == "skip":
                        manifest.stages[node.name] = {
                            "status": "skipped",
                            "seconds": 0.0,
                            "artifacts": {},
                        }
                        continue
                    if how != "run":
                        assert checkpoint is not None
                        checkpoint.require(node.name, typed.start_at)
                    records[node.name] = runner.step(node, how)
                    exits.raise_pending()  # an interrupt Python dropped (a gc callback)
                current, phase = None, "the graph and snapshot step"
                for node in NODES:
                    if isinstance(node, Finishing):
                        node.finish(
                            opts[node.name], records.get(node.name), manifest.stages, manifest.extra
                        )
                from jaxaot.snapshots.snapshot import after_run

                after_run(typed.snapshot, manifest, print_output=print_summary)  # graph, snapshot
                exits.raise_pending()
                manifest.status = "ok"
            except SystemExit as exc:  # sys.exit / os._exit in user code: a failed stage
                if (why := exits.preempted()) is not None:  # the job system's exit, not ours
                    if manifest.status == "running":  # not recorded by record_preempted
                        stage, during, t0 = interrupted()
                        _record_unfinished(manifest, stage, "interrupted", t0)
                        manifest.status, manifest.error = "interrupted", f"{why} during {during}"
                    runner.abandon()  # SLURM's SIGKILL follows: write now, not after a compile
                    raise
                _record_unfinished(manifest, current, "failed", t_stage)
                raise StageError(current or "set-up", exits.describe_exit(exc)) from exc
        except Exception as exc:
            manifest.status, manifest.error = "failed", one_line(exc)
            if isinstance(exc, DoesNotFit):
                manifest.status = exc.run_status
                manifest.extra["fit"] = exc.fit
            raise
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (exits.Terminated)
            exits.clear_pending()
            stage, during, t0 = interrupted()
            _record_unfinished(manifest, stage, "interrupted", t0)
            manifest.status = "interrupted"
            manifest.error = f"{exits.describe_interrupt(exc)} during {during}"
            manifest.write()
            runner.abandon()  # an XLA compile cannot be stopped: do not wait for it
            exc.add_note(f"{manifest.error}; recorded as interrupted in {manifest.path}")
            raise
        finally:
            runner.close()
            jaxenv.restore_config(restore)  # a sweep's next job starts from the same settings
            manifest.extra["wall_seconds"] = round(time.perf_counter() - t_start, 6)
            try:
                manifest.write()
            except OSError as err:  # a full disk: keep the run's own error, if it has one
                if manifest.status == "ok":
                    raise
                log.error("could not write %s: %s", manifest.path, err)
            if print_summary:
                from jaxaot.engine.summary import render

                # The error itself is raised to the caller, which prints it (once).
                print(render(manifest.to_json(), show_error=False), flush=True)
    return RunResult(run_dir=out, manifest=manifest.to_json(), records=records)


def _configure_jax(typed: JaxaotConfig, bound: BoundArgs) -> dict[str, Any]:
    """JAX's settings for this run (backend, device count, x64, ``jax.config``; the plugins'
    start-up noise dropped): the previous values of the options it changed."""
    from jaxaot.stages import jaxenv

    return jaxenv.configure(
        backend=typed.compile.backend,
        num_devices=devices_to_start(
            typed.compile, mesh_spec(typed.mesh, typed.stage_out), typed.stop_after
        ),
        x64=bound.needs_x64,
        jax_config=typed.jax.config,
    )


def _import_target(typed: JaxaotConfig, bound: BoundArgs) -> dict[str, Any]:
    """Configure JAX as the run does, then import ``program.target`` through the run's import
    policy, as stage_out will (Python caches the module: stage_out's import is a look-up).
    A TargetError when it cannot be imported; a target that ends the process while it is
    imported (``sys.exit``, ``os._exit``) is one too. Returns what :func:`_configure_jax`
    returned; the JAX options are put back when the import fails."""
    from jaxaot.config.trust import policy_of
    from jaxaot.errors import TargetError
    from jaxaot.stages import jaxenv
    from jaxaot.stages.resolving import resolve_target

    target = typed.program.target
    restore: dict[str, Any] = {}
    try:
        restore = _configure_jax(typed, bound)
        with exits.guard_os_exit():
            resolve_target(target, policy=policy_of(typed.trust))
    except SystemExit as exc:
        jaxenv.restore_config(restore)
        if exits.preempted() is not None:  # the job system's exit, not the program's
            raise
        module = target.partition(":")[0]
        code = "" if exc.code is None else repr(exc.code)
        raise TargetError(
            f"program.target={target!r}: importing {module!r} called "
            f"{getattr(exc, 'how', 'sys.exit')}({code}); expected the module to import without "
            "ending the process"
        ) from None
    except BaseException:
        jaxenv.restore_config(restore)
        raise
    return restore


def _record_unfinished(manifest: Manifest, stage: str | None, status: str, t0: float) -> None:
    """A stage that ended by an exit or an interrupt, which the stage itself did not record."""
    if stage is None or stage in manifest.stages:  # the stage recorded its own failure
        return
    manifest.stages[stage] = {
        "status": status,
        "seconds": round(time.perf_counter() - t0, 6),
        "key": None,
        "artifacts": {},
        "metrics": {},
        "warnings": [],
    }


@dataclass
class _Ahead:
    """A stage's result found or started while its input was still being made: the verified
    store entry, or the job running on the worker thread together with the store lock on its
    key, held until the put (jobs sharing a key compute it once)."""

    plan: Plan[Any]
    entry: Any = None  # a StoreEntry
    future: Future[tuple[Any, float]] | None = None
    lock: KeyLock | None = None


@dataclass
class _Runner:
    """One generic loop over the stages (:data:`jaxaot.stages.NODES`); no stage is named here, and what a
    stage is beyond :class:`~jaxaot.stages.contract.Stage` is asked with ``isinstance``. For a
    stage before ``start_at``: the checkpoint's result if it is compatible, else computed. For a
    stage this run computes: a verified store hit if it is Cached and has a key, else run (with
    what its ``begin`` started ahead, if anything)."""

    facts: RunFacts
    opts: dict[str, Any]  # each stage's own options, by name
    run_dir: Path
    manifest: Manifest
    store: Any  # jaxaot.store.cache.Store
    checkpoint: Checkpoint | None
    records: dict[str, Any]
    running: set[str] = field(default_factory=set)  # the stages this run computes
    stages: tuple[Stage[Any, Any], ...] = NODES  # in pipeline order
    _ahead: dict[str, _Ahead] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:  # an XLA compile cannot be cancelled: let it finish
            self._pool.shutdown(wait=True)
        for ahead in self._ahead.values():  # the run failed before the stage's turn
            if ahead.lock is not None:
                ahead.lock.release()
        self._ahead.clear()

    def computing_ahead(self, name: str) -> bool:
        """Whether stage ``name`` was started on the worker thread before its turn."""
        ahead = self._ahead.get(name)
        return ahead is not None and ahead.future is not None

    def abandon(self) -> None:
        """Ctrl-C: do not wait for a job started ahead (an XLA compile cannot be stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- one stage -----------------------------------------------------------------------------
    def step(self, node: Stage[Any, Any], how: str) -> Any:
        """``how``: ``run`` (this run computes it), ``resume`` (from the checkpoint) or
        ``recompute`` (before start_at, but the first stage needs it live)."""
        ctx = self._context(node)
        t0 = time.perf_counter()
        up = {n: self.records.get(n) for n in node.inputs}
        try:
            if how == "resume":
                loaded, note = self._resume(node, ctx, up)
                if note is None:
                    assert self.checkpoint is not None
                    self._finish(ctx, "resumed", t0, source=str(self.checkpoint.run_dir))
                    return loaded
                log.warning("[%s] %s", node.name, note)
                ctx.reset()
                ctx.warnings.append(note)
            record, status, extra = self._compute(node, ctx, up)
        except JaxaotError as exc:
            status = "failed"
            if isinstance(exc, DoesNotFit):
                status = exc.run_status
                ctx.metrics.update(exc.metrics)  # the verdict's report columns
                if exc.breakdown:  # what was live at the peak of a program XLA refused
                    from jaxaot.stages import memory_breakdown

                    memory_breakdown.write(ctx, exc.breakdown)
            self.manifest.record_stage(ctx, status, time.perf_counter() - t0, **ctx.extra)
            raise
        except Exception as exc:
            self.manifest.record_stage(ctx, "failed", time.perf_counter() - t0, **ctx.extra)
            raise StageError(node.name, one_line(exc)) from exc
        if how == "recompute":
            self._compare_with_checkpoint(node, ctx)
        self._finish(ctx, status, t0, **extra)
        return record

    def _context(self, node: Stage[Any, Any]) -> StageContext:
        ctx: StageContext[Any] = StageContext(
            opts=self.opts[node.name],
            facts=self.facts,
            stage=node.name,
            out_dir=self.run_dir / node.name,
        )
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        if any(isinstance(c, Ahead) and c.inputs == (node.name,) for c in self._consumers(node)):
            ctx.publish_early = lambda early: self._early(node, early)
        return ctx

    def _consumers(self, node: Stage[Any, Any]) -> list[Stage[Any, Any]]:
        return [c for c in self.stages if node.name in c.inputs and c.name in self.running]

    def _finish(self, ctx: StageContext, status: str, t0: float, **extra: Any) -> None:
        seconds = extra.pop("seconds", time.perf_counter() - t0)
        self.manifest.record_stage(ctx, status, seconds, **ctx.extra, **extra)
        self.manifest.write()
        log.info("[%s] %s in %.3f s", ctx.stage, status, seconds)

    def _compat(self, node: Stage[Any, Any]) -> dict[str, Any]:
        return dict(node.compat(self.manifest.backend)) if isinstance(node, Cached) else {}

    def _plan(self, node: Stage[Any, Any], up: Upstream) -> Plan[Any] | Uncached[Any]:
        assert isinstance(node, Cached)
        return node.plan(self.opts[node.name], self.facts, up, self.manifest.backend)

    # -- resume: the checkpoint as an Entry ------------------------------------------------------
    def _resume(
        self, node: Stage[Any, Any], ctx: StageContext, up: dict[str, Any]
    ) -> tuple[Any, str | None]:
        """(record, None) from the checkpoint, or (None, why) when the checkpoint's result
        cannot serve this run (the same compatibility rule as the store's, or ``load`` raised
        EntryUnusable or NotLoadableHere) and its live inputs are computed: then the stage is
        computed, the store first. Any other error of ``load`` (a corrupt or missing checkpoint
        file, a refused import) ends the run."""
        assert self.checkpoint is not None and isinstance(node, Loadable)
        entry = self.checkpoint.entry(node.name)
        why = compat_mismatch(entry.compat, self._compat(node))
        if why is not None:
            why = f"was built for {why}"
        else:
            try:
                return node.load(ctx, up, entry), None
            except (EntryUnusable, NotLoadableHere) as exc:
                # A result that cannot serve this run, from a stage that can compute it:
                # compute. Anything else (a corrupt or missing file, a refused import) is the
                # user's.
                if not all(i in self.running for i in node.live_inputs):
                    raise
                why = f"unusable here ({one_line(exc)})"
        return None, f"checkpoint {node.show.noun} {why}; not loaded, {node.again}"

    def _compare_with_checkpoint(self, node: Stage[Any, Any], ctx: StageContext) -> None:
        """A stage recomputed before ``start_at``: say when it differs from the checkpoint's."""
        assert self.checkpoint is not None
        if not isinstance(node, Loadable):
            return
        read = self.checkpoint.entry(node.name).read
        for name, note in node.recomputed_differs.items():
            try:
                same = read(name) == ctx.artifacts[name].path.read_bytes()
            except KeyError:
                continue
            if not same:
                ctx.warn(note)

    # -- run: a verified store hit, else compute -----------------------------------------------
    def _compute(
        self, node: Stage[Any, Any], ctx: StageContext, up: dict[str, Any]
    ) -> tuple[Any, str, dict[str, Any]]:
        if not isinstance(node, Cached):
            record, extra = self._run(node, ctx, up, None, None)
            return record, "ran", extra
        planned = self._plan(node, up)  # first: if it raises, close() releases a lock taken ahead
        ahead = self._ahead.pop(node.name, None)
        if ahead is not None and (not isinstance(planned, Plan) or ahead.plan.key != planned.key):
            # Begun on an early record that keys differently: not this run's result. Let it end
            # first (it writes into this stage's folder too: dumps, traces), then compute.
            if ahead.future is not None:
                with contextlib.suppress(Exception):
                    ahead.future.result()
            if ahead.lock is not None:
                ahead.lock.release()
            ahead = None
        if isinstance(planned, Uncached):
            if planned.why:
                ctx.warn(planned.why)
            record, extra = self._run(node, ctx, up, planned, None)
            return record, "ran", extra
        # Jobs sharing a key compute it once: hold the lock taken ahead, or wait for the job
        # that holds it and then hit the store.
        held = ahead.lock if ahead is not None else None
        with held or KeyLock(self.store, node.name, planned.key):
            return self._compute_locked(node, ctx, up, planned, ahead)

    def _compute_locked(
        self,
        node: Cached[Any, Any, Any],
        ctx: StageContext,
        up: dict[str, Any],
        plan: Plan[Any],
        ahead: _Ahead | None,
    ) -> tuple[Any, str, dict[str, Any]]:
        assert isinstance(node, Stage)
        key = plan.key
        store_on = self.store.enabled
        label = f"store entry {node.name}/{key[:12]}"
        entry = ahead.entry if ahead is not None else None
        if entry is None and ahead is None and store_on:
            entry = self.store.get(node.name, key, expect=self._compat(node))
        if entry is not None:
            t0 = time.perf_counter()
            stored = Entry(
                label=label,
                read=entry.read_bytes,
                compat=entry.compat,
                source="store",
                created=entry.created,
            )
            ctx.same_as = {name: entry.path(name) for name in entry.files}  # one copy on disk
            try:
                record = node.load_planned(ctx, up, stored, plan)
            except StoreError as exc:  # EntryUnusable, or any other fault of the entry
                reason = one_line(exc)
                outcome = self.store.discard(node.name, key, reason)
                ctx.warn(f"{label} unusable ({reason}); {outcome}, {node.show.verb} instead")
                ctx.reset()
            except NotLoadableHere as exc:  # the entry is fine; this process is not
                ctx.warn(f"{label} not loaded cold ({one_line(exc)}), {node.show.verb} instead")
                ctx.reset()
            else:
                saved = max(entry.compute_seconds - (time.perf_counter() - t0), 0.0)
                self.store.record(node.name, key, hit=True, seconds_saved=saved)
                log.info(
                    "[%s] cache hit %s: loaded from %s (%.2f s saved)",
                    node.name,
                    key[:12],
                    self.store.root,
                    saved,
                )
                return record, "cached", {"key": key, "seconds_saved": round(saved, 6)}
        record, extra = self._run(node, ctx, up, plan, ahead)
        seconds = extra["seconds"]
        if store_on:
            log.info("[%s] cache miss %s: computed in %.2f s", node.name, key[:12], seconds)
            self.store.record(node.name, key, hit=False)
        # What is stored must be what the key says (and what a hit will be checked against).
        wrong = node.storable(record, plan) if store_on else None
        if wrong:
            ctx.warn(wrong)
        elif store_on and all(name in ctx.artifacts for name in node.required):
            self.store.put(
                node.name,
                key,
                files={n: a.path for n, a in ctx.artifacts.items()},
                meta={"program": self.facts.program, "metrics": ctx.metrics},
                compute_seconds=seconds,
                compat=self._compat(node),
            )
        return record, "ran", {"key": key, **extra}

    def _run(
        self,
        node: Stage[Any, Any],
        ctx: StageContext,
        up: dict[str, Any],
        planned: Plan[Any] | Uncached[Any] | None,
        ahead: _Ahead | None,
    ) -> tuple[Any, dict[str, Any]]:
        """The stage's run (``run_planned`` with a plan), or ``run_begun`` with the result of
        what ``begin`` started ahead. The seconds are the stage's own cost, not its wait: part
        of the work ran while the input was being made."""
        t0 = time.perf_counter()
        if ahead is None or ahead.future is None:
            if planned is not None and isinstance(node, Cached):
                record = node.run_planned(ctx, up, planned)
            else:
                record = node.run(ctx, up)
            return record, {"seconds": round(time.perf_counter() - t0, 6)}
        assert isinstance(node, Ahead)
        started, started_s = ahead.future.result()
        waited = time.perf_counter() - t0
        record = node.run_begun(ctx, up, ahead.plan, started)
        seconds = started_s + (time.perf_counter() - t0 - waited)
        return record, {
            "seconds": round(seconds, 6),
            "overlapped_seconds": round(started_s - waited, 6),
        }

    # -- ahead: a consumer begins on its input's early record ------------------------------------
    def _early(self, producer: Stage[Any, Any], early: object) -> None:
        """``producer`` published an early record (lower: the module exists, the export does not
        yet): each Ahead consumer looks its result up in the store, and on a miss starts it on
        a worker thread (XLA releases the GIL), so the rest of ``producer`` overlaps it."""
        for node in self._consumers(producer):
            if (
                not isinstance(node, Ahead)
                or not isinstance(node, Cached)
                or node.inputs != (producer.name,)
                or node.name in self._ahead
            ):
                continue
            try:
                planned = self._plan(node, {producer.name: early})
            except JaxaotError:
                continue  # the stage reports it, in its turn
            if not isinstance(planned, Plan):
                continue
            lock = KeyLock(self.store, node.name, planned.key)
            if not lock.acquire(blocking=False):
                continue  # another job computes this key: the stage waits, then hits
            try:
                entry = (
                    self.store.get(node.name, planned.key, expect=self._compat(node))
                    if self.store.enabled
                    else None
                )
                job = (
                    None
                    if entry is not None
                    else node.begin(self.opts[node.name], planned, self.run_dir / node.name)
                )
            except BaseException:
                lock.release()  # the stage computes in its turn, and reports what failed
                raise
            if entry is not None:
                lock.release()
                self._ahead[node.name] = _Ahead(planned, entry=entry)
                continue
            assert job is not None

            def timed(job: Callable[[], Any] = job) -> tuple[Any, float]:
                t0 = time.perf_counter()
                return job(), time.perf_counter() - t0

            self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="jaxaot-ahead")
            self._ahead[node.name] = _Ahead(planned, future=self._pool.submit(timed), lock=lock)


__all__ = ["RunResult", "default_run_dir", "one_line", "run"]
