"""On a GPU host: are deviceless CUDA executables right? (a differential check)

For each program and each way of compiling it deviceless (the shipped target config, the
config the real GPU reports, with some XLA passes off), compile for compile-only devices,
serialize, load onto the real GPU, run, and compare with the same program on the CPU backend.
Plain JAX (no jaxaot), so that a wrong answer points at the compile, not at the pipeline.

    PYTHONPATH=<jax 0.10.2 + jax-cuda12 0.10.2> python bench/gpu_deviceless_check.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def programs() -> dict[str, tuple[Any, list[Any]]]:
    import numpy as np
    from jaxaot.examples.mlp import mlp
    from jaxaot.examples.transformer import forward

    rng = np.random.default_rng(0)

    def n(*shape: int, scale: float = 0.02) -> Any:
        return (rng.normal(0, scale, shape)).astype(np.float32)

    params = {
        "embed": n(256, 128),
        "layers": {
            "ln1": np.zeros((2, 128), np.float32),
            "wq": n(2, 128, 4, 32),
            "wk": n(2, 128, 4, 32),
            "wv": n(2, 128, 4, 32),
            "wo": n(2, 4, 32, 128),
            "ln2": np.zeros((2, 128), np.float32),
            "w1": n(2, 128, 512),
            "w2": n(2, 512, 128),
        },
        "ln_f": np.zeros((128,), np.float32),
        "unembed": n(128, 256),
    }
    tokens = rng.integers(0, 256, (4, 64)).astype(np.int32)
    mlp_params = [
        {"w": n(256, 512, scale=0.05), "b": np.zeros(512, np.float32)},
        {"w": n(512, 512, scale=0.05), "b": np.zeros(512, np.float32)},
        {"w": n(512, 128, scale=0.05), "b": np.zeros(128, np.float32)},
    ]
    return {
        "matmul_f32": (lambda x, w: x @ w, [n(256, 512, scale=1.0), n(512, 128, scale=1.0)]),
        "mlp_f32": (mlp, [mlp_params, n(64, 256, scale=1.0)]),
        "transformer_f32": (forward, [params, tokens]),
    }


def main(out: Path) -> None:
    import jax
    import numpy as np
    from jax._src.lib import xla_client
    from jax.experimental import serialize_executable, topologies
    from jax.sharding import SingleDeviceSharding

    out.mkdir(parents=True, exist_ok=True)
    gpu = jax.devices("cuda")[0]
    real_config = str(xla_client.get_topology_for_devices([gpu]).target_config)
    (out / "device_target_config.txtpb").write_text(real_config)
    shipped = (ROOT / "pipeline" / "targets" / "gpu_targets" / "h100.txtpb").read_text()
    variants: dict[str, tuple[str, dict[str, Any]]] = {
        "shipped h100.txtpb": (shipped, {}),
        "the GPU's own config": (real_config, {}),
        "shipped, dynamic_slice_fusion off": (
            shipped,
            {"xla_gpu_enable_dynamic_slice_fusion": False},
        ),
    }
    nvcc = Path(sys.modules["jax"].__file__).parent.parent / "nvidia" / "cuda_nvcc"
    results: dict[str, Any] = {"gpu": gpu.device_kind, "jax": jax.__version__}
    for pname, (fn, args) in programs().items():
        cpu = jax.devices("cpu")[0]
        want = np.asarray(jax.jit(fn)(*jax.device_put(args, cpu)))
        for vname, (config, opts) in variants.items():
            key = f"{pname} / {vname}"
            try:
                topo = topologies.get_topology_desc(
                    platform="cuda", target_config=config, topology="1x1x1"
                )
                s = SingleDeviceSharding(topo.devices[0])
                specs = jax.tree.map(
                    lambda a, s=s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), args
                )
                compiled = (
                    jax.jit(fn)
                    .trace(*specs)
                    .lower(lowering_platforms=("cuda",))
                    .compile(compiler_options={"xla_gpu_cuda_data_dir": str(nvcc), **opts})
                )
                payload, in_tree, out_tree = serialize_executable.serialize(compiled)
                loaded = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, backend="cuda", execution_devices=[gpu]
                )
                dev_args = jax.device_put(args, gpu)
                got = np.asarray(loaded(*dev_args))
                t0 = time.perf_counter()
                for _ in range(20):
                    r = loaded(*dev_args)
                jax.block_until_ready(r)
                step = (time.perf_counter() - t0) / 20
                diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
                kinds = sorted(
                    {
                        ln.split('"kind":"')[1].split('"')[0]
                        for ln in compiled.as_text().splitlines()
                        if '"kind":"' in ln
                    }
                )
                results[key] = {
                    "max_abs_diff_vs_cpu": diff,
                    "max_abs": float(np.abs(want).max()),
                    "step_s": step,
                    "fusion_kinds": kinds,
                }
            except Exception as exc:  # a variant that cannot compile or run here: say why
                results[key] = {"error": " ".join(str(exc).split())[:300]}
            print(key, json.dumps(results[key]), flush=True)
    (out / "deviceless_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
