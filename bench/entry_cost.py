"""What the plain ``jaxaot`` command pays for the server when no server runs.

Every ``jaxaot ...`` first decides whether a ``jaxaot server`` can run it (jaxaot.cli.server:
``entry``); with none running it then runs in-process. This measures that decision three ways,
side by side in one run:

- **Whole processes**, interleaved round by round (machine noise hits every variant alike),
  medians: ``python -m jaxaot --version`` and a tiny warm run (``program=axpy``, store primed),
  each with the server path off (``JAXAOT_SERVER=0``) and on (the default) with no server
  running. The socket is a path in a private 0700 folder with nothing listening, which is the
  default path's case too (a folder left by an earlier server, no socket), so the client walks
  and checks that folder before it finds no server.
- **The decision alone**, in one process: ``try_server(["--version"])`` (what ``entry`` calls
  before ``jaxaot.cli.main``), repeated; median microseconds.
- **Imports**, from ``python -X importtime -m jaxaot --version`` with the server path off and
  on: what the entry imports for itself (``jaxaot.cli.server`` and its submodules, cumulative
  microseconds, medians), and which of those modules the in-process command would not have
  imported anyway.

    python bench/entry_cost.py [--rounds 15] [--calls 2000] [--import-rounds 9] [--other DIR]

``--other DIR`` measures another checkout too, interleaved with this one: DIR holds it as the
package ``jaxaot`` (its ``pipeline/`` as ``DIR/jaxaot``, ``stages/``, ``conf/`` and
``jaxaot_examples/`` inside as ``stages``, ``conf`` and ``examples``), put first on the
PYTHONPATH of its processes. The report names the jaxaot each one imported. Wall times, and
the CPU time (user + system) of each process, which what else runs on the machine disturbs
far less.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
TINY = ["program=axpy", "program.args=[3,4]", "execute.repeats=1"]

DECIDE = """
import os, sys, time
from jaxaot.cli.server import try_server
calls = int(sys.argv[1])
took = []
for _ in range(calls):
    t0 = time.perf_counter_ns()
    try_server(["--version"])  # returns: no server, this process would run it
    took.append(time.perf_counter_ns() - t0)
took.sort()
print(took[len(took) // 2] / 1000)
"""

# What `python -m jaxaot --version` would import with no server code at all.
IN_PROCESS = (
    "import sys; sys.argv = ['jaxaot', '--version']; from jaxaot.cli.main import main; main()"
)


def _wall(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds, and the CPU seconds (user + system) the process used: the CPU time is
    far less sensitive than the wall time to what else the machine is doing."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return took, cpu


def _importtime(cmd: list[str], env: dict[str, str], cwd: Path) -> list[tuple[int, int, str]]:
    """(depth, cumulative us, module) for each import, in the order ``-X importtime`` prints
    them (a module's own imports come before it)."""
    proc = subprocess.run(
        [PY, "-X", "importtime", *cmd], cwd=cwd, env=env, capture_output=True, text=True
    )
    out = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            out.append((len(m[3]) // 2, int(m[2]), m[4]))
    return out


def _entry_imports(rows: list[tuple[int, int, str]]) -> tuple[int, set[str], dict[str, int]]:
    """What the entry imported for itself: the outermost imports of ``jaxaot.cli.server`` and
    its submodules (the package at start-up, a submodule from inside a function), as their
    cumulative microseconds summed, every module under them, and each one's cumulative."""
    total, mods, own = 0, set(), {}
    for i, (depth, cum, name) in enumerate(rows):
        if name.startswith("jaxaot.cli.server"):
            own[name] = cum
        if depth != 0 or not name.startswith("jaxaot.cli.server"):
            continue
        total += cum
        mods.add(name)
        for d, _, n in reversed(rows[:i]):
            if d == 0:
                break
            mods.add(n)
    return total, mods, own


def imports(env: dict[str, str], cwd: Path, rounds: int) -> dict[str, dict[str, object]]:
    """Per mode (server path off, on): the entry's own imports, median over ``rounds``."""
    plain = {n for _, _, n in _importtime(["-c", IN_PROCESS], {**env, "JAXAOT_SERVER": "0"}, cwd)}
    out: dict[str, dict[str, object]] = {}
    for mode, menv in (("off", {**env, "JAXAOT_SERVER": "0"}), ("on", env)):
        totals, owns, mods = [], [], set()
        for _ in range(rounds):
            total, m, own = _entry_imports(_importtime(["-m", "jaxaot", "--version"], menv, cwd))
            totals.append(total)
            owns.append(own)
            mods |= m
        names = sorted({n for own in owns for n in own})
        out[mode] = {
            "us": statistics.median(totals),
            "modules": len(mods),
            "own": {n: statistics.median(o.get(n, 0) for o in owns) for n in names},
            "extra": sorted(mods - plain),
        }
    return out


def _med(xs: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.3f} s (IQR {1000 * (q3 - q1):.0f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--import-rounds", type=int, default=9)
    parser.add_argument(
        "--other",
        help="a folder holding another checkout as the package jaxaot (PYTHONPATH): measured "
        "too, interleaved with this one",
    )
    args = parser.parse_args()
    trees = {"this": os.environ.get("PYTHONPATH", "")}
    if args.other:
        trees["other"] = os.pathsep.join(p for p in (args.other, trees["this"]) if p)
    with tempfile.TemporaryDirectory(prefix="jaxaot-entry-") as tmp_s:
        tmp = Path(tmp_s)
        folder = tmp / "srv"
        folder.mkdir(mode=0o700)
        envs: dict[tuple[str, str], dict[str, str]] = {}
        where = {}
        for tree, pythonpath in trees.items():
            base = {
                **os.environ,
                "PYTHONPATH": pythonpath,
                "JAXAOT_SERVER_SOCKET": str(folder / "server.sock"),  # no server listens there
                "JAXAOT_STORE_DIR": str(tmp / f"store-{tree}"),
            }
            base.pop("JAXAOT_SERVER", None)
            envs[(tree, "on")] = base
            envs[(tree, "off")] = {**base, "JAXAOT_SERVER": "0"}
            where[tree] = subprocess.run(
                [PY, "-c", "import jaxaot; print(jaxaot.__file__)"],
                env=base,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        runs = iter(range(10**6))
        version = [PY, "-m", "jaxaot", "--version"]

        def tiny(env: dict[str, str]) -> tuple[float, float]:
            cmd = [PY, "-m", "jaxaot", *TINY, f"hydra.run.dir={tmp}/runs/{next(runs)}"]
            return _wall(cmd, tmp, env)

        keys = [(what, tree, mode) for what in ("--version", "tiny run") for tree, mode in envs]
        for tree in trees:
            tiny(envs[(tree, "off")])  # primes the store: every measured tiny run loads
        wall: dict[tuple[str, str, str], list[float]] = {k: [] for k in keys}
        cpu: dict[tuple[str, str, str], list[float]] = {k: [] for k in keys}
        for r in range(args.rounds):
            for key in keys if r % 2 == 0 else list(reversed(keys)):
                what, tree, mode = key
                env = envs[(tree, mode)]
                w, c = _wall(version, tmp, env) if what == "--version" else tiny(env)
                wall[key].append(w)
                cpu[key].append(c)
        decide = {
            key: float(
                subprocess.run(
                    [PY, "-c", DECIDE, str(args.calls)],
                    env=env,
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            for key, env in envs.items()
        }
        imp = {tree: imports(envs[(tree, "on")], tmp, args.import_rounds) for tree in trees}

    for tree in trees:
        print(f"{tree}: jaxaot at {where[tree]}")
    print(f"{args.rounds} rounds, interleaved; no server running; medians (interquartile range)\n")
    print("| command | tree | JAXAOT_SERVER=0 (off) | default, no server (on) | on / off |")
    print("|---|---|---|---|---|")
    for what in ("--version", "tiny run"):
        for tree in trees:
            for label, table in (("wall", wall), ("CPU", cpu)):
                lo, hi = (table[(what, tree, m)] for m in ("off", "on"))
                ratio = statistics.median(hi) / statistics.median(lo)
                print(
                    f"| `jaxaot {what}`, {label} | {tree} | {_med(lo)} | {_med(hi)} | {ratio:.3f} |"
                )
    print()
    for tree in trees:
        print(
            f"{tree}: the decision alone (`try_server`, median of {args.calls} calls): "
            f"{decide[(tree, 'off')]:.1f} us off, {decide[(tree, 'on')]:.1f} us on"
        )
        for mode, got in imp[tree].items():
            print(
                f"{tree}: entry imports with the server path {mode} (`-X importtime`, median of "
                f"{args.import_rounds}): {got['us']:.0f} us cumulative over {got['modules']} modules"
            )
            for name, us in got["own"].items():  # type: ignore[attr-defined]
                print(f"  {name}: {us:.0f} us cumulative")
            extra = got["extra"]
            print(
                "  of which the in-process command would not import: "
                + (", ".join(extra) if extra else "none")  # type: ignore[arg-type]
            )


if __name__ == "__main__":
    main()
