"""jaxaot.compat.jax: each private name it reads exists on the installed jax, each gate takes
the public path where the installed jax has one and the fallback (or a one-line refusal naming
the jax version a feature needs) where it has not."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from typing import Any

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest
from jaxaot.compat import jax as compat_jax
from jaxaot.errors import VersionError

INSTALLED = compat_jax.jax_version()
JAX_RANGE = compat_jax.JAX_RANGE


def _objects() -> dict[str, Any]:
    """One of each JAX object whose private attributes compat reads."""
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    traced = jax.jit(lambda x: x + 1).trace(spec)
    lowered = traced.lower()
    (dim,) = jax.export.symbolic_shape("b")
    return {
        "Traced": traced,
        "Lowered": lowered,
        "Compiled": lowered.compile(),
        "ArgInfo": jax.tree.leaves(lowered.args_info)[0],
        "Dim": dim,
        "Layout": compat_jax.format_layout(jnp.ones((2, 3)).format),
    }


def _applies(entry: compat_jax.Private) -> bool:
    return entry.since <= INSTALLED and (entry.until is None or entry.until > INSTALLED)


def test_each_private_name_exists_on_the_installed_jax() -> None:
    objects = _objects()
    applying = [e for e in compat_jax.PRIVATE_NAMES if _applies(e)]
    assert len(applying) >= 30  # jax 0.10.2: every entry but the older layouts'
    missing = []
    for entry in applying:
        try:
            if entry.owner in objects:
                value = objects[entry.owner]
            else:
                value = importlib.import_module(entry.owner)
            for attr in filter(None, entry.name.split(".")):
                value = getattr(value, attr)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{entry.owner} {entry.name}: {type(exc).__name__}: {exc}")
    assert not missing, "\n".join(missing)


def test_the_table_names_each_owner_it_can_resolve() -> None:
    owners = {e.owner for e in compat_jax.PRIVATE_NAMES}
    objects = set(_objects())
    assert {o for o in owners if "." not in o} <= objects
    assert all(e.since < (e.until or (99,)) for e in compat_jax.PRIVATE_NAMES)


def test_versions_come_from_metadata_without_importing_jax() -> None:
    code = (
        "import sys; from jaxaot.compat import jax as c; v = (c.jax_version(), "
        "c.jaxlib_version()); print(v, sorted({m.split('.')[0] for m in sys.modules} & "
        "{'jax', 'jaxlib'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"({INSTALLED!r}, {compat_jax.jaxlib_version()!r}) []"
    assert compat_jax.text(INSTALLED) == jax.__version__.split(".dev")[0]


def _on(monkeypatch: pytest.MonkeyPatch, version: tuple[int, ...], jaxlib: bool = False) -> None:
    monkeypatch.setattr(compat_jax, "jax_version", lambda: version)
    if jaxlib:
        monkeypatch.setattr(compat_jax, "jaxlib_version", lambda: version)


def test_need_refuses_in_one_line_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    compat_jax.need("lower.out_shardings", JAX_RANGE[0], "Traced.out_tree")  # installed: enough
    _on(monkeypatch, (0, 6, 2))
    with pytest.raises(VersionError) as refused:
        compat_jax.need("lower.out_shardings", (0, 8, 1), "Traced.out_tree")
    assert str(refused.value) == (
        "lower.out_shardings needs jax>=0.8.1 (Traced.out_tree); installed: jax 0.6.2; "
        "fix: pip install 'jax>=0.8.1'"
    )


class _OldTraced:
    """A Traced as jax before 0.8.1 lays it out: the output tree under ``_out_tree`` only."""

    def __init__(self, tree: Any) -> None:
        self._out_tree = tree


def test_traced_out_tree_is_public_from_0_8_1_private_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    traced = _objects()["Traced"]  # the installed jax's, on whichever side of the gate
    assert compat_jax.traced_out_tree(traced) == jax.tree_util.tree_structure(0)
    tree = jax.tree_util.tree_structure((1, 2))
    new = _OldTraced(None)
    new.out_tree = tree  # type: ignore[attr-defined]
    _on(monkeypatch, (0, 8, 1))
    assert compat_jax.traced_out_tree(new) is tree
    _on(monkeypatch, (0, 8, 0))
    assert compat_jax.traced_out_tree(_OldTraced(tree)) is tree


def test_use_abstract_mesh_is_public_from_0_7_2_private_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jax._src import mesh as jax_mesh
    from jax.sharding import AbstractMesh

    amesh = AbstractMesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with compat_jax.use_abstract_mesh(amesh):  # the installed jax's
        assert jax.sharding.get_abstract_mesh() == amesh
    monkeypatch.setattr(jax.sharding, "use_abstract_mesh", lambda m: ("public", m), raising=False)
    monkeypatch.setattr(jax_mesh, "use_abstract_mesh", lambda m: ("private", m))
    _on(monkeypatch, (0, 7, 2))
    assert compat_jax.use_abstract_mesh(amesh) == ("public", amesh)
    _on(monkeypatch, (0, 7, 1))
    assert compat_jax.use_abstract_mesh(amesh) == ("private", amesh)


@pytest.mark.parametrize(
    ("jaxlib", "module"),
    [
        ((0, 10, 2), "jaxlib._hlo"),
        ((0, 10, 1), "jaxlib._jax"),
        ((0, 6, 2), "jaxlib._jax"),
    ],
)
def test_the_hlo_printer_is_read_from_the_module_each_jaxlib_has_it_in(
    monkeypatch: pytest.MonkeyPatch, jaxlib: tuple[int, ...], module: str
) -> None:
    imported: list[str] = []
    real = importlib.import_module
    printer = compat_jax._hlo_module()  # the installed jaxlib's, under whichever name it has

    def recording(name: str, package: str | None = None) -> Any:
        imported.append(name)
        return printer if name.startswith("jaxlib.") else real(name, package)

    monkeypatch.setattr(compat_jax.importlib, "import_module", recording)
    _on(monkeypatch, jaxlib, jaxlib=True)
    lowered = _objects()["Lowered"]
    module_ = compat_jax.hlo_module(lowered)
    text = compat_jax.hlo_module_to_text(module_, debug=False, keep_large=False)
    assert text == lowered.as_text(dialect="hlo")
    again = compat_jax.hlo_module_from_text(text)
    assert compat_jax.hlo_module_to_text(again, debug=False, keep_large=False) == text
    assert imported == [module, module, module]


def test_hlo_text_and_cost_analysis_match_jax_public_ones() -> None:
    from jaxaot.stages import module_text

    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    lowered = jax.jit(lambda a: jnp.tanh(a @ a)).trace(x).lower()
    text, module = module_text.hlo_text(lowered, keep_large=False)
    assert text == lowered.as_text(dialect="hlo")
    cost = compat_jax.hlo_module_cost_analysis(compat_jax.lowering_backend(lowered), module)
    assert cost["flops"] == lowered.cost_analysis()["flops"]


def test_a_jax_without_the_locations_option_is_told_in_the_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from jax._src import config
    from jaxaot.stages import concrete_export

    monkeypatch.delattr(config, "traceback_in_locations_limit")
    with concrete_export._without_call_sites():
        pass
    assert "no jax._src.config.traceback_in_locations_limit" in caplog.text


def test_the_private_helpers_give_what_jax_gives() -> None:
    objects = _objects()
    lowered, compiled = objects["Lowered"], objects["Compiled"]
    assert compat_jax.lowering_of(lowered) is lowered._lowering
    assert sorted(compat_jax.kept_var_idx(lowered)) == sorted(compat_jax.kept_var_idx(compiled))
    assert compat_jax.arg_aval(objects["ArgInfo"]).shape == (2,)
    assert compat_jax.evaluate_dim(objects["Dim"] * 2 + 1, {"b": 3}) == 7
    weak = compat_jax.weakly_typed(np.ones(3, np.float32))
    assert weak.aval.weak_type and weak.dtype == np.float32
    aliases, known, canonicalize = compat_jax.platform_rules()
    assert aliases["cuda"] == "gpu" and "cpu" in known and canonicalize("cpu") == "cpu"
    assert "cpu" in compat_jax.platforms_with_donation()
    assert compat_jax.backends_started() == bool(compat_jax.started_backends())
    if compat_jax.backends_started():  # a started backend discovered the plugins first
        assert compat_jax.plugins_discovered()
    assert "lapack_sgetrf_ffi" in compat_jax.stable_custom_call_targets()
    assert compat_jax.registered_custom_call_targets()
    ir, passmanager = compat_jax.mlir_ir()
    assert hasattr(ir, "Context") and hasattr(passmanager, "PassManager")
    assert compat_jax.export_serializer() is not None
    ser, de = compat_jax.export_registries()
    assert isinstance(ser, dict) and isinstance(de, dict)


def test_the_server_preimports_the_private_modules_this_jax_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = compat_jax.preimport()
    assert "jax._src.checkify" in names
    for name in names:
        assert importlib.util.find_spec(name) is not None, name
    _on(monkeypatch, (0, 9, 2))
    assert "jax._src.pallas.mosaic.interpret.params" not in compat_jax.preimport()


def test_set_mesh_is_jax_set_mesh_from_0_7_1_use_mesh_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((1,), ("data",), axis_types=auto, devices=jax.devices()[:1])
    with compat_jax.set_mesh(mesh):  # the installed jax's
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
    monkeypatch.setattr(jax, "set_mesh", lambda m: ("set_mesh", m), raising=False)
    monkeypatch.setattr(jax.sharding, "use_mesh", lambda m: ("use_mesh", m), raising=False)
    _on(monkeypatch, (0, 7, 1))
    assert compat_jax.set_mesh(mesh) == ("set_mesh", mesh)
    _on(monkeypatch, (0, 7, 0))
    assert compat_jax.set_mesh(mesh) == ("use_mesh", mesh)


def test_jaxprs_in_params_public_in_0_10_private_before(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import core as jax_core

    def body(x: Any) -> Any:
        return jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)

    closed = jax.make_jaxpr(body)(jnp.ones(2))
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    found = compat_jax.jaxprs_in_params(cond.params)
    assert len(found) == 2
    monkeypatch.setattr(jax_core, "jaxprs_in_params", lambda params: ["private"])
    _on(monkeypatch, (0, 9, 2))
    assert compat_jax.jaxprs_in_params(cond.params) == ["private"]


def test_a_jax_below_the_floor_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    compat_jax.check_supported()
    _on(monkeypatch, (0, 6, 1))
    with pytest.raises(VersionError) as refused:
        compat_jax.check_supported()
    assert str(refused.value) == (
        "jaxaot needs jax>=0.6.2 (jax.experimental.layout.Format, Array.format, jax.export); "
        "installed: jax 0.6.1; fix: pip install 'jax>=0.6.2'"
    )


def test_the_jax_internal_error_names_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    _on(monkeypatch, (0, 6, 2))
    err = compat_jax.jax_internal("jax._src.x.y", "do z", AttributeError("no y"))
    assert re.fullmatch(
        r"jax 0\.6\.2: jax\._src\.x\.y, which jaxaot uses to do z, is missing or changed "
        r"\(AttributeError: no y\); expected jax 0\.10\.2, which has it \(jax>=0\.6\.2,<0\.11 "
        r"as jaxaot requires\): install that jax, or a jaxaot made for this one",
        str(err),
    )


def test_layouts_read_the_same_under_each_jax_s_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax.experimental import layout as jax_layout

    x = jnp.ones((2, 3))
    layout = compat_jax.format_layout(x.format)
    assert isinstance(layout, compat_jax.layout_class())
    assert compat_jax.layout_fields(layout) == {
        "major_to_minor": (0, 1),
        "tiling": (),
        "sub_byte_element_size_in_bits": 0,
    }

    class Old:  # jax 0.6.2's Format and DeviceLocalLayout
        device_local_layout = "dll"
        _tiling = ((8,),)
        _sub_byte_element_size_in_bits = 4
        major_to_minor = (1, 0)

    class New:
        layout = "layout"

    monkeypatch.setattr(jax_layout, "DeviceLocalLayout", Old, raising=False)
    _on(monkeypatch, (0, 7, 0))
    assert compat_jax.format_layout(New()) == "layout"
    _on(monkeypatch, (0, 6, 2))
    assert compat_jax.format_layout(Old()) == "dll" and compat_jax.format_layout(New()) is None
    assert compat_jax.layout_class() is Old
    assert compat_jax.layout_fields(Old()) == {
        "major_to_minor": (1, 0),
        "tiling": ((8,),),
        "sub_byte_element_size_in_bits": 4,
    }


def test_a_partition_spec_prints_as_jax_0_9_1_prints_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax.sharding import PartitionSpec

    spec = PartitionSpec(("data", "fsdp"), None)
    assert compat_jax.spec_text(spec) == "P(('data', 'fsdp'), None)"

    class Old:
        def __str__(self) -> str:
            return "PartitionSpec('fsdp', 'model')"

    _on(monkeypatch, (0, 9, 0))
    assert compat_jax.spec_text(Old()) == "P('fsdp', 'model')"


def test_an_argless_mesh_program_needs_jax_0_10(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax.sharding import AbstractMesh, AxisType
    from jaxaot.stages.jax_mesh import tracing_on

    _on(monkeypatch, (0, 9, 2))
    want = (
        "A mesh program without arguments needs jax>=0.10.0 (a jit that records the AbstractMesh "
        "in context as its devices: jax._src.pjit.get_ctx_mesh); installed: jax 0.9.2; fix: pip "
        "install 'jax>=0.10.0'"
    )
    for kind in (AxisType.Auto, AxisType.Explicit):
        amesh = AbstractMesh((2,), ("data",), axis_types=(kind,))
        with pytest.raises(VersionError) as refused, tracing_on(amesh, unplaced=True):
            pass
        assert str(refused.value) == want
    with pytest.raises(VersionError), compat_jax.auto_context_mesh():
        pass
    monkeypatch.undo()  # the installed jax
    with tracing_on(amesh):  # a program with arguments: its shardings name the mesh
        assert jax.sharding.get_abstract_mesh() == amesh


@pytest.mark.parametrize(
    ("text", "below", "at_or_above"),
    [
        ("0.10.2", (0, 10, 3), (0, 10, 2)),
        ("0.10.2.dev20260101", (0, 10, 2), (0, 10, 1)),  # a nightly before 0.10.2's features
        ("0.7.0rc1", (0, 7, 0), (0, 6, 2)),
        ("0.10.2+cuda12", (0, 10, 3), (0, 10, 2)),
    ],
)
def test_a_pre_release_is_below_its_release(
    text: str, below: tuple[int, ...], at_or_above: tuple[int, ...]
) -> None:
    from jaxaot.compat.jax import _parse

    assert at_or_above <= _parse(text) < below
