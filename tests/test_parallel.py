"""Per-replica programs (``stage_out.axis_env``) and device counts: the xla_computation examples."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import jaxaot
import numpy as np
import pytest
from jaxaot.config.mesh import devices_to_start, mesh_spec
from jaxaot.errors import ConfigError
from jaxaot.stages.inputs import spec_inputs

_HLO_GROUPS = re.compile(r"all-reduce\(.*?replica_groups=(\{\{[\d,{}]*\}\})")
_SHLO_GROUPS = re.compile(r"replica_groups = dense<(.*?)>")


def _hlo(run_dir: Path) -> str:
    return (run_dir / "lower" / "module.hlo.txt").read_text()


def _typed(*overrides: str) -> jaxaot.JaxaotConfig:
    return jaxaot.validate(jaxaot.compose(list(overrides)))


def _devices(cfg: jaxaot.JaxaotConfig) -> int | None:
    return devices_to_start(cfg.compile, mesh_spec(cfg.mesh, cfg.stage_out), cfg.stop_after)


# --- replica groups, exactly as jax.xla_computation's documentation gives them -------------


def test_psum_minus_groups_equal_xla_computation(compose_run: Any) -> None:
    result = compose_run(
        "program=collectives_psum", "stage_out.axis_env=[[i,4]]", "stop_after=lower"
    )
    hlo = _hlo(result.run_dir)
    assert _HLO_GROUPS.findall(hlo) == ["{{0,1,2,3}}"]
    # The replica body is the per-replica program: s32[] in, x - psum(x) out.
    assert re.search(r"s32\[\] all-reduce\(", hlo)
    assert re.search(r"s32\[\] subtract\(", hlo)
    assert result["lower"].exported.nr_devices == 4


def test_row_col_all_groups_equal_xla_computation(compose_run: Any) -> None:
    result = compose_run(
        "program=collectives", "stage_out.axis_env=[[i,4],[j,2]]", "stop_after=lower"
    )
    assert _HLO_GROUPS.findall(_hlo(result.run_dir)) == [
        "{{0,2,4,6},{1,3,5,7}}",  # psum over i
        "{{0,1},{2,3},{4,5},{6,7}}",  # psum over j
        "{{0,1,2,3,4,5,6,7}}",  # psum over (i, j)
    ]
    stablehlo = (result.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    assert _SHLO_GROUPS.findall(stablehlo) == [
        "[[0, 2, 4, 6], [1, 3, 5, 7]]",
        "[[0, 1], [2, 3], [4, 5], [6, 7]]",
        "[[0, 1, 2, 3, 4, 5, 6, 7]]",
    ]
    signature = result["stage_out"].signature
    assert signature["axis_env"]["replicas"] == 8
    assert [i["type"] for i in signature["inputs"]] == ["f32[8]"]  # one f32[] per replica


def test_512_replicas_lower_without_devices(compose_run: Any) -> None:
    result = compose_run(
        "program=collectives", "stage_out.axis_env=[[i,64],[j,8]]", "stop_after=lower"
    )
    assert result["lower"].exported.nr_devices == 512
    assert result.manifest["backend"] == {}  # no backend was asked for
    assert jax.config.jax_num_cpu_devices != 512
    assert len(jax.devices()) < 512
    over_i, over_j, over_all = _HLO_GROUPS.findall(_hlo(result.run_dir))
    assert over_i.startswith("{{" + ",".join(str(8 * k) for k in range(64)) + "},{1,9,")
    assert over_i.count("{") == 1 + 8
    assert over_j.startswith("{{0,1,2,3,4,5,6,7},{8,")
    assert over_j.count("{") == 1 + 64
    assert over_all == "{{" + ",".join(map(str, range(512))) + "}}"


# --- execution on virtual devices -----------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "env", "devices"),
    [
        ("row_col_all", "[[i,4],[j,2]]", 8),
        ("psum_minus", "[[i,4]]", 4),
        ("ring_shift", "[[i,4],[j,2]]", 8),
        ("mean_max", "[[i,2],[j,4]]", 8),
    ],
)
def test_per_replica_execution_matches_vmap_reference(
    compose_run: Any, target: str, env: str, devices: int
) -> None:
    result = compose_run(
        "program=collectives",
        f"program.target=jaxaot.examples.collectives:{target}",
        f"stage_out.axis_env={env}",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    assert result.manifest["backend"]["device_count"] == devices  # points may differ in count
    assert result["execute"].check["ok"]
    shardings = result.manifest["stages"]["compile"]["metrics"]
    assert shardings["devices"] == devices
    assert shardings["sharded_inputs"] == 1


def test_row_col_all_outputs_are_per_replica_sums(compose_run: Any) -> None:
    result = compose_run(
        "program=collectives",
        "stage_out.axis_env=[[i,4],[j,2]]",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    (x,), _ = spec_inputs(result["stage_out"].bound, 0)
    grid = x.reshape(4, 2)  # replica r = (i, j) row-major
    rows, cols, both = (np.asarray(o) for o in result["execute"].outputs)
    np.testing.assert_allclose(rows, np.broadcast_to(grid.sum(0), (4, 2)).ravel(), rtol=1e-6)
    np.testing.assert_allclose(cols, np.repeat(grid.sum(1), 2), rtol=1e-6)
    np.testing.assert_allclose(both, np.full(8, grid.sum()), rtol=1e-5)
    assert len(set(np.round(x, 6))) == 8  # every replica got its own input


def test_cli_runs_the_issue_example(cli: Any) -> None:
    proc, run_dir = cli(
        "program=collectives",
        "stage_out.axis_env=[[i,4],[j,2]]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    assert "8 replicas" in proc.stdout
    assert "check ok" in proc.stdout
    assert (run_dir / "compile" / "shardings.json").exists()


# --- errors -----------------------------------------------------------------------------------


def test_collective_over_an_unbound_axis_names_it(compose_run: Any) -> None:
    with pytest.raises(ConfigError, match=r"axis 'j', but axis_env binds only \['i'\]"):
        compose_run("program=collectives", "stage_out.axis_env=[[i,4]]", "stop_after=lower")


def test_collective_without_axis_env_says_how_to_bind(compose_run: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"over axis 'i', but no axis names are bound.*axis_env=\[\[i,4\]\]"
    ):
        # the shipped program brings its axis_env: take it away
        compose_run("program=collectives_psum", "program.axis_env=null", "stop_after=stage_out")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stage_out.axis_env=[[i,4],[i,2]]"], r"stage_out.axis_env: expected distinct axis names"),
        (["stage_out.axis_env=[[i,0]]"], r"stage_out.axis_env\[0\]: expected a size >= 1"),
        (["stage_out.axis_env=[i,4]"], r"stage_out.axis_env\[0\]: expected \[axis_name, size\]"),
        (["stage_out.axis_env=[]"], r"stage_out.axis_env: expected \[\[axis_name, size\], ...\]"),
        (
            ["stage_out.axis_env=[[i,4]]", "mesh=data4_model2"],
            r"axis_env and mesh.shape=\[4, 2\] are both set",
        ),
        (
            ["stage_out.axis_env=[[i,4]]", "+program.kwargs.y=f32[]"],
            r"program.kwargs.y: .* positionally",
        ),
        (["stage_out.axis_env=[[i,4],[j,2]]", "compile.num_devices=4"], r"needs 8 devices"),
    ],
)
def test_axis_env_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _typed("program=collectives", *overrides)


# --- how many devices a run starts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["stop_after=lower"], None),  # lowering only: leave JAX alone
        (["stop_after=lower", "stage_out.axis_env=[[i,64],[j,8]]"], None),
        ([], 8),  # compiles: what the axis_env needs
        (["stage_out.axis_env=[[i,4]]"], 4),
        (["compile.num_devices=16"], 16),
    ],
)
def test_devices_to_start(overrides: list[str], expected: int | None) -> None:
    env = [] if any("axis_env" in o for o in overrides) else ["stage_out.axis_env=[[i,4],[j,2]]"]
    assert _devices(_typed("program=collectives", *env, *overrides)) == expected
    if not overrides:
        assert _devices(_typed("program=mlp")) is None  # no mesh: JAX's own count


def test_resumed_per_replica_run_checks_against_its_reference(compose_run: Any) -> None:
    env = "stage_out.axis_env=[[i,4],[j,2]]"
    first = compose_run("program=collectives", env, "stop_after=compile")
    second = compose_run(
        "program=collectives",
        env,
        f"resume_from={first.run_dir}",
        "start_at=execute",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    assert second.manifest["stages"]["stage_out"]["status"] == "resumed"
    assert second["stage_out"].bound.args[0].shape == (8,)  # per-replica f32[], stacked
    assert second["execute"].check["ok"]


# --- device limits, checked before any device starts ----------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # A million virtual CPU devices: unchecked, they are started until memory runs out.
        (
            ["program=collectives", "stage_out.axis_env=[[i,1000],[j,1000]]"],
            r"^stage_out\.axis_env=\[\[i,1000\],\[j,1000\]\] needs 1000000 virtual CPU devices, but "
            r"XLA:CPU runs at most 2048 in one process .*; stop_after=lower needs no devices",
        ),
        # Unchecked, XLA says "Multiprocess computations aren't implemented".
        (
            ["program=mlp", "mesh.shape=[64,64]"],
            r"^mesh\.shape=\[64, 64\] needs 4096 virtual CPU devices, but XLA:CPU runs at most 2048",
        ),
        (
            ["program=mlp", "compile.num_devices=2049"],
            r"^compile\.num_devices=2049 needs 2049 .* at most 2048",
        ),
        # Under XLA's limit but over the configurable cap: the advice says how to raise it.
        (
            ["program=mlp", "mesh.shape=[32,32]", "stop_after=compile"],
            r"^mesh\.shape=\[32, 32\] needs 1024 virtual CPU devices, more than "
            r"compile\.max_devices=512; expected fewer devices, or compile\.max_devices=1024",
        ),
        (
            ["program=collectives", "stage_out.axis_env=[[i,8]]", "compile.max_devices=4"],
            r"^stage_out\.axis_env=\[\[i,8\]\] needs 8 .* more than compile\.max_devices=4",
        ),
        (
            ["program=mlp", "compile.max_devices=0"],
            r"^compile\.max_devices: expected >= 1, found 0",
        ),
    ],
)
def test_device_limits_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _typed(*overrides)


def test_device_limits_bind_only_runs_that_start_devices() -> None:
    # Lowering needs no devices, whatever the mesh; another backend starts no virtual ones.
    assert (
        _devices(
            _typed(
                "program=collectives", "stage_out.axis_env=[[i,1000],[j,1000]]", "stop_after=lower"
            )
        )
        is None
    )
    assert _devices(_typed("program=mlp", "mesh.shape=[64,64]", "stop_after=lower")) is None
    assert (
        _devices(_typed("program=mlp", "compile.num_devices=1024", "compile.max_devices=2048"))
        == 1024
    )
    tpu = _typed("program=mlp", "mesh.shape=[64,64]", "compile.backend=tpu", "stop_after=compile")
    assert _devices(tpu) == 4096
