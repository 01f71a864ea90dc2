"""jaxaot vs a plain-JAX script compiling one program for a TPU topology, whole processes.

Both sides compile ``experiment=decoder_8b``'s program (the rematerialized transformer step
of ``jaxaot.examples.decoder``, bf16 parameters as ShapeDtypeStructs, FSDP x tensor-parallel
shardings on a 2-D mesh) for the same libtpu topology, each in a fresh Python process, side by
side, ``--repeats`` times each (alternating, store off): wall time and peak RSS per process,
and the ratio of the medians. The plain script is what a user writes without jaxaot:
``get_topology_desc`` -> ``make_mesh`` -> ``jit(...).lower(...).compile()``, then the memory
analysis.

    python bench/topology_compile.py                       # 8B-class, v6e:16x16, mesh 16x16
    python bench/topology_compile.py --scale small         # 2 layers, d_model 1024: seconds
    python bench/topology_compile.py --topology v5e:4x4 --mesh 4,4 --scale small

Timings on a shared CPU are noisy: report the medians with the machine's load. XLA's compile
(the same program on both sides: the bench checks the optimized HLO equal, less source info) is most of each
process and most of the noise, so each process also reports its XLA compile seconds (JAX's own
``Finished XLA compilation ... in X sec`` line, ``JAX_LOG_COMPILES=1`` on both sides) and the
rest of its wall time ("own work": start-up, tracing, lowering, writing; jaxaot's compile-ahead
overlaps part of its own with the compile). The last line gives the ratio at equal compile
seconds: (pooled median compile + each side's median own work), which the load moves far less.

jaxaot's topology compiles also have XLA dump their buffer assignment (what is live at the peak,
for ``memory_breakdown.json``). ``--plain-dump`` adds a third side, the plain script compiling
with the same dump options (``xla_dump_to``, ``xla_dump_hlo_as_text``) and nothing else: what
the dump costs XLA's compile, apart from jaxaot's reading of it.

    python bench/topology_compile.py --scale small --plain-dump
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxaot.util.canonical import canonical_hlo

REPO = Path(__file__).resolve().parent.parent

# (layers, d_model, heads, d_head, d_ff, vocab, batch, seq)
SCALES = {
    "8b": (32, 4096, 32, 128, 16384, 128256, 64, 2048),
    "small": (2, 1024, 16, 64, 4096, 32768, 64, 512),
}

_PLAIN = r"""
import sys, json, time
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxaot.examples.decoder import train_step

L, D, H, K, F, V, B, T = {dims}
topo = topologies.get_topology_desc(platform="tpu", topology_name="{topology}",
                                    chip_config_name="{chip_config}")
mesh = topologies.make_mesh(topo, {mesh}, ("fsdp", "model"))
def s(shape, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
params = {{
    "embed": s((V, D), ("model", "fsdp")),
    "layers": {{
        "ln1": s((L, D), ()), "ln2": s((L, D), ()),
        "wq": s((L, D, H, K), (None, "fsdp", "model")), "wk": s((L, D, H, K), (None, "fsdp", "model")),
        "wv": s((L, D, H, K), (None, "fsdp", "model")), "wo": s((L, H, K, D), (None, "model", None, "fsdp")),
        "w1": s((L, D, F), (None, "fsdp", "model")), "w2": s((L, F, D), (None, "model", "fsdp")),
    }},
    "ln_f": s((D,), ()),
    "unembed": s((D, V), ("fsdp", "model")),
}}
tokens = s((B, T), ("fsdp", None), jnp.int32)
out = (jax.tree.map(lambda x: x.sharding, params), NamedSharding(mesh, P()))
# jaxaot's lr (0.01 in the config) traces as a weakly-typed f32 scalar: the same here, or XLA
# fuses the step a little differently and the two sides compile different programs
lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()), weak_type=True)
compiled = jax.jit(train_step, out_shardings=out, donate_argnums=0).lower(
    params, tokens, tokens, lr).compile({options})
m = compiled.memory_analysis()
t0 = time.perf_counter()  # the bench's own check, not the user's work: subtracted from the wall
open("plain.hlo.txt", "w").write(compiled.as_text())
check_s = time.perf_counter() - t0
print(json.dumps({{"temp": m.temp_size_in_bytes, "argument": m.argument_size_in_bytes,
                   "check_s": check_s}}))
"""

# JAX's log line for each XLA compile (jax._src.dispatch, with JAX_LOG_COMPILES=1).
_COMPILE_LINE = re.compile(r"Finished XLA compilation of \S+ in ([\d.]+) sec")


def _run(cmd: list[str], cwd: Path) -> tuple[float, float, int, int, str, float | None]:
    """(wall s, CPU s, peak RSS bytes, exit code, output, XLA compile s) of one whole process."""
    env = dict(
        os.environ, PYTHONPATH=str(REPO), ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_LOG_COMPILES="1"
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime  # less sensitive than wall to a shared CPU's load
    # one XLA compile per process (jaxaot's log handlers may print its line twice)
    compiles = [float(s) for s in _COMPILE_LINE.findall(out)]
    return wall, cpu, usage.ru_maxrss * 1024, proc.returncode, out, max(compiles, default=None)


def _check_seconds(out: str) -> float:
    """The plain script's seconds writing its optimized HLO for the bench's check."""
    try:
        return float(json.loads(out.strip().splitlines()[-1])["check_s"])
    except (ValueError, KeyError, IndexError):
        return 0.0


def _same_program(work: Path, run_dir: Path) -> bool:
    """Whether both sides compiled the same optimized HLO (so the bench compares like with like)."""
    try:
        plain = (work / "plain.hlo.txt").read_text()
        mine = (run_dir / "compile" / "optimized.hlo.txt").read_text()
    except OSError:
        return False
    # Less source locations and stack frames (the two sides' call stacks differ).
    return canonical_hlo(plain) == canonical_hlo(mine)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v6e:16x16")
    ap.add_argument("--mesh", default="16,16", help="fsdp,model sizes")
    ap.add_argument("--scale", choices=sorted(SCALES), default="8b")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--plain-dump", action="store_true", help="a third side: the plain script with XLA's dump"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))  # this checkout's pipeline, not an installed one
    from jaxaot.targets.tpu import resolve

    target = resolve(args.topology)
    mesh = tuple(int(n) for n in args.mesh.split(","))
    dims = SCALES[args.scale]
    L, D, H, K, F, V, B, T = dims

    def plain(options: str) -> str:
        return _PLAIN.format(
            dims=dims,
            topology=target.topology,
            mesh=mesh,
            chip_config=target.generation.chip_config,
            options=options,
        )

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "plain.py").write_text(plain(""))
        # jaxaot's dump options (stages/memory_breakdown.py dump_options), into a fresh folder
        dump = {"xla_dump_to": str(work / "dump"), "xla_dump_hlo_as_text": True}
        (work / "plain_dump.py").write_text(plain(f"compiler_options={dump!r}"))
        jaxaot = [
            sys.executable,
            "-m",
            "jaxaot.cli.main",
            "experiment=decoder_8b",
            f"compile.topology={target.topology}",
            f"mesh.shape=[{mesh[0]},{mesh[1]}]",
            "store.enabled=false",
            "hydra.run.dir=RUN_DIR",
            "hydra.job_logging.root.level=WARNING",
            f"program.args.0.embed.shape=[{V},{D}]",
            f"program.args.0.unembed.shape=[{D},{V}]",
            f"program.args.0.ln_f.shape=[{D}]",
            f"program.args.0.layers.ln1.shape=[{L},{D}]",
            f"program.args.0.layers.ln2.shape=[{L},{D}]",
            *(f"program.args.0.layers.{w}.shape=[{L},{D},{H},{K}]" for w in ("wq", "wk", "wv")),
            f"program.args.0.layers.wo.shape=[{L},{H},{K},{D}]",
            f"program.args.0.layers.w1.shape=[{L},{D},{F}]",
            f"program.args.0.layers.w2.shape=[{L},{F},{D}]",
            f"program.args.1.shape=[{B},{T}]",
            f"program.args.2.shape=[{B},{T}]",
        ]
        sides = {"plain JAX": [sys.executable, str(work / "plain.py")], "jaxaot": jaxaot}
        if args.plain_dump:
            sides["plain + dump"] = [sys.executable, str(work / "plain_dump.py")]
        results: dict[str, list[tuple[float, float, int, float]]] = {k: [] for k in sides}
        for i in range(args.repeats):
            for name, cmd in sides.items():
                # a fresh run directory each time: a run never reuses another's
                cmd = [c.replace("RUN_DIR", str(work / f"run{i}")) for c in cmd]
                wall, cpu, rss, rc, out, xla = _run(cmd, work)
                if name.startswith("plain"):
                    shutil.rmtree(work / "dump", ignore_errors=True)  # each compile its own
                    wall -= _check_seconds(out)
                if rc not in (0, 3) or xla is None:
                    print(f"{name} failed (rc={rc}, XLA compile line: {xla}):\n{out[-400:]}")
                    return 1
                if name == "jaxaot" and rc == 0 and not _same_program(work, work / f"run{i}"):
                    print("the two sides compiled different optimized HLO")
                    return 1
                results[name].append((wall, cpu, rss, xla))
                print(
                    f"  run {i + 1} {name:<12} {wall:7.2f} s wall {cpu:7.2f} s CPU  "
                    f"XLA {xla:6.2f} s  own {wall - xla:5.2f} s  peak RSS {rss / 2**20:7.0f} MiB"
                    f"{'  (does not fit)' if rc == 3 else ''}",
                    flush=True,
                )
    med = {
        k: (
            statistics.median(w for w, _, _, _ in v),
            statistics.median(c for _, c, _, _ in v),
            max(r for _, _, r, _ in v),
            statistics.median(x for _, _, _, x in v),
            statistics.median(w - x for w, _, _, x in v),
        )
        for k, v in results.items()
    }
    print(
        f"\n{args.scale} decoder on {target.topology}, mesh {mesh}, {args.repeats} runs each "
        f"(load avg {os.getloadavg()[0]:.1f})"
    )
    print(
        "| side | median wall | median CPU | median XLA compile | median own work | peak RSS |\n"
        "|---|---|---|---|---|---|"
    )
    for k, (w, c, r, x, own) in med.items():
        print(f"| {k} | {w:.2f} s | {c:.2f} s | {x:.2f} s | {own:.2f} s | {r / 2**20:.0f} MiB |")
    wall = med["jaxaot"][0] / med["plain JAX"][0]
    cpu = med["jaxaot"][1] / med["plain JAX"][1]
    # pooled over the two sides the ratio compares (not the dump side)
    xla = statistics.median(x for k in ("plain JAX", "jaxaot") for _, _, _, x in results[k])
    fair = (xla + med["jaxaot"][4]) / (xla + med["plain JAX"][4])
    print(f"\njaxaot / plain JAX: wall {wall:.3f}x, CPU {cpu:.3f}x (target <= 1.05x)")
    print(
        f"at equal XLA compile ({xla:.2f} s, the median of all runs): {fair:.3f}x; jaxaot's own "
        f"work {med['jaxaot'][4] - med['plain JAX'][4]:+.2f} s over the plain script's"
    )
    if "plain + dump" in med:
        d, p, j = med["plain + dump"], med["plain JAX"], med["jaxaot"]
        print(
            f"XLA's dump in the plain script: wall {d[0] - p[0]:+.2f} s ({d[0] / p[0]:.3f}x), "
            f"XLA compile {d[3] - p[3]:+.2f} s ({d[3] / p[3]:.3f}x); jaxaot / plain + dump: "
            f"wall {j[0] / d[0]:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
