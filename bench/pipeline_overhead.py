"""Pipeline overhead: the whole `jaxaot` process vs the hand-written baseline process.

Runs both as fresh processes, interleaved (baseline, pipeline, baseline, ...) so machine noise
hits both alike, and prints the median wall time of each, the ratio and the absolute overhead.
The pipeline runs cold (store disabled): every stage computes, writes its artifacts, manifest
and summary. Targets: ratio <= 1.05 on the transformer, overhead < 0.5 s on axpy.

The same rounds also time Hydra's floor: `jaxaot program=X --cfg job` (import Hydra, compose
the config, print it; no JAX, no run) minus a bare `python -c pass`. No Hydra command line can
cost less than that on top of the baseline, so (baseline + floor) / baseline is the best ratio
any Hydra-driven run reaches on this machine.

    python bench/pipeline_overhead.py [--rounds 7] [--programs axpy,transformer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _wall(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def measure(program: str, rounds: int) -> tuple[float, float, float]:
    base, pipe, floor = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            bare = _wall([sys.executable, "-c", "pass"], ROOT)
            cfg = _wall(
                [sys.executable, "-m", "jaxaot.cli.main", f"program={program}", "--cfg", "job"],
                Path(tmp),
            )
            floor.append(cfg - bare)
            base.append(_wall([sys.executable, str(ROOT / "bench/baseline_jit.py"), program], ROOT))
            pipe.append(
                _wall(
                    [
                        sys.executable,
                        "-m",
                        "jaxaot.cli.main",
                        f"program={program}",
                        "store.enabled=false",
                        f"hydra.run.dir={tmp}/run{i}",
                    ],
                    Path(tmp),
                )
            )
            print(
                f"  {program}: round {i + 1}/{rounds}: hand-written jit {base[-1]:.2f} s, "
                f"jaxaot {pipe[-1]:.2f} s, Hydra floor {floor[-1]:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    return statistics.median(base), statistics.median(pipe), statistics.median(floor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--programs", default="axpy,transformer")
    opts = ap.parse_args()
    rows = []
    for program in opts.programs.split(","):
        b, p, f = measure(program, opts.rounds)
        rows.append((program, b, p, f))
    print(
        "| program | hand-written jit (s) | jaxaot (s) | ratio | overhead (s) "
        "| Hydra floor (s) | best ratio with Hydra |"
    )
    print("|---|---|---|---|---|---|---|")
    for program, b, p, f in rows:
        print(
            f"| {program} | {b:.3f} | {p:.3f} | {p / b:.3f}x | {p - b:+.3f} | {f:.3f} "
            f"| {(b + f) / b:.3f}x |"
        )


if __name__ == "__main__":
    main()
