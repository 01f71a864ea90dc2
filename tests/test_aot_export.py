"""jax.export from config: platform names, JAX's donation rule across platforms, and the
export's safety checks (``lower.disabled_checks``).

Each test states what plain ``jax.export`` does for a case and checks, in the same test, that
jaxaot's run of it does the same: the export's platforms and safety checks, the module's
donation, the error or warning, and outputs bit for bit.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import aot_export_programs as progs
import jax
import jax.numpy as jnp
import jaxaot
import pytest
from jax.export import DisabledSafetyCheck
from jax_reference import assert_same, run_inputs
from jaxaot.config.argspec import concrete_bound
from jaxaot.errors import BackendError, ConfigError
from jaxaot.schema import validate
from jaxaot.stages.export_rules import check_platforms
from jaxaot.stages.inputs import spec_inputs
from jaxaot.stages.lower import LOWER, canonical_stablehlo

T = "program.target=aot_export_programs"
ADD = (f"{T}:add", "program.args=[f32[4], f32[4]]")
SVD = (f"{T}:singular_values", "program.args=[f32[4,4]]")
# How jax 0.10.2 marks a donated argument in the module (aliased to an output, or a donor).
DONATION = re.compile(r"tf\.aliasing_output|jax\.buffer_donor")


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _exported(run_dir: Path) -> jax.export.Exported:
    return jax.export.deserialize(bytearray((run_dir / "lower" / "exported.bin").read_bytes()))


def _lowered_json(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "lower" / "lowered.json").read_text()))


def _jax_warnings(call: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [" ".join(str(w.message).split()) for w in caught]


X4 = jax.ShapeDtypeStruct((4,), jnp.float32)


# --- platform names: JAX's set is open --------------------------------------------------------


def test_a_platform_jax_does_not_know_is_exported_as_given(compose_run: Any) -> None:
    # JAX: export(platforms=('other',)) lowers with the default rules and records 'other';
    # calling that export on cpu is an error.
    want = jax.export.export(jax.jit(progs.add), platforms=("other",))(X4, X4)
    result = compose_run(*ADD, "lower.platforms=[other]", "stop_after=lower")
    got = _exported(result.run_dir)
    assert got.platforms == want.platforms == ("other",)
    assert canonical_stablehlo(got.mlir_module()) == canonical_stablehlo(want.mlir_module())
    assert _lowered_json(result.run_dir)["platforms"] == ["other"]
    assert not [w for w in result.manifest["warnings"] if "lower.platforms" in w]
    with pytest.raises(ValueError, match=r"exported for platforms '\('other',\)' but it is used"):
        want.call(jnp.ones(4), jnp.ones(4))
    with pytest.raises(
        BackendError, match=r"needs a lowering for 'cpu', but lower.platforms was \['other'\]"
    ):
        compose_run(*ADD, "lower.platforms=[other]", "stop_after=compile")


@pytest.mark.parametrize("name", ["GPU", "Cuda", "other"])
def test_compile_suggests_no_backend_for_a_platform_no_backend_compiles_for(
    compose_run: Any, name: str
) -> None:
    # JAX: an export for a platform it does not know lowers, and calling it on cpu is an error.
    want = jax.export.export(jax.jit(progs.add), platforms=(name,))(X4, X4)
    with pytest.raises(ValueError, match=rf"exported for platforms '\('{name}',\)' but it is used"):
        want.call(jnp.ones(4), jnp.ones(4))
    with pytest.raises(BackendError) as ours:
        compose_run(*ADD, f"lower.platforms=[{name}]", "stop_after=compile")
    text = str(ours.value)
    assert text == (
        f"compile.backend='cpu' needs a lowering for 'cpu', but lower.platforms was ['{name}']; "
        f"no compile.backend compiles for {name} (the backends compile for cpu, cuda, rocm, "
        f"tpu); add 'cpu' to lower.platforms, or export it with "
        f"lower.disabled_checks=[platform] to run its {name} module here"
    )


def test_compile_suggests_the_backend_of_a_lowered_platform_a_backend_compiles_for(
    compose_run: Any,
) -> None:
    with pytest.raises(BackendError) as ours:
        compose_run(*ADD, "lower.platforms=[other,tpu]", "stop_after=compile")
    text = str(ours.value)
    assert "compile for one of those (compile.backend=tpu)" in text
    assert "compile on a tpu machine (resume_from=<this run> start_at=compile)" in text
    assert "compile.backend=other" not in text and "\n" not in text


def test_a_near_miss_of_a_known_platform_is_exported_with_a_warning(compose_run: Any) -> None:
    want = jax.export.export(jax.jit(progs.add), platforms=("tpuu",))(X4, X4)
    result = compose_run(*ADD, "lower.platforms=[tpuu]", "stop_after=lower")
    assert _exported(result.run_dir).platforms == want.platforms == ("tpuu",)
    notes = [w for w in result.manifest["warnings"] if "lower.platforms" in w]
    assert len(notes) == 1
    assert "'tpuu' is no platform this JAX knows (did you mean 'tpu'?)" in notes[0]
    assert "lower.disabled_checks=[platform]" in notes[0]


def test_the_gpu_alias_is_the_gpu_present_and_an_error_without_one(compose_run: Any) -> None:
    # JAX: 'gpu' stands for the cuda/rocm/oneapi platform present; with none, lowering fails.
    with pytest.raises(
        RuntimeError, match=r"no platforms that are instances of gpu are present"
    ) as plain:
        jax.jit(progs.add).trace(X4, X4).lower(lowering_platforms=("gpu",))
    with pytest.raises(ConfigError) as ours:
        compose_run(*ADD, "lower.platforms=[gpu]", "stop_after=lower")
    text = str(ours.value)
    assert text.startswith("lower.platforms: 'gpu' (gpu is an alias of cuda, oneapi, rocm)")
    assert " ".join(str(plain.value).split()) in text
    assert "\n" not in text and text.endswith("(e.g. lower.platforms=[cuda])")


@pytest.mark.parametrize("name", ["_platform_aliases", "known_platforms", "canonicalize_platform"])
def test_a_jax_without_its_platform_tables_is_refused_naming_the_version(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # jax 0.10.2 has no public list or canonicalization of platform names: lower.platforms is
    # read with xla_bridge's private ones, and a jax without them is refused, not guessed at
    # (the lower stage's check; jax itself uses them too, so no whole run works without them).
    from jax._src import xla_bridge

    assert check_platforms(("cpu", "other")) == (("cpu", "other"), [])
    monkeypatch.delattr(xla_bridge, name)
    with pytest.raises(BackendError) as refused:
        check_platforms(("cpu",))
    text = str(refused.value)
    assert text.startswith(
        f"jax {jax.__version__}: jax._src.xla_bridge's _platform_aliases, known_platforms or "
        "canonicalize_platform, which jaxaot uses to read lower.platforms as JAX does, is "
        f"missing or changed (AttributeError: module 'jax._src.xla_bridge' has no attribute "
        f"'{name}'); expected jax 0.10.2, which has it"
    )
    assert "\n" not in text


# --- donation across platforms: all of them donate, or none ------------------------------------


def test_donation_on_platforms_of_which_only_some_donate_is_refused(compose_run: Any) -> None:
    # JAX (jax 0.10.2): a NotImplementedError when lowering, before anything is exported.
    with pytest.raises(NotImplementedError) as plain:
        jax.export.export(jax.jit(progs.add, donate_argnums=0), platforms=("cpu", "other"))(X4, X4)
    with pytest.raises(ConfigError) as ours:
        compose_run(*ADD, "lower.platforms=[cpu,other]", "lower.donate_argnums=[0]")
    jax_text = str(plain.value)
    assert jax_text.startswith("In multi-platform lowering either all or no lowering platforms")
    text = str(ours.value)
    assert text.startswith(
        f"lower.platforms=['cpu', 'other'] with lower.donate_argnums=[0]: NotImplementedError: {jax_text}; "
    )
    assert "\n" not in text


def test_donation_on_platforms_none_of_which_donate_is_dropped(compose_run: Any) -> None:
    # JAX: the export donates nothing and warns "Donation is not implemented for ('other',)".
    want, jax_said = _jax_warnings(
        lambda: jax.export.export(jax.jit(progs.add, donate_argnums=0), platforms=("other",))(
            X4, X4
        )
    )
    said = [w for w in jax_said if "Donation is not implemented for ('other',)" in w]
    assert said and not DONATION.search(want.mlir_module())
    result = compose_run(
        *ADD, "lower.platforms=[other]", "lower.donate_argnums=[0]", "stop_after=lower"
    )
    assert f"lower: UserWarning: {said[0]}" in result.manifest["warnings"]
    assert _lowered_json(result.run_dir)["donate_argnums"] == []
    assert not DONATION.search(_exported(result.run_dir).mlir_module())
    # Where every platform donates, the module says so, as JAX's does.
    both = jax.export.export(jax.jit(progs.add, donate_argnums=0), platforms=("cpu", "tpu"))
    assert DONATION.search(both(X4, X4).mlir_module())
    donating = compose_run(
        *ADD, "lower.platforms=[cpu,tpu]", "lower.donate_argnums=[0]", "stop_after=lower"
    )
    assert _lowered_json(donating.run_dir)["donate_argnums"] == [0]
    assert DONATION.search(_exported(donating.run_dir).mlir_module())
    # JAX: an export for ('other',) drops donate_argnames too, with the same warning; called
    # on cpu (platform check off), its keyword input survives the call.
    plain = jax.jit(progs.shifted, donate_argnames="a")
    off = [DisabledSafetyCheck.platform()]
    want, jax_said = _jax_warnings(
        lambda: jax.export.export(plain, platforms=("other",), disabled_checks=off)(X4, a=X4)
    )
    said = [w for w in jax_said if "Donation is not implemented for ('other',)" in w]
    assert said and not DONATION.search(want.mlir_module())
    result = compose_run(
        f"{T}:shifted",
        "program.args=[f32[4]]",
        "+program.kwargs.a=f32[4]",
        "lower.platforms=[other]",
        "lower.disabled_checks=[platform]",
        "lower.donate_argnames=[a]",
        "compile.backend=cpu",
        "execute.repeats=1",
    )
    assert f"lower: UserWarning: {said[0]}" in result.manifest["warnings"]
    assert _lowered_json(result.run_dir)["donate_argnames"] == []
    (x,), kwargs = run_inputs(result)
    a = jnp.asarray(kwargs["a"])
    assert_same(result.records["execute"].outputs, want.call(x, a=a))
    assert not a.is_deleted()  # nothing donated, nothing consumed
    timings = result.records["execute"].timings
    assert timings["donated_leaves_consumed"] is None
    assert timings["donated_inputs_consumed"] is None


# --- safety checks: platform --------------------------------------------------------------------


def test_an_export_for_tpu_runs_on_cpu_with_the_platform_check_disabled(compose_run: Any) -> None:
    checks = ["lower.platforms=[tpu]", "lower.disabled_checks=[platform]"]
    result = compose_run(*ADD, *checks, "execute.check=reference", "execute.repeats=1")
    x, y = run_inputs(result)[0]
    want = jax.export.export(
        jax.jit(progs.add), platforms=("tpu",), disabled_checks=[DisabledSafetyCheck.platform()]
    )(X4, X4)
    assert_same(result.records["execute"].outputs, want.call(x, y))
    assert result.records["execute"].check["ok"]
    got = _exported(result.run_dir)
    assert got.platforms == ("tpu",)
    assert got.disabled_safety_checks == want.disabled_safety_checks
    assert _lowered_json(result.run_dir)["disabled_checks"] == ["platform"]
    summary = LOWER.show.line(result.manifest["stages"]["lower"]["metrics"])
    assert summary.endswith("; export checks off: platform")
    # Without it, JAX refuses the call and jaxaot the compile.
    plain = jax.export.export(jax.jit(progs.add), platforms=("tpu",))(X4, X4)
    with pytest.raises(ValueError, match=r"exported for platforms '\('tpu',\)' but it is used"):
        plain.call(x, y)
    with pytest.raises(BackendError, match=r"or export it with lower.disabled_checks=\[platform\]"):
        compose_run(*ADD, "lower.platforms=[tpu]", "stop_after=compile")


def test_a_check_disabled_twice_is_exported_twice_as_jax_does(compose_run: Any) -> None:
    # JAX (jax 0.10.2): export(disabled_checks=[platform(), platform()]) keeps both, in the
    # Exported and through its serialization; the export runs as with one.
    twice = [DisabledSafetyCheck.platform(), DisabledSafetyCheck.platform()]
    want = jax.export.export(jax.jit(progs.add), platforms=("tpu",), disabled_checks=twice)(X4, X4)
    assert [str(c) for c in want.disabled_safety_checks] == ["platform", "platform"]
    served = jax.export.deserialize(want.serialize())
    assert served.disabled_safety_checks == want.disabled_safety_checks
    result = compose_run(
        *ADD,
        "lower.platforms=[tpu]",
        "lower.disabled_checks=[platform,platform]",
        "execute.repeats=1",
    )
    got = _exported(result.run_dir)
    assert got.disabled_safety_checks == want.disabled_safety_checks
    assert canonical_stablehlo(got.mlir_module()) == canonical_stablehlo(want.mlir_module())
    assert _lowered_json(result.run_dir)["disabled_checks"] == ["platform", "platform"]
    summary = LOWER.show.line(result.manifest["stages"]["lower"]["metrics"])
    assert summary.endswith("; export checks off: platform, platform")  # what the export holds
    x, y = run_inputs(result)[0]
    assert_same(result.records["execute"].outputs, want.call(x, y))


def test_a_disabled_platform_check_survives_a_resume(compose_run: Any) -> None:
    first = compose_run(
        *ADD, "lower.platforms=[tpu]", "lower.disabled_checks=[platform]", "stop_after=lower"
    )
    # The backend is named: a resume for one platform compiles for it by default.
    chosen = [f"resume_from={first.run_dir}", "start_at=compile", "compile.backend=cpu"]
    again = jaxaot.run(
        jaxaot.compose([*chosen, "execute.repeats=1"]),
        run_dir=first.run_dir.parent / "again",
        overrides=chosen,
    )
    assert again.records["lower"].state == "loaded"
    assert [str(c) for c in _exported(again.run_dir).disabled_safety_checks] == ["platform"]
    x, y = run_inputs(again)[0]
    assert_same(again.records["execute"].outputs, _exported(first.run_dir).call(x, y))


def test_disabled_checks_are_part_of_the_compile_key(compose_run: Any) -> None:
    # A lowering for several platforms compiles through its export, whose bytes record them.
    runs = [
        compose_run(*ADD, "lower.platforms=[cpu,tpu]", *extra, "stop_after=compile")
        for extra in ([], ["lower.disabled_checks=[platform]"])
    ]
    keys = [r.manifest["stages"]["compile"]["key"] for r in runs]
    assert keys[0] != keys[1]
    assert [_exported(r.run_dir).disabled_safety_checks for r in runs] == [
        (),
        (DisabledSafetyCheck.platform(),),
    ]


# --- safety checks: custom calls ----------------------------------------------------------------


def test_a_custom_call_jax_does_not_know_stable_exports_only_when_allowed(
    compose_run: Any,
) -> None:
    a = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(progs.singular_values))(a)
    refused = compose_run(*SVD, "stop_after=lower")
    assert not (refused.run_dir / "lower" / "exported.bin").exists()
    (note,) = [w for w in refused.manifest["warnings"] if "no exported.bin" in w]
    assert "custom calls whose targets have no compatibility guarantees" in note
    assert note.endswith("lower.disabled_checks='[custom_call:lapack_sgesvd_ffi]'")

    allow = DisabledSafetyCheck.custom_call("lapack_sgesvd_ffi")
    want = jax.export.export(jax.jit(progs.singular_values), disabled_checks=[allow])(a)
    first = compose_run(
        *SVD, "lower.disabled_checks=[custom_call:lapack_sgesvd_ffi]", "stop_after=lower"
    )
    got = _exported(first.run_dir)
    assert got.disabled_safety_checks == want.disabled_safety_checks == (allow,)
    assert canonical_stablehlo(got.mlir_module()) == canonical_stablehlo(want.mlir_module())
    again = compose_run(
        *SVD, f"resume_from={first.run_dir}", "start_at=compile", "execute.repeats=1"
    )
    (x,) = run_inputs(again)[0]
    assert_same(again.records["execute"].outputs, jax.jit(want.call)(x))
    assert_same(again.records["execute"].outputs, jax.jit(progs.singular_values)(x))


@pytest.mark.parametrize(
    "value",
    ["[platfrom]", "[custom_call:]", "['custom_call: x']", "[3]", "[custom_call]"],
)
def test_disabled_check_spellings_are_validated(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(jaxaot.compose([*ADD, f"lower.disabled_checks={value}"]))
    text = str(err.value)
    assert re.match(
        r"lower\.disabled_checks: expected 'platform' or 'custom_call:<target>' \(the "
        r"jax\.export\.DisabledSafetyCheck spellings\), found .+; e\.g\. ",
        text,
    )
    assert "\n" not in text


def test_disabled_check_spellings_jax_takes_are_accepted() -> None:
    cfg = validate(jaxaot.compose([*ADD, "lower.disabled_checks=[platform, 'custom_call:ALL']"]))
    from jaxaot.stages.export_rules import safety_checks

    assert safety_checks(cfg.lower.disabled_checks) == [
        DisabledSafetyCheck.platform(),
        DisabledSafetyCheck.custom_call("ALL"),
    ]


def test_a_polymorphic_export_keeps_its_checks_when_made_concrete(compose_run: Any) -> None:
    # JAX: an export called at concrete sizes and exported again needs the same checks off.
    allow = DisabledSafetyCheck.custom_call("lapack_sgesvd_ffi")
    (b,) = jax.export.symbolic_shape("b")
    poly = jax.export.export(jax.jit(progs.singular_values), disabled_checks=[allow])(
        jax.ShapeDtypeStruct((b, 4, 4), jnp.float32)
    )
    concrete = jax.export.export(jax.jit(poly.call), disabled_checks=poly.disabled_safety_checks)
    want = concrete(jax.ShapeDtypeStruct((2, 4, 4), jnp.float32))
    result = compose_run(
        f"{T}:singular_values",
        "program.args=['f32[b,4,4]']",
        "compile.shapes={b: 2}",
        "lower.disabled_checks=[custom_call:lapack_sgesvd_ffi]",
        "execute.repeats=1",
    )
    assert result.records["lower"].exported.disabled_safety_checks == (allow,)
    staged = result.records["stage_out"]
    (x,), _ = spec_inputs(concrete_bound(staged.bound, {"b": 2}), 0)
    assert_same(result.records["execute"].outputs, want.call(x))


def test_a_sharded_tpu_export_runs_on_cpu_devices_with_the_platform_check_off(
    compose_run: Any,
) -> None:
    # JAX: the export's shardings laid over a concrete cpu mesh, called there.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    result = compose_run(
        *ADD,
        "mesh.shape=[2]",
        "mesh.axes=[data]",
        "lower.in_shardings=[[data], [data]]",
        "lower.platforms=[tpu]",
        "lower.disabled_checks=[platform]",
        "execute.check=reference",
        "execute.repeats=1",
    )
    x, y = run_inputs(result)[0]
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])  # the run's devices
    spec = NamedSharding(mesh, P("data"))
    want = jax.export.export(
        jax.jit(progs.add, in_shardings=(spec, spec)),
        platforms=("tpu",),
        disabled_checks=[DisabledSafetyCheck.platform()],
    )(X4, X4)
    plain = jax.jit(want.call, in_shardings=tuple(want.in_shardings_jax(mesh)))
    compiled = plain.lower(x, y).compile()
    assert_same(result.records["execute"].outputs, compiled(x, y))
    ours = result.records["compile"].compiled
    assert [s.spec for s in ours.input_shardings[0]] == [
        s.spec for s in compiled.input_shardings[0]
    ]
    assert _exported(result.run_dir).nr_devices == want.nr_devices == 2
