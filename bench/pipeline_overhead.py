"""Pipeline overhead: the whole `jaxaot` process vs the hand-written baseline process.

Runs both as fresh processes, interleaved (baseline, pipeline, baseline, ...) so machine noise
hits both alike, and prints the median wall time of each, the ratio and the absolute overhead.
The pipeline runs cold (store disabled): every stage computes, writes its artifacts, manifest
and summary. Targets: ratio <= 1.05 on the transformer, overhead < 0.5 s on axpy.

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


def measure(program: str, rounds: int) -> tuple[float, float]:
    base, pipe = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            base.append(_wall([sys.executable, str(ROOT / "bench/baseline_jit.py"), program], ROOT))
            pipe.append(
                _wall(
                    [
                        sys.executable,
                        "-m",
                        "pipeline.cli",
                        f"program={program}",
                        "store.enabled=false",
                        f"hydra.run.dir={tmp}/run{i}",
                    ],
                    Path(tmp),
                )
            )
    return statistics.median(base), statistics.median(pipe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--programs", default="axpy,transformer")
    opts = ap.parse_args()
    rows = []
    for program in opts.programs.split(","):
        b, p = measure(program, opts.rounds)
        rows.append((program, b, p))
    print("| program | hand-written jit (s) | jaxaot (s) | ratio | overhead (s) |")
    print("|---|---|---|---|---|")
    for program, b, p in rows:
        print(f"| {program} | {b:.3f} | {p:.3f} | {p / b:.3f}x | {p - b:+.3f} |")


if __name__ == "__main__":
    main()
