"""The stage graph and its runner: stage_out -> lower -> compile -> execute.

The runner owns ordering, ``start_at``/``stop_after``, resume, the store, timing, the manifest
and the summary; stages own their JAX work (``stages/``). Everything checkable without JAX is
checked by :func:`jaxaot.config.schema.validate` and :func:`jaxaot.config.argspec.bind` before JAX is
imported.

Stage statuses in the manifest: ``ran`` (computed here), ``cached`` (served from the store),
``resumed`` (loaded from ``resume_from``), ``skipped`` (after ``stop_after``), ``failed``,
``interrupted`` (Ctrl-C or SIGTERM while it ran). A target that calls ``sys.exit`` or
``os._exit`` fails its stage instead of ending the process (jaxaot.util.exits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxaot.config.argspec import BoundArgs, bind_config, check_inputs_fit
from jaxaot.config.mesh import devices_to_start
from jaxaot.config.order import STAGES
from jaxaot.config.schema import JaxaotConfig, to_container, validate
from jaxaot.engine.resume import Checkpoint
from jaxaot.errors import JaxaotError, StageError, StoreError, one_line
from jaxaot.rundir.dirs import claim
from jaxaot.rundir.manifest import Manifest
from jaxaot.stages.node import StageContext
from jaxaot.store.locks import KeyLock
from jaxaot.util import exits
from jaxaot.util.fsio import key_of
from omegaconf import DictConfig

log = logging.getLogger("jaxaot")


@dataclass(frozen=True)
class RunResult:
    """What a run produced: its directory, the manifest and each stage's record."""

    run_dir: Path
    manifest: dict[str, Any]
    records: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.manifest.get("status") == "ok")

    def __getitem__(self, stage: str) -> Any:
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
    for unexpected failures); the manifest records the failure either way.
    """
    typed = validate(cfg)
    checkpoint = None
    if typed.start_at != "stage_out":
        checkpoint = Checkpoint(typed.resume_from or "")
        typed = checkpoint.apply(typed, _hydra_overrides() if overrides is None else overrides)
    bound = bind_config(typed)  # arg specs checked before JAX is imported
    if typed.stop_after == "execute":
        check_inputs_fit(bound)  # the inputs execute builds, before any work
    out = Path(run_dir) if run_dir is not None else default_run_dir()
    manifest = Manifest(run_dir=out, config=to_container(typed))
    if checkpoint is not None:
        manifest.extra["resumed_from"] = str(checkpoint.run_dir.resolve())
    claim(out, manifest.to_json(), key=_run_dir_key(run_dir))  # a new dir, or a one-line refusal

    from jaxaot.stages import jaxenv
    from jaxaot.store.cache import Store, resolve_store_root

    store = Store(
        resolve_store_root(typed.store.dir),
        enabled=typed.store.enabled,
        trust=typed.store.trust or None,
    )
    first, last = STAGES.index(typed.start_at), STAGES.index(typed.stop_after)
    records: dict[str, Any] = {}
    runner = _Runner(typed, out, manifest, store, checkpoint, records)
    t_start = time.perf_counter()
    current: str | None = None  # the stage in progress, for an exit or interrupt
    restore: dict[str, Any] = {}  # JAX options this run changed (jax.config), put back after
    phase, t_stage = "set-up", t_start
    with exits.signals_raise(), exits.guard_os_exit():
        try:
            try:
                restore = jaxenv.configure(
                    backend=typed.compile.backend,
                    num_devices=devices_to_start(typed),
                    x64=bound.needs_x64,
                    jax_config=typed.jax.config,
                )
                manifest.versions = jaxenv.versions()
                manifest.environment = jaxenv.environment()  # what the compile key sees (issue 12)
                if first <= STAGES.index("compile") <= last:
                    store.check_trusted()  # a store others can write to: one line, before work
                comp = typed.compile
                if comp.topology and first == STAGES.index("execute"):
                    from jaxaot.stages.topology import check_resume

                    check_resume(comp)  # a topology's executable runs on a TPU host only
                if STAGES.index("compile") <= last:
                    manifest.backend = (
                        jaxenv.target_info(comp.topology, comp.num_slices)
                        if comp.topology
                        else jaxenv.backend_info(comp.backend)
                    )
                for i, stage in enumerate(STAGES):
                    current, t_stage = stage, time.perf_counter()
                    phase = f"stage {stage!r}"
                    if i < first:
                        records[stage] = runner.resume(stage, bound)
                    elif i <= last:
                        records[stage] = runner.run(stage)
                    else:
                        manifest.stages[stage] = {
                            "status": "skipped",
                            "seconds": 0.0,
                            "artifacts": {},
                        }
                current, phase = None, "the graph and snapshot step"
                if comp.topology and records.get("compile") is not None:
                    from jaxaot.stages.topology import EXECUTE_NOTE, fit_of

                    if manifest.stages.get("execute", {}).get("status") == "skipped":
                        manifest.stages["execute"]["note"] = EXECUTE_NOTE
                    # The verdict, in the manifest; DoesNotFit (exit code 3) when it is no.
                    manifest.extra["fit"] = fit_of(records["compile"], comp)
                from jaxaot.snapshots.snapshot import after_run

                after_run(typed, manifest, print_output=print_summary)  # graph, snapshot
                manifest.status = "ok"
            except SystemExit as exc:  # sys.exit / os._exit in user code: a failed stage
                if (why := exits.preempted()) is not None:  # the job system's exit, not ours
                    _record_unfinished(manifest, current, "interrupted", t_stage)
                    manifest.status, manifest.error = "interrupted", f"{why} during {phase}"
                    raise
                _record_unfinished(manifest, current, "failed", t_stage)
                raise StageError(current or "set-up", exits.describe_exit(exc)) from exc
        except Exception as exc:
            manifest.status, manifest.error = getattr(exc, "run_status", "failed"), one_line(exc)
            if getattr(exc, "fit", None) is not None:
                manifest.extra["fit"] = exc.fit  # type: ignore[attr-defined]
            raise
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (exits.Terminated)
            _record_unfinished(manifest, current, "interrupted", t_stage)
            manifest.status = "interrupted"
            manifest.error = f"{exits.describe_interrupt(exc)} during {phase}"
            manifest.write()
            if runner._pool is not None:  # an XLA compile cannot be stopped: do not wait for it
                runner._pool.shutdown(wait=False, cancel_futures=True)
                runner._pool = None
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
class _Runner:
    cfg: JaxaotConfig
    run_dir: Path
    manifest: Manifest
    store: Any  # jaxaot.store.cache.Store
    checkpoint: Checkpoint | None
    records: dict[str, Any]
    # The compile stage's store entry or running compile, found/started while lowering.
    _ahead: tuple[str, Any] | None = None
    _pool: ThreadPoolExecutor | None = None
    # The store-wide lock on the key compiling ahead, held until its put (issue 5).
    _held: KeyLock | None = None

    def close(self) -> None:
        if self._pool is not None:  # an XLA compile cannot be cancelled: let it finish
            self._pool.shutdown(wait=True)
        if self._held is not None:  # the run failed between lower and compile
            self._held.release()
            self._held = None

    def _context(self, stage: str) -> StageContext:
        ctx = StageContext(cfg=self.cfg, stage=stage, out_dir=self.run_dir / stage)
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        if stage == "lower" and STAGES.index(self.cfg.stop_after) >= STAGES.index("compile"):
            ctx.on_lowered = self._compile_ahead
        return ctx

    def _compile_key(self, lowered: Any) -> tuple[str | None, dict[str, Any], Any]:
        """The compile key, the store's compat dict and the :class:`jaxaot.stages.compile.Target`;
        the key is None when jax does not say which arguments the executable keeps (then the
        store is not used: a key without them could serve another program)."""
        from jaxaot.stages import compile as compile_stage
        from jaxaot.stages import jaxenv

        backend = self.manifest.backend
        target = compile_stage.prepare(self.cfg.compile, lowered)
        compat = {k: backend[k] for k in ("jax", "jaxlib", "platform", "platform_version")}
        if target.convention.kept is None:
            return None, compat, target
        key = key_of(
            compile_stage.cache_key(self.cfg, lowered, target, backend, jaxenv.key_environment())
        )
        return key, compat, target

    def _compile_ahead(self, lowered: Any) -> None:
        """Called by the lower stage once the module exists: look the executable up in the
        store, and on a miss start compiling on a worker thread (XLA releases the GIL), so the
        export, HLO text and cost analysis that lowering still does overlap the compile."""
        from jaxaot.stages import compile as compile_stage

        try:
            key, compat, target = self._compile_key(lowered)
        except JaxaotError:
            return  # the compile stage reports it, in its turn
        if key is None:
            return
        lock = KeyLock(self.store, "compile", key)
        if not lock.acquire(blocking=False):
            return  # another job is compiling this key: the compile stage waits, then hits
        entry = self.store.get("compile", key, expect=compat) if self.store.enabled else None
        if entry is not None:
            lock.release()
            self._ahead = (key, entry)
            return
        job = compile_stage.start(self.cfg.compile, target)
        self._held = lock

        def timed() -> tuple[Any, float]:
            t0 = time.perf_counter()
            return job(), time.perf_counter() - t0

        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="jaxaot-compile")
        self._ahead = (key, self._pool.submit(timed))

    def _upstream(self, stage: str) -> tuple[Any, ...]:
        r = self.records
        return {
            "stage_out": (),
            "lower": (r.get("stage_out"),),
            "compile": (r.get("lower"),),
            "execute": (r.get("compile"), r.get("stage_out")),
        }[stage]

    def _finish(self, ctx: StageContext, status: str, t0: float, **extra: Any) -> None:
        seconds = extra.pop("seconds", time.perf_counter() - t0)
        self.manifest.record_stage(ctx, status, seconds, **extra)
        self.manifest.write()
        log.info("[%s] %s in %.3f s", ctx.stage, status, seconds)

    def run(self, stage: str) -> Any:
        from jaxaot.stages import STAGE_FUNCTIONS

        ctx = self._context(stage)
        t0 = time.perf_counter()
        try:
            if stage == "compile":
                record, status, extra = self._compile(ctx)
            else:
                record, status, extra = (
                    STAGE_FUNCTIONS[stage](ctx, *self._upstream(stage)),
                    "ran",
                    {},
                )
        except JaxaotError as exc:
            if getattr(exc, "fit", None) is not None:  # DoesNotFit: the verdict's figures
                from jaxaot.stages.topology import metrics

                ctx.metrics.update(metrics({"fit": exc.fit}))  # type: ignore[attr-defined]
            status = getattr(exc, "run_status", "failed")
            self.manifest.record_stage(ctx, status, time.perf_counter() - t0)
            raise
        except Exception as exc:
            self.manifest.record_stage(ctx, "failed", time.perf_counter() - t0)
            raise StageError(stage, one_line(exc)) from exc
        self._finish(ctx, status, t0, **extra)
        return record

    def _compile(self, ctx: StageContext) -> tuple[Any, str, dict[str, Any]]:
        """Compile through the store: a verified hit is loaded, a miss is compiled and stored."""
        lowered = self.records["lower"]
        key, compat, target = self._compile_key(lowered)
        held, self._held = self._held, None
        if key is None:
            if held is not None:
                held.release()
            ctx.warn(
                "this jax does not say which arguments an executable keeps; compiled "
                "without the store"
            )
            return self._compile_locked(ctx, lowered, None, compat, target)
        # Jobs sharing a key compile it once: hold the lock taken ahead, or wait for the job
        # that holds it and then hit the store (issue 5).
        if held is not None and held.key != key:
            held.release()
            held = None
        with held or KeyLock(self.store, "compile", key):
            return self._compile_locked(ctx, lowered, key, compat, target)

    def _compile_locked(
        self, ctx: StageContext, lowered: Any, key: str | None, compat: dict[str, Any], target: Any
    ) -> tuple[Any, str, dict[str, Any]]:
        from jaxaot.stages import compile as compile_stage
        from jaxaot.stages import custom_calls

        store_on = self.store.enabled and key is not None
        label = f"compile/{(key or '')[:12]}"
        ahead, self._ahead = (self._ahead or (None, None)), None
        future = ahead[1] if ahead[0] == key and isinstance(ahead[1], Future) else None
        entry = ahead[1] if ahead[0] == key and future is None else None
        if entry is None and future is None and store_on:
            assert key is not None
            entry = self.store.get("compile", key, expect=compat)
        if entry is not None:
            assert key is not None
            t0 = time.perf_counter()
            try:
                record = compile_stage.load(
                    ctx, lowered, entry.read_bytes, f"store entry {label}", [target.convention]
                )
            except custom_calls.ColdLoadError as exc:  # the entry is fine; this process is not
                ctx.warn(
                    f"store entry {label} not loaded cold ({one_line(exc)}), compiling instead"
                )
                ctx.artifacts.clear()
                ctx.metrics.clear()
            except StoreError as exc:  # verified bytes that cannot serve this run (issue 12)
                reason = getattr(exc, "reason", None) or one_line(exc)
                outcome = self.store.discard("compile", key, reason)
                ctx.warn(f"store entry {label} unusable ({reason}); {outcome}, compiling instead")
                ctx.artifacts.clear()
                ctx.metrics.clear()
            else:
                saved = max(entry.compute_seconds - (time.perf_counter() - t0), 0.0)
                self.store.record("compile", key, hit=True, seconds_saved=saved)
                log.info(
                    "[compile] cache hit %s: executable loaded from %s (%.2f s saved)",
                    key[:12],
                    self.store.root,
                    saved,
                )
                return record, "cached", {"key": key, "seconds_saved": round(saved, 6)}
        t0 = time.perf_counter()
        extra: dict[str, Any] = {"key": key}
        if future is not None:
            waited = time.perf_counter()
            compiled, compile_s = future.result()
            waited = time.perf_counter() - waited
            record = compile_stage.run(ctx, lowered, compiled)
            seconds = compile_s + (time.perf_counter() - t0 - waited)
            # The stage's cost, not its wait: part of the compile ran during lowering.
            extra |= {
                "seconds": round(seconds, 6),
                "overlapped_seconds": round(compile_s - waited, 6),
            }
        else:
            record = compile_stage.run(ctx, lowered, target=target)
            seconds = time.perf_counter() - t0
        if store_on:
            assert key is not None
            log.info("[compile] cache miss %s: compiled in %.2f s", key[:12], seconds)
            self.store.record("compile", key, hit=False)
        # What is stored must be what the key says (and what a hit will be checked against).
        wrong = store_on and compile_stage.mismatch(
            compile_stage.convention_of(record.compiled), [target.convention]
        )
        if wrong:
            ctx.warn(f"executable not stored: {wrong} (a jax change?)")
        elif store_on and "executable.bin" in ctx.artifacts:  # else nothing a hit could load
            assert key is not None
            self.store.put(
                "compile",
                key,
                files={n: a.path for n, a in ctx.artifacts.items()},
                meta={"program": self.cfg.program.name, "metrics": ctx.metrics},
                compute_seconds=seconds,
                compat=compat,
            )
        return record, "ran", extra

    def resume(self, stage: str, bound: BoundArgs) -> Any:
        """Load a stage that ran before ``start_at`` from the checkpoint (hashes verified)."""
        from jaxaot.stages import lower as lower_stage
        from jaxaot.stages import stage_out

        assert self.checkpoint is not None
        ckpt, start_at = self.checkpoint, self.cfg.start_at
        ckpt.require(stage, start_at)
        read = ckpt.reader(stage)
        ctx = self._context(stage)
        t0 = time.perf_counter()
        record: Any
        if stage == "stage_out":
            if start_at == "lower":  # lowering again needs the traced program: trace it here
                record = stage_out.run(ctx)
                self._compare_jaxpr(ctx, read)
                self._finish(ctx, "ran", t0)
                return record
            record = stage_out.resumed(ctx, bound, read)
        elif stage == "lower":
            record = lower_stage.load(ctx, read)
        else:
            record, why = self._resume_compile(ctx, read)
            if record is None:
                record = self.run("compile")
                self.manifest.stages["compile"]["warnings"].append(why)
                self.manifest.write()
                return record
        self._finish(ctx, "resumed", t0, source=str(ckpt.run_dir))
        return record

    def _compare_jaxpr(self, ctx: StageContext, read: Any) -> None:
        try:
            same = read("jaxpr.txt") == ctx.artifacts["jaxpr.txt"].path.read_bytes()
        except KeyError:
            return
        if not same:
            ctx.warn(
                "the program traces to a different jaxpr than in the checkpoint (code changed?)"
            )

    def _resume_compile(self, ctx: StageContext, read: Any) -> tuple[Any, str]:
        """The checkpoint's executable if this host can run it, else (None, why) to recompile."""
        from jaxaot.stages import compile as compile_stage

        assert self.checkpoint is not None
        theirs = self.checkpoint.manifest.get("backend", {})
        mine = self.manifest.backend
        fields = ("platform", "platform_version", "jaxlib")
        if any(theirs.get(f) != mine.get(f) for f in fields):
            what = ", ".join(
                f"{f} {theirs.get(f)!r} (here {mine.get(f)!r})"
                for f in fields
                if theirs.get(f) != mine.get(f)
            )
            why = f"checkpoint executable was built for {what}; not loaded, compiled again from lower/exported.bin"
            log.warning("[compile] %s", why)
            return None, why
        lowered = self.records["lower"]
        try:
            # The store's rule (compile_stage.mismatch), against what the checkpoint's export
            # says the executable must be; the checkpoint itself is kept.
            record = compile_stage.load(
                ctx,
                lowered,
                read,
                f"resume_from={self.checkpoint.run_dir}",
                compile_stage.export_conventions(lowered),
            )
            return record, ""
        except compile_stage.UnusableExecutable as exc:
            reason = exc.reason
        except StoreError:
            raise
        except Exception as exc:
            reason = one_line(exc)
        why = (
            f"checkpoint executable unusable here ({reason}); not loaded, compiled again "
            "from lower/exported.bin"
        )
        ctx.artifacts.clear()
        ctx.metrics.clear()
        log.warning("[compile] %s", why)
        return None, why


__all__ = ["RunResult", "default_run_dir", "one_line", "run"]
