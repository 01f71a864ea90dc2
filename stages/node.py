"""What a stage gets from the runner: its config, its output folder and an artifact writer.

Stages write files only through :meth:`StageContext.write`, so every artifact is written
atomically and lands in the manifest with its sha256 and size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxaot.config.schema import JaxaotConfig
from jaxaot.util.fsio import atomic_write_bytes

log = logging.getLogger("jaxaot")


@dataclass(frozen=True)
class Artifact:
    """One file a stage wrote: where, its sha256 and size."""

    path: Path
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}


@dataclass
class StageContext:
    """Per-stage state the runner owns; stages fill ``artifacts``, ``metrics`` and ``warnings``."""

    cfg: JaxaotConfig
    stage: str
    out_dir: Path
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # Set by the runner on the lower stage: called with a preliminary record (no export yet)
    # as soon as the module exists, so compilation can overlap the rest of lowering.
    on_lowered: Callable[[Any], None] | None = None

    def write(self, name: str, data: bytes | str) -> Artifact:
        raw = data.encode() if isinstance(data, str) else data
        path = self.out_dir / name
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


__all__ = ["Artifact", "StageContext"]
