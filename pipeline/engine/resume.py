"""Resuming from another run's checkpoint: verified reads and the options that come with them.

``resume_from=<run dir> start_at=<stage>`` loads the stages before ``start_at`` from that run.
Their options are part of what was checkpointed, so they come from the checkpoint's manifest,
and an explicit override that contradicts them is an error naming the key; options of the
stages that run now may be overridden freely. ``resume_from`` needs a ``start_at`` after
``stage_out`` (a run that starts at the first stage loads nothing).

``resume_from=latest`` is the newest run under the launch folder's ``outputs/`` that finished
those stages and whose options agree with every override given for them (``program=mlp``
passes over an axpy run). The ``jaxaot`` command resolves it once, before Hydra composes, and
runs with the folder in its place (:func:`resolve_latest_argv`): every job of a sweep, and a
requeued job hours later, loads the same run, and ``.hydra/overrides.yaml`` and the manifest
record that folder. A run from Python, or a command line it cannot read without running it
(``--config-dir``, a sweep over a loaded section), resolves it when the run starts
(:func:`resolve_resume_from`), once per sweep process. Either prints the run chosen on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.config.sections import override_key
from jaxaot.errors import ConfigError, StoreError
from jaxaot.rundir.dirs import OUTPUTS_ROOT
from jaxaot.rundir.manifest import MANIFEST_NAME, load_manifest
from jaxaot.schema import JaxaotConfig, to_container, typed_config, validate
from jaxaot.stages import NODES
from jaxaot.stages.contract import Entry, OnResume
from jaxaot.util.fsio import folder_problem, trust_from_env
from jaxaot.util.verified import checkpoint_files

log = logging.getLogger("jaxaot")

# Checkpoint files deserialized with pickle: read only from a run directory that no user you
# do not trust can write to.
PICKLED = frozenset({"executable.bin"})


def frozen_sections(start_at: str) -> tuple[str, ...]:
    """The config sections that a run starting at ``start_at`` takes from its checkpoint: those
    each earlier node declares (DESIGN.md: options belong to the stage where they first change
    the result)."""
    return tuple(s for node in NODES[: STAGES.index(start_at)] for s in node.sections)


_MISSING = object()  # a key absent from a config tree

# Frozen keys a resume may still set, each to the one value given here (or to the
# checkpoint's): that value changes nothing the checkpoint holds. mesh.abstract says whether
# this run may compile on the mesh, not what is lowered for it (the lowering is on an
# AbstractMesh either way): a lowering made with mesh.abstract=true compiles at
# start_at=compile with mesh.abstract=false, as JAX compiles an AbstractMesh lowering on a
# concrete mesh of the same axes. The other way, true over a lowering made to compile, would
# record a run that compiled as one that could not.
FREE_AT_RESUME: Mapping[str, Any] = MappingProxyType({"mesh.abstract": False})


def _select(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif (
            isinstance(node, list)
            and part.lstrip("-").isdigit()
            and -len(node) <= int(part) < len(node)
        ):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _override_key(override: str) -> str | None:
    """The config key an override sets (``key@package=v`` -> ``key``), None for an empty one."""
    return override_key(override).split("@", 1)[0].strip() or None


LATEST = "latest"  # resume_from=latest
FINISHED = ("ran", "cached", "resumed")  # a stage status whose files a later run can load


def _started(manifest: Mapping[str, Any]) -> float | None:
    """When the checkpoint's run started (its files are that old at least), if recorded."""
    started = manifest.get("started")
    return float(started) if isinstance(started, (int, float)) else None


def _finished(record: Mapping[str, Any]) -> bool:
    status = record.get("status")
    # A program judged not to fit by its memory analysis still has its executable: the
    # verdict is an estimate, and the hardware may be tried (computed: how it came).
    if status == "does_not_fit":
        status = record.get("computed", status)
    return status in FINISHED


# Folders under outputs/ that hold no runs: the store's old default place.
_NOT_RUNS = frozenset({"store"})
# The deepest run dir under outputs/: a sweep job, multirun/<date>/<time>/<n>.
_RUN_DEPTH = 4


def _manifests(root: Path) -> list[Path]:
    """The run dirs under ``root`` (a folder holding a manifest): single runs
    (``<date>/<time>``) and sweep jobs (``multirun/<date>/<time>/<n>``); hidden folders (a
    sweep's ``.jaxaot/`` with requeued attempts, ``.hydra/``), ``store/``, a run's own stage
    folders and anything deeper than a sweep job are not searched."""
    found = []
    base = len(root.parts)
    for here, dirs, files in os.walk(root):
        if MANIFEST_NAME in files:
            found.append(Path(here))
            dirs[:] = []
            continue
        depth = len(Path(here).parts) - base
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and depth < _RUN_DEPTH and (depth or d not in _NOT_RUNS)
        ]
    return found


def _brief(value: Any, width: int = 60) -> str:
    """A config value for a one-line message: its repr, cut to ``width`` characters."""
    if value is _MISSING:
        return "absent"
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _difference(key: str, mine: Any, theirs: Any) -> tuple[str, Any, Any]:
    """The first key at or below ``key`` where two values differ, with both values there: a
    group choice (``program=mlp``) compares whole sections, shown by the key that tells them
    apart (``program.name``) rather than both dicts."""
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return key, mine, theirs
    names = [*mine, *(k for k in theirs if k not in mine)]
    names.sort(key=lambda k: k not in ("name", "target"))  # what names a section, first
    for name in names:
        a, b = mine.get(name, _MISSING), theirs.get(name, _MISSING)
        if a != b:
            return _difference(f"{key}.{name}", a, b)
    return key, mine, theirs


def _conflict(
    start_at: str, current: Mapping[str, Any], saved: Mapping[str, Any], overrides: Sequence[str]
) -> tuple[str, str, Any, Any] | None:
    """The first override of an option that ``start_at`` takes from a checkpoint whose config
    is ``saved`` and that says otherwise: (the override's key, the key at which the values
    differ, this run's value there, the checkpoint's), or None."""
    frozen = frozen_sections(start_at)
    for override in overrides:
        key = _override_key(override)
        if key is None or key.split(".")[0] not in frozen:
            continue
        mine, theirs = _select(current, key), _select(saved, key)
        if key in FREE_AT_RESUME and mine == FREE_AT_RESUME[key]:
            continue
        if mine != theirs:
            return (key, *_difference(key, mine, theirs))
    return None


def _choose_latest(
    start_at: str,
    root: Path | str,
    cfg: JaxaotConfig | None = None,
    overrides: Sequence[str] = (),
) -> tuple[Path, Mapping[str, Any]]:
    """:func:`latest_run`, with the manifest of the run chosen."""
    needed = STAGES[: STAGES.index(start_at)]
    found: list[tuple[float, Path, Mapping[str, Any]]] = []
    for run_dir in _manifests(Path(root)):
        try:
            data = json.loads((run_dir / MANIFEST_NAME).read_text())
            stages = data.get("stages") or {}
            started = float(data.get("started") or 0.0)
            if all(_finished(stages.get(s) or {}) for s in needed):
                found.append((started, run_dir, data))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # unreadable, or being replaced: not a run to resume from
    found.sort(key=lambda f: f[0], reverse=True)
    where = os.path.abspath(root)
    finished = " and ".join(needed)
    if not found:
        raise ConfigError(
            f"resume_from=latest: expected a run under {where} that finished "
            f"{finished} (start_at={start_at} loads {'them' if len(needed) > 1 else 'it'}), "
            f"found none; run one first (jaxaot stop_after={needed[-1]}) or name its folder: "
            "resume_from=<run dir>"
        )
    if cfg is None:
        return found[0][1], found[0][2]
    current = to_container(cfg)
    first: tuple[str, str, Any, Any] | None = None
    for _, run_dir, data in found:
        saved = data.get("config")
        clash = _conflict(start_at, current, saved if isinstance(saved, dict) else {}, overrides)
        if clash is None:
            return run_dir, data
        first = first or clash
    assert first is not None
    key, at, mine, theirs = first
    newest = found[0][1]
    if len(found) == 1:
        head = f"the only run under {where} that finished {finished}, {newest}, has"
        tail = f" (the command line's {key})"
    else:
        head = (
            f"none of the {len(found)} runs under {where} that finished {finished} agrees "
            f"with the command line's {key}; the newest, {newest}, has"
        )
        tail = ""
    raise ConfigError(
        f"resume_from=latest: {head} {at} = {_brief(theirs)}, not {_brief(mine)}{tail}; run "
        f"one with these options first (jaxaot ... stop_after={needed[-1]}) or name its "
        "folder: resume_from=<run dir>"
    )


def latest_run(
    start_at: str,
    root: Path | str = OUTPUTS_ROOT,
    *,
    cfg: JaxaotConfig | None = None,
    overrides: Sequence[str] = (),
) -> Path:
    """``resume_from=latest``: the run under ``root`` (``outputs/``, where runs go unless
    ``hydra.run.dir`` names another folder) started last, by its manifest's start time, of
    those that finished every stage before ``start_at``; a ConfigError when there is none.

    With ``cfg``, only a run whose options agree with ``cfg`` on every key that ``overrides``
    sets in the sections ``start_at`` loads (as :meth:`Checkpoint.apply` requires); a
    ConfigError naming the first difference when runs finished those stages but none agrees.
    """
    return _choose_latest(start_at, root, cfg, overrides)[0]


def _announce(run_dir: Path, data: Mapping[str, Any]) -> None:
    """The run ``resume_from=latest`` chose, as one line on stderr: shown in quiet runs too."""
    config = data.get("config")
    program = config.get("program") if isinstance(config, dict) else None
    name = program.get("name") if isinstance(program, dict) else None
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(data["started"])))
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        started = "?"
    print(
        f"resume_from=latest: {run_dir} (program {name or '?'}, started {started})",
        file=sys.stderr,
        flush=True,
    )


def _launch_outputs() -> Path:
    """``outputs/`` under the folder the command was started in (not a job's own folder, which
    ``hydra.job.chdir=true`` makes the working directory)."""
    from hydra.core.hydra_config import HydraConfig

    cwd = HydraConfig.get().runtime.cwd if HydraConfig.initialized() else os.getcwd()
    return Path(cwd) / OUTPUTS_ROOT


def _sweep() -> str | None:
    """The folder of the sweep this process runs a job of, None outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return str(HydraConfig.get().sweep.dir)
    return None


# resume_from=latest resolved in this process: (the sweep's folder, outputs/, start_at, the
# overrides of the loaded sections) -> run dir, so that a job does not resume from the job
# before it.
_RESOLVED: dict[tuple[str, ...], Path] = {}


def resolve_resume_from(cfg: JaxaotConfig, overrides: Sequence[str]) -> JaxaotConfig:
    """``cfg`` with ``resume_from=latest`` replaced by the run it means (:func:`latest_run`
    under the launch folder's ``outputs/``, checked against ``overrides``; once per process in a
    sweep); a ConfigError for a ``resume_from`` that a run starting at stage_out would ignore."""
    if STAGES.index(cfg.start_at) == 0:
        if cfg.resume_from:
            raise ConfigError(
                f"resume_from={cfg.resume_from}: set, but start_at={cfg.start_at} runs every "
                "stage and loads nothing from it; expected a later start_at "
                f"({', '.join(STAGES[1:])}), e.g. resume_from={cfg.resume_from} "
                f"start_at={STAGES[2]}, or no resume_from"
            )
        return cfg
    if cfg.resume_from != LATEST:
        return cfg
    root = _launch_outputs()
    frozen = frozen_sections(cfg.start_at)
    given = sorted(o for o in overrides if (_override_key(o) or ".").split(".")[0] in frozen)
    sweep = _sweep()
    key = (str(sweep), str(root), cfg.start_at, *given)
    run_dir = _RESOLVED.get(key) if sweep is not None else None
    if run_dir is None:
        run_dir, data = _choose_latest(cfg.start_at, root, cfg, overrides)
        _announce(run_dir, data)
        if sweep is not None:
            _RESOLVED[key] = run_dir
    return dataclasses.replace(cfg, resume_from=str(run_dir))


_LATEST_ARG = re.compile(rf"^(\+{{0,2}})resume_from={LATEST}$")
# Command-line flags that leave the config as the overrides make it.
_PLAIN_FLAGS = ("-m", "--multirun")


def _as_override(prefix: str, path: Path) -> str | None:
    """``resume_from=<path>`` as Hydra reads back exactly ``path``, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    text = str(path)
    if "$" in text:  # an interpolation to OmegaConf, quoted or not
        return None
    parser = OverridesParser.create()
    for value in (text, "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"):
        line = f"{prefix}resume_from={value}"
        try:
            [parsed] = parser.parse_overrides([line])
        except Exception:
            continue
        if parsed.value() == text:
            return line
    return None


def resolve_latest_argv(
    args: Sequence[str], compose: Callable[[list[str]], Any], cwd: Path | str | None = None
) -> list[str]:
    """The ``jaxaot`` command line with ``resume_from=latest`` replaced by the run dir it means
    (under ``cwd``'s ``outputs/``, default the working folder), chosen as
    :func:`resolve_resume_from` would for the config ``compose(overrides)`` makes
    (:func:`jaxaot.compose`) and announced on stderr; ``args`` as they are when there
    is no such argument, when ``start_at`` is stage_out (the run refuses it), or when the
    config cannot be known without Hydra's run (a config dir, a sweep over ``start_at`` or
    over a section the resume loads): the run then resolves it when it starts."""
    args = list(args)
    at = [(i, m[1]) for i, a in enumerate(args) if (m := _LATEST_ARG.match(a.strip()))]
    if not at or any(a.startswith("-") and a not in _PLAIN_FLAGS for a in args):
        return args
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(
            [a for a in args if a not in _PLAIN_FLAGS]
        )
        task = [o for o in parsed if not o.key_or_group.startswith("hydra")]
        plain = [o.input_line for o in task if not o.is_sweep_override()]
        cfg = validate(compose([str(line) for line in plain]))
    except Exception:  # the run reports what is wrong with its config
        return args
    if STAGES.index(cfg.start_at) == 0 or cfg.resume_from != LATEST:
        return args
    loaded = {*frozen_sections(cfg.start_at), "start_at", "resume_from", "experiment"}
    for o in task:
        if o.is_sweep_override() and o.key_or_group.split("/")[0].split(".")[0] in loaded:
            return args
    root = Path(cwd if cwd is not None else os.getcwd()) / OUTPUTS_ROOT
    run_dir, data = _choose_latest(cfg.start_at, root, cfg, [str(line) for line in plain])
    lines = [_as_override(prefix, run_dir) for _, prefix in at]
    if None in lines:
        return args
    _announce(run_dir, data)
    for (i, _), line in zip(at, lines, strict=True):
        args[i] = str(line)
    return args


class Checkpoint:
    """A finished run directory used as the input of a later run."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            problem = folder_problem(self.run_dir, write=False, create=False)
            found = f": {problem}" if problem and str(run_dir) else ""
            raise StoreError(
                f"resume_from={str(run_dir)!r}: no such run directory{found}; expected the "
                "directory of a finished run (the one holding its manifest.json)"
            )
        self.manifest = load_manifest(self.run_dir)
        # store.trust / $JAXAOT_TRUST_STORE: unpickle executable.bin whatever the permissions.
        self.trust = trust_from_env()
        self.artifacts: dict[str, dict[str, Any]] = {
            name: rec
            for stage in self.manifest.get("stages", {}).values()
            for name, rec in stage.get("artifacts", {}).items()
        }

    def require(self, stage: str, start_at: str) -> None:
        record = self.manifest.get("stages", {}).get(stage, {})
        if not _finished(record):
            raise StoreError(
                f"resume_from={str(self.run_dir)!r} start_at={start_at}: that run has no "
                f"finished {stage!r} stage (status {record.get('status')!r}); start earlier"
            )

    def entry(self, stage: str) -> Entry:
        """One stage's files as an :class:`~jaxaot.stages.contract.Entry`, like a store entry's:
        reads checked against the manifest's size and sha256 (a missing or altered file is a
        StoreError naming it, one the manifest does not list a KeyError), executables unpickled
        only from a run directory no user you do not trust can write, and the backend the run
        had (what a Cached stage's ``compat`` is checked against)."""
        files = checkpoint_files(
            self.run_dir, stage, self.artifacts, trusted=self.trust, guarded=PICKLED
        )
        return Entry(
            label=files.label,
            read=files.read,
            compat=self.manifest.get("backend") or {},
            source="checkpoint",
            created=_started(self.manifest),
        )

    def apply(self, cfg: JaxaotConfig, overrides: Sequence[str]) -> JaxaotConfig:
        """``cfg`` with the frozen sections taken from the checkpoint (typed, not yet checked:
        the run validates what it runs with once); conflicts are errors."""
        self.trust = self.trust or cfg.store.trust
        frozen = frozen_sections(cfg.start_at)
        current, saved = to_container(cfg), self.manifest["config"]
        clash = _conflict(cfg.start_at, current, saved, overrides)
        if clash is not None:
            key, at, mine, theirs = clash
            free = (
                f" ({key} may be overridden only to {FREE_AT_RESUME[key]!r} at a resume)"
                if key in FREE_AT_RESUME
                else ""
            )
            how = f"to {_brief(mine)}" if at == key else f"so that {at} = {_brief(mine)}"
            raise ConfigError(
                f"{key}: overridden {how}, but start_at={cfg.start_at} resumes stages "
                f"whose options come from the checkpoint ({at} = {_brief(theirs)} in "
                f"{self.run_dir}){free}; drop the override or start at an earlier stage"
            )
        merged = {**current, **{s: saved[s] for s in frozen if s in saved}}
        keys = {k for k in (_override_key(o) for o in overrides) if k}
        for key in keys & FREE_AT_RESUME.keys():
            section, name = key.split(".", 1)
            if section in frozen and isinstance(merged.get(section), dict):
                merged[section] = {**merged[section], name: current[section][name]}
        # A node that runs now on resumed inputs may take a default from the checkpoint.
        start = STAGES.index(cfg.start_at)
        for i, node in enumerate(NODES):
            resumed_inputs = all(STAGES.index(n) < start for n in node.inputs)
            if isinstance(node, OnResume) and i >= start and node.inputs and resumed_inputs:
                merged[node.name] = node.resume_default(saved, merged[node.name], keys)
        return typed_config(merged)


__all__ = [
    "FREE_AT_RESUME",
    "LATEST",
    "Checkpoint",
    "frozen_sections",
    "latest_run",
    "resolve_latest_argv",
    "resolve_resume_from",
]
