"""The stage graph and its runner: stage_out -> lower -> compile -> execute.

The runner owns ordering, ``start_at``/``stop_after``, resume, the store, timing, the manifest
and the summary; stages own their JAX work (``stages/``). Everything checkable without JAX is
checked by :func:`pipeline.config.validate` and :func:`pipeline.argspec.bind` before JAX is
imported.

Stage statuses in the manifest: ``ran`` (computed here), ``cached`` (served from the store),
``resumed`` (loaded from ``resume_from``), ``skipped`` (after ``stop_after``), ``failed``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from .argspec import BoundArgs, bind_config
from .checkpoint import Checkpoint
from .config import STAGES, JaxaotConfig, to_container, validate
from .context import StageContext
from .errors import JaxaotError, StageError, StoreError, one_line
from .fsutil import key_of
from .keylock import KeyLock
from .manifest import Manifest
from .parallel import devices_to_start

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
    """Hydra's run directory when called from a Hydra app, else a fresh ``outputs/runs/...``."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    return Path("outputs/runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"


def _hydra_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run(cfg: DictConfig | JaxaotConfig | dict[str, Any], *, run_dir: Path | str | None = None,
        print_summary: bool = False, overrides: Sequence[str] | None = None) -> RunResult:  # fmt: skip
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
    out = Path(run_dir) if run_dir is not None else default_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(run_dir=out, config=to_container(typed))
    if checkpoint is not None:
        manifest.extra["resumed_from"] = str(checkpoint.run_dir.resolve())

    from . import jaxenv
    from .store import Store, resolve_store_root

    store = Store(resolve_store_root(typed.store.dir), enabled=typed.store.enabled)
    first, last = STAGES.index(typed.start_at), STAGES.index(typed.stop_after)
    records: dict[str, Any] = {}
    runner = _Runner(typed, out, manifest, store, checkpoint, records)
    t_start = time.perf_counter()
    try:
        jaxenv.configure(backend=typed.compile.backend, num_devices=devices_to_start(typed),
                         x64=bound.needs_x64)  # fmt: skip
        manifest.versions = jaxenv.versions()
        if typed.compile.topology and first == STAGES.index("execute"):
            from stages.topology import check_resume

            check_resume(typed.compile)  # a topology's executable runs on a TPU host only
        if STAGES.index("compile") <= last:
            comp = typed.compile
            manifest.backend = (jaxenv.target_info(comp.topology, comp.num_slices) if comp.topology
                                else jaxenv.backend_info(comp.backend))  # fmt: skip
        for i, stage in enumerate(STAGES):
            if i < first:
                records[stage] = runner.resume(stage, bound)
            elif i <= last:
                records[stage] = runner.run(stage)
            else:
                manifest.stages[stage] = {"status": "skipped", "seconds": 0.0, "artifacts": {}}
        if typed.compile.topology and records.get("compile") is not None:
            from stages.topology import EXECUTE_NOTE, fit_of

            if manifest.stages.get("execute", {}).get("status") == "skipped":
                manifest.stages["execute"]["note"] = EXECUTE_NOTE
            # The verdict, in the manifest; DoesNotFit (a result, exit code 3) when it is no.
            manifest.extra["fit"] = fit_of(records["compile"], typed.compile)
        from .snapshot import after_run

        after_run(typed, manifest, print_output=print_summary)  # graph, snapshot write/verify
        manifest.status = "ok"
    except Exception as exc:
        manifest.status, manifest.error = getattr(exc, "run_status", "failed"), one_line(exc)
        if getattr(exc, "fit", None) is not None:
            manifest.extra["fit"] = exc.fit  # type: ignore[attr-defined]
        raise
    finally:
        runner.close()
        manifest.extra["wall_seconds"] = round(time.perf_counter() - t_start, 6)
        manifest.write()
        if print_summary:
            from .summary import render

            print(render(manifest.to_json()), flush=True)
    return RunResult(run_dir=out, manifest=manifest.to_json(), records=records)


@dataclass
class _Runner:
    cfg: JaxaotConfig
    run_dir: Path
    manifest: Manifest
    store: Any  # pipeline.store.Store
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

    def _compile_key(self, lowered: Any) -> tuple[str, dict[str, Any]]:
        from stages import compile as compile_stage

        backend = self.manifest.backend
        key = key_of(compile_stage.cache_key(self.cfg, lowered, backend))
        return key, {k: backend[k] for k in ("jax", "jaxlib", "platform", "platform_version")}

    def _compile_ahead(self, lowered: Any) -> None:
        """Called by the lower stage once the module exists: look the executable up in the
        store, and on a miss start compiling on a worker thread (XLA releases the GIL), so the
        export, HLO text and cost analysis that lowering still does overlap the compile."""
        from stages import compile as compile_stage

        key, compat = self._compile_key(lowered)
        lock = KeyLock(self.store, "compile", key)
        if not lock.acquire(blocking=False):
            return  # another job is compiling this key: the compile stage waits, then hits
        entry = self.store.get("compile", key, expect=compat) if self.store.enabled else None
        if entry is not None:
            lock.release()
            self._ahead = (key, entry)
            return
        try:
            job = compile_stage.start(self.cfg.compile, lowered)
        except JaxaotError:
            lock.release()
            return  # the compile stage reports it, in its turn
        self._held = lock

        def timed() -> tuple[Any, float]:
            t0 = time.perf_counter()
            return job(), time.perf_counter() - t0

        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="jaxaot-compile")
        self._ahead = (key, self._pool.submit(timed))

    def _upstream(self, stage: str) -> tuple[Any, ...]:
        r = self.records
        return {"stage_out": (), "lower": (r.get("stage_out"),), "compile": (r.get("lower"),),
                "execute": (r.get("compile"), r.get("stage_out"))}[stage]  # fmt: skip

    def _finish(self, ctx: StageContext, status: str, t0: float, **extra: Any) -> None:
        seconds = extra.pop("seconds", time.perf_counter() - t0)
        self.manifest.record_stage(ctx, status, seconds, **extra)
        self.manifest.write()
        log.info("[%s] %s in %.3f s", ctx.stage, status, seconds)

    def run(self, stage: str) -> Any:
        from stages import STAGE_FUNCTIONS

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
                from stages.topology import metrics

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
        key, compat = self._compile_key(lowered)
        # Jobs sharing a key compile it once: hold the lock taken ahead, or wait for the job
        # that holds it and then hit the store (issue 5).
        held, self._held = self._held, None
        if held is not None and held.key != key:
            held.release()
            held = None
        with held or KeyLock(self.store, "compile", key):
            return self._compile_locked(ctx, lowered, key, compat)

    def _compile_locked(self, ctx: StageContext, lowered: Any, key: str,
                        compat: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:  # fmt: skip
        from stages import compile as compile_stage

        label = f"compile/{key[:12]}"
        ahead, self._ahead = (self._ahead or (None, None)), None
        future = ahead[1] if ahead[0] == key and isinstance(ahead[1], Future) else None
        entry = ahead[1] if ahead[0] == key and future is None else None
        if entry is None and future is None and self.store.enabled:
            entry = self.store.get("compile", key, expect=compat)
        if entry is not None:
            t0 = time.perf_counter()
            try:
                record = compile_stage.load(ctx, lowered, entry.read_bytes, f"store entry {label}")
            except (StoreError, JaxaotError) as exc:
                ctx.warn(f"store entry {label} unusable, compiling instead: {one_line(exc)}")
                ctx.artifacts.clear()
                ctx.metrics.clear()
            else:
                saved = max(entry.compute_seconds - (time.perf_counter() - t0), 0.0)
                self.store.record("compile", key, hit=True, seconds_saved=saved)
                log.info("[compile] cache hit %s: executable loaded from %s (%.2f s saved)",
                         key[:12], self.store.root, saved)  # fmt: skip
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
            record = compile_stage.run(ctx, lowered)
            seconds = time.perf_counter() - t0
        if self.store.enabled:
            log.info("[compile] cache miss %s: compiled in %.2f s", key[:12], seconds)
            self.store.record("compile", key, hit=False)
            self.store.put("compile", key, files={n: a.path for n, a in ctx.artifacts.items()},
                           meta={"program": self.cfg.program.name, "metrics": ctx.metrics},
                           compute_seconds=seconds, compat=compat)  # fmt: skip
        return record, "ran", extra

    def resume(self, stage: str, bound: BoundArgs) -> Any:
        """Load a stage that ran before ``start_at`` from the checkpoint (hashes verified)."""
        from stages import lower as lower_stage
        from stages import stage_out

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
        from stages import compile as compile_stage

        assert self.checkpoint is not None
        theirs = self.checkpoint.manifest.get("backend", {})
        mine = self.manifest.backend
        fields = ("platform", "platform_version", "jaxlib")
        if any(theirs.get(f) != mine.get(f) for f in fields):
            what = ", ".join(f"{f} {theirs.get(f)!r} (here {mine.get(f)!r})"
                             for f in fields if theirs.get(f) != mine.get(f))  # fmt: skip
            why = f"checkpoint executable was built for {what}; not loaded, compiled again from lower/exported.bin"
            log.warning("[compile] %s", why)
            return None, why
        try:
            record = compile_stage.load(ctx, self.records["lower"], read,
                                        f"resume_from={self.checkpoint.run_dir}")  # fmt: skip
            return record, ""
        except StoreError:
            raise
        except Exception as exc:
            why = (f"checkpoint executable cannot be loaded here ({one_line(exc)}); compiled "
                   "again from lower/exported.bin")  # fmt: skip
            log.warning("[compile] %s", why)
            return None, why


__all__ = ["RunResult", "default_run_dir", "one_line", "run"]
