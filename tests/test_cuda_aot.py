"""compile.topology for NVIDIA GPUs: deviceless CUDA compiles on this CPU host.

Tiny programs for h100 / b200 targets through the CUDA plugin's compile-only devices, each a
second or two. The executable cannot run here: what is checked is the CUDA compile itself
(optimized GPU HLO, cubins serialized), the verdict, the store key, the gap (no autotuning),
the ptxas guard, the cuDNN refusal and the refusal to resume at execute without a GPU.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from conftest import read_json, run_numbered
from jaxaot.errors import BackendError, ConfigError, StageError
from jaxaot.schema import validate
from jaxaot.targets import cuda as cuda_targets
from jaxaot.targets.tpu import GENERATIONS, resolve, topology_devices

HERE = "test_cuda_aot"  # this module, importable as a program target (tests/ is on sys.path)
GPUS = sorted(g for g in GENERATIONS if GENERATIONS[g].platform == "cuda")


def matmul(x: Any, w: Any) -> Any:
    """A contraction; sharded over "model" it needs one all-reduce of the partial products."""
    return x @ w


def cudnn_attention(q: Any) -> Any:
    """A cuDNN-only kernel: flash attention through cuDNN."""
    import jax

    return jax.nn.dot_product_attention(q, q, q, implementation="cudnn")


@pytest.fixture(autouse=True)
def _on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


_run = run_numbered
_json = read_json


_MATMUL = (f"program.target={HERE}:matmul", "program.args=[bf16[64,128],bf16[128,32]]")


# -- names and the table ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "topo", "devices"),
    [
        ("h100", "h100:1x1x1", 1),
        ("h100x8", "h100:1x1x8", 8),
        ("b200x8", "b200:1x1x8", 8),
        ("h100:2x1x8", "h100:2x1x8", 16),
        ("A100X4", "a100:1x1x4", 4),
    ],
)
def test_gpu_names_resolve(name: str, topo: str, devices: int) -> None:
    t = resolve(name)
    assert (t.topology, t.devices, t.generation.platform) == (topo, devices, "cuda")
    assert cuda_targets.topology_name(t) == topo.split(":")[1]


@pytest.mark.parametrize(
    ("value", "num_slices", "match"),
    [
        (
            "h100-8",
            1,
            r"^compile.topology: 'h100-8': expected an NVIDIA GPU target as h100, "
            r"h100x8 .* or h100:2x1x8",
        ),
        ("h100:2x2", 1, r"expected an NVIDIA GPU target"),
        ("h100x0", 1, r"expected counts >= 1"),
        (
            "h100x8",
            2,
            r"^compile.num_slices=2: GPU targets count slices in compile.topology; "
            r"expected e.g. compile.topology=h100:2x1x8",
        ),
        ("x100", 1, r"GPUs: a100, b200, h100, h200\), found 'x100'$"),
    ],
)
def test_bad_gpu_names_are_one_line_config_errors(value: str, num_slices: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        resolve(value, num_slices)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("gen", GPUS)
def test_each_target_config_gives_its_gpu(gen: str) -> None:
    g = GENERATIONS[gen]
    assert g.source.startswith("NVIDIA ") and g.hbm_usable_bytes == int(g.hbm_bytes * 0.75)
    assert g.peak_bf16_flops > 0 and g.hbm_bandwidth > 0
    devs = topology_devices(resolve(f"{gen}x2"))
    assert len(devs) == 2 and {d.device_kind for d in devs} == {g.device_kind}


def test_topology_sets_cuda_backend_and_platforms() -> None:
    cfg = validate(jaxaot.compose(["program=mlp", "compile.topology=h100x8", "mesh=data8"]))
    assert cfg.compile.backend == "cuda" and cfg.lower.platforms == ["cuda"]
    assert cfg.stop_after == "compile"
    with pytest.raises(
        ConfigError,
        match=r"^lower.platforms=\['tpu'\] contradicts "
        r"compile.topology='h100'; expected cuda among them",
    ):
        validate(jaxaot.compose(["program=mlp", "compile.topology=h100", "lower.platforms=[tpu]"]))
    with pytest.raises(ConfigError, match=r"has 4 devices but compile.topology=h100x8 has 8"):
        validate(
            jaxaot.compose(
                ["program=mlp", "compile.topology=h100x8", "mesh.shape=[4]", "mesh.axes=[data]"]
            )
        )


# -- compiling -------------------------------------------------------------------------------


def test_matmul_for_h100_with_verdict_gap_and_store(tmp_path: Path) -> None:
    first = _run(tmp_path, *_MATMUL, "compile.topology=h100")
    rd, m = first.run_dir, first.manifest
    assert m["status"] == "ok" and m["stages"]["compile"]["status"] == "ran"
    be = m["backend"]
    assert be["platform"] == "cuda" and be["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert be["target_config_sha256"] == cuda_targets.target_config_sha256(GENERATIONS["h100"])
    assert be["jax-cuda12-plugin"] == be["jax-cuda12-pjrt"] == "0.10.2"
    assert be["ptxas"].startswith("12.") and be["autotuned"] is False
    hlo = (rd / "compile" / "optimized.hlo.txt").read_text()
    assert "operation_queue_id" in hlo  # GPU backend configs: a CUDA compile, not a CPU one
    info = _json(rd, "compile/compiled.json")
    assert info["backend"] == "cuda" and info["autotuned"] is False
    memory = _json(rd, "compile/memory_analysis.json")
    assert "fit" not in info and m["fit"]["fits"] is True  # the run's verdict: the manifest's
    assert (
        m["fit"]["hbm_bytes_needed"]
        >= memory["argument_size_in_bytes"]
        == 2 * (64 * 128 + 128 * 32)
    )
    assert m["fit"]["hbm_bytes_available"] == int(84942979072 * 0.75)
    assert any(
        "without autotuning" in w and "xla_gpu_enable_triton_gemm: false" in w
        for w in m["warnings"]
    )
    assert m["stages"]["compile"]["metrics"]["autotuned"] is False
    payload, _, _ = pickle.loads((rd / "compile" / "executable.bin").read_bytes())
    assert len(payload) > 1000  # the serialized executable, cubins included
    # Second run: a store hit with the same verified artifacts, and nothing to load here.
    second = _run(tmp_path, *_MATMUL, "compile.topology=h100")
    assert second.manifest["stages"]["compile"]["status"] == "cached"
    for name in ("optimized.hlo.txt", "executable.bin", "compiled.json"):
        assert (second.run_dir / "compile" / name).read_bytes() == (
            rd / "compile" / name
        ).read_bytes()
    assert second["compile"].compiled is None
    # Another GPU: another target config, another key.
    other = _run(tmp_path, *_MATMUL, "compile.topology=b200")
    assert other.manifest["stages"]["compile"]["status"] == "ran"
    assert other.manifest["stages"]["compile"]["key"] != m["stages"]["compile"]["key"]
    assert other.manifest["backend"]["device_kind"] == "NVIDIA B200"


def test_gemms_through_cublas(tmp_path: Path) -> None:
    # The way around the autotuning gap: cuBLAS(Lt) custom calls instead of Triton GEMMs.
    r = _run(
        tmp_path,
        *_MATMUL,
        "compile.topology=h100",
        "+compile.compiler_options.xla_gpu_enable_triton_gemm=false",
    )
    hlo = (r.run_dir / "compile" / "optimized.hlo.txt").read_text()
    assert '"__cublas$lt$matmul"' in hlo or '"__cublas$gemm"' in hlo
    (note,) = [w for w in r.manifest["warnings"] if "without autotuning" in w]
    assert "xla_gpu_enable_triton_gemm" not in note


def test_sharded_over_8_gpus_with_an_all_reduce(tmp_path: Path) -> None:
    r = _run(
        tmp_path,
        *_MATMUL,
        "mesh.shape=[2,4]",
        "mesh.axes=[data,model]",
        "compile.topology=h100x8",
        "lower.in_shardings=[[data,model],[model,null]]",
    )
    info = _json(r.run_dir, "compile/compiled.json")
    assert info["target"]["devices"] == 8 and len(info["device_ids"]) == 8
    ar = info["collectives"]["all-reduce"]
    # Each device's partial [32, 32] bf16 product is summed over "model".
    assert ar["count"] >= 1 and ar["bytes"] >= 32 * 32 * 2
    assert r.manifest["backend"]["device_count"] == 8
    shard = _json(r.run_dir, "compile/shardings.json")
    assert shard["inputs"][0]["shard_shape"] == [32, 32]
    # No cost analysis from a deviceless GPU executable: the roofline estimate is the lowering's
    # (whole program) over the 8 devices, and says so.
    whole = _json(r.run_dir, "lower/cost_analysis.json")
    roof = info["roofline"]
    assert roof["estimate"] is True and roof["source"].startswith("lowering cost analysis")
    assert roof["flops"] == whole["flops"] / 8
    assert roof["step_s"] == max(whole["flops"] / 8 / 989e12, whole["bytes accessed"] / 8 / 3350e9)
    assert r.manifest["stages"]["compile"]["metrics"]["est_step_s"] == roof["step_s"]


def test_ptxas_of_another_cuda_major_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "cuda13"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "ptxas").write_text(
        "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
    )
    (fake / "bin" / "ptxas").chmod(0o755)
    with pytest.raises(
        BackendError,
        match=r"^compile.compiler_options.xla_gpu_cuda_data_dir: "
        r".*ptxas is CUDA 13, expected CUDA 12",
    ):
        cuda_targets.compile_options({"xla_gpu_cuda_data_dir": str(fake)})
    opts = cuda_targets.compile_options({})
    assert Path(opts["xla_gpu_cuda_data_dir"]) == cuda_targets.cuda_data_dir()
    assert (cuda_targets.cuda_data_dir() / "nvvm" / "libdevice").is_dir()


def test_cudnn_kernel_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(
        StageError,
        match=r"jax.nn.dot_product_attention\(implementation='cudnn'\) "
        r"needs cuDNN.*nvidia-cudnn-cu12",
    ) as info:
        _run(
            tmp_path,
            f"program.target={HERE}:cudnn_attention",
            "program.args=[bf16[1,64,2,64]]",
            "compile.topology=h100",
        )
    assert "\n" not in str(info.value)


def test_resume_at_execute_needs_the_gpus(tmp_path: Path) -> None:
    r = _run(tmp_path, *_MATMUL, "compile.topology=h100")
    cfg = jaxaot.compose([*_MATMUL, f"resume_from={r.run_dir}", "start_at=execute"])
    with pytest.raises(
        BackendError,
        match=r"^start_at=execute: the executable was compiled "
        r"deviceless for NVIDIA GPU target h100:1x1x1 \(1 x "
        r"NVIDIA H100 80GB HBM3, .*this host has no NVIDIA GPU",
    ):
        jaxaot.run(cfg, run_dir=tmp_path / "resumed", overrides=[])


def test_resume_on_a_gpu_host_loads_the_stored_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Everything up to the load, on this CPU host: JAX is told it has one H100, and the loader
    # must get the stored executable's bytes, for the cuda backend and that device, without a
    # compile. (The load itself ran on a real H100: bench/gpu_results/.)
    import jax
    from jax.experimental import serialize_executable

    r = _run(tmp_path, *_MATMUL, "compile.topology=h100")
    stored, _, _ = pickle.loads((r.run_dir / "compile" / "executable.bin").read_bytes())
    gpu = type(
        "FakeH100",
        (),
        {"id": 0, "device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu", "client": None},
    )()
    real_devices = jax.devices

    def devices(backend: Any = None) -> Any:
        return [gpu] if backend in ("cuda", "gpu") else real_devices(backend)

    loads: list[tuple[bytes, str, list[Any]]] = []

    class Loaded(Exception):
        pass

    def deserialize_and_load(
        payload: bytes, in_tree: Any, out_tree: Any, backend: str, execution_devices: list[Any]
    ) -> Any:
        loads.append((payload, backend, execution_devices))
        raise Loaded("stop here: this host cannot run it")

    monkeypatch.setattr(jax, "devices", devices)
    monkeypatch.setattr(serialize_executable, "deserialize_and_load", deserialize_and_load)
    cfg = jaxaot.compose([*_MATMUL, f"resume_from={r.run_dir}", "start_at=execute"])
    with pytest.raises(Exception):  # noqa: B017 - whatever comes after the load: no GPU here
        jaxaot.run(cfg, run_dir=tmp_path / "resumed", overrides=[])
    assert loads and loads[0][0] == stored
    assert loads[0][1] == "cuda" and loads[0][2] == [gpu]


def test_resume_refuses_other_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    r = _run(tmp_path, *_MATMUL, "compile.topology=h100")
    a100 = type("FakeA100", (), {"id": 0, "device_kind": "NVIDIA A100-SXM4-80GB"})()
    real_devices = jax.devices
    monkeypatch.setattr(
        jax, "devices", lambda backend=None: [a100] if backend == "cuda" else real_devices(backend)
    )
    cfg = jaxaot.compose([*_MATMUL, f"resume_from={r.run_dir}", "start_at=execute"])
    with pytest.raises(
        BackendError,
        match=r"^start_at=execute: the executable was compiled for "
        r"h100:1x1x1 .* but this host has 1 x NVIDIA "
        r"A100-SXM4-80GB; expected 1 x NVIDIA H100 80GB HBM3",
    ):
        jaxaot.run(cfg, run_dir=tmp_path / "resumed", overrides=[])


def test_the_plugin_is_quiet_on_a_host_without_a_gpu(cli: Any) -> None:
    # jaxaot[cuda-aot] on a CPU host: neither the plugin's import lines nor its failed CUDA
    # check (two tracebacks) reach the terminal of an ordinary CPU run.
    proc, _ = cli("program=axpy", "stop_after=lower")
    assert "cudart_stub" not in proc.stderr and "Could not find cuda drivers" not in proc.stderr
    assert "Jax plugin configuration error" not in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def test_xla_runs_the_ptxas_it_is_given(tmp_path: Path) -> None:
    # xla_gpu_cuda_data_dir steers XLA's choice (this machine's PATH has a CUDA 13 ptxas): a
    # ptxas that logs its calls, then runs the package's, is the one XLA runs for sm_90a.
    real = cuda_targets.cuda_data_dir()
    fake, calls = tmp_path / "cuda", tmp_path / "calls.txt"
    (fake / "bin").mkdir(parents=True)
    (fake / "nvvm").symlink_to(real / "nvvm")
    (fake / "bin" / "ptxas").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\nexec {real / "bin" / "ptxas"} "$@"\n'
    )
    (fake / "bin" / "ptxas").chmod(0o755)
    r = _run(
        tmp_path,
        f"program.target={HERE}:matmul",
        "program.args=[bf16[48,96],bf16[96,40]]",
        "compile.topology=h100",
        "store.enabled=false",
        f"+compile.compiler_options.xla_gpu_cuda_data_dir={fake}",
    )
    assert r.manifest["stages"]["compile"]["status"] == "ran"
    assert "-arch=sm_90a" in calls.read_text()
