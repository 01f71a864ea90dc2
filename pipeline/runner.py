"""The stage graph and its runner: stage_out -> lower -> compile -> execute.

The runner owns ordering, ``stop_after``, timing, the manifest and the summary; stages own
their JAX work (``stages/``). Everything checkable without JAX is checked by
:func:`pipeline.config.validate` and :func:`pipeline.argspec.bind` before JAX is imported.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from .argspec import bind
from .config import STAGES, JaxaotConfig, to_container, validate
from .context import StageContext
from .errors import JaxaotError, StageError
from .manifest import Manifest

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
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:  # pragma: no cover - hydra is a dependency
        pass
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    return Path("outputs/runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, JaxaotError) else text


def _stage_fn(name: str) -> Callable[..., Any]:
    from stages import STAGE_FUNCTIONS

    return STAGE_FUNCTIONS[name]


def run(cfg: DictConfig | JaxaotConfig | dict[str, Any], *, run_dir: Path | str | None = None,
        print_summary: bool = False) -> RunResult:  # fmt: skip
    """Run the pipeline for ``cfg`` and return the typed stage records.

    Raises :class:`JaxaotError` (a :class:`StageError` naming the stage for unexpected
    failures); the manifest records the failure either way.
    """
    typed = validate(cfg)  # type: ignore[arg-type]
    # Arg specs are checked before JAX is imported (names refine this again at stage_out).
    bound = bind(
        typed.program.args,
        typed.program.kwargs,
        static_argnums=typed.stage_out.static_argnums,
        static_argnames=typed.stage_out.static_argnames,
        donate_argnums=typed.lower.donate_argnums,
        donate_argnames=typed.lower.donate_argnames,
    )
    out = Path(run_dir) if run_dir is not None else default_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(run_dir=out, config=to_container(typed))

    from . import jaxenv

    jaxenv.configure(backend=typed.compile.backend, num_devices=typed.compile.num_devices,
                     x64=bound.needs_x64)  # fmt: skip
    manifest.versions = jaxenv.versions()
    first, last = STAGES.index(typed.start_at), STAGES.index(typed.stop_after)
    records: dict[str, Any] = {}
    try:
        if STAGES.index("compile") <= last:
            manifest.backend = jaxenv.backend_info(typed.compile.backend)
        for stage in STAGES[first : last + 1]:
            records[stage] = _run_stage(stage, typed, out, manifest, records)
        manifest.status = "ok"
    except JaxaotError as exc:
        manifest.status, manifest.error = "failed", _one_line(exc)
        raise
    except Exception as exc:
        manifest.status, manifest.error = "failed", _one_line(exc)
        raise
    finally:
        manifest.write()
        if print_summary:
            from .summary import render

            print(render(manifest.to_json()), flush=True)
    return RunResult(run_dir=out, manifest=manifest.to_json(), records=records)


def _upstream_args(stage: str, records: dict[str, Any]) -> tuple[Any, ...]:
    if stage == "stage_out":
        return ()
    if stage == "lower":
        return (records["stage_out"],)
    if stage == "compile":
        return (records["lower"],)
    return (records["compile"], records.get("stage_out"))


def _run_stage(stage: str, cfg: JaxaotConfig, run_dir: Path, manifest: Manifest,
               records: dict[str, Any]) -> Any:  # fmt: skip
    ctx = StageContext(cfg=cfg, stage=stage, out_dir=run_dir / stage)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        record = _stage_fn(stage)(ctx, *_upstream_args(stage, records))
    except JaxaotError:
        manifest.record_stage(ctx, "failed", time.perf_counter() - t0)
        raise
    except Exception as exc:
        manifest.record_stage(ctx, "failed", time.perf_counter() - t0)
        raise StageError(stage, _one_line(exc)) from exc
    seconds = time.perf_counter() - t0
    manifest.record_stage(ctx, "ran", seconds)
    manifest.write()
    log.info("[%s] ran in %.3f s", stage, seconds)
    return record


__all__ = ["RunResult", "default_run_dir", "run"]
