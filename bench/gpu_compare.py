"""Deviceless CUDA compile vs a compile on the GPU: outputs, memory analysis, speed.

Two halves, on two machines:

``prepare OUT`` (the CPU host, ``jaxaot[cuda-aot]`` installed): compiles each program below for
``compile.topology=h100`` without a GPU and leaves the run directories in ``OUT``.

``device RUNS OUT`` (a host with one H100, the same jax/jaxlib/plugin versions, cuBLAS 12): for
each program, (a) ``resume_from=<deviceless run> start_at=execute``: the stored executable is
loaded and run, never compiled; (b) by default ``resume_from=<the same run> start_at=compile
compile.topology=null compile.backend=cuda``: the same lowering compiled on the GPU (with XLA's
autotuning) and run on the same inputs (GPU_COMPARE_B names other variants). Writes
``compare.json`` and ``compare.md`` (outputs equal?, max abs difference, memory analysis and
median step of each).

Programs: the shipped transformer example (f32, 2 layers, d_model 128) and a bf16 matmul
(4096 x 4096 x 4096: big enough for GEMM tiles to matter), on XLA's Triton GEMMs and through
cuBLAS. Results: bench/gpu_results/ (how they were run: bench/gpu_device.sh).

Compare (a) with a *resumed* (b), not a fresh run: a resumed run draws the inputs of dict-shaped
arguments in another order than a fresh one (a pre-existing jaxaot bug, found here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS: dict[str, list[str]] = {
    # GEMMs through cuBLAS(Lt), whose own heuristics pick the kernel on the GPU at run time.
    "matmul_bf16_4096_cublas": [
        "program.target=gpu_compare:matmul",
        "program.name=matmul_bf16_4096_cublas",
        "program.description='bf16 matmul 4096^3 through cuBLAS'",
        "program.args=[bf16[4096,4096],bf16[4096,4096]]",
        "+compile.compiler_options.xla_gpu_enable_triton_gemm=false",
    ],
    "matmul_bf16_4096": [
        "program.target=gpu_compare:matmul",
        "program.name=matmul_bf16_4096",
        "program.description='bf16 matmul 4096 x 4096 x 4096'",
        "program.args=[bf16[4096,4096],bf16[4096,4096]]",
    ],
    "transformer": ["program=transformer"],
}
REPEATS = 100


def matmul(x: Any, w: Any) -> Any:
    return x @ w


def _cli(args: list[str], env_extra: dict[str, str] | None = None) -> tuple[int, str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "bench"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env.update(env_extra or {})
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def prepare(out: Path) -> None:
    for name, overrides in PROGRAMS.items():
        rd = out / name
        rc, log, wall = _cli(
            [*overrides, "compile.topology=h100", "store.enabled=false", f"hydra.run.dir={rd}"]
        )
        print(f"{name}: rc={rc} in {wall:.1f} s")
        if rc:
            print(log[-3000:])


def _summary(rd: Path, stored: Path | None = None) -> dict[str, Any]:
    """A run's figures; ``stored``: the deviceless run whose compile a resumed run loaded."""
    m = _json(rd / "manifest.json") or {}
    st = m.get("stages", {})
    memory = _json(rd / "compile" / "memory_analysis.json")
    if memory is None and stored is not None:
        memory = _json(stored / "compile" / "memory_analysis.json")
    return {
        "status": m.get("status"),
        "error": m.get("error"),
        "compile_status": st.get("compile", {}).get("status"),
        "compile_s": st.get("compile", {}).get("seconds"),
        "memory": memory,
        "median_s": st.get("execute", {}).get("metrics", {}).get("median_s"),
        "min_s": st.get("execute", {}).get("metrics", {}).get("min_s"),
        "device_kind": (m.get("backend") or {}).get("device_kind"),
        "versions": m.get("versions"),
    }


def _outputs_equal(a: Path, b: Path) -> dict[str, Any]:
    import numpy as np

    if not (a.exists() and b.exists()):
        return {"compared": False}
    with np.load(a) as fa, np.load(b) as fb:
        keys = sorted(fa.files)
        equal = keys == sorted(fb.files) and all(np.array_equal(fa[k], fb[k]) for k in keys)
        diff = max(
            float(np.max(np.abs(fa[k].astype(np.float64) - fb[k].astype(np.float64)))) for k in keys
        )
        scale = max(float(np.max(np.abs(fb[k].astype(np.float64)))) for k in keys)
    return {"compared": True, "bitwise_equal": equal, "max_abs_diff": diff, "max_abs": scale}


def device(runs: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    only = os.environ.get("GPU_COMPARE_ONLY")
    for name, overrides in PROGRAMS.items():
        if only and name not in only.split(","):
            continue
        a_dir, b_dir = out / f"{name}-deviceless", out / f"{name}-ongpu"
        rc_a, log_a, wall_a = _cli(
            [
                f"resume_from={runs / name}",
                "start_at=execute",
                f"execute.repeats={REPEATS}",
                "execute.warmup=5",
                "store.enabled=false",
                f"hydra.run.dir={a_dir}",
            ]
        )
        # (b) variants, from GPU_COMPARE_B: "label|PYTHONPATH extra|mode|override;override"
        # entries separated by "@@". mode "resume": the deviceless run's own lowering compiled
        # on the GPU (resume_from=<it> start_at=compile): same module, same inputs as (a);
        # mode "fresh": an ordinary run (another JAX version may lower differently).
        ongpu: dict[str, Any] = {}
        for spec in os.environ.get("GPU_COMPARE_B", "on the GPU||resume|").split("@@"):
            label, path, mode, extra = spec.split("|")
            b_dir = out / f"{name}-ongpu-{len(ongpu)}"
            env = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
            if path:
                env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "bench"), path])
            how = (
                [f"resume_from={runs / name}", "start_at=compile", "compile.topology=null"]
                if mode == "resume"
                else [*overrides, "lower.platforms=[cuda]"]
            )
            rc_b, log_b, wall_b = _cli(
                [
                    *how,
                    "compile.backend=cuda",
                    f"execute.repeats={REPEATS}",
                    "execute.warmup=5",
                    "store.enabled=false",
                    f"hydra.run.dir={b_dir}",
                    *[o for o in extra.split(";") if o],
                ],
                env,
            )
            ongpu[label] = {
                "rc": rc_b,
                "wall_s": wall_b,
                **_summary(b_dir),
                "log": log_b[-1500:],
                "outputs": _outputs_equal(
                    a_dir / "execute" / "outputs.npz", b_dir / "execute" / "outputs.npz"
                ),
            }
        results[name] = {
            "deviceless_loaded": {
                "rc": rc_a,
                "wall_s": wall_a,
                **_summary(a_dir, runs / name),
                "compiled_here": "compiled in" in log_a,
                "log": log_a[-1500:],
            },
            **{f"ongpu: {k}": v for k, v in ongpu.items()},
        }
        print(name, json.dumps({k: v for k, v in results[name].items()}, default=str)[:3000])
    (out / "compare.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "compare.md").write_text(_markdown(results))
    print(_markdown(results))


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _markdown(results: dict[str, Any]) -> str:
    lines = [
        "| program | compiled | compile | process wall | temp | arg | out | median step "
        "| outputs vs deviceless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for label, s in r.items():
            mem = s.get("memory") or {}
            med = s.get("median_s")
            o = s.get("outputs") or {}
            same = (
                (
                    "bitwise equal"
                    if o.get("bitwise_equal")
                    else f"max abs diff {o.get('max_abs_diff'):.3g} (of {o.get('max_abs'):.3g})"
                )
                if o.get("compared")
                else "-"
            )
            jax_v = (s.get("versions") or {}).get("jax")
            lines.append(
                f"| {name} | {label} (jax {jax_v}, rc {s.get('rc')}) | {s.get('compile_status')} "
                f"{(s.get('compile_s') or 0):.2f} s | {s.get('wall_s', 0):.1f} s | "
                f"{_mib(mem.get('temp_size_in_bytes'))} | {_mib(mem.get('argument_size_in_bytes'))} "
                f"| {_mib(mem.get('output_size_in_bytes'))} | "
                f"{'-' if med is None else f'{med * 1e3:.3f} ms'} | {same} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]).resolve())
    else:
        device(Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve())
