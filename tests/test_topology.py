"""compile.topology: compiling for TPU topologies on this CPU host through libtpu.

Tiny programs on v5e:2x2 / v4:2x2x1, each compile a second or so. The fit verdict is checked
against XLA's own memory analysis and its own HBM rejection; the store against a second run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from jaxaot.errors import BackendError, ConfigError, DoesNotFit
from jaxaot.schema import validate
from jaxaot.stages import topology
from jaxaot.targets import tpu as accelerators
from jaxaot.targets.tpu import GENERATIONS, GiB, default_shape, resolve
from jaxaot.util.canonical import canonical_hlo

HERE = "test_topology"  # this module, importable as a program target (tests/ is on sys.path)


def matmul(x: Any, w: Any) -> Any:
    """A contraction sharded over "model": one all-reduce of the [x rows, w cols] result."""
    return x @ w


def head(x: Any) -> Any:
    """No temporaries: what it needs is its argument."""
    return x[:8]


def big_sort(x: Any) -> Any:
    """Temporaries of ~128x the input: 64 MiB in, ~8 GiB of temporaries."""
    import jax.numpy as jnp

    return jnp.sort(jnp.concatenate([x] * 64, axis=1), axis=1)[:, :4].sum()


@pytest.fixture(autouse=True)
def _on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _run(tmp_path: Path, *overrides: str, name: str = "run") -> jaxaot.RunResult:
    # (conftest.run_numbered; this module is also imported as a program target, without
    # pytest's conftest on the path)
    rd = tmp_path / f"{name}{len(list(tmp_path.glob(name + '*')))}"
    return jaxaot.run(jaxaot.compose(list(overrides)), run_dir=rd)


def _json(run_dir: Path, name: str) -> Any:
    return json.loads((run_dir / name).read_text())


# -- names and the table ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "topo", "devices"),
    [
        ("v5e-256", "v5e:16x16", 256),  # v5e counts chips
        ("v5e-8", "v5e:2x4", 8),
        ("v6e-64", "v6e:8x8", 64),
        ("v4-32", "v4:2x2x4", 16),  # v4 counts TensorCores: 2 per chip
        ("v4-8", "v4:2x2x1", 4),
        ("v5p-128", "v5p:4x4x4", 64),
        ("v5litepod-16", "v5e:4x4", 16),
        ("v5e:4x4", "v5e:4x4", 16),
        ("V4:2x2x1", "v4:2x2x1", 4),
    ],
)
def test_names_resolve_to_libtpu_topologies(name: str, topo: str, devices: int) -> None:
    target = resolve(name)
    assert (target.topology, target.devices) == (topo, devices)


def test_default_shapes_are_googles() -> None:
    assert [default_shape(n, 3) for n in (4, 8, 16, 32, 64, 128)] == [
        (2, 2, 1),
        (2, 2, 2),
        (2, 2, 4),
        (2, 4, 4),
        (4, 4, 4),
        (4, 4, 8),
    ]
    assert [default_shape(n, 2) for n in (4, 8, 16, 32, 256)] == [
        (2, 2),
        (2, 4),
        (4, 4),
        (4, 8),
        (16, 16),
    ]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("v9z-8", r"compile.topology: unknown TPU generation 'v9z'"),
        ("v4-6", r"v4-N counts TensorCores \(2 per chip\)"),
        ("v5e-12", r"v5e-N counts chips"),
        ("v5e:2x2x1", r"v5e topologies have 2 dimensions"),
        ("tpu", r"expected a TPU topology such as v5e:4x4"),
    ],
)
def test_bad_names_are_one_line_config_errors(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        resolve(value)
    assert "\n" not in str(info.value)


def test_table_has_every_figure_with_a_source() -> None:
    for gen in GENERATIONS.values():
        if gen.platform == "cuda":  # NVIDIA GPUs: tests/test_cuda_aot.py
            assert gen.source.startswith("NVIDIA ")
        else:
            assert gen.platform == "tpu" and gen.source.startswith("cloud.google.com/tpu/docs")
        assert 0 < gen.hbm_usable_bytes <= gen.hbm_bytes * 1.01
        assert gen.peak_int8_ops >= gen.peak_bf16_flops > 1e14
        assert gen.hbm_bandwidth > 5e11
    assert GENERATIONS["v5e"].hbm_usable_bytes == int(15.75 * GiB)  # XLA's own figure


# -- config ----------------------------------------------------------------------------------


def test_topology_sets_backend_platforms_and_stops_after_compile() -> None:
    cfg = validate(jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2"]))
    assert (cfg.compile.backend, cfg.lower.platforms, cfg.stop_after) == ("tpu", ["tpu"], "compile")
    both = validate(
        jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2", "lower.platforms=[cpu,tpu]"])
    )
    assert both.lower.platforms == ["cpu", "tpu"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["compile.backend=gpu"], r"compile.backend='gpu' contradicts compile.topology='v5e:2x2'"),
        (["lower.platforms=[cpu]"], r"lower.platforms=\['cpu'\] contradicts compile.topology"),
        (["mesh=data2_model4"], r"mesh.shape=\[2, 4\] has 8 devices but .*v5e:2x2 has 4"),
        (["compile.num_slices=0"], r"compile.num_slices: expected >= 1, found 0"),
    ],
)
def test_contradictions_are_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2", *overrides]))


def test_num_slices_needs_a_topology() -> None:
    with pytest.raises(ConfigError, match=r"compile.num_slices=2 needs compile.topology"):
        validate(jaxaot.compose(["program=mlp", "compile.num_slices=2"]))


# -- compiling -------------------------------------------------------------------------------


def test_compiles_for_v5e_with_a_fit_verdict_and_the_store(tmp_path: Path) -> None:
    first = _run(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    rd = first.run_dir
    m = first.manifest
    assert m["status"] == "ok" and m["stages"]["compile"]["status"] == "ran"
    assert m["stages"]["execute"]["status"] == "skipped"
    assert "start_at=execute" in m["stages"]["execute"]["note"]
    from jaxaot.engine.summary import render

    screen = render(m)
    assert "topology v5e:2x2, compile only" in screen and "fits: " in screen
    assert "HBM per device (v5e:2x2)" in screen and "roofline estimate" in screen
    assert m["backend"]["topology"] == "v5e:2x2" and m["backend"]["device_kind"] == "TPU v5 lite"
    assert m["backend"]["libtpu"] == accelerators.libtpu_version()
    hlo = (rd / "compile" / "optimized.hlo.txt").read_text()
    assert "T(8,128)" in hlo  # TPU tiled layouts: a TPU compile, not a CPU one
    memory = _json(rd, "compile/memory_analysis.json")
    info = _json(rd, "compile/compiled.json")
    need = (
        memory["argument_size_in_bytes"]
        + memory["output_size_in_bytes"]
        + memory["temp_size_in_bytes"]
        + memory["generated_code_size_in_bytes"]
        - memory["alias_size_in_bytes"]
    )
    fit = m["fit"]
    assert fit["hbm_bytes_needed"] == need and fit["hbm_bytes_available"] == int(15.75 * GiB)
    assert fit["fits"] is True and fit["headroom_bytes"] == int(15.75 * GiB) - need
    metrics = m["stages"]["compile"]["metrics"]
    assert metrics["fits"] is True and metrics["hbm_bytes_needed"] == need
    cost = _json(rd, "compile/cost_analysis.json")
    roof = info["roofline"]
    assert roof["estimate"] is True
    assert roof["step_s"] == max(cost["flops"] / 197e12, cost["bytes accessed"] / 819e9)
    assert (rd / "compile" / "executable.bin").stat().st_size > 0
    # Second run: a store hit with the same verified artifacts.
    second = _run(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    assert second.manifest["stages"]["compile"]["status"] == "cached"
    for name in ("optimized.hlo.txt", "executable.bin", "compiled.json"):
        assert (second.run_dir / "compile" / name).read_bytes() == (
            rd / "compile" / name
        ).read_bytes()
    assert second.manifest["stages"]["compile"]["metrics"]["fits"] is True
    assert second["compile"].compiled is None  # compile-only: nothing to load here
    # Another topology of another generation: another key, another verdict.
    other = _run(tmp_path, "program=mlp", "compile.topology=v4:2x2x1")
    assert other.manifest["stages"]["compile"]["status"] == "ran"
    assert other.manifest["stages"]["compile"]["key"] != m["stages"]["compile"]["key"]
    assert other.manifest["fit"]["hbm_bytes_available"] == int(30.75 * GiB)
    assert "fit" not in _json(other.run_dir, "compile/compiled.json")  # the run's, not stored


def test_a_mesh_lies_over_the_topology_and_collectives_are_counted(tmp_path: Path) -> None:
    r = _run(
        tmp_path,
        f"program.target={HERE}:matmul",
        "program.args=[f32[64,128],f32[128,32]]",
        "mesh.shape=[2,2]",
        "mesh.axes=[data,model]",
        "compile.topology=v5e:2x2",
        "lower.in_shardings=[[data,model],[model,null]]",
    )
    info = _json(r.run_dir, "compile/compiled.json")
    assert info["target"]["devices"] == 4 and len(info["device_ids"]) == 4
    ar = info["collectives"]["all-reduce"]
    # Each device's partial [32, 32] f32 product is summed over "model": one all-reduce.
    assert ar["count"] >= 1 and ar["bytes"] >= 32 * 32 * 4
    assert r.manifest["stages"]["compile"]["metrics"]["collectives"] >= 1
    shard = _json(r.run_dir, "compile/shardings.json")
    assert shard["inputs"][0]["shard_shape"] == [32, 64]


_MATMUL_ON_2X2 = (
    f"program.target={HERE}:matmul",
    "program.args=[f32[64,128],f32[128,32]]",
    "mesh.shape=[2,2]",
    "mesh.axes=[data,model]",
    "compile.topology=v5e:2x2",
    "lower.in_shardings=[[data,model],[model,null]]",
)


def test_the_live_compile_is_plain_jaxs_and_agrees_with_the_export_path(tmp_path: Path) -> None:
    """A program lowered here for TPU compiles its own lowering on the topology's devices
    (ahead, while lower still exports): the executable a plain jit(...).lower(...).compile()
    over the topology's mesh gives, and the verdict the export path (a resumed run) gives."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxaot.stages.executable import cost_of, memory_of

    live = _run(tmp_path, *_MATMUL_ON_2X2)
    stage = live.manifest["stages"]["compile"]
    assert stage["status"] == "ran" and "overlapped_seconds" in stage  # begun ahead
    rd = live.run_dir
    hlo = (rd / "compile" / "optimized.hlo.txt").read_text()

    target = resolve("v5e:2x2")
    with accelerators.quiet_libtpu():
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name="v5e:2x2", chip_config_name=target.generation.chip_config
        )
    mesh = topologies.make_mesh(topo, (2, 2), ("data", "model"))
    x = jax.ShapeDtypeStruct(
        (64, 128), jnp.float32, sharding=NamedSharding(mesh, P("data", "model"))
    )
    w = jax.ShapeDtypeStruct((128, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    plain = jax.jit(matmul).lower(x, w).compile()
    assert hlo.startswith("HloModule jit_matmul,")
    # Less what says where the source lines are (the call stacks differ) and the module name.
    assert canonical_hlo(hlo) == canonical_hlo(plain.as_text())
    assert _json(rd, "compile/memory_analysis.json") == memory_of(plain)
    assert _json(rd, "compile/cost_analysis.json") == cost_of(plain)

    # The export path (a resumed lowering has no live one): another key, the same verdict.
    cfg = jaxaot.compose([*_MATMUL_ON_2X2, f"resume_from={rd}", "start_at=compile"])
    resumed = jaxaot.run(cfg, run_dir=tmp_path / "resumed", overrides=[])
    r_stage = resumed.manifest["stages"]["compile"]
    assert [resumed.manifest["stages"][s]["status"] for s in ("lower", "compile")] == [
        "resumed",
        "ran",
    ]
    assert "overlapped_seconds" not in r_stage and r_stage["key"] != stage["key"]
    info, r_info = (
        _json(rd, "compile/compiled.json"),
        _json(resumed.run_dir, "compile/compiled.json"),
    )
    assert (
        resumed.manifest["fit"]["fits"] is True and resumed.manifest["fit"] == live.manifest["fit"]
    )
    assert info["collectives"] == r_info["collectives"] and info["roofline"] == r_info["roofline"]
    assert _json(rd, "compile/memory_analysis.json") == _json(
        resumed.run_dir, "compile/memory_analysis.json"
    )

    # Store off and a store hit: the same artifacts, byte for byte.
    off = _run(tmp_path, *_MATMUL_ON_2X2, "store.enabled=false", name="off")
    hit = _run(tmp_path, *_MATMUL_ON_2X2, name="hit")
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    assert hit.manifest["stages"]["compile"]["key"] == stage["key"]
    for other in (off, hit):
        for name in (
            "optimized.hlo.txt",
            "memory_analysis.json",
            "cost_analysis.json",
            "compiled.json",
            "shardings.json",
            "executable.bin",
        ):
            assert (other.run_dir / "compile" / name).read_bytes() == (
                rd / "compile" / name
            ).read_bytes(), name
    assert off.manifest["fit"] == hit.manifest["fit"] == live.manifest["fit"]


def test_rebinding_refuses_what_it_cannot_compile_elsewhere() -> None:
    """Only a lowering against an AbstractMesh, with no hoisted constants (an executable jax
    0.10 cannot serialize), in the layout jax 0.10 gives it, is rebound; the rest goes through
    the export. The original is never changed."""
    from types import SimpleNamespace

    from jaxaot.stages.executable import rebound

    def lowering(**over: Any) -> Any:
        comp = {"compile_args": {"backend": "cpu"}, "_device_list": None, "const_args": []}
        return SimpleNamespace(_lowering=SimpleNamespace(**(comp | over)))

    live = lowering()
    out = rebound(live, "tpu client")
    assert out is not None and out._lowering.compile_args == {"backend": "tpu client"}
    assert live._lowering.compile_args == {"backend": "cpu"}
    assert rebound(lowering(_device_list=["cpu:0"]), "tpu client") is None
    assert rebound(lowering(const_args=[1.0]), "tpu client") is None
    assert rebound(lowering(compile_args={}), "tpu client") is None
    assert rebound(SimpleNamespace(), "tpu client") is None


def test_multi_slice(tmp_path: Path) -> None:
    r = _run(
        tmp_path,
        f"program.target={HERE}:matmul",
        "program.args=[f32[64,128],f32[128,32]]",
        "mesh.shape=[2,4]",
        "mesh.axes=[data,model]",
        "compile.topology=v5e:2x2",
        "compile.num_slices=2",
        "lower.in_shardings=[[data,model],[model,null]]",
    )
    assert r.manifest["backend"]["device_count"] == 8
    assert r.manifest["backend"]["num_slices"] == 2


def test_hbm_rejection_is_a_verdict(tmp_path: Path) -> None:
    with pytest.raises(
        DoesNotFit,
        match=r"^does not fit: needs [\d.]+ GiB of 15.75 GiB per "
        r"device \(v5e, v5e:2x2\)$",
    ) as info:
        _run(
            tmp_path,
            f"program.target={HERE}:big_sort",
            "program.args=[f32[4096,16384]]",
            "compile.topology=v5e:2x2",
        )
    assert info.value.fit["fits"] is False and info.value.fit["source"] == "xla"
    manifest = _json(next(tmp_path.glob("run*")), "manifest.json")
    assert manifest["status"] == "does_not_fit" and manifest["fit"]["fits"] is False
    assert manifest["stages"]["compile"]["status"] == "does_not_fit"
    assert manifest["stages"]["compile"]["metrics"]["hbm_bytes_needed"] > 16 * GiB


def test_hbm_rejection_of_a_compile_begun_ahead_is_a_verdict(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a mesh the compile starts ahead, on the runner's worker thread (the live lowering):
    XLA's refusal is still the stage's verdict, and libtpu says nothing while it compiles."""
    import threading

    calls: list[tuple[bool, str]] = []
    compile_for = topology.compile_for

    def spy(lowered: Any, target: Any, options: Any, live: Any = None) -> Any:
        calls.append((live is not None, threading.current_thread().name))
        return compile_for(lowered, target, options, live)

    monkeypatch.setattr(topology, "compile_for", spy)
    capfd.readouterr()
    with pytest.raises(DoesNotFit, match=r"^does not fit: needs [\d.]+ GiB of 15.75 GiB") as info:
        _run(
            tmp_path,
            f"program.target={HERE}:big_sort",
            "program.args=[f32[16384,16384]]",
            "mesh.shape=[4]",
            "mesh.axes=[data]",
            "lower.in_shardings=[[data,null]]",
            "compile.topology=v5e:2x2",
        )
    assert info.value.fit["source"] == "xla" and info.value.fit["hbm_bytes_needed"] > 16 * GiB
    manifest = _json(next(tmp_path.glob("run*")), "manifest.json")
    assert manifest["stages"]["lower"]["status"] == "ran"
    assert manifest["stages"]["compile"]["status"] == "does_not_fit"
    assert len(calls) == 1 and calls[0][0] and calls[0][1].startswith("jaxaot-ahead")
    out, err = capfd.readouterr()
    for noise in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "InitGoogle", "libtpu"):
        assert noise not in out + err


def test_arguments_count_against_hbm(tmp_path: Path) -> None:
    # 16 GiB of bf16 arguments and no temporaries: XLA refuses it too (it counts arguments).
    with pytest.raises(DoesNotFit, match=r"needs 16.0 GiB of 15.75 GiB"):
        _run(
            tmp_path,
            f"program.target={HERE}:head",
            "program.args=[bf16[8589934592]]",
            "compile.topology=v5e:2x2",
        )


def test_memory_analysis_past_hbm_does_not_fit() -> None:
    # What fit_of does after a compile that XLA accepted: the same sum, the same verdict.
    cfg = validate(jaxaot.compose(["program=mlp", "compile.topology=v5e:2x2"])).compile
    memory = {
        "argument_size_in_bytes": 15 * GiB,
        "output_size_in_bytes": GiB // 2,
        "temp_size_in_bytes": GiB // 2,
        "generated_code_size_in_bytes": 0,
        "alias_size_in_bytes": GiB // 2,
    }
    record = type("Record", (), {"memory": memory})()
    topology.fit_of(record, cfg)  # 15.5 GiB: fits in 15.75
    memory["alias_size_in_bytes"] = 0
    with pytest.raises(DoesNotFit, match=r"needs 16.0 GiB of 15.75 GiB") as info:
        topology.fit_of(record, cfg)
    assert info.value.fit["headroom_bytes"] == -GiB // 4


def test_resume_at_execute_needs_a_tpu_host(tmp_path: Path) -> None:
    r = _run(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    cfg = jaxaot.compose(["program=mlp", f"resume_from={r.run_dir}", "start_at=execute"])
    with pytest.raises(
        BackendError,
        match=r"^start_at=execute: the executable was compiled for "
        r"TPU topology v5e:2x2 .* this host has no TPU",
    ):
        jaxaot.run(cfg, run_dir=tmp_path / "resumed", overrides=[])


def test_without_libtpu_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerators, "libtpu_version", lambda: None)
    with pytest.raises(BackendError, match=r"needs libtpu.*pip install 'jaxaot\[tpu\]'"):
        accelerators._topology.__wrapped__("v5e:8x8", 1, "default")


def test_does_not_fit_exit_code_and_quiet_libtpu(cli: Any, tmp_path: Path) -> None:
    proc, rd = cli(
        "program.target=tests.test_topology:big_sort",
        "program.args=[f32[4096,16384]]",
        "compile.topology=v5e:2x2",
        expect_ok=False,
    )
    assert proc.returncode == 3, proc.stderr
    assert json.loads((rd / "manifest.json").read_text())["status"] == "does_not_fit"
    assert "jaxaot: does not fit: needs" in proc.stderr
    assert "DOES NOT FIT" in proc.stdout  # the summary row; the verdict line is on stderr, once
    for noise in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "InitGoogle"):
        assert noise not in proc.stderr + proc.stdout


# -- HLO analysis ----------------------------------------------------------------------------

_HLO = """HloModule m, num_partitions=4

ENTRY %main (p: bf16[8,128]) -> bf16[32,128] {
  %p = bf16[8,128]{1,0} parameter(0)
  %ags = (bf16[8,128]{1,0}, bf16[32,128]{1,0}) all-gather-start(bf16[8,128]{1,0} %p), dimensions={0}
  %agd = bf16[32,128]{1,0} all-gather-done((bf16[8,128]{1,0}, bf16[32,128]{1,0}) %ags)
  %ar = f32[16]{0} all-reduce(f32[16]{0} %x), to_apply=%add
  ROOT %cp = bf16[32,128]{1,0} collective-permute(bf16[32,128]{1,0} %agd), source_target_pairs={{0,1}}
}
"""


def test_collectives_count_async_pairs_once() -> None:
    found = topology.collectives(_HLO)
    assert found["all-gather"] == {"count": 1, "bytes": 32 * 128 * 2}
    assert found["all-reduce"] == {"count": 1, "bytes": 16 * 4}
    assert found["collective-permute"] == {"count": 1, "bytes": 32 * 128 * 2}
    assert found["reduce-scatter"]["count"] == found["all-to-all"]["count"] == 0


# -- fit search ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("boundary", "low", "high", "multiple"),
    [
        (7, 1, 16, 1),
        (1, 1, 16, 1),
        (16, 1, 16, 1),
        (0, 1, 16, 1),
        (96, 32, 512, 32),
        (100, 1, 1000, 1),
    ],
)
def test_bisection_finds_the_boundary(boundary: int, low: int, high: int, multiple: int) -> None:
    from jaxaot.sweeps.fit_search import FitOptions, Search, bisect

    opts = FitOptions(overrides=["x={n}"], low=low, high=high, multiple=multiple)
    probed: list[int] = []

    def fits(n: int) -> bool:
        probed.append(n)
        return n <= boundary

    search = bisect(opts, fits, Search(fixed=[]))
    result = search.to_json(opts)
    expected = max((n for n in range(low, high + 1, multiple) if n <= boundary), default=None)
    assert search.largest_fit == expected
    assert search.smallest_misfit == (
        None if expected == high else (low if expected is None else expected + multiple)
    )
    assert all(n % multiple == 0 for n in probed) and len(set(probed)) == len(probed)
    steps = (high - low) // multiple + 1
    assert result["compiles"] <= 2 + steps.bit_length()
    linear = [n for n in range(low, high + 1, multiple)]
    first_misfit = next((i for i, n in enumerate(linear) if n > boundary), len(linear) - 1)
    assert result["linear_scan_compiles"] == first_misfit + 1


def test_fit_options_are_checked() -> None:
    from jaxaot.sweeps.fit_search import FitOptions

    with pytest.raises(ConfigError, match=r"hydra.sweeper.overrides: expected key=value"):
        FitOptions(overrides=["program.args.0=f32[8]"]).check()
    with pytest.raises(ConfigError, match=r"multiples of hydra.sweeper.multiple=32"):
        FitOptions(overrides=["a={n}"], low=1, high=64, multiple=32).check()


def test_fit_sweeper_bisects_per_topology(tmp_path: Path) -> None:
    """The probes run in the search's own process (hydra.sweeper.isolate=false): what a probe
    in a process of its own adds (a crash is a row) is tests/test_fit_search.py's."""
    from conftest import cli_env, run_cli

    sweep = tmp_path / "fit"
    proc = run_cli(
        [
            "-m",
            "hydra/sweeper=jaxaot_fit",
            "program.target=tests.test_topology:head",
            "program.args=[bf16[8,8]]",
            "compile.topology=v5e:2x2",
            "hydra.sweeper.overrides=['program.args.0=bf16[{n},1048576]']",
            "hydra.sweeper.low=4096",
            "hydra.sweeper.high=8192",
            "hydra.sweeper.multiple=1024",
            "hydra.sweeper.isolate=false",
            "hydra.callbacks.sweep.plots=false",  # the report's text is checked, not its plots
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    fit = json.loads((sweep / "fit.json").read_text())
    (search,) = fit["searches"]
    # 2 MiB per n: 7168 x 2 MiB = 14 GiB fits in 15.75, 8192 x 2 MiB = 16 GiB does not.
    assert (search["largest_fit"], search["smallest_misfit"]) == (7168, 8192)
    assert search["hbm_bytes_needed_at_fit"] >= 7168 * 2 * 1024**2
    # low, high, then the medians: 4096, 8192, 6144, 7168 (a scan from 4096 takes 5)
    assert search["compiles"] == 4 and search["linear_scan_compiles"] == 5
    assert "n=7168 fits, n=8192 does not" in proc.stdout
    report = (sweep / "sweep.md").read_text()
    assert "4 jobs: 3 ok, 1 do not fit, 0 failed." in report


# -- the shipped experiment and its program --------------------------------------------------


def test_decoder_8b_experiment_composes_for_256_devices() -> None:
    cfg = validate(jaxaot.compose(["experiment=decoder_8b"]))
    assert cfg.compile.topology == "v5e-256" and cfg.stop_after == "compile"
    assert resolve(cfg.compile.topology).devices == 256 == 32 * 8
    params = cfg.program.args[0]
    n = sum(math.prod(leaf["shape"]) for leaf in _leaves(params))
    assert 7e9 < n < 9e9  # 8B-class
    for topo, mesh in (("v6e-256", "[16,16]"), ("v5e:16x16", "[32,8]")):
        validate(
            jaxaot.compose(
                ["experiment=decoder_8b", f"compile.topology={topo}", f"mesh.shape={mesh}"]
            )
        )


def _leaves(tree: Any) -> list[dict[str, Any]]:
    if isinstance(tree, dict) and "shape" in tree:
        return [tree]
    return [
        leaf for v in (tree.values() if isinstance(tree, dict) else tree) for leaf in _leaves(v)
    ]


def test_remat_decoder_step_equals_the_transformer_step() -> None:
    import jax
    import numpy as np
    from jaxaot.examples import decoder, transformer

    rng = np.random.default_rng(0)
    L, D, H, K, F, V = 2, 16, 2, 8, 32, 32
    shapes = {
        "embed": (V, D),
        "ln_f": (D,),
        "unembed": (D, V),
        "layers": {
            "ln1": (L, D),
            "ln2": (L, D),
            "wq": (L, D, H, K),
            "wk": (L, D, H, K),
            "wv": (L, D, H, K),
            "wo": (L, H, K, D),
            "w1": (L, D, F),
            "w2": (L, F, D),
        },
    }
    params = jax.tree.map(
        lambda s: rng.normal(0, 0.1, s).astype(np.float32),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )
    tokens = rng.integers(0, V, (2, 8)).astype(np.int32)
    targets = rng.integers(0, V, (2, 8)).astype(np.int32)
    # What the two steps compute is compared, not their compiles. (conftest imported here:
    # jaxaot imports this module as a program, where tests' conftest is no top-level module.)
    from conftest import FAST_CPU_CODEGEN

    args = (params, tokens, targets, 0.1)
    mine = jax.jit(decoder.train_step).lower(*args).compile(FAST_CPU_CODEGEN)(*args)
    ref = jax.jit(transformer.train_step).lower(*args).compile(FAST_CPU_CODEGEN)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_resume_a_topology_lowering_for_another_topology(tmp_path: Path) -> None:
    first = _run(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    cfg = jaxaot.compose(
        [
            "program=mlp",
            f"resume_from={first.run_dir}",
            "start_at=compile",
            "compile.topology=v6e:2x2",
        ]
    )
    r = jaxaot.run(cfg, run_dir=tmp_path / "v6e", overrides=["compile.topology=v6e:2x2"])
    assert [r.manifest["stages"][s]["status"] for s in ("lower", "compile")] == ["resumed", "ran"]
    assert r.manifest["backend"]["topology"] == "v6e:2x2"
    assert r.manifest["fit"]["hbm_bytes_available"] == int(31.25 * GiB)


@pytest.mark.parametrize(
    ("text", "need", "have", "over"),
    [
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (34.53G) exceeds available HBM (15.75G).",
            34.53 * GiB,
            15.75 * GiB,
            None,
        ),
        (
            "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out "
            "of memory in memory space hbm. Used 16.44G of 15.75G hbm. Exceeded hbm capacity by "
            "709.08M.",
            16.44 * GiB,
            15.75 * GiB,
            709.08 * 1024**2,
        ),
    ],
)
def test_both_of_xlas_hbm_messages_are_verdicts(
    text: str, need: float, have: float, over: float | None
) -> None:
    """Needed is the larger of XLA's rounded 'used' figure and its limit plus the amount it says
    it was exceeded by, and always more than available."""
    verdict = topology.rejected_for_hbm(RuntimeError(text), resolve("v5e-256"))
    assert verdict is not None
    needed = max(int(need), int(have) + (int(over) if over is not None else 0))
    assert verdict.fit["hbm_bytes_needed"] == needed > verdict.fit["hbm_bytes_available"]
    assert verdict.fit["hbm_bytes_available"] == int(have)
    if over is not None:  # 15.75G + 709.08M is more than the rounded 16.44G
        assert needed == int(have) + int(over) > int(need)
    assert verdict.fit["fits"] is False
    assert (
        topology.rejected_for_hbm(
            RuntimeError("RESOURCE_EXHAUSTED: host memory"), resolve("v5e-256")
        )
        is None
    )


def test_a_mesh_that_splits_physical_axes(tmp_path: Path) -> None:
    # 16 x 4 matches no axis of v6e's 8 x 8 torus: jax.make_mesh refuses, split axes do not.
    r = _run(
        tmp_path,
        f"program.target={HERE}:matmul",
        "program.args=[f32[64,128],f32[128,32]]",
        "mesh.shape=[16,4]",
        "mesh.axes=[data,model]",
        "compile.topology=v6e:8x8",
        "lower.in_shardings=[[data,model],[model,null]]",
    )
    assert r.ok and r.manifest["stages"]["compile"]["metrics"]["devices"] == 64


def test_a_store_hit_gives_the_verdict_a_fresh_compile_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accelerator table is not in the store key: a hit recomputes the verdict and the
    estimate from the stored analyses with today's table, equal to a fresh compile's."""
    import dataclasses

    _run(tmp_path, "program=mlp", "compile.topology=v5e:2x2")
    v5e = accelerators.GENERATIONS["v5e"]
    monkeypatch.setitem(
        accelerators.GENERATIONS,
        "v5e",
        dataclasses.replace(v5e, hbm_usable_bytes=v5e.hbm_usable_bytes // 2),
    )
    hit = _run(tmp_path, "program=mlp", "compile.topology=v5e:2x2", name="hit")
    fresh = _run(
        tmp_path, "program=mlp", "compile.topology=v5e:2x2", "store.enabled=false", name="fresh"
    )
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    metrics = [r.manifest["stages"]["compile"]["metrics"] for r in (hit, fresh)]
    for k in ("fits", "hbm_bytes_needed", "hbm_bytes_available", "headroom_bytes", "est_step_s"):
        assert metrics[0][k] == metrics[1][k], k
    assert metrics[0]["hbm_bytes_available"] == v5e.hbm_usable_bytes // 2
