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

    python bench/entry_cost.py [--rounds 15] [--calls 2000] [--import-rounds 9]

Another checkout can be measured with the same script: ``PYTHONPATH=<a folder holding that
checkout as the package jaxaot> python bench/entry_cost.py``; the processes it starts inherit
PYTHONPATH, and the report names the jaxaot it measured.
"""

from __future__ import annotations

import argparse
import os
import re
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


def _wall(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--import-rounds", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxaot-entry-") as tmp_s:
        tmp = Path(tmp_s)
        folder = tmp / "srv"
        folder.mkdir(mode=0o700)
        base = {
            **os.environ,
            "JAXAOT_SERVER_SOCKET": str(folder / "server.sock"),  # no server listens there
            "JAXAOT_STORE_DIR": str(tmp / "store"),
        }
        base.pop("JAXAOT_SERVER", None)
        where = subprocess.run(
            [PY, "-c", "import jaxaot; print(jaxaot.__file__)"],
            env=base,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        off = {**base, "JAXAOT_SERVER": "0"}
        runs = iter(range(10**6))

        def tiny(env: dict[str, str]) -> float:
            cmd = [PY, "-m", "jaxaot", *TINY, f"hydra.run.dir={tmp}/runs/{next(runs)}"]
            return _wall(cmd, tmp, env)

        version = [PY, "-m", "jaxaot", "--version"]
        variants = {
            ("--version", "off"): lambda: _wall(version, tmp, off),
            ("--version", "on"): lambda: _wall(version, tmp, base),
            ("tiny run", "off"): lambda: tiny(off),
            ("tiny run", "on"): lambda: tiny(base),
        }
        tiny(off)  # primes the store: every measured tiny run loads its executable
        times: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(list(variants)))
            for key in order:
                times[key].append(variants[key]())
        decide = {
            mode: float(
                subprocess.run(
                    [PY, "-c", DECIDE, str(args.calls)],
                    env=env,
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            for mode, env in (("off", off), ("on", base))
        }
        imp = imports(base, tmp, args.import_rounds)

    print(f"jaxaot: {where}; {args.rounds} rounds, interleaved; no server running\n")
    print("| command | JAXAOT_SERVER=0 (off) | default, no server (on) | on / off | on - off |")
    print("|---|---|---|---|---|")
    for what in ("--version", "tiny run"):
        cells = []
        for mode in ("off", "on"):
            q1, _, q3 = statistics.quantiles(times[(what, mode)], n=4)
            cells.append(
                f"{statistics.median(times[(what, mode)]):.3f} s (IQR {1000 * (q3 - q1):.0f} ms)"
            )
        lo, hi = (statistics.median(times[(what, m)]) for m in ("off", "on"))
        print(
            f"| `jaxaot {what}` | {cells[0]} | {cells[1]} | {hi / lo:.3f} | {1000 * (hi - lo):+.1f} ms |"
        )
    print(
        f"\nThe decision alone (`try_server`, median of {args.calls} calls): "
        f"{decide['off']:.1f} us off, {decide['on']:.1f} us on"
    )
    for mode, what in imp.items():
        print(
            f"Entry imports with the server path {mode} (`-X importtime`, median of "
            f"{args.import_rounds}): {what['us']:.0f} us cumulative over {what['modules']} modules"
        )
        for name, us in what["own"].items():  # type: ignore[attr-defined]
            print(f"  {name}: {us:.0f} us cumulative")
        extra = what["extra"]
        print(
            "  of which the in-process command would not import: "
            + (", ".join(extra) if extra else "none")  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
