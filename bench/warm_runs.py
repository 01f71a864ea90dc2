"""Warm and cold runs against the hand-written script, with and without the jaxaot server.

Whole fresh processes, interleaved round by round (so machine noise hits every variant
alike), medians. Per program:

- *script, JAX cache*: ``bench/baseline_cached.py`` (``bench/baseline_jit.py`` with JAX's
  persistent compilation cache on, primed by a first run): the peer for warm runs.
- *script*: ``bench/baseline_jit.py``, no cache: the peer for cold runs.
- *jaxaot warm*: ``jaxaot program=X`` with its store primed; *jaxaot cold*: ``store.enabled=false``.
  Each in-process (``JAXAOT_SERVER=0``) and through a running ``jaxaot server``.

Targets: warm <= 0.8x of the script with JAX's cache; cold <= script + 0.2 s.

    python bench/warm_runs.py [--rounds 3] [--programs transformer,transformer_train]
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
PY = sys.executable


def _wall(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


def measure(program: str, rounds: int, tmp: Path) -> dict[str, float]:
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    served = {
        **base,
        "JAXAOT_SERVER_SOCKET": str(tmp / "srv" / "server.sock"),
        "JAXAOT_STORE_DIR": str(tmp / "store"),
    }
    alone = {**served, "JAXAOT_SERVER": "0"}
    cache = str(tmp / "jax-cache")
    jaxaot = [PY, "-m", "jaxaot", f"program={program}"]
    runs = iter(range(10**6))

    def rd() -> str:
        return f"hydra.run.dir={tmp}/runs/{program}-{next(runs)}"

    variants = {
        "script, JAX cache": lambda: _wall(
            [PY, "bench/baseline_cached.py", program, cache], ROOT, base
        ),
        "script": lambda: _wall([PY, "bench/baseline_jit.py", program], ROOT, base),
        "jaxaot warm": lambda: _wall([*jaxaot, rd()], tmp, alone),
        "jaxaot warm, server": lambda: _wall([*jaxaot, rd()], tmp, served),
        "jaxaot cold": lambda: _wall([*jaxaot, "store.enabled=false", rd()], tmp, alone),
        "jaxaot cold, server": lambda: _wall([*jaxaot, "store.enabled=false", rd()], tmp, served),
    }
    # Prime both caches (and check every variant runs) before timing.
    variants["script, JAX cache"]()
    variants["jaxaot warm"]()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def _help_times(rounds: int, tmp: Path, env: dict[str, str]) -> dict[str, float]:
    """``jaxaot --help``: in-process, through the server, and a bare ``python -c pass``."""
    cmds = {
        "python -c pass": ([PY, "-c", "pass"], env),
        "in-process": ([PY, "-m", "jaxaot", "--help"], {**env, "JAXAOT_SERVER": "0"}),
        "server": ([PY, "-m", "jaxaot", "--help"], env),
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(rounds):
        for k, (cmd, e) in cmds.items():
            times[k].append(_wall(cmd, tmp, e))
    return {k: statistics.median(t) for k, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--programs", default="transformer,transformer_train")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "JAXAOT_SERVER_SOCKET": str(tmp / "srv" / "server.sock"),
        }
        subprocess.run(
            [PY, "-m", "jaxaot", "server", "start"], env=env, check=True, capture_output=True
        )
        try:
            rows = {p: measure(p, opts.rounds, tmp) for p in opts.programs.split(",")}
            helps = _help_times(opts.rounds, tmp, env)
        finally:
            subprocess.run([PY, "-m", "jaxaot", "server", "stop"], env=env, capture_output=True)
    print(
        f"medians of {opts.rounds} interleaved rounds, whole processes; load "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        "| program | script, JAX cache | jaxaot warm | ratio | jaxaot warm, server | ratio "
        "| target |"
    )
    print("|---|---|---|---|---|---|---|")
    for p, m in rows.items():
        peer = m["script, JAX cache"]
        print(
            f"| {p} | {peer:.2f} s | {m['jaxaot warm']:.2f} s | {m['jaxaot warm'] / peer:.2f}x "
            f"| {m['jaxaot warm, server']:.2f} s | {m['jaxaot warm, server'] / peer:.2f}x "
            f"| <= 0.8x |"
        )
    print()
    print(
        "| program | script (no cache) | jaxaot cold | overhead | jaxaot cold, server "
        "| overhead | target |"
    )
    print("|---|---|---|---|---|---|---|")
    for p, m in rows.items():
        peer = m["script"]
        print(
            f"| {p} | {peer:.2f} s | {m['jaxaot cold']:.2f} s | {m['jaxaot cold'] - peer:+.2f} s "
            f"| {m['jaxaot cold, server']:.2f} s | {m['jaxaot cold, server'] - peer:+.2f} s "
            f"| <= +0.2 s |"
        )
    print()
    print(
        f"`jaxaot --help`: {helps['in-process']:.2f} s in-process, {helps['server']:.2f} s "
        f"through the server (`python -c pass`: {helps['python -c pass']:.2f} s)"
    )


if __name__ == "__main__":
    main()
