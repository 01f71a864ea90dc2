"""This checkout against an earlier commit: the same ``jaxaot`` commands, side by side.

A change that makes jaxaot slower shows here before it ships. The earlier commit is checked
out into a temporary git worktree; each tree is laid out as the package ``jaxaot`` (its
``pipeline/`` as ``jaxaot``, with ``stages/``, ``conf/`` and ``jaxaot_examples/`` inside as
``stages``, ``conf`` and ``examples``) in a folder put first on PYTHONPATH, so both run on this
venv's JAX and Hydra. Whole processes (``JAXAOT_SERVER=0``: no resident server), each tree with
its own primed store, interleaved round by round with the order alternated, so the machine's
noise hits both alike. Reported: medians of wall and CPU time (user + system: what other load
disturbs far less), and the median of the per-round CPU ratios (after / before).

    python bench/versus_commit.py REV [--rounds 20] [--cases version,axpy,cold,warm]

One run's CPU time moves by +-10% on a loaded 2-core machine: use 20 rounds or more before
reading a few per cent into a ratio.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "version": ["--version"],
    "axpy": ["program=axpy", "store.enabled=false"],
    "cold": ["program=transformer", "store.enabled=false"],
    "warm": ["program=transformer"],  # a store hit: the executable loaded, not compiled
}
TITLES = {
    "version": "`jaxaot --version`",
    "axpy": "`jaxaot program=axpy` (store off)",
    "cold": "`jaxaot program=transformer` (store off)",
    "warm": "`jaxaot program=transformer` (store hit)",
}


def package_site(tree: Path, where: Path) -> Path:
    """``tree`` as an importable ``jaxaot`` (and its ``hydra_plugins``) under ``where``."""
    pkg = where / "jaxaot"
    pkg.mkdir(parents=True)
    for item in (tree / "pipeline").iterdir():
        (pkg / item.name).symlink_to(item)
    for name, src in (("stages", "stages"), ("conf", "conf"), ("examples", "jaxaot_examples")):
        (pkg / name).symlink_to(tree / src)
    (where / "hydra_plugins").symlink_to(tree / "hydra_plugins")
    return where


def one(site: Path, args: list[str], cwd: Path, store: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one ``python -m jaxaot ARGS`` from ``site``."""
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "JAXAOT_SERVER": "0",
        "JAXAOT_STORE_DIR": str(store),
    }
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"jaxaot {' '.join(args)} from {site}: {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def imported_from(site: Path) -> str:
    code = "import jaxaot; print(jaxaot.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()[-300:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the earlier commit (anything git rev-parse takes)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    opts = parser.parse_args()
    cases = opts.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        raise SystemExit(f"--cases: expected some of {', '.join(CASES)}; found {unknown}")
    rev = subprocess.run(
        ["git", "rev-parse", "--short", opts.rev], cwd=REPO, capture_output=True, text=True
    )
    if rev.returncode != 0:
        raise SystemExit(f"REV: {opts.rev!r} is not a commit of {REPO}: {rev.stderr.strip()}")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    head += "+uncommitted changes" if dirty else ""  # the working tree is what runs
    with tempfile.TemporaryDirectory(prefix="jaxaot-versus-") as tmp:
        t = Path(tmp)
        worktree = t / "before-tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(worktree), rev.stdout.strip()],
            cwd=REPO,
            check=True,
        )
        try:
            sites = {
                "before": package_site(worktree, t / "before"),
                "after": package_site(REPO, t / "after"),
            }
            for name, site in sites.items():
                (t / f"store-{name}").mkdir()
                one(site, CASES["warm"], t, t / f"store-{name}")  # primes the store
                print(f"{name}: imports {imported_from(site)}", flush=True)
            cpu: dict[tuple[str, str], list[float]] = {(c, k): [] for c in cases for k in sites}
            wall: dict[tuple[str, str], list[float]] = {(c, k): [] for c in cases for k in sites}
            for r in range(opts.rounds):
                order = list(sites.items()) if r % 2 == 0 else list(reversed(sites.items()))
                for case in cases:
                    for name, site in order:
                        w, c = one(site, CASES[case], t, t / f"store-{name}")
                        wall[(case, name)].append(w)
                        cpu[(case, name)].append(c)
                print(f"round {r + 1}/{opts.rounds}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO)
            shutil.rmtree(worktree, ignore_errors=True)
    load = os.getloadavg()[0]
    print(
        f"\n{rev.stdout.strip()} (before) vs {head} (after), {opts.rounds} rounds, load {load:.1f}"
    )
    print(
        "\n| command | before CPU | after CPU | ratio | per-round ratio | before wall | after wall |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        b, a = cpu[(case, "before")], cpu[(case, "after")]
        per_round = statistics.median(y / x for x, y in zip(b, a, strict=True))
        bw, aw = statistics.median(wall[(case, "before")]), statistics.median(wall[(case, "after")])
        print(
            f"| {TITLES[case]} | {statistics.median(b):.2f} s | {statistics.median(a):.2f} s | "
            f"{statistics.median(a) / statistics.median(b):.2f}x | {per_round:.2f}x | "
            f"{bw:.2f} s | {aw:.2f} s |"
        )


if __name__ == "__main__":
    main()
