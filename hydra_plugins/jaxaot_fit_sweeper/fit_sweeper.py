"""``hydra/sweeper=jaxaot_fit``: bisect an integer override for the largest value that fits.

Each probe is an ordinary sweep job launched with the configured launcher (one compile, stored
like any other); the job's exit code is the verdict (0 fits, 3 does not fit). The other sweep
arguments on the command line give one search each (e.g. per ``compile.topology``). Writes
``fit.json`` in the sweep dir and logs one line per search. No ``from __future__ import
annotations`` here: Hydra executes plugin modules before registering them in ``sys.modules``,
where dataclasses would look string annotations up.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from jaxaot.errors import EXIT_DOES_NOT_FIT
from jaxaot.rundir.manifest import MANIFEST_NAME
from jaxaot.sweeps.compose_cache import LaunchingSweeper
from jaxaot.sweeps.fit_search import (
    FIT_NAME,
    FitOptions,
    Search,
    bisect,
    combinations,
    summary_line,
)
from jaxaot.sweeps.progress import JobOutcome, read_json
from jaxaot.util.fsio import atomic_write_json
from omegaconf import OmegaConf

log = logging.getLogger("jaxaot")


@dataclass
class JaxaotFitSweeperConf:
    _target_: str = "hydra_plugins.jaxaot_fit_sweeper.fit_sweeper.JaxaotFitSweeper"
    overrides: list[str] = field(default_factory=list)
    low: int = 1
    high: int = 1024
    multiple: int = 1


ConfigStore.instance().store(
    group="hydra/sweeper", name="jaxaot_fit", node=JaxaotFitSweeperConf, provider="jaxaot"
)


def _verdict(job: JobReturn) -> tuple[bool | None, str | None, dict[str, Any]]:
    """(fits, error, compile metrics) of one probe job."""
    value = job._return_value
    if job.status != JobStatus.COMPLETED:
        return None, f"job raised {type(value).__name__}: {value}", {}
    code = value.code if isinstance(value, JobOutcome) else int(value or 0)
    run_dir = Path(str(job.hydra_cfg.hydra.runtime.output_dir)) if job.hydra_cfg else None
    manifest = read_json(run_dir / MANIFEST_NAME) if run_dir else None
    metrics = ((manifest or {}).get("stages", {}).get("compile", {}).get("metrics")) or {}
    if code == 0 and metrics.get("fits") is None:
        return None, "the job has no fit verdict (set compile.topology)", metrics
    if code in (0, EXIT_DOES_NOT_FIT):
        return code == 0, None, metrics
    return None, (value.error if isinstance(value, JobOutcome) else f"exit code {code}"), metrics


class JaxaotFitSweeper(LaunchingSweeper):
    """Bisects ``overrides``' ``{n}`` over [low, high] (multiples of ``multiple``)."""

    def __init__(self, **options: Any) -> None:
        overrides = options.pop("overrides", None) or []
        if OmegaConf.is_config(overrides):
            overrides = OmegaConf.to_container(overrides, resolve=True)
        self.opts = FitOptions(overrides=[str(o) for o in overrides], **options)

    def sweep(self, arguments: list[str]) -> Sequence[Any]:
        assert self.config is not None and self.hydra_context is not None
        self.opts.check()
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        combos = combinations(parser.parse_overrides(list(arguments)))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns: list = []
        results: list = []
        common = set.intersection(*(set(c) for c in combos))
        for fixed in combos:
            search = Search(fixed=fixed, label=" ".join(o for o in fixed if o not in common))

            def probe(n: int, fixed: list = fixed, search: Search = search) -> bool | None:
                batch = [[*fixed, *self.opts.with_value(n)]]
                self.validate_batch_is_legal(batch)
                job = self.launcher.launch(batch, initial_job_idx=sum(map(len, returns)))[0]
                returns.append([job])
                fits, error, metrics = _verdict(job)
                search.probes.append(
                    {
                        "n": n,
                        "fits": fits,
                        "job": sum(map(len, returns)) - 1,
                        "error": error,
                        "hbm_bytes_needed": metrics.get("hbm_bytes_needed"),
                        "hbm_bytes_available": metrics.get("hbm_bytes_available"),
                    }
                )
                if fits is None:
                    search.error = f"n={n}: {error}"
                return fits

            bisect(self.opts, probe, search)
            result = search.to_json(self.opts)
            results.append(result)
            log.info("%s", summary_line(result))
            atomic_write_json(
                sweep_dir / FIT_NAME,
                {
                    "overrides": self.opts.overrides,
                    "low": self.opts.low,
                    "high": self.opts.high,
                    "multiple": self.opts.multiple,
                    "searches": results,
                },
            )
        for result in results:
            print(summary_line(result), flush=True)
        return returns


__all__ = ["JaxaotFitSweeper", "JaxaotFitSweeperConf"]
