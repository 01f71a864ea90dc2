"""jaxaot's fit search vs the batch-size scan a MaxText user scripts by hand, whole processes.

Both sides look for the largest batch of a small decoder's training step (``experiment=
decoder_8b``'s program, the rematerialized transformer step, at a few MiB of parameters) that
fits a TPU topology, compiled deviceless with libtpu (default ``v5e:2x2``, mesh 2x2,
FSDP x tensor parallel). Each side is a fresh process (jaxaot's probes are processes of their
own too), run one after the other, store off:

- **plain JAX**: one Python process that builds the topology mesh once, then compiles
  ``jit(train_step).lower(...).compile()`` at batch = multiple, 2 x multiple, ... and stops at
  the first that does not fit: XLA refuses it (``RESOURCE_EXHAUSTED``), or its memory analysis
  (arguments + outputs + temporaries + code - aliased) is over XLA's per-device limit (15.75 GiB
  on v5e, the figure libtpu prints in its refusal). That is how people size a batch.
- **jaxaot**: ``jaxaot -m hydra/sweeper=jaxaot_fit`` over the same values (low = multiple,
  high = ``--high``): bisection, each probe a process of its own that writes a run directory,
  a manifest, the fit verdict and the memory breakdown.

The answers (largest fitting batch) must agree. Then the **crash case**: the same step, but the
process kills itself with SIGSEGV while tracing at one batch size K (a compiler that crashes on
one shape). K is a value both sides compile: one the first search probed and found fitting,
below its answer. The plain script dies at K with no answer; jaxaot's search records a crash
row and still finds the same boundary.

    python bench/fit_search.py                       # ~10 min on a loaded 2-core CPU
    python bench/fit_search.py --multiple 128        # a coarser scan: fewer compiles each
    python bench/fit_search.py --no-crash            # the search only

Timings on a shared CPU are noisy (XLA's compile is most of each probe): the load average is
printed with each side's wall time; ``--rounds`` repeats the pair, alternating, and reports
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CRASH_ENV = "JAXAOT_BENCH_CRASH_AT"  # the batch size at which crash_step segfaults
# (layers, d_model, heads, d_head, d_ff, vocab, seq): ~24 MiB per sequence per device on v5e:2x2
DIMS = (2, 256, 4, 64, 1024, 4096, 1024)
# XLA's per-device limit on v5e (libtpu 0.0.42.1: "... exceeds available HBM (15.75G)")
V5E_LIMIT = int(15.75 * 2**30)


def crash_step(params: Any, tokens: Any, targets: Any, lr: Any = 1e-2) -> Any:
    """The decoder's train step, but the process dies of SIGSEGV while tracing when the batch
    is ``$JAXAOT_BENCH_CRASH_AT``, as a compiler that crashes on one shape does."""
    from jaxaot.examples.decoder import train_step

    if tokens.shape[0] == int(os.environ.get(CRASH_ENV, "-1")):
        os.kill(os.getpid(), signal.SIGSEGV)
    return train_step(params, tokens, targets, lr)


# What a user writes: one process, one mesh, a compile per batch size until one does not fit.
_PLAIN = r"""
import json, time
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from {module} import {function} as train_step

L, D, H, K, F, V, T = {dims}
LIMIT = {limit}  # bytes per device XLA allows (its refusal says "available HBM (15.75G)")
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
out = (jax.tree.map(lambda x: x.sharding, params), NamedSharding(mesh, P()))
lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()), weak_type=True)
largest = None
for n in range({low}, {high} + 1, {multiple}):
    tokens = s((n, T), ("fsdp", None), jnp.int32)
    t0 = time.perf_counter()
    try:
        compiled = jax.jit(train_step, out_shardings=out, donate_argnums=0).lower(
            params, tokens, tokens, lr).compile()
    except Exception as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        fits, needed = False, None
    else:
        m = compiled.memory_analysis()
        needed = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  + m.generated_code_size_in_bytes - m.alias_size_in_bytes)
        fits = needed <= LIMIT
    print(json.dumps({{"n": n, "fits": fits, "needed": needed,
                       "s": time.perf_counter() - t0}}), flush=True)
    if not fits:
        break
    largest = n
print(json.dumps({{"largest_fit": largest}}), flush=True)
"""


def _env(crash_at: int | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop(CRASH_ENV, None)
    if crash_at is not None:
        env[CRASH_ENV] = str(crash_at)
    return env


def _timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, int, str, float]:
    """(wall s, exit code, output, load average at the end) of one whole process."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return time.perf_counter() - t0, proc.returncode, proc.stdout, os.getloadavg()[0]


def _plain(work: Path, script: str, crash_at: int | None) -> dict[str, Any]:
    path = work / "plain.py"
    path.write_text(script)
    wall, rc, out, load = _timed([sys.executable, str(path)], work, _env(crash_at))
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    probes = [r for r in rows if "n" in r]
    answer = next((r["largest_fit"] for r in rows if "largest_fit" in r), None)
    finished = any("largest_fit" in r for r in rows)
    if rc != 0 and not (rc < 0 and crash_at is not None):
        raise SystemExit(f"plain JAX failed (exit {rc}):\n{out[-1500:]}")
    died = f"died: {signal.Signals(-rc).name} at n={crash_at}" if rc < 0 else None
    return {
        "wall": wall,
        "compiles": len(probes) + (1 if died else 0),  # the one it died in counts
        "answer": answer if finished else None,
        "rc": rc,
        "died": died,
        "probes": [(p["n"], p["fits"]) for p in probes],
        "load": load,
    }


def _jaxaot(
    work: Path, name: str, args: argparse.Namespace, target: str, crash_at: int | None
) -> dict[str, Any]:
    sweep = work / name
    T = DIMS[-1]
    overrides = f"'program.args.1.shape=[{{n}},{T}]','program.args.2.shape=[{{n}},{T}]'"
    cmd = [
        sys.executable,
        "-m",
        "jaxaot",
        "-m",
        "hydra/sweeper=jaxaot_fit",
        *_program_overrides(args),
        f"program.target={target}",
        f"hydra.sweeper.overrides=[{overrides}]",
        f"hydra.sweeper.low={args.multiple}",
        f"hydra.sweeper.high={args.high}",
        f"hydra.sweeper.multiple={args.multiple}",
        f"hydra.sweep.dir={sweep}",
    ]
    wall, rc, out, load = _timed(cmd, work, _env(crash_at))
    try:
        fit = json.loads((sweep / "fit.json").read_text())
    except OSError:
        raise SystemExit(f"jaxaot wrote no fit.json (exit {rc}):\n{out[-1500:]}") from None
    (search,) = fit["searches"]
    return {
        "wall": wall,
        "compiles": search["compiles"],
        "answer": search["largest_fit"],
        "rc": rc,
        "died": None,
        "probes": [(p["n"], p["fits"]) for p in search["probes"]],
        "crashed": [p["n"] for p in search["probes"] if p["status"] == "crashed"],
        "summary": next((ln for ln in out.splitlines() if "fit search [" in ln), ""),
        "load": load,
    }


def _program_overrides(args: argparse.Namespace) -> list[str]:
    """experiment=decoder_8b at DIMS on the bench's topology and mesh, store off."""
    L, D, H, K, F, V, _ = DIMS
    return [
        "experiment=decoder_8b",
        f"compile.topology={args.topology}",
        f"mesh.shape=[{args.mesh[0]},{args.mesh[1]}]",
        "store.enabled=false",
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
    ]


def _crash_value(jaxaot: dict[str, Any], low: int) -> int | None:
    """A value both sides compile below the answer: the first fitting probe of the search
    other than ``low`` and the answer itself, else ``low`` (None if low is the answer)."""
    answer = jaxaot["answer"]
    for n, fits in jaxaot["probes"]:
        if fits and n not in (low, answer):
            return int(n)
    return low if answer is not None and low < answer else None


def _line(case: str, side: str, r: dict[str, Any]) -> str:
    answer = r["died"] or ("-" if r["answer"] is None else str(r["answer"]))
    per = r["wall"] / r["compiles"] if r["compiles"] else float("nan")
    return (
        f"| {case} | {side} | {r['wall']:.1f} s | {r['compiles']} | {per:.1f} s | {answer} | "
        f"{r['load']:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--mesh", default="2,2", help="fsdp,model sizes")
    ap.add_argument("--multiple", type=int, default=64, help="the scan's step, the search's unit")
    ap.add_argument("--high", type=int, default=1024, help="the search's upper bound")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--crash-at", type=int, default=None, help="K (default: from the search)")
    ap.add_argument("--no-crash", action="store_true", help="skip the crash case")
    args = ap.parse_args(argv)
    args.mesh = tuple(int(n) for n in args.mesh.split(","))
    sys.path.insert(0, str(REPO))  # this checkout's pipeline, not an installed one
    from jaxaot.targets.tpu import resolve

    target = resolve(args.topology)
    if target.generation.name != "v5e":
        print(f"--topology {args.topology}: the plain script's limit is v5e's; expected a v5e")
        return 2

    def plain_script(module: str, function: str) -> str:
        return _PLAIN.format(
            module=module,
            function=function,
            dims=DIMS,
            limit=V5E_LIMIT,
            topology=target.topology,
            chip_config=target.generation.chip_config,
            mesh=args.mesh,
            low=args.multiple,
            high=args.high,
            multiple=args.multiple,
        )

    print(
        f"decoder {DIMS} (layers, d_model, heads, d_head, d_ff, vocab, seq) on "
        f"{target.topology}, mesh {args.mesh}; batch = {args.multiple}, {2 * args.multiple}, "
        f"... <= {args.high}; load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {"plain JAX": [], "jaxaot": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.rounds):
            order = ["plain JAX", "jaxaot"] if i % 2 == 0 else ["jaxaot", "plain JAX"]
            for side in order:
                if side == "plain JAX":
                    r = _plain(work, plain_script("jaxaot.examples.decoder", "train_step"), None)
                else:
                    r = _jaxaot(work, f"fit{i}", args, "jaxaot.examples.decoder:train_step", None)
                results[side].append(r)
                print(
                    f"  round {i + 1} {side:<9} {r['wall']:6.1f} s, {r['compiles']} compiles, "
                    f"largest fit {r['answer']}, probes {r['probes']} (load {r['load']:.1f})",
                    flush=True,
                )
        answers = {r["answer"] for v in results.values() for r in v}
        if len(answers) != 1:
            print(f"the two sides disagree: {results}")
            return 1
        (answer,) = answers
        crash: dict[str, dict[str, Any]] = {}
        k = args.crash_at or _crash_value(results["jaxaot"][0], args.multiple)
        if not args.no_crash and k is not None:
            print(f"crash case: SIGSEGV while tracing at batch {k}", flush=True)
            crash["plain JAX"] = _plain(work, plain_script("bench.fit_search", "crash_step"), k)
            crash["jaxaot"] = _jaxaot(work, "fit_crash", args, "bench.fit_search:crash_step", k)
            for side, r in crash.items():
                print(
                    f"  {side:<9} {r['wall']:6.1f} s, exit {r['rc']}, {r['compiles']} compiles, "
                    f"largest fit {r['answer']}{', ' + r['died'] if r['died'] else ''}"
                    f" (load {r['load']:.1f})",
                    flush=True,
                )
            if crash["jaxaot"].get("summary"):
                print(f"  jaxaot: {crash['jaxaot']['summary'].strip()}")
            if crash["plain JAX"]["answer"] is not None or crash["jaxaot"]["answer"] != answer:
                print("crash case: expected the plain script to die and jaxaot to find the answer")
                return 1

    med = {
        side: {
            "wall": statistics.median(r["wall"] for r in v),
            "compiles": v[0]["compiles"],
            "answer": answer,
            "died": None,
            "load": max(r["load"] for r in v),
        }
        for side, v in results.items()
    }
    print(
        f"\n{args.rounds} round(s); wall = the whole process (jaxaot: the sweep and its probe "
        f"processes); load = 1-minute load average at the end (max over rounds)\n"
    )
    print("| case | side | wall | compiles | wall per compile | largest fit | load |")
    print("|---|---|---|---|---|---|---|")
    for side, r in med.items():
        print(_line("search", side, r))
    for side, r in crash.items():
        print(_line(f"crash at {k}", side, r))
    p, j = med["plain JAX"], med["jaxaot"]
    print("\n| case | jaxaot / plain JAX wall | compiles (plain / jaxaot) | answers |")
    print("|---|---|---|---|")
    print(
        f"| search | {j['wall'] / p['wall']:.2f}x | {p['compiles']} / {j['compiles']} "
        f"({p['compiles'] / j['compiles']:.2f}x) | both {answer} |"
    )
    if crash:
        cp, cj = crash["plain JAX"], crash["jaxaot"]
        print(
            f"| crash at {k} | {cj['wall'] / cp['wall']:.2f}x (plain dies) | "
            f"{cp['compiles']} / {cj['compiles']} | plain: none ({cp['died']}); jaxaot: "
            f"{cj['answer']}, crash row{'s' if len(cj['crashed']) > 1 else ''} at "
            f"{', '.join(map(str, cj['crashed']))} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
