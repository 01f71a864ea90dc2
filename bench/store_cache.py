"""What the store saves: cold vs warm runs, compile vs load, and an execute-only sweep.

Every number comes from fresh processes run in this script, side by side:
- cold vs warm: the whole `jaxaot` process, empty store vs a store holding the executable
  (target: warm <= 0.3x cold);
- compile vs load: the compile stage's own time when it compiles vs when it loads the stored
  executable, from the manifests (target: >= 10x);
- an 8-point execute-only sweep (`-m execute.seed=0..7`, basic launcher, one process): exactly
  one compile, and wall <= 1.3x (one cold run + 7 executes).

- the identity checks a store hit makes before it serves, in this process: the calling convention of
  what would be compiled and of the loaded executable, the environment part of the key (XLA
  flags, JAX config values) and the comparison (target: < 5 ms per hit).

The same rounds time the floor of any warm run: a bare `python -c pass`, plus importing JAX and
starting its CPU backend, plus Hydra's floor (`jaxaot --cfg job`: import Hydra and compose the
config, no JAX). A warm run cannot be faster than that sum, so sum / cold is the best warm/cold
ratio reachable on this machine with this program.

    python bench/store_cache.py [--program transformer] [--rounds 3] [--checks-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jaxaot

ROOT = Path(__file__).resolve().parent.parent


def _jaxaot(args: list[str], cwd: Path, store: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAXAOT_STORE_DIR": str(store)}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "jaxaot.cli.main", *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def _wall(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def _floor(prog: str, cwd: Path) -> float:
    """Wall time no warm run can beat: Python + JAX start-up + Hydra's import and composition."""
    bare = _wall([sys.executable, "-c", "pass"], cwd)
    jax_up = _wall([sys.executable, "-c", "import jax; jax.devices()"], cwd)
    hydra = _wall([sys.executable, "-m", "jaxaot.cli.main", prog, "--cfg", "job"], cwd)
    return jax_up + (hydra - bare)


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _identity_checks(prog: str, tmp: Path, reps: int = 200) -> list[tuple[str, float, float]]:
    """Per kind of hit, (label, median seconds of the identity work a hit adds, seconds of that
    hit's whole compile stage), in this process: the convention and environment parts of the
    key, and the loaded executable's convention checked against the expected one. Kinds: a hit
    of a live lowering, and of a resumed one (start_at=compile: the export form)."""
    sys.path.insert(0, str(ROOT))
    from jaxaot.schema import validate
    from jaxaot.stages import compile as compile_stage
    from jaxaot.stages import jaxenv
    from jaxaot.util.fsio import key_of

    os.environ["JAXAOT_STORE_DIR"] = str(tmp / "checks_store")
    live = jaxaot.compose([prog, "execute.repeats=1"])
    src = jaxaot.run(jaxaot.compose([prog, "stop_after=lower"]), run_dir=tmp / "lowered")
    resumed = jaxaot.compose(
        [f"resume_from={src.run_dir}", "start_at=compile", "execute.repeats=1"]
    )
    out = []
    for label, cfg in (("live lowering", live), ("resumed, start_at=compile", resumed)):
        jaxaot.run(cfg, run_dir=tmp / f"cold-{len(out)}", overrides=[])
        hit = jaxaot.run(cfg, run_dir=tmp / f"warm-{len(out)}", overrides=[])
        assert hit.manifest["stages"]["compile"]["status"] == "cached"
        lowered, loaded = hit["lower"], hit["compile"].compiled
        typed, backend = validate(hit.manifest["config"]), hit.manifest["backend"]

        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            target = compile_stage.prepare(typed.compile, lowered)  # convention to key, check
            env = jaxenv.key_environment(compile_stage.compile_platform(typed.compile))
            key_of(compile_stage.cache_key(typed.compile, lowered, target, backend, env))
            why = compile_stage.mismatch(compile_stage.convention_of(loaded), [target.convention])
            samples.append(time.perf_counter() - t0)
            assert why is None, why
        stage = float(hit.manifest["stages"]["compile"]["seconds"])
        out.append((label, statistics.median(samples), stage))
    return out


def _print_checks(checks: list[tuple[str, float, float]]) -> None:
    for label, added, stage in checks:
        print(
            f"| identity checks per hit, {label} (key convention + environment + load "
            f"check) | {added * 1e3:.3f} ms = {added / stage:.1%} of the hit's compile stage "
            f"({stage * 1e3:.1f} ms) | < 5 ms |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", default="transformer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--checks-only",
        action="store_true",
        help="time only the identity checks a hit makes (in this process)",
    )
    opts = ap.parse_args()
    prog = f"program={opts.program}"
    if opts.checks_only:
        with tempfile.TemporaryDirectory() as tmp_:
            print("| measurement | value | target |")
            print("|---|---|---|")
            _print_checks(_identity_checks(prog, Path(tmp_)))
        return
    cold, warm, compile_s, load_s, floor = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for i in range(opts.rounds):
            store = tmp / f"store{i}"
            cold.append(_jaxaot([prog, f"hydra.run.dir={tmp}/cold{i}"], tmp, store))
            warm.append(_jaxaot([prog, f"hydra.run.dir={tmp}/warm{i}"], tmp, store))
            floor.append(_floor(prog, tmp))
            c, w = _manifest(tmp / f"cold{i}"), _manifest(tmp / f"warm{i}")
            assert (c["stages"]["compile"]["status"], w["stages"]["compile"]["status"]) == (
                "ran",
                "cached",
            )
            compile_s.append(c["stages"]["compile"]["seconds"])
            load_s.append(w["stages"]["compile"]["seconds"])
        execute_s = statistics.median(
            _manifest(tmp / f"cold{i}")["stages"]["execute"]["seconds"] for i in range(opts.rounds)
        )
        sweep_store, sweep_dir = tmp / "sweep_store", tmp / "sweep"
        seeds = ",".join(map(str, range(8)))
        sweep = _jaxaot(
            ["-m", prog, f"execute.seed={seeds}", f"hydra.sweep.dir={sweep_dir}"], tmp, sweep_store
        )
        statuses = [_manifest(sweep_dir / str(n))["stages"]["compile"]["status"] for n in range(8)]
        checks = _identity_checks(prog, tmp)
    c, w = statistics.median(cold), statistics.median(warm)
    cs, ls = statistics.median(compile_s), statistics.median(load_s)
    budget = c + 7 * execute_s
    print(f"program: {opts.program}, rounds: {opts.rounds}")
    print("| measurement | value | target |")
    print("|---|---|---|")
    print(f"| cold run (whole process) | {c:.2f} s | |")
    print(f"| warm run (whole process) | {w:.2f} s | |")
    print(f"| warm / cold | {w / c:.2f}x | <= 0.30x |")
    f = statistics.median(floor)
    print(
        f"| floor of a warm run (Python + JAX start-up + Hydra --cfg job) | {f:.2f} s = "
        f"{f / c:.2f}x of cold | |"
    )
    print(
        f"| compile stage: compile / load from store | {cs:.3f} s / {ls:.3f} s = {cs / ls:.0f}x | >= 10x |"
    )
    print(
        f"| 8-point execute-only sweep: compiles | {statuses.count('ran')} (7 cached: {statuses.count('cached') == 7}) | 1 |"
    )
    print(
        f"| sweep wall / (cold + 7 executes) | {sweep:.2f} s / {budget:.2f} s = {sweep / budget:.2f}x | <= 1.3x |"
    )
    _print_checks(checks)


if __name__ == "__main__":
    main()
