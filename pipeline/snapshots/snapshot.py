"""Golden lowering snapshots: ``snapshot.write``, ``snapshot.verify`` and ``snapshot.update``.

A snapshot is a folder of canonical text (:mod:`jaxaot.util.canonical`) that pins what a config
traces, lowers and compiles to, meant to be checked in and verified in CI::

    snapshot.json     format version, program, stages, and every other file's sha256 and size
    config.json       the resolved config, less where things go (snapshot, store, resume_from, debug)
    versions.json     jax, jaxlib, jaxaot, python, numpy, and the backend the program compiled for
    stage_out/jaxpr.txt  stage_out/signature.json
    lower/module.stablehlo.mlir  lower/module.hlo.txt
    compile/optimized.hlo.txt  compile/cost_analysis.json  compile/memory_analysis.json

No file holds a timestamp or a path, so one config gives byte-identical snapshots in any two
processes. A run with ``write`` or ``verify`` also keeps its own snapshot in
``<run dir>/snapshot/``: the actual side of a failed verify, ready to review or copy.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.config.order import STAGES
from jaxaot.config.snapshot_dirs import check_snapshot_dirs
from jaxaot.errors import SnapshotError, SnapshotMismatch
from jaxaot.rundir.manifest import Manifest
from jaxaot.util.canonical import (
    ARTIFACT_BY_PATH,
    CANONICAL_ARTIFACTS,
    CanonicalArtifact,
    dump_json,
)
from jaxaot.util.fsio import atomic_write_text
from jaxaot.util.textdiff import bounded, changed_keys, unified
from jaxaot.util.verified import (
    FileRecord,
    Mismatch,
    Refused,
    VerifiedFiles,
    parse_versioned_json,
    record_of,
)

if TYPE_CHECKING:
    from jaxaot.config.sections import SnapshotConfig

# Snapshot format history:
#   1 (2026-11-22): snapshot.json {format_version, program, stages, files{path: {sha256, size}}};
#                   config.json, versions.json and the canonical artifacts of jaxaot.util.canonical.
SNAPSHOT_FORMAT_VERSION = 1
INDEX_NAME = "snapshot.json"
RUN_SNAPSHOT_DIR = "snapshot"
DIFF_NAME = "snapshot.diff"
# Where things were written or how they were reported: not part of what a program lowers to.
_UNPINNED_CONFIG_KEYS = ("snapshot", "store", "resume_from", "debug", "verbose")
_PINNED_VERSIONS = ("jax", "jaxlib", "python", "numpy")
_PINNED_BACKEND = ("platform", "platform_version", "device_kind", "device_count")
OK_STATUSES = ("written", "unchanged", "match", "updated", "created")


@contextlib.contextmanager
def _writing(what: str) -> Iterator[None]:
    """An OSError while writing ``what`` (a full disk, a file in the way) as one SnapshotError
    line naming it and the file; files already written stay whole (each write is atomic)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, SnapshotError):
            raise
        name = f" {exc.filename}" if exc.filename else ""
        raise SnapshotError(
            f"{what}: cannot write{name} ({exc.strerror or exc}); free space there or choose "
            "another folder, then run again"
        ) from exc


@dataclass(frozen=True)
class Snapshot:
    """Canonical files by path relative to the snapshot folder (``snapshot.json`` excluded)."""

    files: dict[str, str]
    program: str

    @property
    def stages(self) -> list[str]:
        return [s for s in STAGES if any(p.startswith(s + "/") for p in self.files)]

    @property
    def artifacts(self) -> list[str]:
        return [a.path for a in CANONICAL_ARTIFACTS if a.path in self.files]

    def meta(self, name: str) -> dict[str, Any]:
        text = self.files.get(name)
        return json.loads(text) if text else {}

    def index(self) -> dict[str, Any]:
        entries = {}
        for path, text in sorted(self.files.items()):
            raw = text.encode()
            entries[path] = record_of(raw).to_json()
        return {
            "format_version": SNAPSHOT_FORMAT_VERSION,
            "program": self.program,
            "stages": self.stages,
            "files": entries,
        }


def from_run(run_dir: Path, manifest: dict[str, Any]) -> Snapshot:
    """The snapshot of a finished run: canonical artifacts (hash-checked against the manifest,
    resumed and cached stages included: they write their artifacts into the run too), the
    config and the versions."""
    files: dict[str, str] = {}
    recorded = {
        p: rec
        for stage in manifest.get("stages", {}).values()
        for p, a in stage.get("artifacts", {}).items()
        if (rec := FileRecord.from_json(a)) is not None
    }

    def changed(m: Mismatch) -> Exception:
        if m.error is not None:
            return SnapshotError(f"{m.path}: unreadable ({m.error.strerror or m.error})")
        return SnapshotError(
            f"{m.path}: sha256 {str(m.sha256)[:12]} does not match its manifest "
            f"({m.expected.sha256[:12]}); the artifact changed after the run wrote it; "
            "rerun the pipeline"
        )

    run = VerifiedFiles(Path(run_dir), recorded, label=f"run dir {run_dir}", refuse=changed)
    for art in CANONICAL_ARTIFACTS:
        if art.path in recorded:
            files[art.path] = art.canonicalize(run.read(art.path).decode())
    config = {k: v for k, v in manifest["config"].items() if k not in _UNPINNED_CONFIG_KEYS}
    files["config.json"] = dump_json(config)
    files["versions.json"] = dump_json(_versions(manifest))
    return Snapshot(files=files, program=str(manifest["config"]["program"]["name"]))


def _versions(manifest: dict[str, Any]) -> dict[str, Any]:
    from jaxaot.version import __version__

    seen = manifest.get("versions", {})
    out: dict[str, Any] = {k: seen[k] for k in _PINNED_VERSIONS if k in seen}
    out["jaxaot"] = __version__
    backend = manifest.get("backend") or {}
    if backend:
        out["backend"] = {k: backend[k] for k in _PINNED_BACKEND if k in backend}
    return out


def _index_problem(raw: bytes) -> str:
    """What is wrong with a ``snapshot.json`` that :func:`parse_versioned_json` refused: what,
    expected and found, in one clause."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"not valid JSON: expected the JSON object jaxaot writes, found {exc}"
    if not isinstance(doc, dict):
        return f"expected the JSON object jaxaot writes, found a JSON {type(doc).__name__}"
    found = doc.get("format_version")
    if not isinstance(found, int) or isinstance(found, bool):
        shown = "none" if "format_version" not in doc else repr(found)
        return f"format_version: expected the integer {SNAPSHOT_FORMAT_VERSION}, found {shown}"
    return f"snapshot format version {found}; this jaxaot reads version {SNAPSHOT_FORMAT_VERSION}"


def _read_index(folder: Path) -> tuple[dict[str, Any], dict[str, FileRecord]]:
    """``snapshot.json`` of ``folder`` and its file records; SnapshotError (one line: what,
    expected, found, and the update that rewrites it) when it cannot be used."""
    index_path = folder / INDEX_NAME
    fix = f"rewrite it with snapshot.verify={folder} snapshot.update=true"
    try:
        raw = index_path.read_bytes()
    except FileNotFoundError:
        raise SnapshotError(f"{folder}: not a jaxaot snapshot (no {INDEX_NAME})") from None
    except OSError as exc:
        raise SnapshotError(
            f"{index_path}: unreadable ({exc.strerror or exc}); make it readable or {fix}"
        ) from None
    try:
        index = parse_versioned_json(raw, SNAPSHOT_FORMAT_VERSION, name=INDEX_NAME, kind="snapshot")
    except Refused:
        raise SnapshotError(f"{index_path}: {_index_problem(raw)}; {fix}") from None
    listed = index.get("files", {})
    if not isinstance(listed, dict):
        raise SnapshotError(
            f"{index_path}: files: expected an object of file records, found a JSON "
            f"{type(listed).__name__}; {fix}"
        )
    records: dict[str, FileRecord] = {}
    for rel, entry in listed.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise SnapshotError(
                f"{index_path}: file entry {rel!r}: expected a path inside the folder, found "
                f"one that leaves it; {fix}"
            )
        rec = FileRecord.from_json(entry)
        if rec is None:
            raise SnapshotError(
                f'{index_path}: file entry {rel!r}: expected {{"sha256": str, "size": int}}, '
                f"found {entry!r}; {fix}"
            )
        records[rel] = rec
    return index, records


def load_snapshot(folder: Path, *, check: bool = True) -> Snapshot:
    """Read a snapshot; with ``check``, every file must match the sha256 in ``snapshot.json``.
    Without it (an update, which rewrites the folder), a ``snapshot.json`` that cannot be used
    reads as an empty snapshot, and a file is what is there."""
    folder = Path(folder)
    try:
        index, records = _read_index(folder)
    except SnapshotError:
        if check or not (folder / INDEX_NAME).is_file():
            raise
        return Snapshot(files={}, program="")

    def refuse(m: Mismatch) -> Exception:
        if m.missing:
            return SnapshotError(
                f"{m.path}: listed in {INDEX_NAME} but missing; restore it or rewrite "
                f"the snapshot with snapshot.verify={folder} snapshot.update=true"
            )
        if m.error is not None:
            return SnapshotError(f"{m.path}: unreadable ({m.error.strerror or m.error})")
        return SnapshotError(
            f"{m.path}: sha256 {str(m.sha256)[:12]} but {INDEX_NAME} records "
            f"{m.expected.sha256[:12]}: the file was edited by hand; regenerate it with "
            f"snapshot.verify={folder} snapshot.update=true"
        )

    verified = VerifiedFiles(folder, records, label=f"snapshot {folder}", refuse=refuse)
    files: dict[str, str] = {}
    for rel in records:
        if check:
            files[rel] = verified.read(rel).decode()
            continue
        try:  # unchecked: what is there, as it is (an update rewrites it)
            files[rel] = (folder / rel).read_bytes().decode()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SnapshotError(f"{folder / rel}: unreadable ({exc.strerror or exc})") from None
    return Snapshot(files=files, program=str(index.get("program", "")))


def write_snapshot(snapshot: Snapshot, folder: Path) -> None:
    """Write every file atomically, the index last; drop files the old index listed and this
    one does not (a stage the new run did not reach)."""
    folder = Path(folder)
    try:
        listed = json.loads((folder / INDEX_NAME).read_bytes()).get("files", {})
        old = set(listed) if isinstance(listed, dict) else set()
    except (OSError, ValueError, AttributeError):  # no index, or one an update replaces whole
        old = set()
    for rel, text in sorted(snapshot.files.items()):
        atomic_write_text(folder / rel, text)
    atomic_write_text(folder / INDEX_NAME, dump_json(snapshot.index()))
    for rel in sorted(old - set(snapshot.files)):
        stale = folder / rel
        if not Path(rel).is_absolute() and ".." not in Path(rel).parts:
            stale.unlink(missing_ok=True)
            if stale.parent != folder and not any(stale.parent.iterdir()):
                stale.parent.rmdir()


@dataclass(frozen=True)
class Comparison:
    """How an actual snapshot differs from a golden one, artifacts in pipeline order."""

    differing: tuple[str, ...]
    only_golden: tuple[str, ...]
    only_actual: tuple[str, ...]
    versions: tuple[str, ...]
    config: tuple[str, ...]

    @property
    def first(self) -> CanonicalArtifact | None:
        return ARTIFACT_BY_PATH[self.differing[0]] if self.differing else None

    def state(self, path: str) -> str:
        if path in self.only_golden:
            return "is only in the golden snapshot"
        if path in self.only_actual:
            return "is not in the golden snapshot"
        return "differs"


def compare(golden: Snapshot, actual: Snapshot) -> Comparison:
    differing, only_golden, only_actual = [], [], []
    for art in CANONICAL_ARTIFACTS:
        a, b = golden.files.get(art.path), actual.files.get(art.path)
        if a == b:
            continue
        differing.append(art.path)
        if b is None:
            only_golden.append(art.path)
        elif a is None:
            only_actual.append(art.path)
    return Comparison(
        differing=tuple(differing),
        only_golden=tuple(only_golden),
        only_actual=tuple(only_actual),
        versions=tuple(changed_keys(golden.meta("versions.json"), actual.meta("versions.json"))),
        config=tuple(changed_keys(golden.meta("config.json"), actual.meta("config.json"))),
    )


# What JAX's jaxpr printer and XLA's optimizer may change between jax/jaxlib releases for the
# same lowering; a golden verifies on another release when everything else (the signature and
# the lowering: StableHLO and HLO) is equal.
ACROSS_VERSIONS = (
    "stage_out/jaxpr.txt",
    "compile/optimized.hlo.txt",
    "compile/cost_analysis.json",
    "compile/memory_analysis.json",
)


def lowering_holds(golden: Snapshot, actual: Snapshot, cmp: Comparison) -> bool:
    """Whether a golden from another jax or jaxlib holds here: both record their jax and
    jaxlib and one differs, the config is the golden's, both lowered, and only what
    :data:`ACROSS_VERSIONS` names differs."""
    mine, theirs = actual.meta("versions.json"), golden.meta("versions.json")
    recorded = all(v.get(d) for v in (mine, theirs) for d in ("jax", "jaxlib"))
    other_jax = recorded and any(mine[d] != theirs[d] for d in ("jax", "jaxlib")) and not cmp.config
    lowered = all("lower/module.stablehlo.mlir" in snap.files for snap in (golden, actual))
    return (
        other_jax
        and lowered
        and not cmp.only_golden
        and not cmp.only_actual
        and all(p in ACROSS_VERSIONS for p in cmp.differing)
    )


def versions_note(cmp: Comparison, actual: Snapshot) -> str:
    """Says whether jax/jaxlib changed since the golden, so an upgrade is told from a code change."""
    if cmp.versions:
        return (
            f"versions changed since the golden ({'; '.join(cmp.versions)}): an upgrade may "
            "explain the difference"
        )
    v = actual.meta("versions.json")
    return f"same versions as the golden (jax {v.get('jax')}, jaxlib {v.get('jaxlib')})"


def diff_lines(golden: Snapshot, actual: Snapshot, path: str, labels: tuple[str, str]) -> list[str]:
    """Unified diff of one artifact; a side that lacks it diffs as empty."""
    return unified(
        golden.files.get(path, ""),
        actual.files.get(path, ""),
        f"{labels[0]}/{path}",
        f"{labels[1]}/{path}",
    )


def full_diff(golden: Snapshot, actual: Snapshot, cmp: Comparison, labels: tuple[str, str]) -> str:
    """Every differing artifact's diff, headed by the versions and config notes."""
    first = cmp.first
    head = [
        f"# jaxaot snapshot diff: {labels[0]} (golden) vs {labels[1]} (this run)",
        f"# first difference: {first.where if first else 'none'}",
        f"# {versions_note(cmp, actual)}",
        *(f"# config: {c}" for c in cmp.config),
    ]
    body = [line for p in cmp.differing for line in diff_lines(golden, actual, p, labels)]
    return "\n".join(head + body) + "\n"


def _say(print_output: bool) -> Callable[[str], None]:
    return (lambda text: print(text, flush=True)) if print_output else (lambda _text: None)


def after_run(snap: SnapshotConfig, manifest: Manifest, *, print_output: bool = False) -> None:
    """The runner's last step, as the ``snapshot`` section says: draw the graph, then write or
    verify the snapshot.

    Records what happened under ``snapshot`` in the manifest; raises SnapshotMismatch when
    verify finds a difference and ``snapshot.update`` is off.
    """
    if not (snap.write or snap.verify or snap.graph):
        return
    say = _say(print_output)
    record: dict[str, Any] = {}
    manifest.extra["snapshot"] = record
    if snap.graph:
        from jaxaot.snapshots.hlo_graph import graph_of_run

        record["graph"] = graph_of_run(
            manifest.run_dir, image_format=snap.graph_format, max_nodes=snap.graph_max_nodes
        )
        say(f"graph: {record['graph']['summary']}")
    if not (snap.write or snap.verify):
        return
    record["status"] = "error"  # until write or verify says otherwise
    actual = from_run(manifest.run_dir, manifest.to_json())
    with _writing(f"run dir {manifest.run_dir}: the run's snapshot"):
        write_snapshot(actual, manifest.run_dir / RUN_SNAPSHOT_DIR)
    if snap.write:
        with _writing(f"snapshot.write={snap.write}"):
            _write_golden(actual, snap.write, record, say)
    else:
        with _writing(f"snapshot.verify={snap.verify}"):
            _verify(actual, snap, manifest.run_dir, record, say)


def _write_golden(
    actual: Snapshot, where: str, record: dict[str, Any], say: Callable[[str], None]
) -> None:
    folder = Path(where)
    record.update(mode="write", dir=where, files=len(actual.files) + 1)
    if (folder / INDEX_NAME).is_file():
        existing = load_snapshot(folder, check=False)
        cmp = compare(existing, actual)
        if cmp.first is not None:
            raise SnapshotError(
                f"snapshot.write={where}: a different snapshot is there already "
                f"({cmp.first.where} {cmp.state(cmp.first.path)}); to replace it on purpose "
                f"use snapshot.verify={where} snapshot.update=true"
            )
        # Same lowering: only config.json/versions.json may be refreshed.
        record["status"] = "unchanged" if existing.files == actual.files else "written"
    elif folder.is_dir() and any(folder.iterdir()):
        raise SnapshotError(
            f"snapshot.write={where}: the folder is not empty and holds no {INDEX_NAME}; "
            "choose a new or empty folder"
        )
    else:
        record["status"] = "written"
    if record["status"] == "written":
        write_snapshot(actual, folder)
    say(
        f"snapshot: {record['status']} {where} ({record['files']} files, stages "
        f"{', '.join(actual.stages)})"
    )


def _verify(
    actual: Snapshot,
    snap: SnapshotConfig,
    run_dir: Path,
    record: dict[str, Any],
    say: Callable[[str], None],
) -> None:
    where = snap.verify or ""
    folder = Path(where)
    record.update(mode="verify", dir=where, update=snap.update)
    if not (folder / INDEX_NAME).is_file():
        if not snap.update:
            raise SnapshotError(
                f"snapshot.verify={where}: no {INDEX_NAME} there; write the golden snapshot "
                f"first with snapshot.write={where} (or add snapshot.update=true)"
            )
        write_snapshot(actual, folder)
        record["status"] = "created"
        say(f"snapshot: created {where} (stages {', '.join(actual.stages)})")
        return
    golden = load_snapshot(folder, check=not snap.update)
    cmp = compare(golden, actual)
    note = versions_note(cmp, actual)
    record.update(
        differing=list(cmp.differing), versions=list(cmp.versions), config=list(cmp.config)
    )
    if cmp.first is None:
        changed = snap.update and golden.files != actual.files
        if changed:
            write_snapshot(actual, folder)
        record["status"] = "updated" if changed else "match"
        say(
            f"snapshot: {where} {'updated (versions/config)' if changed else 'matches'}: "
            f"{len(actual.artifacts)} artifacts, stages {', '.join(actual.stages)}; {note}"
        )
        if cmp.config and not changed:
            say(f"  config differs without changing the lowering: {'; '.join(cmp.config)}")
        return
    labels = (where.rstrip("/"), str(run_dir / RUN_SNAPSHOT_DIR))
    diff_path = run_dir / DIFF_NAME
    atomic_write_text(diff_path, full_diff(golden, actual, cmp, labels))
    if not snap.update and lowering_holds(golden, actual, cmp):
        record.update(status="match", across_versions=list(cmp.differing), diff=str(diff_path))
        differ = ", ".join(ARTIFACT_BY_PATH[p].where for p in cmp.differing)
        say(
            f"snapshot: {where} matches: the same signature and lowering (StableHLO, HLO) "
            f"across jax versions ({'; '.join(cmp.versions)}); {differ} differ, as JAX's jaxpr "
            f"printer and XLA's optimizer change between releases (full diff: {diff_path}; "
            "snapshot.update=true pins this version's)"
        )
        return
    first = cmp.first
    shown = bounded(diff_lines(golden, actual, first.path, labels), snap.diff_lines, str(diff_path))
    record.update(first_difference=first.path, diff=str(diff_path))
    others = [ARTIFACT_BY_PATH[p].where for p in cmp.differing[1:]]
    also = f"; also {', '.join(others)}" if others else ""
    if snap.update:
        write_snapshot(actual, folder)
        record["status"] = "updated"
        say(f"snapshot: updated {where}: {first.where} {cmp.state(first.path)}{also}; {note}")
        say(shown)
        return
    record["status"] = "mismatch"
    say(f"snapshot: {first.where} {cmp.state(first.path)} (golden {where}){also}")
    say(f"  {note}")
    for c in cmp.config:
        say(f"  config: {c}")
    say(shown)
    raise SnapshotMismatch(
        f"snapshot.verify={where}: {first.where} {cmp.state(first.path)}{also}; {note}; "
        f"full diff: {diff_path}; to accept the change: add snapshot.update=true",
        diff=shown,
        diff_path=str(diff_path),
    )


__all__ = [
    "ACROSS_VERSIONS",
    "DIFF_NAME",
    "INDEX_NAME",
    "OK_STATUSES",
    "RUN_SNAPSHOT_DIR",
    "SNAPSHOT_FORMAT_VERSION",
    "Comparison",
    "Snapshot",
    "after_run",
    "check_snapshot_dirs",
    "compare",
    "diff_lines",
    "from_run",
    "full_diff",
    "load_snapshot",
    "lowering_holds",
    "versions_note",
    "write_snapshot",
]
