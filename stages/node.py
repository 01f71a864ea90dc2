"""What a stage is (:class:`Node`) and what it gets from the runner (:class:`StageContext`).

Each stage file ends with its ``Node(...)`` declaration: options schema, record type, inputs,
checks, cache key and what must match at load, run, load (one function for a store hit and a
resume), the config sections it freezes on resume, its artifacts, and how it is summarised and
reported. The engine (:mod:`jaxaot.engine.runner`) knows no stage by name: for each node it
resumes from a compatible checkpoint, else loads a verified store hit, else runs it.

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
from typing import TYPE_CHECKING, Any

from jaxaot.util.fsio import atomic_write_bytes, sha256_bytes
from jaxaot.util.links import LINK_MIN_BYTES, link_same

if TYPE_CHECKING:
    from jaxaot.config.argspec import BoundArgs
    from jaxaot.schema import JaxaotConfig

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
    # More of this stage's manifest entry: files it has that are not artifacts (not hashed,
    # not stored), e.g. compile.dump's listing.
    extra: dict[str, Any] = field(default_factory=dict)
    # The run's arguments, bound to the program's signature (what a resumed stage_out needs).
    bound: BoundArgs | None = None
    # Set by the runner: a stage calls it with an early record (lower: the module exists, the
    # export does not yet) so that a consumer's Node.begin can start on it (compile-ahead).
    publish_early: Callable[[Any], None] | None = None
    # Set by the runner while a store hit loads: file name -> the entry's verified file. A big
    # artifact with exactly those bytes is hard-linked from there, not copied (issue 19).
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


Upstream = Mapping[str, Any]  # the records of a node's inputs, by node name


@dataclass(frozen=True)
class Entry:
    """One stage's verified files: a store entry or a checkpoint folder, read alike."""

    label: str  # "store entry compile/1a2b3c4d5e6f", "resume_from=/runs/x"
    read: Callable[[str], bytes]  # sha256-checked; KeyError for a file it does not record
    compat: Mapping[str, Any]  # what it was made with (versions, platform)
    source: str  # "store" | "checkpoint"


@dataclass(frozen=True)
class Keyed:
    """A node's store key for this run, and what computing it prepared.

    ``key`` is None when the node cannot say what its result depends on (``why`` says so):
    then the store is not used. ``state`` is handed to ``run``, ``load`` and ``begin`` so that
    nothing is prepared twice (compile: the Target that is compiled)."""

    key: str | None
    state: Any = None
    why: str = ""


def compat_mismatch(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """The one rule for store entries and checkpoints: every field this run requires (``mine``)
    must be what the entry was made with; None when all match."""
    diff = [k for k in sorted(mine) if theirs.get(k) != mine[k]]
    if not diff:
        return None
    return ", ".join(f"{k} {theirs.get(k)!r} (here {mine[k]!r})" for k in diff)


def _no_check(cfg: Any) -> None:
    return None


def _no_summary(metrics: Mapping[str, Any]) -> str:
    return ""


@dataclass(frozen=True)
class Node:
    """A stage, declared: everything the engine, the store, resume, sweeps and reports need.

    Hooks (each stage file defines them; the engine calls them, never the stage by name):

    * ``run(ctx, up, keyed, started)`` computes the record; ``started`` is what ``begin``'s job
      returned when it ran ahead (else None).
    * ``load(ctx, up, entry, keyed)`` makes the record from stored files (a store hit and a
      resume alike). A :class:`~jaxaot.errors.StoreError` means "this entry cannot serve the
      run" (a store entry is dropped); any other :class:`~jaxaot.errors.JaxaotError` with
      ``entry_ok = True`` means "not in this process" (the entry is kept). Either way the
      engine computes instead.
    * ``compat(backend)``: the fields a loaded entry must match (store and checkpoint alike).
    * ``cache_key(cfg, up, env)`` -> :class:`Keyed` (the store key's inputs as a dict are
      hashed by the engine); None for a node that is never stored.
    * ``begin(cfg, keyed, out_dir)`` -> a callable to run on a worker thread as soon as an
      early record of the node's single input is published (compile-ahead); ``out_dir`` is the
      node's run-dir folder.
    * ``storable(record, keyed)`` -> why the result must not be stored, or None.
    * ``before_resume(cfg)`` refuses a resume that cannot work here, before any work;
      ``finish(cfg, record, stages, extra)`` adds to the manifest after the last node.
    """

    name: str  # config section, run-dir folder, store namespace
    options: type  # the section's schema (a dataclass in jaxaot.config.schema)
    record: type  # what run and load return
    inputs: tuple[str, ...]  # upstream nodes whose records run/load take
    run: Callable[..., Any]
    check: Callable[[Any], None] = _no_check  # pre-JAX checks of the whole config
    load: Callable[..., Any] | None = None
    compat: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    cache_key: Callable[..., Keyed | None] | None = None
    begin: Callable[[Any, Keyed, Path], Callable[[], Any]] | None = None
    storable: Callable[[Any, Keyed], str | None] | None = None
    required: tuple[str, ...] = ()  # artifacts without which nothing is stored (nothing to load)
    before_resume: Callable[[Any], None] | None = None  # refuse early: cfg -> None or raise
    # Resuming past earlier nodes, this node's section from (the checkpoint's config, this
    # run's section, the keys overridden): e.g. compile for the platform it was lowered for.
    resume_default: (
        Callable[[Mapping[str, Any], dict[str, Any], set[str]], dict[str, Any]] | None
    ) = None
    # Before any work (JAX not imported yet), for a node this run computes: (cfg, bound args).
    before_run: Callable[[Any, Any], None] | None = None
    # After every node ran: what the run's manifest gets from this node's record (the
    # engine passes the config, the record, the manifest's stages and its extra dict).
    finish: Callable[[Any, Any, dict[str, Any], dict[str, Any]], None] | None = None
    live_inputs: tuple[str, ...] = ()  # inputs that must be computed when this node runs
    sections: tuple[str, ...] = ()  # config sections frozen when a later stage resumes
    artifacts: tuple[str, ...] = ()  # files it writes and a store entry holds
    # Artifacts compared with the checkpoint's when an input is recomputed on resume, with
    # the warning when they differ.
    recomputed_differs: Mapping[str, str] = field(default_factory=dict)
    noun: str = "result"  # what its record is called in messages ("executable")
    again: str = "computed again"  # what happens when a checkpoint's result cannot serve
    verb: str = ""  # progress lines: "still compiling"
    report: tuple[str, ...] = ()  # metrics that become sweep report columns (<name>.<metric>)
    summarize: Callable[[Mapping[str, Any]], str] = _no_summary  # one summary line


__all__ = ["Artifact", "Entry", "Keyed", "Node", "StageContext", "Upstream", "compat_mismatch"]
