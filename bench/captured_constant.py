"""A program that closes over a 51 MB constant: jaxaot's lower stage vs plain JAX.

``program=captured_constant`` is ``tanh(x @ W)`` with ``W`` a captured 3584x3584 f32 array.
Plain JAX: ``jax.jit(f).lower(x)`` then ``.as_text()`` (timed inside a fresh process). jaxaot:
the lower stage's own time from the manifest (``stop_after=lower``, so no compile overlaps
it), the whole process's peak RSS, and the size of a full run's directory (store on). Fresh
processes, interleaved, medians. Targets (issue 19): lower stage <= 1.5x plain JAX, run dir
<= ~1.5x the constant.

    python bench/captured_constant.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
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


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAXAOT_SERVER": "0"}
    plain_t, plain_rss, ours_t, ours_rss, kept_t, full_rss, sizes = [], [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        env["JAXAOT_STORE_DIR"] = str(tmp / "store")
        jaxaot = [PY, "-m", "jaxaot.cli.main", "program=captured_constant"]
        for i in range(opts.rounds):
            out, rss = _rss([PY, "-c", _PLAIN], ROOT, env)
            plain_t.append(float(out.split()[-1]))
            plain_rss.append(rss)
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
            rd = tmp / f"full{i}"
            _, rss = _rss([*jaxaot, f"hydra.run.dir={rd}"], tmp, env)
            full_rss.append(rss)
            sizes.append(_du(rd))
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
        f"| same, `lower.elide_constants_over=null` (texts keep the constant) | "
        f"{med(plain_t):.2f} s | {med(kept_t):.2f} s | {med(kept_t) / med(plain_t):.2f}x | |"
    )
    print(
        f"| peak RSS (plain: lower + text; jaxaot: stop_after=lower) | {med(plain_rss) / mb:.0f} MB "
        f"| {med(ours_rss) / mb:.0f} MB | {med(ours_rss) / med(plain_rss):.2f}x | |"
    )
    print(f"| peak RSS, whole jaxaot run | | {med(full_rss) / mb:.0f} MB | | |")
    print(
        f"| run directory, whole run | constant {CONSTANT_BYTES / mb:.1f} MB | "
        f"{med(sizes) / mb:.1f} MB | {med(sizes) / CONSTANT_BYTES:.2f}x of the constant "
        "| <= ~1.5x |"
    )


if __name__ == "__main__":
    main()
