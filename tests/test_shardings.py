"""Meshes and shardings from config: spec matching, GSPMD runs on 8 virtual devices, platforms."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jaxaot
import pytest
import yaml
from jaxaot.config.sharding import Leaf, Spec, match_specs
from jaxaot.engine.summary import render
from jaxaot.errors import BackendError, ConfigError
from jaxaot.stages.compile import execution_devices

CONF = Path(__file__).resolve().parents[1] / "conf"
MESH = {"data": 4, "model": 2}
_KEY_LINE = re.compile(r"^\s*(?:-\s+)*[A-Za-z_][\w-]*:(?:\s|$)")


def _typed(*overrides: str) -> jaxaot.JaxaotConfig:
    return jaxaot.validate(jaxaot.compose(list(overrides)))


def _leaf(*shape: int) -> Leaf:
    return Leaf(shape, f"f32{list(shape)}")


# Two arguments: a params dict and a [batch, features] array.
ARGS = ({"w": _leaf(16, 8), "b": _leaf(6)}, _leaf(32, 16))
NAMES = ["program.args[0]", "program.args[1]"]


def _match(value: Any, tree: tuple[Any, ...] = ARGS, names: list[str] = NAMES) -> Any:
    return match_specs(value, tree, key="lower.in_shardings", names=names, mesh=MESH)


# --- spec matching (pure Python, before JAX) ---------------------------------------------------


def test_one_spec_per_argument_and_partial_trees() -> None:
    params, x = _match([{"w": [None, "model"]}, ["data", None]])
    assert params == {"w": Spec((None, "model")), "b": Spec()}  # b left out: replicated
    assert x == Spec(("data",))  # trailing None dropped


def test_a_subtree_may_take_one_spec() -> None:
    params, x = _match([["model"], None])
    assert params == {"w": Spec(("model",)), "b": Spec(("model",))}
    assert x == Spec()


def test_a_single_spec_applies_to_every_argument() -> None:
    assert _match(["model"]) == ({"w": Spec(("model",)), "b": Spec(("model",))}, Spec(("model",)))
    assert _match(None) == ({"w": Spec(), "b": Spec()}, Spec())


def test_several_mesh_axes_on_one_dimension() -> None:
    (x,) = _match([["data", "model"], None], (_leaf(32, 16),), ["program.args[0]"])
    assert x == Spec((("data", "model"),))


def test_two_valid_readings_that_differ_are_ambiguous() -> None:
    tree = (_leaf(32, 16), _leaf(8, 8))
    with pytest.raises(
        ConfigError,
        match=r"ambiguous for 2 entries .* write \[\[\[data, model\], null\], \[\[data, model\], null\]\]",
    ):
        _match([["data", "model"], None], tree)
    # Spelled per argument, it is not.
    assert _match([["data", "model"], [None]], tree) == (Spec(("data", "model")), Spec())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            [None, ["data", None, None]],
            r"program.args\[1\] \(f32\[32, 16\]\): spec \[data, null, null\] has 3 entries but the array has rank 2",
        ),
        (
            [{"w": [None, "pipe"]}, None],
            r"program.args\[0\].w .*names mesh axis 'pipe'; expected one of \['data', 'model'\]",
        ),
        (
            [{"b": ["data"]}, None],
            r"program.args\[0\].b \(f32\[6\]\): dimension 0 has size 6, which mesh axes \['data'\] \(together 4 devices\) do not divide",
        ),
        (
            [{"v": None}, None],
            r"program.args\[0\] has no key\(s\) \['v'\]; expected a subset of \['b', 'w'\]",
        ),
        (
            [None, None, {"w": None}],
            r"expected one entry for each of 2 \(program.args\[0\], program.args\[1\]\)",
        ),
        (
            [None, None, None],
            r"program.args\[0\].w \(f32\[16, 8\]\): spec \[null, null, null\] has 3 entries.*\(read as one spec for every array: 3 entries for 2",
        ),
        ([None, ["data", "data"]], r"uses mesh axis 'data' twice"),
        ([None, [1]], r"expected a spec"),
    ],
)
def test_spec_errors_name_the_argument_path(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _match(value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lower.in_shardings=[data]"], r"lower.in_shardings needs a mesh"),
        (
            ["mesh=data4_model2", "lower.out_shardings=[[data, modle]]"],
            r"lower.out_shardings\[0\]\[1\]: mesh axis 'modle'",
        ),
        (
            [
                "mesh=data4_model2",
                "lower.in_shardings=[null, [null, [data, model]]]",
                "program.args.1.shape=[64,12]",
            ],
            r"program.args\[1\] \(f32\[64,12\]\): dimension 1 has size 12",
        ),
        (
            ["mesh=data4_model2", "compile.num_devices=4"],
            r"compile.num_devices=4 but mesh.shape=\[4, 2\] needs 8 devices; expected compile.num_devices=8 .* or stop_after=lower",
        ),
        (["mesh=pod16x16"], r"mesh.abstract=true .* expected stop_after=lower"),
        (["mesh.shape=[4,2]", "mesh.axes=[a]"], r"mesh.axes: expected 2 axis name\(s\)"),
        (["mesh.shape=[4,0]"], r"mesh.shape: expected a non-empty list of sizes >= 1"),
        (["mesh.axes=[a]"], r"mesh.axes=\['a'\] but mesh.shape is null"),
        (
            ["mesh.shape=[4,2]", "mesh.axis_types=[auto,bogus]"],
            r"mesh.axis_types: expected null or 2 of auto",
        ),
        (
            ["stage_out.axis_env=[[i,2]]", "+program.kwargs.z=f32[4]"],
            r"program.kwargs.z: stage_out.axis_env programs take traced arguments positionally",
        ),
    ],
)
def test_mesh_and_sharding_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _typed("program=mlp", *overrides)


def test_mesh_shape_alone_gets_default_axis_names() -> None:
    typed = _typed("program=mlp", "mesh.shape=[16,16]", "mesh.abstract=true", "stop_after=lower")
    from jaxaot.config.mesh import mesh_spec

    mesh = mesh_spec(typed.mesh, typed.stage_out)
    assert mesh is not None and mesh.axes == ("data", "model") and mesh.size == 256


# --- shipped mesh presets and the data + model parallel experiment ---------------------------


@pytest.mark.parametrize(
    "path",
    sorted((CONF / "mesh").glob("*.yaml")) + sorted((CONF / "experiment").glob("*.yaml")),
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)
def test_mesh_and_experiment_configs_comment_every_key(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    if path.parent.name == "mesh":
        assert raw["defaults"] == ["base_mesh", "_self_"]
    uncommented = [
        ln for ln in path.read_text().splitlines() if _KEY_LINE.match(ln) and " # " not in ln
    ]
    assert uncommented == []


@pytest.mark.parametrize("shape", ["[8,1]", "[4,2]", "[2,4]", "[1,8]"])
def test_experiment_fits_every_sweep_mesh(shape: str) -> None:
    typed = _typed("experiment=transformer_dp_mp", f"mesh.shape={shape}")
    assert typed.mesh.axes == ["data", "model"]
    assert typed.execute.check == "reference"


def test_sweep_over_mesh_shapes(tmp_path: Path) -> None:
    from conftest import run_cli

    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "experiment=transformer_dp_mp",
            "mesh.shape=[8,1],[2,4]",
            "stop_after=lower",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    meshes = [
        json.loads((sweep / str(n) / "lower" / "lowered.json").read_text())["mesh"]["shape"]
        for n in range(2)
    ]
    assert meshes == [[8, 1], [2, 4]]


def test_data_model_parallel_training_step_matches_unsharded(compose_run: Any) -> None:
    result = compose_run("experiment=transformer_dp_mp", "execute.warmup=0", "execute.repeats=1")
    assert result["execute"].check["ok"]
    shardings = json.loads((result.run_dir / "compile" / "shardings.json").read_text())
    inputs = {r["path"]: r for r in shardings["inputs"]}
    assert inputs["args[0]['layers']['wq']"]["sharding"] == "P(None, None, 'model')"
    assert inputs["args[0]['layers']['wq']"]["shard_shape"] == [2, 128, 4, 16]
    assert inputs["args[1]"]["sharding"] == "P('data',)"
    assert inputs["args[0]['ln_f']"]["replicated"]
    outputs = {r["path"]: r for r in shardings["outputs"]}
    assert outputs["[0]['layers']['w1']"]["sharding"] == "P(None, None, 'model')"
    metrics = result.manifest["stages"]["compile"]["metrics"]
    assert (metrics["mesh"], metrics["devices"], metrics["sharded_inputs"]) == (
        "data=4,model=2",
        8,
        10,
    )
    assert "mesh data=4,model=2: sharded in 10/14, out 8/12" in render(result.manifest)
    assert "compile/shardings.json" in result.manifest["stages"]["compile"]["artifacts"]


def test_mlp_sharded_in_and_out_matches_reference(compose_run: Any) -> None:
    result = compose_run(
        "program=mlp",
        "mesh=data2_model4",
        "lower.in_shardings=[[{w: [null, model]}, {w: [model, null]}, {w: [null, model]}], [data, null]]",
        "lower.out_shardings=[data, model]",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    assert result["execute"].check["ok"]
    compiled = result["compile"].compiled
    out = compiled.output_shardings
    assert out.spec == jax.sharding.PartitionSpec("data", "model")
    assert dict(out.mesh.shape) == {"data": 2, "model": 4}


# --- platforms: cross-lowering, multi-platform exports, refusals --------------------------------


@pytest.mark.requires_jax("0.7.0")  # Shardy's text: jax's default partitioner from 0.7.0
def test_tpu_cross_lowering_gives_a_loadable_export(compose_run: Any) -> None:
    result = compose_run(
        "program=mlp",
        "mesh=data4_model2",
        "lower.in_shardings=[null, [data, null]]",
        "lower.platforms=[tpu]",
        "stop_after=lower",
    )
    exp = jax.export.deserialize(
        bytearray((result.run_dir / "lower" / "exported.bin").read_bytes())
    )
    assert exp.platforms == ("tpu",)
    assert exp.nr_devices == 8
    assert [a.shape for a in exp.in_avals][-1] == (64, 256)
    assert [str(a.dtype) for a in exp.in_avals] == ["float32"] * 7
    assert [a.shape for a in exp.out_avals] == [(64, 128)]
    assert '<@mesh, [{"data"}, {}]>' in exp.mlir_module()


def test_abstract_16x16_mesh_lowers_for_tpu_without_devices(compose_run: Any) -> None:
    result = compose_run(
        "program=transformer",
        "mesh.shape=[16,16]",
        "mesh.abstract=true",
        "lower.platforms=[tpu]",
        "stop_after=lower",
    )
    meta = json.loads((result.run_dir / "lower" / "lowered.json").read_text())
    assert meta["nr_devices"] == 256 and meta["platforms"] == ["tpu"]
    assert meta["mesh"]["shape"] == [16, 16]
    assert len(jax.devices()) < 256


def test_multi_platform_export_compiles_for_cpu_and_matches(compose_run: Any) -> None:
    result = compose_run(
        "program=mlp",
        "mesh=data4_model2",
        "lower.in_shardings=[null, [data, null]]",
        "lower.platforms=[cuda,tpu,cpu]",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    exp = jax.export.deserialize(
        bytearray((result.run_dir / "lower" / "exported.bin").read_bytes())
    )
    assert exp.platforms == ("cuda", "tpu", "cpu")
    assert result["execute"].check["ok"]
    shardings = json.loads((result.run_dir / "compile" / "shardings.json").read_text())
    assert shardings["inputs"][-1]["sharding"] == "P('data',)"


def test_compile_refuses_a_platform_the_lowering_lacks(compose_run: Any) -> None:
    with pytest.raises(
        BackendError,
        match=r"needs a lowering for 'cpu', but lower.platforms was \['tpu'\].*stop_after=lower.*start_at=compile",
    ):
        compose_run("program=mlp", "lower.platforms=[tpu]", "stop_after=compile")


def test_compile_refuses_a_backend_this_machine_lacks(compose_run: Any) -> None:
    with pytest.raises(
        BackendError,
        match=r"no tpu backend on this machine.*lower.platforms=\[tpu\] stop_after=lower",
    ):
        compose_run("program=mlp", "compile.backend=tpu", "stop_after=compile")


def test_compile_refuses_a_mesh_larger_than_the_devices(compose_run: Any) -> None:
    result = compose_run("program=mlp", "mesh=data4_model2", "stop_after=lower")
    from jaxaot.stages import jaxenv

    jaxenv.configure(backend="cpu", num_devices=2, x64=False)
    with pytest.raises(
        BackendError,
        match=r"lowered for 8 devices \(its mesh data=4,model=2\), but compile.backend='cpu' has 2; expected compile.num_devices=8",
    ):
        execution_devices(result["lower"], "cpu")


def test_a_mesh_lowering_resumes_at_compile(compose_run: Any) -> None:
    config = ("program=mlp", "mesh=data4_model2", "lower.in_shardings=[null, [data, null]]")
    first = compose_run(*config, "stop_after=lower")
    second = compose_run(
        *config,
        f"resume_from={first.run_dir}",
        "start_at=compile",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    assert second.manifest["stages"]["lower"]["status"] == "resumed"
    assert second.manifest["stages"]["compile"]["metrics"]["devices"] == 8
    assert second["execute"].check["ok"]
