"""The run manifest: what ran, with which config and versions, and every artifact's hash.

``manifest.json`` sits at the top of the run directory and is rewritten atomically after every
stage, so an interrupted run still leaves a consistent record of the stages that finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jaxaot.errors import RunDirError, StoreError
from jaxaot.util.fsio import atomic_write_json
from jaxaot.util.verified import Refused, read_versioned_json

log = logging.getLogger("jaxaot")


class StageOutcome(Protocol):
    """What a finished (or failed) stage leaves for the manifest (a StageContext has it)."""

    @property
    def stage(self) -> str: ...
    @property
    def artifacts(self) -> Mapping[str, Any]: ...  # name -> has to_json(): sha256 and size
    @property
    def metrics(self) -> dict[str, Any]: ...
    @property
    def warnings(self) -> list[str]: ...


# Manifest format history:
#   1 (2026-11-22): first version: config, versions, backend, stages{status, seconds, key,
#                   artifacts{name: {sha256, size}}, metrics, warnings}, status, error.
#     (2026-11-23, additive, still 1): environment{xla_flags, xla_flags_not_in_key, jax_config,
#                   jax_config_not_in_key}: what the compile key saw.
#     (2026-11-25, additive, still 1): environment{flag_variables{XLA_FLAGS, LIBTPU_INIT_ARGS:
#                   {raw, file, file_sha256, words, ignored, effective, not_in_key, read_by}},
#                   xla_debug_options_sha256, hlo_transformations}; xla_flags lists XLA_FLAGS'
#                   flags in effect (--name=value, the last value of each).
#     (2026-11-29, additive, still 1): environment.host_cpu: the host CPU the compile key has
#                   (jaxaot.util.host_cpu; XLA:CPU compiles for it).
MANIFEST_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass
class Manifest:
    run_dir: Path
    config: dict[str, Any]
    versions: dict[str, str] = field(default_factory=dict)
    backend: dict[str, Any] = field(default_factory=dict)
    # XLA flags in effect and every JAX config value (jaxaot.stages.jaxenv.environment).
    environment: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    # running | ok | failed | interrupted (Ctrl-C, SIGTERM: jaxaot.util.exits); written as
    # "running" when the run claims its directory (jaxaot.rundir.dirs.claim)
    status: str = "running"
    error: str | None = None
    started: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    # The error of a failed write: a later write failing while the run ends with it is quiet.
    _unwritable: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def path(self) -> Path:
        return self.run_dir / MANIFEST_NAME

    def record_stage(
        self, ctx: StageOutcome, status: str, seconds: float, key: str | None = None, **extra: Any
    ) -> None:
        self.stages[ctx.stage] = {
            "status": status,
            "seconds": round(seconds, 6),
            "key": key,
            "artifacts": {
                f"{ctx.stage}/{name}": a.to_json() for name, a in sorted(ctx.artifacts.items())
            },
            "metrics": ctx.metrics,
            "warnings": ctx.warnings,
            **extra,
        }

    @property
    def warnings(self) -> list[str]:
        return [f"{s}: {w}" for s, rec in self.stages.items() for w in rec.get("warnings", [])]

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": MANIFEST_FORMAT_VERSION,
            "run_dir": str(self.run_dir),
            "started": self.started,
            "status": self.status,
            "error": self.error,
            "config": self.config,
            "versions": self.versions,
            "backend": self.backend,
            "environment": self.environment,
            "stages": self.stages,
            "warnings": self.warnings,
            **self.extra,
        }

    def write(self) -> None:
        """Rewrite ``manifest.json`` atomically. A failure (a full disk, a file system gone
        read-only) is one :class:`RunDirError` line naming the run dir and the cause; the last
        complete manifest stays in place, never a torn one."""
        try:
            atomic_write_json(self.path, self.to_json())
        except OSError as exc:
            err = (
                exc
                if isinstance(exc, RunDirError)
                else RunDirError(
                    f"run dir {self.run_dir}: cannot write {MANIFEST_NAME} "
                    f"({exc.strerror or exc}); the last complete one is kept there; free space "
                    "on that file system (or run with hydra.run.dir on another one) and run again"
                )
            )
            if self._unwritable is not None and self.error == self._unwritable:
                # The run is ending with this very error, which its caller reports once.
                log.debug("%s", err)
                return
            self._unwritable = " ".join(str(err).split())
            raise err from exc


def load_manifest(run_dir: Path) -> dict[str, Any]:
    """Read a run's manifest, refusing unknown format versions (a StoreError naming the file)."""
    path = Path(run_dir) / MANIFEST_NAME
    try:
        return read_versioned_json(path, MANIFEST_FORMAT_VERSION, kind="manifest")
    except FileNotFoundError:
        raise StoreError(f"resume_from={str(run_dir)!r}: no {MANIFEST_NAME} there") from None
    except OSError as exc:
        raise StoreError(f"{path}: unreadable manifest ({exc})") from None
    except Refused as bad:
        raise StoreError(f"{path}: {bad.reason}") from None


__all__ = ["MANIFEST_FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "load_manifest"]
