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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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


# Canonicalizing is one pass over the lines, each touched only where it holds what is dropped:
# linear in the text's size (a module with a captured constant printed in full is 100 MB on
# one line), and usable on a stream of lines (:func:`iter_canonical_stablehlo`).

# MLIR location info (`loc(...)` suffixes and `#locN = loc(...)` aliases) varies with source
# paths and line numbers; it is stripped so a moved file or a renamed local changes nothing.
_LOC_ALIAS = re.compile(r"#loc[0-9]*\s*=")
# A quoted string (skipped whole: it may hold "loc(" or parentheses) or the start of a `loc(`.
_STRING_OR_LOC = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\s*\bloc\(')
_STRING_OR_PAREN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[()]')
_MODULE_NAME = re.compile(r"^module @[\w.$-]+")


def _strip_locs(line: str) -> str:
    """``line`` without its ``loc(...)`` parts (balanced parentheses, strings respected)."""
    if "loc(" not in line:
        return line
    out: list[str] = []
    pos = 0
    while (m := _STRING_OR_LOC.search(line, pos)) is not None:
        if m[0].startswith('"'):
            out.append(line[pos : m.end()])
            pos = m.end()
            continue
        out.append(line[pos : m.start()])
        depth, end = 1, m.end()
        while depth and (p := _STRING_OR_PAREN.search(line, end)) is not None:
            depth += {"(": 1, ")": -1}.get(p[0], 0)
            end = p.end()
        pos = end if not depth else len(line)
    out.append(line[pos:])
    return "".join(out)


def _tidy_lines(lines: Iterable[str], squeeze: bool = True) -> Iterator[str]:
    """Trailing spaces stripped, leading and trailing blank lines dropped, blank-line runs
    squeezed to one (``squeeze``); each yielded line ends with a newline."""
    started, blanks = False, 0
    for raw in lines:
        line = raw.rstrip()
        if not line:
            blanks += started
            continue
        yield from ("\n" for _ in range(min(blanks, 1) if squeeze else blanks))
        blanks = 0
        yield (line if started else line.lstrip()) + "\n"
        started = True
    if not started:
        yield "\n"


def _tidy(text: str) -> str:
    """Strip trailing spaces, squeeze blank-line runs, end with exactly one newline."""
    return "".join(_tidy_lines(text.splitlines()))


def iter_canonical_stablehlo(lines: Iterable[str]) -> Iterator[str]:
    """:func:`canonical_stablehlo`, one line in, at most one line out (lines may end in \\n)."""

    def strip() -> Iterator[str]:
        renamed = False
        for raw in lines:
            line = raw.rstrip("\n")
            if line.startswith("#loc") and _LOC_ALIAS.match(line):
                continue
            line = _strip_locs(line)
            if not renamed and line.startswith("module @"):
                line, renamed = _MODULE_NAME.sub("module @main_module", line, count=1), True
            yield line

    yield from _tidy_lines(strip(), squeeze=False)


def canonical_stablehlo(text: str) -> str:
    """StableHLO text without location/debug info or the module's (counter-suffixed) name."""
    return "".join(iter_canonical_stablehlo(text.splitlines()))


def canonical_jaxpr(text: str) -> str:
    """A jaxpr's text with object addresses masked."""
    return _tidy(_ADDRESS.sub(" at 0x?", text))


def iter_canonical_hlo(lines: Iterable[str]) -> Iterator[str]:
    """:func:`canonical_hlo`, one line in, at most one line out (lines may end in \\n)."""

    def strip() -> Iterator[str]:
        skipping, renamed = False, False
        for raw in lines:
            line = raw.rstrip("\n")
            if line.strip() in _DEBUG_TABLES and not line.startswith(" "):
                skipping = True
                continue
            if skipping:
                skipping = bool(line.strip())
                continue
            if "metadata={" in line:
                line = _METADATA.sub("", line)
            if not renamed and line.startswith("HloModule "):
                line, renamed = _HLO_MODULE.sub("HloModule main_module", line, count=1), True
            yield line

    yield from _tidy_lines(strip())


def canonical_hlo(text: str) -> str:
    """HLO text (as lowered or as optimized) without debug tables, metadata or module name."""
    return "".join(iter_canonical_hlo(text.splitlines()))


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
    "iter_canonical_hlo",
    "iter_canonical_stablehlo",
]
