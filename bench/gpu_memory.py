"""On a GPU host: is XLA's memory figure one can trust before booking hardware? (plain JAX)

For each program, in a fresh process each (the allocator's peak is per process):

- ``gpu``: compiled on the GPU (XLA autotunes), run ``STEPS`` times; XLA's
  ``memory_analysis()`` (arguments, outputs, temporaries, ``peak_memory_in_bytes``), the sum
  jaxaot's verdict uses (arguments + outputs + temporaries + code - aliased), and what the
  allocator saw: ``memory_stats()['peak_bytes_in_use']`` less what was in use before the
  compile. The ratio measured/predicted is what "trust" means here.
- ``deviceless``: the same program compiled for compile-only devices made from the GPU's own
  target config (no autotuning): its memory analysis, to set beside the GPU's.
- ``fit``: a program sized to need 90% and then 110% of the allocator's limit
  (``bytes_limit``): the verdict (needed <= limit) against whether it actually ran.

jaxaot's breakdown (``jaxaot.stages.memory_breakdown``) is added where it imports.

    python bench/gpu_memory.py OUT            # all programs, one subprocess each
    python bench/gpu_memory.py one NAME MODE EXE  # one step, a JSON line on stdout
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = 5
# For a dry run on a host without a GPU: GPU_MEMORY_PLATFORM=cpu GPU_MEMORY_SCALE=16 (sizes / 16).
PLATFORM = os.environ.get("GPU_MEMORY_PLATFORM", "cuda")
SCALE = int(os.environ.get("GPU_MEMORY_SCALE", "1"))
PROGRAMS = ("mlp_train_f32", "transformer_train_bf16", "transformer_train_bf16_remat")


def _program(name: str) -> tuple[Any, list[Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "jaxaot_examples"))
    import transformer  # type: ignore[import-not-found]

    rng = np.random.default_rng(0)

    def n(*shape: int, dtype: Any = np.float32, scale: float = 0.02) -> Any:
        return rng.normal(0, scale, shape).astype(dtype)

    if name == "mlp_train_f32":
        w, batch = 8192 // SCALE, 4096 // SCALE
        params = [{"w": n(w, w), "b": np.zeros(w, np.float32)} for _ in range(4)]
        x, y = n(batch, w, scale=1.0), n(batch, w, scale=1.0)

        def loss(p: Any, x: Any, y: Any) -> Any:
            for layer in p:
                x = jnp.tanh(x @ layer["w"] + layer["b"])
            return jnp.mean((x - y) ** 2)

        def step(p: Any, x: Any, y: Any) -> Any:
            v, g = jax.value_and_grad(loss)(p, x, y)
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), v

        return step, [params, x, y]
    bf16 = jnp.bfloat16
    L, d, h, dh, ff, vocab, b, t = (
        8,
        1024 // SCALE,
        8,
        128 // SCALE,
        4096 // SCALE,
        32768 // SCALE,
        16,
        2048 // SCALE,
    )
    params = {
        "embed": n(vocab, d, dtype=bf16),
        "layers": {
            "ln1": np.zeros((L, d), bf16),
            "wq": n(L, d, h, dh, dtype=bf16),
            "wk": n(L, d, h, dh, dtype=bf16),
            "wv": n(L, d, h, dh, dtype=bf16),
            "wo": n(L, h, dh, d, dtype=bf16),
            "ln2": np.zeros((L, d), bf16),
            "w1": n(L, d, ff, dtype=bf16),
            "w2": n(L, ff, d, dtype=bf16),
        },
        "ln_f": np.zeros((d,), bf16),
        "unembed": n(d, vocab, dtype=bf16),
    }
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    remat = name.endswith("_remat")

    def tstep(p: Any, tok: Any, tgt: Any) -> Any:
        return transformer.train_step(p, tok, tgt, remat=remat)

    return tstep, [params, tokens, tokens]


def _figures(compiled: Any, dump: Path | None = None) -> dict[str, Any]:
    m = compiled.memory_analysis()
    fig = {
        f: int(getattr(m, f))
        for f in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "temp_size_in_bytes",
            "alias_size_in_bytes",
            "generated_code_size_in_bytes",
            "peak_memory_in_bytes",
        )
        if hasattr(m, f)
    }
    fig["needed"] = (
        fig["argument_size_in_bytes"]
        + fig["output_size_in_bytes"]
        + fig["temp_size_in_bytes"]
        + fig.get("generated_code_size_in_bytes", 0)
        - fig["alias_size_in_bytes"]
    )
    try:
        from jaxaot.stages import memory_breakdown  # type: ignore[import-not-found]

        hlo = compiled.as_text() or ""
        bd = memory_breakdown.from_proto(compiled, hlo, 3)
        if bd is None and dump is not None:  # jaxlib gives CUDA compiles no proto: the dump
            bd = memory_breakdown.from_dump(dump, hlo, compiled, 3)
        if bd:
            fig["breakdown_source"] = bd.get("source")
            fig["live_peak_bytes"] = bd.get("live_peak_bytes")
            fig["top3"] = memory_breakdown.top_text(bd, 3)
    except Exception as exc:  # jaxaot not importable under this jax: plain figures only
        fig["breakdown_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return fig


def one(name: str, mode: str, exe: Path) -> dict[str, Any]:
    """``gpu`` / ``deviceless``: compile and save the executable to ``exe``; ``run``: load it
    in a fresh process (so autotuning's allocations are not in the peak) and run it."""
    import jax
    from jax.experimental import serialize_executable

    gpu = jax.devices(PLATFORM)[0]
    if mode == "fit":
        return _fit(gpu, float(name))
    fn, args = _program(name)
    if mode == "run":
        before = int(_stats(gpu)["bytes_in_use"])
        payload, in_tree, out_tree = json_pickle_load(exe)
        loaded = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=PLATFORM, execution_devices=[gpu]
        )
        dev_args = jax.device_put(args, gpu)
        jax.block_until_ready(dev_args)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            jax.block_until_ready(loaded(*dev_args))
        step_s = (time.perf_counter() - t0) / STEPS
        stats = _stats(gpu)
        return {
            "measured_peak": int(stats["peak_bytes_in_use"]) - before,
            "bytes_limit": int(stats["bytes_limit"]),
            "step_s": step_s,
        }
    if mode == "deviceless":
        from jax._src.lib import xla_client
        from jax.experimental import topologies
        from jax.sharding import SingleDeviceSharding

        config = str(xla_client.get_topology_for_devices([gpu]).target_config)
        topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
        s = SingleDeviceSharding(topo.devices[0])
        specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), args)
        t0 = time.perf_counter()
        lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
    else:
        specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*specs)
    dump = exe.with_suffix(".dump")
    compiled = lowered.compile(_dump_options(dump))
    compile_s = time.perf_counter() - t0
    json_pickle_dump(exe, serialize_executable.serialize(compiled))
    return {"compile_s": compile_s, **_figures(compiled, dump)}


def _dump_options(folder: Path) -> dict[str, Any]:
    """XLA's buffer-assignment dump of this compile (what the breakdown reads without a proto)."""
    try:
        from jaxaot.stages import memory_breakdown  # type: ignore[import-not-found]

        return memory_breakdown.dump_options(folder)
    except Exception:
        return {}


def _stats(device: Any) -> dict[str, int]:
    """The allocator's figures (a dry run's CPU has none: zeros, and a 4 GiB "limit")."""
    return device.memory_stats() or {
        "bytes_in_use": 0,
        "peak_bytes_in_use": 0,
        "bytes_limit": 4 * 1024**3 // SCALE,
    }


def json_pickle_dump(path: Path, obj: Any) -> None:
    import pickle

    path.write_bytes(pickle.dumps(obj))


def json_pickle_load(path: Path) -> Any:
    import pickle

    return pickle.loads(path.read_bytes())


def _fit(gpu: Any, fraction: float) -> dict[str, Any]:
    """A program that needs ``fraction`` of the allocator's limit: 1 argument, 3 outputs."""
    import jax
    import jax.numpy as jnp

    limit = int(_stats(gpu)["bytes_limit"])
    n = int(fraction * limit / 4 / 4) // 1024 * 1024  # 4 f32 buffers of n elements

    def f(x: Any) -> Any:
        return x + 1, x * 2, x - 3

    spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    dump = Path(os.environ.get("TMPDIR", "/tmp")) / f"fit{fraction}.dump"
    compiled = jax.jit(f).lower(spec).compile(_dump_options(dump))
    fig = _figures(compiled, dump)
    verdict = fig["needed"] <= limit
    try:
        x = jnp.zeros((n,), jnp.float32, device=gpu)
        jax.block_until_ready(compiled(x))
        ran, error = True, None
    except Exception as exc:
        ran, error = False, " ".join(str(exc).split())[:160]
    return {
        "fraction": fraction,
        "bytes_limit": limit,
        **fig,
        "verdict_fits": verdict,
        "ran": ran,
        "error": error,
    }


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    jobs = [(p, m, c) for p in PROGRAMS for c in ("gpu", "deviceless") for m in (c, "run")]
    jobs += [("0.9", "fit", ""), ("1.1", "fit", "")]
    for name, mode, compiled_by in jobs:
        exe = out / f"{name}.{compiled_by}.exe"
        proc = subprocess.run(
            [sys.executable, __file__, "one", name, mode, str(exe)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        res = (
            json.loads(lines[-1]) if lines else {"error": proc.stderr[-600:], "rc": proc.returncode}
        )
        label = f"{name}/{compiled_by or mode}" + ("/run" if mode == "run" else "")
        results[label] = res
        print(label, json.dumps(res), flush=True)
    for exe in out.glob("*.exe"):
        exe.unlink()
    for dump in out.glob("*.dump"):
        shutil.rmtree(dump)
    import jax

    results["jax"] = jax.__version__
    results["gpu"] = jax.devices(PLATFORM)[0].device_kind
    (out / "gpu_memory.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    (out / "gpu_memory.md").write_text(table(results) + "\n")


def table(r: dict[str, Any]) -> str:
    mib = 1024**2
    rows = [
        "| program | compiled | XLA peak | needed (args+out+temp) | measured peak (loaded, run) "
        "| measured/needed | temp | step | compile | live at the peak (jaxaot) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PROGRAMS:
        for c in ("gpu", "deviceless"):
            g, run = r.get(f"{p}/{c}", {}), r.get(f"{p}/{c}/run", {})
            if "needed" not in g or "measured_peak" not in run:
                err = g.get("error") or run.get("error")
                rows.append(f"| {p} | {c} | error: {' '.join(str(err).split())[-120:]} ||||||")
                continue
            rows.append(
                f"| {p} | {'on the GPU' if c == 'gpu' else 'deviceless'} "
                f"| {g.get('peak_memory_in_bytes', 0) / mib:.1f} MiB | {g['needed'] / mib:.1f} MiB "
                f"| {run['measured_peak'] / mib:.1f} MiB | {run['measured_peak'] / g['needed']:.3f} "
                f"| {g['temp_size_in_bytes'] / mib:.1f} MiB | {run['step_s'] * 1e3:.2f} ms "
                f"| {g['compile_s']:.2f} s | {g.get('top3') or g.get('breakdown_error', '-')} |"
            )
    rows.append("")
    rows.append("| needs (of the allocator's limit) | verdict | ran |")
    rows.append("|---|---|---|")
    for f in ("0.9", "1.1"):
        x = r.get(f"{f}/fit", {})
        rows.append(
            f"| {x.get('needed', 0) / max(x.get('bytes_limit', 1), 1):.3f} "
            f"| {'fits' if x.get('verdict_fits') else 'does not fit'} "
            f"| {'yes' if x.get('ran') else 'no: ' + str(x.get('error'))[:60]} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1] == "one":
        print(json.dumps(one(sys.argv[2], sys.argv[3], Path(sys.argv[4]))), flush=True)
    else:
        main(Path(sys.argv[1]))
