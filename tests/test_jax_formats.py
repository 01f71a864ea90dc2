"""JAX's own layout and memory-kind tests (jax tests/layout_test.py, memories_test.py) said as
configs: ``lower.in_layouts``/``out_layouts`` and ``lower.in_memory_kinds``/``out_memory_kinds``
reach JAX exactly as ``Format(Layout...)`` and ``sharding.with_memory_kind`` do.

Each case runs the config and plain ``jax.jit`` with the same ``Format``/memory kinds on the
same concrete mesh, in the same test: the compiled input and output formats (layouts,
shardings, memory kinds) are equal, the assertion of JAX's own test holds on the config's
executable, and the outputs are equal bit for bit. JAX's tests run on TPU; here on the 8
virtual CPU devices, whose memories are device, pinned_host and unpinned_host (jax 0.10.2)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aot_records_programs as progs
import jax
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from jaxaot.compat import jax as compat_jax
from jaxaot.stages.execute import load_outputs
from jaxaot.stages.inputs import spec_inputs

T = "program.target=aot_records_programs"
ONCE = ("execute.warmup=0", "execute.repeats=1")
Layout = compat_jax.layout_class()  # jax 0.6.x: DeviceLocalLayout
AUTO = Layout.AUTO


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Any:
    """The run's concrete mesh: its first devices, axis types auto (mesh.axis_types=null)."""
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    n = int(np.prod(shape))
    return jax.make_mesh(shape, axes, axis_types=auto, devices=jax.devices("cpu")[:n])


def _mesh_overrides(shape: tuple[int, ...], axes: tuple[str, ...]) -> list[str]:
    return [f"mesh.shape=[{', '.join(map(str, shape))}]", f"mesh.axes=[{', '.join(axes)}]"]


@dataclass(frozen=True)
class Case:
    """One JAX test: the config, and the jit options plain JAX is given for it."""

    program: str
    args: str
    overrides: tuple[str, ...]
    # (mesh or None) -> (in_shardings, out_shardings) for plain jax.jit
    plain: Callable[[Any], tuple[Any, Any]]
    mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None
    # JAX's own assertion on the compiled executable
    check: Callable[[Any], None] | None = None
    donate: tuple[int, ...] = ()  # lower.donate_argnums, and plain jax.jit's donate_argnums


def _m2m(fmt: Any) -> tuple[int, ...]:
    return tuple(compat_jax.format_layout(fmt).major_to_minor)


def _auto_layout_check(c: Any) -> None:
    # test_auto_layout: each output's major_to_minor is its input's reversed (a transpose)
    for i, o in zip(c.input_formats[0], c.output_formats, strict=True):
        assert _m2m(i) == _m2m(o)[::-1]


def _default_check(c: Any) -> None:
    # test_default_layout: the default (row-major) layout in and out
    assert _m2m(c.input_formats[0][0])[::-1] == (2, 1, 0)
    assert _m2m(c.output_formats)[::-1] == (2, 1, 0)


def _default_auto_check(c: Any) -> None:
    # test_default_layout's compiled_auto: the input row-major, the output the transpose's
    assert _m2m(c.input_formats[0][0])[::-1] == (2, 1, 0)
    assert _m2m(c.output_formats)[::-1] == (0, 1, 2)


def _in_default_out_auto_check(c: Any) -> None:
    # test_in_layouts_out_layouts and test_sharding_and_layouts
    assert _m2m(c.input_formats[0][0])[::-1] == (1, 0)
    assert _m2m(c.output_formats)[::-1] == (0, 1)


def _dce_check(c: Any) -> None:
    # test_dce_in_layouts: the four unused inputs have no format, the used ones a layout
    formats = c.input_formats[0]
    assert [compat_jax.format_layout(f) is not None for f in formats] == [
        False,
        False,
        True,
        False,
        True,
        False,
    ]
    assert all(f.sharding is None for i, f in enumerate(formats) if i not in (2, 4))


def _concrete_out_check(c: Any) -> None:
    # test_concrete_layout_jit: the output in the asked layout, on the concrete mesh
    assert _m2m(c.output_formats) == (0, 1)
    assert isinstance(c.output_formats.sharding.mesh, jax.sharding.Mesh)


def _concrete_in_check(c: Any) -> None:
    # test_concrete_layout_in_shardings: the input as asked, the auto output its reverse
    assert _m2m(c.input_formats[0][0]) == (0, 1)
    assert _m2m(c.output_formats) == (0, 1)[::-1]


def _column_major_check(c: Any) -> None:
    # a layout that is not the default (row-major) one: the input and output as asked
    assert _m2m(c.input_formats[0][0]) == (1, 0)
    assert _m2m(c.output_formats) == (1, 0)


def _donated_check(c: Any) -> None:
    # test_layout_donation(_matching_in_and_out): an argument put in the compiled format is
    # consumed by the call
    fmt = c.input_formats[0][0]
    shape = c.in_avals[0][0].shape
    arr = jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), fmt)
    assert c.args_info[0][0].donated
    c(arr)
    assert arr.is_deleted()


def _host_outputs_check(kind: str) -> Callable[[Any], None]:
    def check(c: Any) -> None:  # memories_test: _check_mem_kind on every output
        kinds = c.runtime_executable().get_output_memory_kinds()[0]
        assert list(kinds) == [kind] * len(kinds)
        assert {o.sharding.memory_kind for o in jax.tree.leaves(c.output_formats)} == {kind}

    return check


XY = ((2, 2), ("x", "y"))
CASES = {
    # layout_test.py
    "test_auto_layout": Case(
        "transpose_two",
        "[f32[8, 8], f32[8, 8]]",
        ("lower.in_shardings=[[x, y], [x]]", "lower.in_layouts=auto", "lower.out_layouts=auto"),
        lambda m: (
            (Format(AUTO, NamedSharding(m, P("x", "y"))), Format(AUTO, NamedSharding(m, P("x")))),
            Format(AUTO),
        ),
        XY,
        _auto_layout_check,
    ),
    "test_default_layout": Case(
        "transpose",
        "[f32[4, 4, 2]]",
        ("lower.in_shardings={x: [x, y]}", "lower.in_layouts=default", "lower.out_layouts=null"),
        lambda m: ((NamedSharding(m, P("x", "y")),), None),
        XY,
        _default_check,
    ),
    "test_default_layout-auto": Case(
        "transpose",
        "[f32[4, 4, 2]]",
        ("lower.in_shardings={x: [x, y]}", "lower.in_layouts=auto", "lower.out_layouts=auto"),
        lambda m: ((Format(AUTO, NamedSharding(m, P("x", "y"))),), Format(AUTO)),
        XY,
        _default_auto_check,
    ),
    "test_in_layouts_out_layouts": Case(
        "transpose",
        "[f32[8, 8]]",
        ("lower.in_shardings={x: [x, y]}", "lower.in_layouts=default", "lower.out_layouts=auto"),
        lambda m: ((NamedSharding(m, P("x", "y")),), Format(AUTO)),
        XY,
        _in_default_out_auto_check,
    ),
    "test_sharding_and_layouts": Case(
        "transpose",
        "[f32[4, 8]]",
        (
            "lower.in_shardings={x: [x, y]}",
            "lower.out_shardings={output: [x, y]}",
            "lower.in_layouts=auto",
            "lower.out_layouts=auto",
        ),
        lambda m: (
            (Format(AUTO, NamedSharding(m, P("x", "y"))),),
            Format(AUTO, NamedSharding(m, P("x", "y"))),
        ),
        XY,
        _in_default_out_auto_check,
    ),
    "test_dce_in_layouts": Case(
        "six",
        "[" + ", ".join(["f32[8, 2]"] * 6) + "]",
        ("lower.in_layouts=auto", "lower.out_layouts=auto"),
        lambda _: (tuple(Format(AUTO) for _ in range(6)), Format(AUTO)),
        None,
        _dce_check,
    ),
    "test_no_error_dced_args": Case(
        "double_first",
        "[f32[8, 2], f32[8, 2]]",
        (
            "lower.in_shardings=[[x, y], [x, y]]",
            "lower.out_shardings={output: [x, y]}",
            "lower.in_layouts=auto",
            "lower.out_layouts=auto",
        ),
        lambda m: (
            (Format(AUTO, NamedSharding(m, P("x", "y"))),) * 2,
            Format(AUTO, NamedSharding(m, P("x", "y"))),
        ),
        ((2, 1), ("x", "y")),
    ),
    # Concrete (major-to-minor) layouts on a mesh: jax.jit gets them on the concrete mesh's
    # NamedSharding, as JAX's tests write them. On CPU (0, 1) is a matrix's default layout.
    "test_concrete_layout_jit": Case(
        "transpose",
        "[f32[16, 128]]",
        (
            "lower.in_shardings={x: [x]}",
            "lower.out_shardings={output: [x]}",
            "lower.out_layouts=[0, 1]",
        ),
        lambda m: (
            (NamedSharding(m, P("x")),),
            Format(Layout((0, 1)), NamedSharding(m, P("x"))),
        ),
        XY,
        _concrete_out_check,
    ),
    "test_concrete_layout_in_shardings": Case(
        "transpose",
        "[f32[16, 128]]",
        ("lower.in_shardings={x: [x, y]}", "lower.in_layouts=[0, 1]", "lower.out_layouts=auto"),
        lambda m: ((Format(Layout((0, 1)), NamedSharding(m, P("x", "y"))),), Format(AUTO)),
        XY,
        _concrete_in_check,
    ),
    "test_layout_donation": Case(
        "identity",
        "[f32[16, 128]]",
        ("lower.in_shardings={x: [x, y]}", "lower.in_layouts=[0, 1]"),
        lambda m: ((Format(Layout((0, 1)), NamedSharding(m, P("x", "y"))),), None),
        XY,
        _donated_check,
        donate=(0,),
    ),
    "test_layout_donation_matching_in_and_out": Case(
        "square",
        "[f32[128, 16]]",
        (
            "lower.in_shardings={x: [x, y]}",
            "lower.out_shardings={output: [x, y]}",
            "lower.in_layouts=[0, 1]",
            "lower.out_layouts=[0, 1]",
        ),
        lambda m: (
            (Format(Layout((0, 1)), NamedSharding(m, P("x", "y"))),),
            Format(Layout((0, 1)), NamedSharding(m, P("x", "y"))),
        ),
        XY,
        _donated_check,
        donate=(0,),
    ),
    "column_major_on_a_mesh": Case(
        "transpose",
        "[f32[16, 128]]",
        (
            "lower.in_shardings={x: [x, y]}",
            "lower.out_shardings={output: [y, x]}",
            "lower.in_layouts=[1, 0]",
            "lower.out_layouts=[1, 0]",
        ),
        lambda m: (
            (Format(Layout((1, 0)), NamedSharding(m, P("x", "y"))),),
            Format(Layout((1, 0)), NamedSharding(m, P("y", "x"))),
        ),
        XY,
        _column_major_check,
    ),
    # memories_test.py (its tpu_hbm is device here; its unpinned_host both host kinds)
    "test_jit_out_shardings-pinned_host": Case(
        "transpose_two",
        "[f32[8, 2], f32[8, 2]]",
        (
            "lower.in_shardings=[[x, y], [x, y]]",
            "lower.out_shardings=[[y, x], [y, x]]",
            "lower.out_memory_kinds=pinned_host",
        ),
        lambda m: (
            (NamedSharding(m, P("x", "y")),) * 2,
            (NamedSharding(m, P("y", "x"), memory_kind="pinned_host"),) * 2,
        ),
        ((4, 2), ("x", "y")),
        _host_outputs_check("pinned_host"),
    ),
    "test_jit_out_shardings_single_output-unpinned_host": Case(
        "add_one",
        "[f32[8, 2]]",
        (
            "lower.in_shardings={x: [x, y]}",
            "lower.out_shardings={output: []}",
            "lower.out_memory_kinds=unpinned_host",
        ),
        lambda m: (
            (NamedSharding(m, P("x", "y")),),
            NamedSharding(m, P(), memory_kind="unpinned_host"),
        ),
        ((4, 2), ("x", "y")),
        _host_outputs_check("unpinned_host"),
    ),
    "test_jit_in_out_shardings-device": Case(
        "sin",
        "[f32[8, 2]]",
        ("lower.in_shardings={x: [x, y]}", "lower.in_memory_kinds=device"),
        lambda m: ((NamedSharding(m, P("x", "y"), memory_kind="device"),), None),
        ((4, 2), ("x", "y")),
        _host_outputs_check("device"),
    ),
    "test_jit_out_shardings-one_device": Case(
        "add_one",
        "[f32[8, 2]]",
        ("lower.out_memory_kinds=pinned_host",),
        lambda _: (
            None,
            SingleDeviceSharding(jax.devices("cpu")[0], memory_kind="pinned_host"),
        ),
        None,
        _host_outputs_check("pinned_host"),
    ),
}


# JAX's own layout and memory tests as of jax 0.7: jax 0.6 has no output memory kinds on CPU, lays
# some outputs out otherwise, and compiles a mesh lowering through its export (every input kept).
@pytest.mark.requires_jax("0.7.0")
@pytest.mark.parametrize("name", sorted(CASES))
def test_jax_layout_and_memory_tests_as_configs(compose_run: Any, name: str) -> None:
    case = CASES[name]
    mesh_over = _mesh_overrides(*case.mesh) if case.mesh else []
    donate = [f"lower.donate_argnums=[{', '.join(map(str, case.donate))}]"] if case.donate else []
    result = compose_run(
        f"{T}:{case.program}",
        f"program.args={case.args}",
        *mesh_over,
        *case.overrides,
        *donate,
        *ONCE,
    )
    args = list(spec_inputs(result["stage_out"].bound, 0)[0])
    mesh = _mesh(*case.mesh) if case.mesh else None
    in_sh, out_sh = case.plain(mesh)
    opts = {} if in_sh is None else {"in_shardings": in_sh}
    if out_sh is not None:
        opts["out_shardings"] = out_sh
    if case.donate:
        opts["donate_argnums"] = case.donate
    fn = getattr(progs, case.program)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    plain = jax.jit(fn, **opts).lower(*abstract).compile()
    exe = result["compile"].compiled
    assert exe.input_formats == plain.input_formats
    assert exe.output_formats == plain.output_formats
    if case.check is not None:
        case.check(plain)  # JAX's own assertion holds for JAX
        case.check(exe)  # and for the config's executable
    kept = [
        jax.device_put(a, f)
        for a, f in zip(args, plain.input_formats[0], strict=True)
        if f.sharding
    ]
    want = plain(
        *[
            a if f.sharding is None else kept.pop(0)
            for a, f in zip(args, plain.input_formats[0], strict=True)
        ]
    )
    got = load_outputs(result.run_dir / "execute")
    want_flat = jax.tree_util.tree_flatten_with_path(want)[0]
    assert sorted(got) == sorted(jax.tree_util.keystr(p) for p, _ in want_flat)
    for path, w in want_flat:
        g = got[jax.tree_util.keystr(path)]
        assert g.dtype == np.asarray(w).dtype and np.array_equal(g, np.asarray(w))
    # shardings.json says what the executable says: each input's kept flag and layout
    rows = json.loads((result.run_dir / "compile" / "shardings.json").read_text())
    fmts = jax.tree.leaves(plain.input_formats, is_leaf=lambda x: isinstance(x, Format))
    assert [r["kept"] for r in rows["inputs"]] == [f.sharding is not None for f in fmts]
    assert [r["layout"] and r["layout"]["major_to_minor"] for r in rows["inputs"]] == [
        (lay := compat_jax.format_layout(f)) and list(lay.major_to_minor) for f in fmts
    ]
    assert [r["memory_kind"] for r in rows["outputs"]] == [
        f.sharding.memory_kind
        for f in jax.tree.leaves(plain.output_formats, is_leaf=lambda x: isinstance(x, Format))
    ]


COLUMN_MAJOR_ON_XY = (
    f"{T}:transpose",
    "program.args=[f32[16, 128]]",
    *_mesh_overrides(*XY),
    "lower.in_shardings={x: [x, y]}",
    "lower.out_shardings={output: [y, x]}",
)


def _formats_of_plain(layout: tuple[int, ...]) -> Any:
    """Plain jax.jit's executable for COLUMN_MAJOR_ON_XY with ``layout`` in and out."""
    mesh = _mesh(*XY)
    fmt_in = Format(Layout(layout), NamedSharding(mesh, P("x", "y")))
    fmt_out = Format(Layout(layout), NamedSharding(mesh, P("y", "x")))
    sds = jax.ShapeDtypeStruct((16, 128), np.float32)
    return jax.jit(progs.transpose, in_shardings=(fmt_in,), out_shardings=fmt_out).lower(sds)


def test_a_concrete_layout_on_a_mesh_changes_only_its_leaves_in_the_module(
    compose_run: Any,
) -> None:
    # The leaves with a major-to-minor layout go on the concrete mesh; the module is the one
    # the AbstractMesh gives, with the layout on them. Row-major is a matrix's default on
    # CPU: JAX writes no layout for it, and the module is the plain mesh lowering's.
    def module(*layouts: str) -> str:
        run = compose_run(
            *COLUMN_MAJOR_ON_XY, *layouts, "stop_after=lower", "compile.num_devices=4"
        )
        return (run.run_dir / "lower" / "module.stablehlo.mlir").read_text()

    bare = module()
    plain_row, plain_col = (_main(_formats_of_plain(m).as_text()) for m in ((0, 1), (1, 0)))
    assert module("lower.in_layouts=[0, 1]", "lower.out_layouts=[0, 1]") == bare
    assert _main(bare) == plain_row and "mhlo.layout_mode" not in plain_row
    column = module("lower.in_layouts=[1, 0]", "lower.out_layouts=[1, 0]")
    # jax prints the layout minor-to-major: [1, 0] major-to-minor is {0,1}
    assert _main(column) == plain_col and plain_col.count('mhlo.layout_mode = "{0,1}"') == 2
    assert column.replace('mhlo.layout_mode = "{0,1}", ', "") == bare


def _main(module: str) -> str:
    """The module's entry signature: its arguments' and results' attributes."""
    (line,) = [x.strip() for x in module.splitlines() if "func.func public @main" in x]
    return line


def test_a_concrete_layout_on_a_mesh_compiles_again_at_resume(compose_run: Any) -> None:
    # Compiled from the lowering's export (which keeps no layout, jax 0.10.2) on the concrete
    # mesh with the recorded layouts asked for again: plain JAX's formats and outputs.
    layouts = ("lower.in_layouts=[1, 0]", "lower.out_layouts=[1, 0]", *ONCE)
    # A lowering-only run starts no devices unless asked: the layouts need the mesh's four.
    first = compose_run(*COLUMN_MAJOR_ON_XY, *layouts, "stop_after=lower", "compile.num_devices=4")
    again = compose_run(
        *COLUMN_MAJOR_ON_XY, *layouts, f"resume_from={first.run_dir}", "start_at=compile"
    )
    assert again.manifest["stages"]["lower"]["status"] == "resumed"
    plain = _formats_of_plain((1, 0)).compile()
    exe = again["compile"].compiled
    assert exe.input_formats == plain.input_formats
    assert exe.output_formats == plain.output_formats
    (x,) = spec_inputs(again["stage_out"].bound, 0)[0]
    want = np.asarray(plain(jax.device_put(x, plain.input_formats[0][0])))
    (got,) = load_outputs(again.run_dir / "execute").values()
    assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ("mesh.shape=[4]", "mesh.axes=[x]", "compile.num_devices=2", "stop_after=lower"),
            r"^lower.in_layouts: x's layout \[1, 0\] places it on the mesh's 4 devices .* "
            r"found compile.backend=cpu with 2; expected compile.num_devices=4, or auto/default$",
        ),
        (
            ("mesh.shape=[2]", "mesh.axes=[x]", "lower.platforms=[tpu]", "stop_after=lower"),
            r"^lower.in_layouts: x's layout \[1, 0\] places it on the mesh's 2 devices .* "
            r"found none for lower.platforms=\['tpu'\]; expected lower.platforms=\[cpu\] \(a ",
        ),
    ],
)
def test_a_concrete_layout_on_a_mesh_without_its_devices_is_one_line(
    compose_run: Any, overrides: tuple[str, ...], match: str
) -> None:
    from jaxaot.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as info:
        compose_run(
            f"{T}:transpose", "program.args=[f32[16, 128]]", "lower.in_layouts=[1, 0]", *overrides
        )
    assert "\n" not in str(info.value)
