"""Lowering a 70B-class decoder for a 256-device mesh: no devices, no parameter bytes.

The model is ``jaxaot.examples.transformer`` (layers stacked under ``lax.scan``) with bf16
parameters given as abstract specs; the mesh is ``conf/mesh/pod16x16.yaml`` (data=16 x model=16,
``mesh.abstract=true``) with 2-D shardings: every weight split over both axes (FSDP x tensor
parallel), tokens over ``data``. Each measurement is a fresh process:

- ``jaxaot``: ``jaxaot.run`` of the composed config with ``stop_after=lower`` (stage_out, then
  lower: StableHLO, HLO text, ``jax.export`` bytes, cost analysis, manifest);
- ``plain``: the same lowering written by hand (jit with NamedShardings on an AbstractMesh,
  trace, lower, StableHLO + HLO text, export + serialize).

It prints wall time (whole process, imports included) and peak RSS for each, and the ratio.
Targets: under 60 s and 2 GiB for 70B, with RSS flat across model sizes (parameters are never
materialised, so memory must not grow with parameter bytes).

    python bench/lower_70b.py [--models 8b,70b,405b] [--platform tpu|cpu] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jaxaot

ROOT = Path(__file__).resolve().parent.parent
# layers, d_model, heads, d_head, d_ff, vocab (batch 256 x seq 4096 tokens)
MODELS: dict[str, tuple[int, int, int, int, int, int]] = {
    "8b": (32, 4096, 32, 128, 14336, 128256),
    "70b": (80, 8192, 64, 128, 28672, 128256),
    "405b": (126, 16384, 128, 128, 53248, 128256),
}
TOKENS = (256, 4096)
# Parameter shardings on (data, model): FSDP over data, tensor parallel over model.
SHARDINGS: dict[str, Any] = {
    "embed": ["model", "data"],
    "layers": {
        "wq": [None, "data", "model", None],
        "wk": [None, "data", "model", None],
        "wv": [None, "data", "model", None],
        "wo": [None, "model", None, "data"],
        "w1": [None, "data", "model"],
        "w2": [None, "model", "data"],
    },
    "unembed": ["data", "model"],
}


def param_shapes(model: str) -> dict[str, Any]:
    L, D, H, Dh, F, V = MODELS[model]
    return {
        "embed": (V, D),
        "layers": {
            "ln1": (L, D),
            "wq": (L, D, H, Dh),
            "wk": (L, D, H, Dh),
            "wv": (L, D, H, Dh),
            "wo": (L, H, Dh, D),
            "ln2": (L, D),
            "w1": (L, D, F),
            "w2": (L, F, D),
        },
        "ln_f": (D,),
        "unembed": (D, V),
    }


def _count(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_count(v) for v in tree.values())
    n = 1
    for d in tree:
        n *= d
    return n


def _map(fn: Any, tree: Any) -> Any:
    return {k: _map(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def run_jaxaot(model: str, platform: str, out: Path) -> None:
    from omegaconf import OmegaConf

    cfg = jaxaot.compose(
        [
            "program=transformer",
            "mesh=pod16x16",
            f"lower.platforms=[{platform}]",
            "stop_after=lower",
            "store.enabled=false",
        ]
    )
    spec = {"dtype": "bf16", "init": "zeros"}
    params = _map(lambda s: {"shape": list(s), **spec}, param_shapes(model))
    tokens = {"shape": list(TOKENS), "dtype": "i32", "init": "zeros"}
    OmegaConf.update(cfg, "program.args", [params, tokens], merge=False)
    OmegaConf.update(cfg, "lower.in_shardings", [SHARDINGS, ["data", None]], merge=False)
    OmegaConf.update(cfg, "lower.out_shardings", ["data", None, "model"], merge=False)
    result = jaxaot.run(cfg, run_dir=out)
    assert result.ok and result["lower"].exported.nr_devices == 256


def run_plain(model: str, platform: str, out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxaot.examples.transformer import forward

    mesh = AbstractMesh((16, 16), ("data", "model"))
    params = _map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), param_shapes(model))
    tokens = jax.ShapeDtypeStruct(TOKENS, jnp.int32)

    def sharding(path: tuple[str, ...]) -> NamedSharding:
        node: Any = SHARDINGS
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return NamedSharding(mesh, P(*(node or ())))

    def walk(tree: Any, path: tuple[str, ...] = ()) -> Any:
        if isinstance(tree, dict):
            return {k: walk(v, (*path, k)) for k, v in tree.items()}
        return sharding(path)

    jitted = jax.jit(
        forward,
        in_shardings=(walk(params), NamedSharding(mesh, P("data", None))),
        out_shardings=NamedSharding(mesh, P("data", None, "model")),
    )
    lowered = jitted.trace(params, tokens).lower(lowering_platforms=(platform,))
    (out / "module.stablehlo.mlir").write_text(lowered.as_text())
    (out / "module.hlo.txt").write_text(lowered.as_text(dialect="hlo"))
    exported = jax.export.export(jitted, platforms=(platform,))(params, tokens)
    (out / "exported.bin").write_bytes(exported.serialize())
    assert exported.nr_devices == 256


def child(kind: str, model: str, platform: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        (run_jaxaot if kind == "jaxaot" else run_plain)(model, platform, Path(tmp))
        work = time.perf_counter() - t0
    # ru_maxrss is KiB on Linux.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"work_s": work, "rss_bytes": rss}))


def measure(kind: str, model: str, platform: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, __file__, "--child", kind, "--models", model, "--platform", platform]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{kind} {model} failed:\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b,70b")
    parser.add_argument("--platform", default="tpu", choices=["tpu", "cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", choices=["jaxaot", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.models, opts.platform)
        return
    rows = []
    for model in opts.models.split(","):
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "jaxaot": []}
        for _ in range(opts.rounds):  # interleaved, so machine noise hits both alike
            for kind in runs:
                runs[kind].append(measure(kind, model, opts.platform))
        med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
        params = _count(param_shapes(model))
        rows.append(
            {
                "model": model,
                "params": params,
                "param_bytes": 2 * params,
                **{f"{k}_{m}": med[k][m] for k in med for m in med[k]},
            }
        )
    gib = 2**30
    print(
        f"lowering for a 256-device abstract mesh (data=16 x model=16), platform "
        f"{opts.platform}, tokens {TOKENS[0]}x{TOKENS[1]}, median of {opts.rounds}"
    )
    print(
        "| model | params (bf16 bytes) | plain wall | jaxaot wall | ratio | plain RSS | jaxaot RSS |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e9:.1f} B ({r['param_bytes'] / gib:.0f} GiB) | "
            f"{r['plain_wall_s']:.1f} s | {r['jaxaot_wall_s']:.1f} s | "
            f"{r['jaxaot_wall_s'] / r['plain_wall_s']:.2f} | {r['plain_rss_bytes'] / gib:.2f} GiB | "
            f"{r['jaxaot_rss_bytes'] / gib:.2f} GiB |"
        )
    ok = all(r["jaxaot_wall_s"] < 60 and r["jaxaot_rss_bytes"] < 2 * gib for r in rows)
    print(f"targets (< 60 s, < 2 GiB per jaxaot run): {'met' if ok else 'MISSED'}")
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
