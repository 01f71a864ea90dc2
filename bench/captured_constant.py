"""A program that closes over a 51 MB constant: jaxaot's lower stage vs plain JAX.

``program=captured_constant`` is ``tanh(x @ W)`` with ``W`` a captured 3584x3584 f32 array.
Plain JAX: ``jax.jit(f).lower(x)`` then ``.as_text()`` (timed inside a fresh process). jaxaot:
the lower stage's own time from the manifest (``stop_after=lower``, so no compile overlaps
it), the whole process's peak RSS, and the disk a whole run adds (store on, a fresh store each
round: one cold run that puts the executable, one warm run that loads it; hard links counted
once), the bytes only the run directory holds, and its apparent size. For transparency, plain
JAX is also timed with glibc's heap thresholds raised the way jaxaot's lower stage raises them
for big constants (``jaxaot.util.heap``). Fresh processes, interleaved, medians.
Targets: lower stage <= 1.5x plain JAX, run dir <= ~1.5x the constant.

    python bench/captured_constant.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CONSTANT_BYTES = 3584 * 3584 * 4

_PLAIN = """
import time, jax, jax.numpy as jnp
from jaxaot.examples.captured import project, weight
weight()  # built before timing, as jaxaot's stage_out does
t0 = time.perf_counter()
lowered = jax.jit(project).lower(jax.ShapeDtypeStruct((8, 3584), jnp.float32))
text = lowered.as_text()
print(time.perf_counter() - t0)
"""


# glibc reads these at start: what jaxaot.util.heap sets with mallopt() while lowering.
_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _rss(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, int]:
    """Like :func:`_run`, with the peak RSS read through ``wait4``."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err.decode()[-2000:]}")
    return out.decode(), usage.ru_maxrss * 1024


def _inodes(*roots: Path) -> dict[tuple[int, int], int]:
    """Every regular file under ``roots``, once per inode: (device, inode) -> size."""
    found: dict[tuple[int, int], int] = {}
    for root in roots:
        for p in root.rglob("*") if root.exists() else ():
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                found[(st.st_dev, st.st_ino)] = st.st_size
    return found


def _apparent(path: Path) -> int:
    """What ``du --apparent-size`` of the run directory alone says: every name counted."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _full_run(
    cmd: list[str], rd: Path, store: Path, env: dict[str, str]
) -> tuple[int, int, int, int]:
    """One whole run: (peak RSS, bytes it added to the disk, bytes only its run directory
    holds, apparent size of its run directory). Added bytes are the sizes of the files that
    did not exist before, in the run directory and in the store, each inode once: a
    run-directory file hard-linked to the store's entry counts once, and the entry's copy
    counts on the run that put it there. Its own bytes leave out what it shares with the store."""
    before = _inodes(store)
    _, rss = _rss([*cmd, f"hydra.run.dir={rd}"], rd.parent, env)
    stored = _inodes(store)
    added = sum(size for ino, size in (stored | _inodes(rd)).items() if ino not in before)
    own = sum(size for ino, size in _inodes(rd).items() if ino not in stored)
    return rss, added, own, _apparent(rd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAXAOT_SERVER": "0"}
    plain_t, plain_rss, ours_t, ours_rss, kept_t, plain_heap_t = [], [], [], [], [], []
    full_rss, cold, warm, own, apparent = [], [], [], [], []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        jaxaot = [PY, "-m", "jaxaot.cli.main", "program=captured_constant"]
        for i in range(opts.rounds):
            store = tmp / f"store{i}"  # a fresh store each round: one cold and one warm run
            env["JAXAOT_STORE_DIR"] = str(store)
            out, rss = _rss([PY, "-c", _PLAIN], ROOT, env)
            plain_t.append(float(out.split()[-1]))
            plain_rss.append(rss)
            out, _ = _rss([PY, "-c", _PLAIN], ROOT, {**env, **_HEAP_ENV})
            plain_heap_t.append(float(out.split()[-1]))
            for variant, times, rsses in (("elided", ours_t, ours_rss), ("kept", kept_t, None)):
                rd = tmp / f"{variant}{i}"
                extra = ["lower.elide_constants_over=null"] if variant == "kept" else []
                _, rss = _rss(
                    [*jaxaot, "stop_after=lower", *extra, f"hydra.run.dir={rd}"], tmp, env
                )
                manifest = json.loads((rd / "manifest.json").read_text())
                times.append(float(manifest["stages"]["lower"]["seconds"]))
                if rsses is not None:
                    rsses.append(rss)
            rss, added, mine, size = _full_run(jaxaot, tmp / f"cold{i}", store, env)
            full_rss.append(rss)
            cold.append(added)
            own.append(mine)
            apparent.append(size)
            _, added, mine, size = _full_run(jaxaot, tmp / f"warm{i}", store, env)
            warm.append(added)
            own.append(mine)
            apparent.append(size)
    med = statistics.median
    mb = 1e6
    print(
        f"medians of {opts.rounds} interleaved rounds; load {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores; the constant is {CONSTANT_BYTES / mb:.1f} MB"
    )
    print("| measurement | plain JAX | jaxaot | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| lower (plain: `lower()` + `as_text()`; jaxaot: lower stage) | {med(plain_t):.2f} s "
        f"| {med(ours_t):.2f} s | {med(ours_t) / med(plain_t):.2f}x | <= 1.5x |"
    )
    print(
        f"| same, plain JAX with the heap tuned as jaxaot's lower stage tunes it | "
        f"{med(plain_heap_t):.2f} s | {med(ours_t):.2f} s | "
        f"{med(ours_t) / med(plain_heap_t):.2f}x | |"
    )
    print(
        f"| same, `lower.elide_constants_over=null` (texts keep the constant) | "
        f"{med(plain_t):.2f} s | {med(kept_t):.2f} s | {med(kept_t) / med(plain_t):.2f}x | |"
    )
    print(
        f"| peak RSS (plain: lower + text; jaxaot: stop_after=lower) | {med(plain_rss) / mb:.0f} MB "
        f"| {med(ours_rss) / mb:.0f} MB | {med(ours_rss) / med(plain_rss):.2f}x | |"
    )
    print(f"| peak RSS, whole jaxaot run | | {med(full_rss) / mb:.0f} MB | | |")
    c = CONSTANT_BYTES
    print(
        f"| run directory, whole run: bytes only it holds (what it shares with the store left "
        f"out) | constant {c / mb:.1f} MB | {med(own) / mb:.1f} MB | {med(own) / c:.2f}x of "
        "the constant | <= ~1.5x |"
    )
    print(
        f"| disk a whole run adds, cold store (its run dir + the store entry it puts; hard "
        f"links once) | constant {c / mb:.1f} MB | {med(cold) / mb:.1f} MB | "
        f"{med(cold) / c:.2f}x of the constant | |"
    )
    print(
        f"| disk a whole run adds, warm store (its run dir; `executable.bin` links the "
        f"store's) | constant {c / mb:.1f} MB | {med(warm) / mb:.1f} MB | "
        f"{med(warm) / c:.2f}x of the constant | |"
    )
    print(
        f"| run directory's apparent size (every name counted, as `du --apparent-size`) | "
        f"constant {c / mb:.1f} MB | {med(apparent) / mb:.1f} MB | "
        f"{med(apparent) / c:.2f}x of the constant | |"
    )


if __name__ == "__main__":
    main()
