"""Sweeps in parallel: joblib (n_jobs=2) vs the basic launcher, and execute-only sweeps.

Every number comes from fresh `jaxaot -m` processes run by this script, side by side:
- 8 distinct compiles (8 token shapes of the transformer train step, stop_after=compile, each
  sweep with an empty store) under the basic launcher (one process, one job after another) and
  under joblib with n_jobs=2 (two worker processes): the wall-time ratio (target >= 1.6x on a
  2-core machine);
- an 8-point execute-only sweep (`execute.seed=0..7` of the transformer forward pass, as in
  bench/store_cache.py, empty store) under both launchers:
  compiles counted from the job manifests (target: exactly 1, however launched) and the wall
  time against one cold run + 7 executes (target <= 1.3x for the basic launcher).
Rounds alternate basic and joblib so machine noise hits both alike; medians are printed.
The CPU time of the basic sweep (one process) gives the ceiling any launcher can reach on this
machine: a job that already keeps 1.5 of 2 cores busy (XLA:CPU compiles on a thread pool, and
the runner overlaps the compile with lowering) leaves little for a second process.

    python bench/sweep_parallel.py [--rounds 3] [--program transformer_train] [--seeds-program transformer]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPES = "[1,32],[1,64],[2,32],[2,64],[4,32],[4,64],[8,32],[8,64]"
LAUNCHERS = {"basic": [], "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _jaxaot(args: list[str], cwd: Path, store: Path, cpu: list[float] | None = None) -> float:
    """Wall seconds of one `jaxaot` process; its CPU seconds are appended to ``cpu``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAXAOT_STORE_DIR": str(store)}
    t0, c0 = time.perf_counter(), _cpu()
    subprocess.run(
        [sys.executable, "-m", "jaxaot.cli.main", *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
    )
    if cpu is not None:
        cpu.append(_cpu() - c0)
    return time.perf_counter() - t0


def _manifests(sweep_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/manifest.json"))]


def _compiles(sweep_dir: Path) -> int:
    return sum(m["stages"]["compile"]["status"] == "ran" for m in _manifests(sweep_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--program", default="transformer_train", help="for the distinct compiles")
    ap.add_argument("--seeds-program", default="transformer", help="for the execute-only sweep")
    opts = ap.parse_args()
    prog, seeds_prog = f"program={opts.program}", f"program={opts.seeds_program}"
    # tokens and targets share one shape: sweep the tokens, interpolate the targets.
    distinct = [
        prog,
        "stop_after=compile",
        f"program.args.1.shape={SHAPES}",
        "program.args.2.shape=${program.args.1.shape}",
    ]
    seeds = [seeds_prog, "execute.seed=" + ",".join(map(str, range(8)))]
    walls: dict[str, list[float]] = {
        f"{k}/{n}": [] for k in ("distinct", "seeds") for n in LAUNCHERS
    }
    compiles: dict[str, list[int]] = {k: [] for k in walls}
    cold, execute_s, basic_cpu = [], [], []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for r in range(opts.rounds):
            run_dir = tmp / f"cold{r}"
            cold.append(
                _jaxaot([seeds_prog, f"hydra.run.dir={run_dir}"], tmp, tmp / f"cold_store{r}")
            )
            manifest = json.loads((run_dir / "manifest.json").read_text())
            execute_s.append(manifest["stages"]["execute"]["seconds"])
            order = list(LAUNCHERS) if r % 2 == 0 else list(reversed(LAUNCHERS))
            for kind, args in (("distinct", distinct), ("seeds", seeds)):
                for name in order:
                    key, sweep_dir = f"{kind}/{name}", tmp / f"{kind}_{name}_{r}"
                    walls[key].append(
                        _jaxaot(
                            ["-m", *args, *LAUNCHERS[name], f"hydra.sweep.dir={sweep_dir}"],
                            tmp,
                            tmp / f"store_{kind}_{name}_{r}",
                            basic_cpu if key == "distinct/basic" else None,
                        )
                    )
                    compiles[key].append(_compiles(sweep_dir))
    med = {k: statistics.median(v) for k, v in walls.items()}
    budget = statistics.median(cold) + 7 * statistics.median(execute_s)
    print(
        f"programs: {opts.program} (compiles), {opts.seeds_program} (execute-only), rounds: "
        f"{opts.rounds}, cpus: {os.cpu_count()}, load "
        f"average (1 min) before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f}"
    )
    print("| sweep | basic | joblib n_jobs=2 | ratio | target |")
    print("|---|---|---|---|---|")
    b, j = med["distinct/basic"], med["distinct/joblib"]
    print(f"| 8 distinct compiles (wall) | {b:.2f} s | {j:.2f} s | {b / j:.2f}x faster | >= 1.6x |")
    cpu, cores = statistics.median(basic_cpu), os.cpu_count() or 1
    print(
        f"| 8 distinct compiles: CPU of the basic sweep | {cpu:.2f} s ({cpu / b:.2f} cores "
        f"busy) | | ceiling {b / (cpu / cores):.2f}x on {cores} cores | |"
    )
    b, j = med["seeds/basic"], med["seeds/joblib"]
    print(f"| 8-point execute-only (wall) | {b:.2f} s | {j:.2f} s | {b / j:.2f}x faster | |")
    cb, cj = max(compiles["seeds/basic"]), max(compiles["seeds/joblib"])
    print(f"| 8-point execute-only: compiles (max over rounds) | {cb} | {cj} | | 1 |")
    print(
        f"| execute-only wall / (cold run {statistics.median(cold):.2f} s + 7 executes "
        f"{7 * statistics.median(execute_s):.2f} s) | {b / budget:.2f}x | {j / budget:.2f}x | "
        f"| <= 1.3x |"
    )


if __name__ == "__main__":
    main()
