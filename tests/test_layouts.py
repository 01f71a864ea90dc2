"""Layouts from config (lower.in_layouts / out_layouts): checks, the compiled formats against
plain JAX's (one device and a mesh), execute relaying inputs to them, outputs bit for bit,
store keys, and the export path asking for them again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jaxaot
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jaxaot.errors import ConfigError
from jaxaot.examples.mlp import mlp
from jaxaot.stages.execute import load_outputs
from jaxaot.stages.inputs import spec_inputs

MLP = ("program=mlp", "execute.warmup=0", "execute.repeats=1")
COLUMN_MAJOR = ("lower.in_layouts={x: [1, 0]}", "lower.out_layouts=[1, 0]")


def _json(run_dir: Path, name: str) -> Any:
    return json.loads((run_dir / name).read_text())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["lower.in_layouts=column"], r"^lower.in_layouts: expected auto, default, null or a list"),
        (
            ["lower.out_layouts={output: [0, 0]}"],
            r"^lower.out_layouts\['output'\]: layout \[0, 0\] ",
        ),
        (
            [
                "mesh=data2_model4",
                "mesh.abstract=true",
                "stop_after=lower",
                "lower.in_layouts={x: [1, 0]}",
            ],
            r"^lower.in_layouts\['x'\]: layout \[1, 0\] needs the devices .* which "
            r"mesh.abstract=true lowers without",
        ),
        (
            ["compile.topology=v5e:2x2", "lower.out_layouts=[1, 0]"],
            r"^lower.out_layouts: layout \[1, 0\] .* which compile.topology=v5e:2x2 lowers",
        ),
    ],
)
def test_bad_layouts_are_one_line_errors_before_jax(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        jaxaot.validate(jaxaot.compose(["program=mlp", *overrides]))
    assert "\n" not in str(info.value)


def test_a_layout_of_another_rank_names_the_leaf(compose_run: Any) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^lower.in_layouts: layout \[1, 0\] has 2 dimensions "
        r"but params/0/b has rank 1",
    ):
        compose_run(*MLP, "lower.in_layouts=[1, 0]")


def _inputs(result: Any) -> list[Any]:
    return list(spec_inputs(result["stage_out"].bound, 0)[0])


def _plain(args: list[Any], in_sh: Any = None, out_sh: Any = None) -> tuple[Any, np.ndarray]:
    opts = {} if in_sh is None else {"in_shardings": in_sh, "out_shardings": out_sh}
    abstract = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), a) for a in args]
    compiled = jax.jit(mlp, **opts).lower(*abstract).compile()
    put = [jax.device_put(a, f) for a, f in zip(args, compiled.input_formats[0], strict=True)]
    return compiled, np.asarray(compiled(*put))


def _layouts(rows: list[dict[str, Any]]) -> list[list[int]]:
    return [r["layout"]["major_to_minor"] for r in rows]


@pytest.mark.requires_jax("0.7.0")  # the test builds plain JAX's layouts with jax 0.7's API
def test_column_major_on_one_device_is_plain_jaxs_and_relayed(compose_run: Any) -> None:
    from jax.sharding import SingleDeviceSharding

    result = compose_run(*MLP, *COLUMN_MAJOR)
    rd = result.run_dir
    dev = SingleDeviceSharding(jax.devices("cpu")[0])
    col = Format(Layout((1, 0)), dev)
    args = _inputs(result)
    plain, want = _plain(args, (None, col), col)
    exe = result["compile"].compiled
    assert exe.input_formats == plain.input_formats and exe.output_formats == plain.output_formats
    shardings = _json(rd, "compile/shardings.json")
    assert _layouts(shardings["inputs"])[-1] == [1, 0]  # x
    assert _layouts(shardings["outputs"]) == [[1, 0]]
    assert _layouts(shardings["inputs"])[:-1] == [
        list(f.layout.major_to_minor) for f in jax.tree.leaves(plain.input_formats[0][0])
    ]
    got = load_outputs(rd / "execute")[""]
    assert got.dtype == want.dtype and np.array_equal(got, want)
    # The same values as the default layouts give: a layout moves no number.
    assert np.array_equal(want, _plain(args)[1])


def test_execute_puts_an_input_in_its_compiled_layout() -> None:
    from jax.sharding import SingleDeviceSharding
    from jaxaot.compat import jax as compat_jax
    from jaxaot.stages.execute import _put

    layout = compat_jax.layout_class()  # jax 0.6.x: DeviceLocalLayout
    fmt = Format(layout((1, 0)), SingleDeviceSharding(jax.devices("cpu")[0]))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for value in (x, jax.device_put(x)):
        put = _put(value, fmt)
        assert compat_jax.format_layout(put.format).major_to_minor == (1, 0)
        assert np.array_equal(np.asarray(put), x)
    default = jax.device_put(x)
    own = compat_jax.format_layout(default.format)
    assert _put(default, Format(own, default.sharding)) is default
    laid = _put(x, fmt)
    assert _put(laid, fmt) is laid  # already there: not moved again


def test_a_layout_changes_the_keys_and_a_store_hit_gives_the_same_outputs(
    compose_run: Any,
) -> None:
    plain_run = compose_run(*MLP)
    laid = compose_run(*MLP, *COLUMN_MAJOR)
    hit = compose_run(*MLP, *COLUMN_MAJOR)
    off = compose_run(*MLP, *COLUMN_MAJOR, "store.enabled=false")
    shas = [_json(r.run_dir, "lower/lowered.json")["module_sha256"] for r in (plain_run, laid, hit)]
    assert shas[0] != shas[1] == shas[2]
    keys = [r.manifest["stages"]["compile"]["key"] for r in (plain_run, laid, hit)]
    assert keys[0] != keys[1] == keys[2]
    assert hit.manifest["stages"]["compile"]["status"] == "cached"
    assert hit["compile"].compiled.input_formats == laid["compile"].compiled.input_formats
    want = load_outputs(laid.run_dir / "execute")[""]
    for r in (hit, off, plain_run):
        got = load_outputs(r.run_dir / "execute")[""]
        assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.requires_jax("0.7.0")  # Layout.AUTO and Format.layout
def test_auto_on_a_mesh_is_plain_jaxs(compose_run: Any) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    result = compose_run(
        *MLP,
        "mesh=data2_model4",
        "lower.in_shardings=[null, [data]]",
        "lower.in_layouts=auto",
        "lower.out_layouts=auto",
    )
    auto = (jax.sharding.AxisType.Auto,) * 2  # the run's mesh.axis_types (jax's default: explicit)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto, devices=jax.devices("cpu")[:8])
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = [{"w": Format(Layout.AUTO, rep), "b": Format(Layout.AUTO, rep)}] * 3
    args = _inputs(result)
    plain, want = _plain(args, (params, Format(Layout.AUTO, rows)), Format(Layout.AUTO))
    exe = result["compile"].compiled
    assert exe.input_formats == plain.input_formats and exe.output_formats == plain.output_formats
    got = load_outputs(result.run_dir / "execute")[""]
    assert np.array_equal(got, want)
    record = _json(result.run_dir, "lower/lowered.json")["placement"]
    assert {r["layout"] for r in record["inputs"] + record["outputs"]} == {"auto"}
    assert len(record["inputs"]) == 7 and len(record["outputs"]) == 1


def test_the_export_path_asks_for_the_recorded_layouts_again(compose_run: Any) -> None:
    """jax.jit(exported.call) keeps no layouts (jax 0.10.2); export_placed puts them back."""
    from jax.sharding import SingleDeviceSharding
    from jaxaot.stages.jax_placement import export_placed

    result = compose_run(*MLP, *COLUMN_MAJOR)
    rd = result.run_dir
    exp = jax.export.deserialize(bytearray((rd / "lower" / "exported.bin").read_bytes()))
    one = SingleDeviceSharding(jax.devices("cpu")[0])
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, exp.in_avals)

    def compiled(ins_flat: list[Any], outs_flat: list[Any]) -> Any:
        ins = jax.tree_util.tree_unflatten(exp.in_tree, ins_flat)[0]
        outs = jax.tree_util.tree_unflatten(exp.out_tree, outs_flat)
        return jax.jit(exp.call, in_shardings=ins, out_shardings=outs).lower(*args).compile()

    flat_in, flat_out = [one] * len(exp.in_avals), [one] * len(exp.out_avals)
    live = result["compile"].compiled
    assert compiled(flat_in, flat_out).input_formats != live.input_formats  # lost
    record = _json(rd, "lower/lowered.json")["placement"]
    again = compiled(*export_placed(record, flat_in, flat_out))
    assert again.input_formats == live.input_formats
    assert again.output_formats == live.output_formats
    assert not kwargs
