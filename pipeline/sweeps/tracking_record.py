"""What a run or a sweep puts into an experiment tracker, read from its files (no tracker here).

A run's record is built from its run directory after the run: ``manifest.json`` (through the
typed records of :mod:`jaxaot.rundir.metrics`), ``.hydra/overrides.yaml`` and the resolved
config the manifest holds. A job that wrote no manifest (a config error before the run dir was
claimed) is described by its config and its error alone. A sweep's record is its overrides, its
report (``sweep.md``, ``sweep.csv``, ``plots/``) and the counts of its jobs.

Names: parameters are config keys (``compile.optimization_level``) or, for a config group the
command line chose, the group (``program``); metrics are ``<stage>.<figure>`` as in the sweep
report (``execute.median_s``, ``compile.seconds``); tags start with ``jaxaot.``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.rundir.metrics import NUMERIC_UNITS, RECORDS, Metric, RunMetrics
from jaxaot.sweeps.progress import override_key, read_json
from jaxaot.sweeps.report import CSV_NAME, MD_NAME, PLOTS_DIR, collect

# The config sections whose resolved values are parameters (the run's own keys too).
PARAM_SECTIONS = ("program", "stage_out", "lower", "compile", "execute", "mesh", "store")
PARAM_KEYS = ("stop_after", "start_at", "resume_from")
# MLflow's limits: a parameter value of 6000 characters, a tag value of 8000.
PARAM_CHARS = 6000
TAG_CHARS = 5000
NAME_CHARS = 250  # a run name as MLflow's UI shows it
LINKS_NAME = "links.tsv"  # the artifact listing the files too large to upload


@dataclass
class Record:
    """One tracked run: what the tracker stores, in its own terms."""

    name: str
    status: str  # ok | failed | does_not_fit | interrupted | ... (the manifest's)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: list[tuple[Path, str]] = field(default_factory=list)  # (file, artifact dir)
    links: list[str] = field(default_factory=list)  # lines of links.tsv
    started: float | None = None  # seconds since the epoch
    wall_s: float | None = None


# The program's arguments: one parameter per argument (``program.args.1``, as an override names
# it), each whole (an argument spec's pytree as JSON), never one per leaf of a spec.
_PER_ARGUMENT = ("program.args", "program.kwargs")


def _flat(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if prefix in _PER_ARGUMENT and isinstance(value, list | tuple | Mapping):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for k, v in items:
            yield f"{prefix}.{k}", v
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def _text(value: Any, limit: int) -> str:
    return clip(value if isinstance(value, str) else _json(value), limit)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut marked ``...``."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)


def config_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The resolved options that steer a run: each leaf of the stage sections and the run's
    own keys, set ones only (a None or an empty list or mapping is the default: omitted)."""
    out: dict[str, str] = {}
    for section in PARAM_SECTIONS:
        for key, value in _flat(config.get(section) or {}, section):
            if value is None or value == [] or value == {} or key == "program.description":
                continue
            out[key] = _text(value, PARAM_CHARS)
    for key in PARAM_KEYS:
        if config.get(key) is not None:
            out[key] = _text(config[key], PARAM_CHARS)
    return out


def override_params(overrides: list[str], known: Mapping[str, str]) -> dict[str, str]:
    """The command line's overrides that no resolved leaf names: config groups it chose
    (``program=axpy`` -> ``program``), keys outside the parameter sections. The program's
    arguments are parameters one per argument already (``program.args.0`` ...): left out."""
    out: dict[str, str] = {}
    for line in overrides:
        key = override_key(line)
        if key in known or "=" not in line:
            continue
        if key in _PER_ARGUMENT and any(k.startswith(key + ".") for k in known):
            continue
        out[key] = _text(line.split("=", 1)[1], PARAM_CHARS)
    return out


def metric_values(manifest: Mapping[str, Any] | None) -> dict[str, float]:
    """Every numeric figure of the manifest's stages (XLA's "unknown" sentinels left out), each
    stage's seconds, the run's wall time, and the fit verdict's flags as 1 or 0."""
    figures = RunMetrics.from_manifest(manifest)
    out: dict[str, float] = {}
    for stage, record in RECORDS.items():
        if figures.run(stage).status == "skipped":
            continue  # a stage the run did not reach has no figures (stop_after, start_at)
        seconds = figures.run(stage).seconds
        if seconds is not None:
            out[f"{stage}.seconds"] = float(seconds)
        metrics = [
            Metric(stage, f.name, f.metadata["unit"])
            for f in fields(record)
            if "record" not in f.metadata
        ]
        verdict = [f for f in fields(record) if "record" in f.metadata]
        for f in verdict:
            metrics += [
                Metric(stage, g.name, g.metadata["unit"], verdict=True)
                for g in fields(f.metadata["record"])
            ]
        for m in metrics:
            if m.unit == "flag" and m.verdict:
                flag = figures.value(m)
                if flag is not None:
                    out[m.column] = 1.0 if flag else 0.0
            elif m.unit in NUMERIC_UNITS:
                value = figures.figure(m)
                if value is not None:
                    out[m.column] = float(value)
    wall = (manifest or {}).get("wall_seconds")
    if isinstance(wall, int | float) and not isinstance(wall, bool):
        out["wall_seconds"] = float(wall)
    return out


def run_tags(manifest: Mapping[str, Any] | None, status: str, error: str | None) -> dict[str, str]:
    m: Mapping[str, Any] = manifest or {}
    config = m.get("config") or {}
    backend = m.get("backend") or {}
    versions = m.get("versions") or {}
    compile_entry = (m.get("stages") or {}).get("compile") or {}
    tags = {
        "jaxaot.program": (config.get("program") or {}).get("name"),
        "jaxaot.target": (config.get("program") or {}).get("target"),
        "jaxaot.backend": backend.get("platform") or (config.get("compile") or {}).get("backend"),
        "jaxaot.device_kind": backend.get("device_kind"),
        "jaxaot.topology": backend.get("topology") or (config.get("compile") or {}).get("topology"),
        "jaxaot.jax": versions.get("jax") or backend.get("jax"),
        "jaxaot.jaxlib": versions.get("jaxlib") or backend.get("jaxlib"),
        "jaxaot.libtpu": versions.get("libtpu") or backend.get("libtpu"),  # a TPU topology's
        "jaxaot.compile_key": compile_entry.get("key"),
        "jaxaot.status": status,
        "jaxaot.error": error,
        "jaxaot.run_dir": m.get("run_dir"),
    }
    return {k: _text(v, TAG_CHARS) for k, v in tags.items() if v not in (None, "")}


def _files(run_dir: Path) -> list[str]:
    """Every file under ``run_dir`` (relative, folder by folder, each sorted), less submitit's
    ``.submitit/`` folder: the manifest, the stage artifacts, the log, Hydra's record of the
    config, snapshots and graphs alike, whether or not the manifest lists them."""
    names: list[str] = []
    for root, dirs, files in os.walk(run_dir):
        dirs.sort()
        for name in sorted(files):
            rel = (Path(root) / name).relative_to(run_dir).as_posix()
            if not rel.startswith(".submitit/"):
                names.append(rel)
    return names


def add_files(record: Record, run_dir: Path, names: list[str], max_bytes: int) -> None:
    """Small files become artifacts (in their folder), larger ones a line of ``links.tsv``:
    relative path, bytes, absolute path."""
    for rel in names:
        path = run_dir / rel
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size <= max_bytes:
            parent = Path(rel).parent.as_posix()
            record.files.append((path, "" if parent == "." else parent))
        else:
            record.links.append(f"{rel}\t{size}\t{path.resolve()}")


def run_record(
    run_dir: Path,
    *,
    name: str,
    overrides: list[str],
    config: Mapping[str, Any] | None,
    fallback: tuple[str, str | None],
    max_bytes: int,
) -> Record:
    """The record of the run in ``run_dir``. ``config``: the resolved config when the run wrote
    no manifest; ``fallback``: (status, error) from the job's return when the manifest has none."""
    manifest = read_json(run_dir / MANIFEST_NAME)
    status = str((manifest or {}).get("status") or fallback[0])
    error = (manifest or {}).get("error") or fallback[1]
    resolved = (manifest or {}).get("config") or config or {}
    params = config_params(resolved)
    params.update(override_params(overrides, params))
    tags = run_tags(manifest, status, error)
    if overrides:
        tags["jaxaot.overrides"] = _text(" ".join(overrides), TAG_CHARS)
    if "jaxaot.program" not in tags and (resolved.get("program") or {}).get("name"):
        tags["jaxaot.program"] = str(resolved["program"]["name"])
    started = (manifest or {}).get("started")
    wall = (manifest or {}).get("wall_seconds")
    record = Record(
        name=name,
        status=status,
        params=params,
        metrics=metric_values(manifest),
        tags=tags,
        started=float(started) if isinstance(started, int | float) else None,
        wall_s=float(wall) if isinstance(wall, int | float) else None,
    )
    add_files(record, run_dir, _files(run_dir), max_bytes)
    return record


def sweep_record(sweep_dir: Path, *, name: str, max_bytes: int) -> Record:
    """The sweep's counts as metrics and its report, plots and Hydra config as artifacts."""
    table = collect(sweep_dir)
    failed, misfits = len(table.failed), len(table.does_not_fit)
    metrics = {
        "sweep.jobs": float(len(table.rows)),
        "sweep.ok": float(len(table.rows) - failed - misfits),
        "sweep.failed": float(failed),
        "sweep.does_not_fit": float(misfits),
    }
    record = Record(name=name, status="failed" if failed else "ok", metrics=metrics)
    names = [n for n in (MD_NAME, CSV_NAME, "multirun.yaml") if (sweep_dir / n).is_file()]
    plots = sweep_dir / PLOTS_DIR
    if plots.is_dir():
        names += [f"{PLOTS_DIR}/{p.name}" for p in sorted(plots.iterdir()) if p.is_file()]
    add_files(record, sweep_dir, names, max_bytes)
    return record


__all__ = [
    "LINKS_NAME",
    "Record",
    "add_files",
    "clip",
    "config_params",
    "metric_values",
    "override_params",
    "run_record",
    "run_tags",
    "sweep_record",
]
