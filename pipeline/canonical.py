"""Canonical text of each stage's artifacts: what snapshots store and what verify compares.

A canonical form keeps everything that describes the program and drops what varies between
processes or checkouts: MLIR locations, HLO ``metadata={...}`` (op names, source files and
lines, stack-frame ids), the file/stack tables that newer XLA prints before the computations,
and module names. Two fresh processes lowering the same config give byte-identical canonical
text; moving a source file or calling the pipeline from another script does not change it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.lower import canonical_stablehlo

# Python object reprs carry their address. JAX masks the ones it prints in jaxprs
# (`0xXXXXXXXXXXXX`), but a user's static argument or callback object may not.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# Newer XLA prints the tables that `stack_frame_id=N` metadata points into before the
# computations; they hold absolute paths and the whole Python stack of the caller (the CLI,
# pytest, a notebook), so they differ with where the pipeline was called from.
_DEBUG_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# `metadata={op_name="..." source_file="..." source_line=N stack_frame_id=N}`; quoted strings
# may hold braces, commas and escaped quotes.
_METADATA = re.compile(r',\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
# HLO module names come from the jitted function's name, and XLA appends uniquifying counters
# when a process builds several modules of one name: `jit_f.3` (seen in iree-org/iree#10987).
_HLO_MODULE = re.compile(r"^HloModule [^\s,]+", re.MULTILINE)


def _tidy(text: str) -> str:
    """Strip trailing spaces, squeeze blank-line runs, end with exactly one newline."""
    lines = [line.rstrip() for line in text.splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip("\n") + "\n"


def canonical_jaxpr(text: str) -> str:
    """A jaxpr's text with object addresses masked."""
    return _tidy(_ADDRESS.sub(" at 0x?", text))


def _drop_debug_tables(text: str) -> str:
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.strip() in _DEBUG_TABLES and not line.startswith(" "):
            skipping = True
            continue
        if skipping:
            if not line.strip():
                skipping = False
            continue
        out.append(line)
    return "\n".join(out)


def canonical_hlo(text: str) -> str:
    """HLO text (as lowered or as optimized) without debug tables, metadata or module name."""
    text = _drop_debug_tables(text)
    text = _METADATA.sub("", text)
    text = _HLO_MODULE.sub("HloModule main_module", text, count=1)
    return _tidy(text)


def canonical_json(text: str) -> str:
    """JSON re-dumped with sorted keys and a fixed indent."""
    return dump_json(json.loads(text))


def dump_json(obj: Any) -> str:
    """The one JSON layout snapshot files use."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) + "\n"


@dataclass(frozen=True)
class CanonicalArtifact:
    """A stage artifact that snapshots keep, in pipeline order, with its canonicalizer."""

    path: str  # "<stage>/<file>", as in the run directory and the snapshot
    label: str  # what a user calls it: "jaxpr", "StableHLO", "optimized HLO", ...
    canonicalize: Callable[[str], str]

    @property
    def stage(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def where(self) -> str:
        """``stage_out (jaxpr)``: how messages name it."""
        return f"{self.stage} ({self.label})"


# Pipeline order: verify reports the first entry that differs.
CANONICAL_ARTIFACTS: tuple[CanonicalArtifact, ...] = (
    CanonicalArtifact("stage_out/jaxpr.txt", "jaxpr", canonical_jaxpr),
    CanonicalArtifact("stage_out/signature.json", "signature", canonical_json),
    CanonicalArtifact("lower/module.stablehlo.mlir", "StableHLO", canonical_stablehlo),
    CanonicalArtifact("lower/module.hlo.txt", "HLO", canonical_hlo),
    CanonicalArtifact("compile/optimized.hlo.txt", "optimized HLO", canonical_hlo),
    CanonicalArtifact("compile/cost_analysis.json", "cost analysis", canonical_json),
    CanonicalArtifact("compile/memory_analysis.json", "memory analysis", canonical_json),
)
ARTIFACT_BY_PATH: dict[str, CanonicalArtifact] = {a.path: a for a in CANONICAL_ARTIFACTS}


__all__ = [
    "ARTIFACT_BY_PATH",
    "CANONICAL_ARTIFACTS",
    "CanonicalArtifact",
    "canonical_hlo",
    "canonical_jaxpr",
    "canonical_json",
    "canonical_stablehlo",
    "dump_json",
]
