"""Resuming from another run's checkpoint: verified reads and the options that come with them.

``resume_from=<run dir> start_at=<stage>`` loads the stages before ``start_at`` from that run
(``resume_from=latest``: the newest run under ``outputs/`` that finished them). Their options are part of what was checkpointed, so they come from the checkpoint's manifest,
and an explicit override that contradicts them is an error naming the key; options of the
stages that run now may be overridden freely.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jaxaot.config.order import STAGES
from jaxaot.config.sections import override_key
from jaxaot.errors import ConfigError, StoreError
from jaxaot.rundir.dirs import OUTPUTS_ROOT
from jaxaot.rundir.manifest import MANIFEST_NAME, load_manifest
from jaxaot.schema import JaxaotConfig, to_container, validate
from jaxaot.stages import NODES
from jaxaot.stages.node import Entry
from jaxaot.store.entries import shown_with_target
from jaxaot.util.fsio import folder_problem, trust_from_env, untrusted_path

log = logging.getLogger("jaxaot")

# Checkpoint files deserialized with pickle: read only from a run directory that no user you
# do not trust can write to (issue 12, item 9).
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


def _finished(record: Mapping[str, Any]) -> bool:
    status = record.get("status")
    # A program judged not to fit by its memory analysis still has its executable: the
    # verdict is an estimate, and the hardware may be tried (computed: how it came).
    if status == "does_not_fit":
        status = record.get("computed", status)
    return status in FINISHED


def _manifests(root: Path) -> list[Path]:
    """The run dirs under ``root`` (a folder holding a manifest): single runs
    (``<date>/<time>``) and sweep jobs (``multirun/<date>/<time>/<n>``); hidden folders (a
    sweep's ``.jaxaot/`` with requeued attempts, ``.hydra/``) and a run's own stage folders
    are not searched."""
    found = []
    for here, dirs, files in os.walk(root):
        if MANIFEST_NAME in files:
            found.append(Path(here))
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".")]
    return found


def latest_run(start_at: str, root: Path | str = OUTPUTS_ROOT) -> Path:
    """``resume_from=latest``: the run under ``root`` (``outputs/``, where runs go unless
    ``hydra.run.dir`` names another folder) started last, by its manifest's start time, of
    those that finished every stage before ``start_at``; a ConfigError when there is none."""
    needed = STAGES[: STAGES.index(start_at)]
    best: tuple[float, Path] | None = None
    for run_dir in _manifests(Path(root)):
        try:
            data = json.loads((run_dir / MANIFEST_NAME).read_text())
            stages = data.get("stages") or {}
            started = float(data.get("started") or 0.0)
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # unreadable, or being replaced: not a run to resume from
        if not all(_finished(stages.get(s) or {}) for s in needed):
            continue
        if best is None or started > best[0]:
            best = (started, run_dir)
    if best is None:
        where = os.path.abspath(root)
        raise ConfigError(
            f"resume_from=latest: expected a run under {where} that finished "
            f"{' and '.join(needed)} (start_at={start_at} loads {'them' if len(needed) > 1 else 'it'}), "
            f"found none; run one first (jaxaot stop_after={needed[-1]}) or name its folder: "
            "resume_from=<run dir>"
        )
    return best[1]


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
        """One stage's files as an :class:`~jaxaot.stages.node.Entry`, like a store entry's:
        verified reads, and the backend the run had (what a node's ``compat`` is checked
        against)."""
        return Entry(
            label=f"resume_from={self.run_dir}",
            read=self.reader(stage),
            compat=self.manifest.get("backend") or {},
            source="checkpoint",
        )

    def reader(self, stage: str) -> Callable[[str], bytes]:
        """``read(name)`` for one stage's files, each checked against the manifest's sha256.

        An artifact the manifest does not list raises KeyError (optional files); one that is
        listed but missing or altered raises StoreError naming the file.
        """

        def read(name: str) -> bytes:
            rel = f"{stage}/{name}"
            rec = self.artifacts[rel]
            path = self.run_dir / rel
            if name in PICKLED and not self.trust:
                self._check_trusted(path)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise StoreError(f"resume_from: checkpoint file {path} is missing") from None
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != rec["size"] or digest != rec["sha256"]:
                raise StoreError(
                    f"resume_from: checkpoint file {path} is corrupt ({len(data)} bytes, sha256 "
                    f"{digest[:12]}; the manifest says {rec['size']} bytes, {rec['sha256'][:12]}); "
                    "re-run the stage that wrote it"
                )
            return data

        return read

    def _check_trusted(self, path: Path) -> None:
        try:
            reason = untrusted_path(path, self.run_dir)
        except FileNotFoundError:
            return  # reported as missing by the read
        if reason:
            via = shown_with_target(self.run_dir)[len(str(self.run_dir)) :]
            raise StoreError(
                f"resume_from={str(self.run_dir)!r}{via}: refusing to unpickle "
                f"{path.name}: {reason}; "
                "make the run directory writable by you (and your team's group) only "
                "(chmod -R o-w), or set store.trust=true (JAXAOT_TRUST_STORE=1) if you trust "
                "every user who can write there"
            )

    def apply(self, cfg: JaxaotConfig, overrides: Sequence[str]) -> JaxaotConfig:
        """``cfg`` with the frozen sections taken from the checkpoint; conflicts are errors."""
        self.trust = self.trust or cfg.store.trust
        frozen = frozen_sections(cfg.start_at)
        current, saved = to_container(cfg), self.manifest["config"]
        for override in overrides:
            key = _override_key(override)
            if key is None or key.split(".")[0] not in frozen:
                continue
            mine, theirs = _select(current, key), _select(saved, key)
            if key in FREE_AT_RESUME and mine == FREE_AT_RESUME[key]:
                continue
            if mine != theirs:
                shown = "absent" if theirs is _MISSING else repr(theirs)
                free = (
                    f" ({key} may be overridden only to {FREE_AT_RESUME[key]!r} at a resume)"
                    if key in FREE_AT_RESUME
                    else ""
                )
                raise ConfigError(
                    f"{key}: overridden to {mine!r}, but start_at={cfg.start_at} resumes stages "
                    f"whose options come from the checkpoint ({key} = {shown} in "
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
            if node.resume_default is not None and i >= start and node.inputs and resumed_inputs:
                merged[node.name] = node.resume_default(saved, merged[node.name], keys)
        return validate(merged)


__all__ = ["FREE_AT_RESUME", "LATEST", "Checkpoint", "frozen_sections", "latest_run"]
