"""The config schema (``jaxaot.schema``): composing, validating, and failing before JAX."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from typing import Any

import jaxaot
import pytest
from conftest import cli_env, run_cli
from jaxaot.errors import ConfigError
from jaxaot.schema import JaxaotConfig, to_container, validate

_PROGRAM = {"name": "p", "target": "pkg.mod:fn"}


def _cfg(**overrides: Any) -> dict[str, Any]:
    return {"program": dict(_PROGRAM), **overrides}


# --- composing -------------------------------------------------------------------------------


def test_default_config_is_the_transformer_through_all_stages() -> None:
    typed = validate(jaxaot.compose())
    assert isinstance(typed, JaxaotConfig)
    assert typed.program.name == "transformer"
    assert (typed.start_at, typed.stop_after) == ("stage_out", "execute")
    assert typed.compile.backend == "cpu"


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        (["program.target=jax.numpy:einsum", "program.args=[f32[2]]"], "einsum"),
        (["program=mlp", "program.target=jax.nn.functions:relu"], "relu"),
        (["program.target=pkg.mod:Model.apply", "program.args=[f32[2]]"], "apply"),
        (["program.target=jax.numpy:einsum", "program.args=[f32[2]]", "program.name=mm"], "mm"),
        (["program=mlp"], "mlp"),
    ],
)
def test_a_retargeted_program_is_named_after_its_function(overrides: list[str], name: str) -> None:
    assert jaxaot.compose(overrides).program.name == name


def test_typed_config_is_frozen_and_json_ready() -> None:
    typed = validate(jaxaot.compose(["program=axpy"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.stop_after = "lower"  # type: ignore[misc]
    plain = to_container(typed)
    assert json.loads(json.dumps(plain)) == plain
    assert plain["program"]["args"] == [3, 4]


def test_stage_out_static_args_default_to_the_programs() -> None:
    typed = validate(jaxaot.compose(["program=attention"]))
    assert typed.stage_out.static_argnames == ["is_causal"]
    assert typed.stage_out.static_argnums == []
    override = validate(jaxaot.compose(["program=axpy", "stage_out.static_argnums=[0]"]))
    assert override.stage_out.static_argnums == [0]


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        (
            "compile.compiler_options={xla_cpu_enable_fast_math:true}",
            "compile.compiler_options",
            {"xla_cpu_enable_fast_math": True},
        ),
        (
            "compile.compiler_options.xla_cpu_enable_fast_math=true",
            "compile.compiler_options",
            {"xla_cpu_enable_fast_math": True},
        ),
        ("program.kwargs={y:2}", "program.kwargs", {"y": 2}),
        ("execute.inputs=[a.npy,3]", "execute.inputs", ["a.npy", 3]),
        ("lower.platforms=[cpu,tpu]", "lower.platforms", ["cpu", "tpu"]),
    ],
)
def test_free_form_dict_and_list_overrides(override: str, key: str, value: Any) -> None:
    # A user sets compile.compiler_options={...} on the command line.
    typed = validate(jaxaot.compose(["program=axpy", override]))
    section, _, name = key.partition(".")
    assert getattr(getattr(typed, section), name) == value


# --- rejected, naming the key ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (_cfg(compile={"bogus": 1}), r"^compile\.bogus: Key 'bogus' not in 'CompileConfig'"),
        (
            _cfg(execute={"repeats": "abc"}),
            r"^execute\.repeats: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (_cfg(debug="maybe"), r"^debug: Value 'maybe' is not a valid bool"),
        (
            {"program": {**_PROGRAM, "bogus": 2}},
            r"^program\.bogus: Key 'bogus' not in 'ProgramConfig'",
        ),
        ({"program": {"name": "p"}}, r"missing mandatory value: target"),
        ({}, r"missing mandatory value: program"),
    ],
)
def test_unknown_keys_and_wrong_types(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+foo=bar",
            "foo: unknown key; the top level has compile, debug, execute, jax, lower, mesh, "
            "program, resume_from, snapshot, stage_out, start_at, stop_after, store, trust, verbose",
        ),
        (
            "+program.zz=1",
            "program.zz: unknown key; program has args, axis_env, description, kwargs, "
            "name, static_argnames, static_argnums, target",
        ),
        ("+trust.allow=[os]", "trust.allow: unknown key; trust has allow_imports, deny_imports"),
    ],
)
def test_a_key_added_with_plus_is_unknown_naming_it(override: str, message: str) -> None:
    # Hydra lets `+key=value` add a key to the typed config; it is an unknown key, not an
    # "internal error: FrozenInstanceError" from building the frozen dataclass.
    with pytest.raises(ConfigError) as info:
        validate(jaxaot.compose(["program=axpy", override]))
    assert str(info.value) == message


def test_a_key_added_to_a_free_form_dict_is_kept() -> None:
    typed = validate(jaxaot.compose(["program=axpy", "+compile.compiler_options.xla_x=1"]))
    assert typed.compile.compiler_options == {"xla_x": 1}


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            _cfg(stop_after="link"),
            r"^stop_after: expected one of stage_out, lower, compile, execute, found 'link'",
        ),
        (
            _cfg(start_at="later"),
            r"^start_at: expected one of stage_out, lower, compile, execute, found 'later'",
        ),
        (
            _cfg(start_at="compile", stop_after="lower", resume_from="r"),
            r"start_at='compile' comes after stop_after='lower'",
        ),
        (_cfg(start_at="lower"), r"start_at='lower' needs resume_from=<run dir>"),
        (
            {"program": {**_PROGRAM, "target": "pkg.mod.fn"}},
            r"^program\.target: expected 'package\.module:function', found 'pkg\.mod\.fn'",
        ),
        (
            _cfg(stage_out={"static_argnums": [-1]}),
            r"^stage_out\.static_argnums: expected non-negative argument positions, found -1",
        ),
        (
            _cfg(lower={"donate_argnums": [1, 1]}),
            r"^lower\.donate_argnums: expected distinct positions, found \[1, 1\]",
        ),
        (
            _cfg(compile={"backend": "metal"}),
            r"^compile\.backend: expected one of cpu, gpu, cuda, rocm, tpu, found 'metal'",
        ),
        (
            _cfg(lower={"platforms": ["c-p-u"]}),
            r"^lower\.platforms: expected platform names \(e\.g\. cpu, cuda, rocm, tpu\), found 'c-p-u'",
        ),
        (
            _cfg(lower={"platforms": []}),
            r"^lower\.platforms: expected at least one platform or null, found \[\]",
        ),
        (_cfg(compile={"num_devices": 0}), r"^compile\.num_devices: expected >= 1, found 0"),
        (
            _cfg(execute={"check": "golden"}),
            r"^execute\.check: expected one of none, reference, found 'golden'",
        ),
        (_cfg(execute={"warmup": -1}), r"^execute\.warmup: expected >= 0, found -1"),
        (_cfg(execute={"repeats": 0}), r"^execute\.repeats: expected >= 1, found 0"),
        (
            _cfg(execute={"rtol": -1}),
            r"^execute\.rtol: expected a finite number >= 0 or null, found -1\.0;",
        ),
        (
            _cfg(execute={"atol": -0.5}),
            r"^execute\.atol: expected a finite number >= 0 or null, found -0\.5;",
        ),
        (
            _cfg(execute={"rtol": float("nan")}),
            r"^execute\.rtol: expected a finite number >= 0 or null, found nan; null takes the "
            r"output dtype's default, execute\.check=none skips the comparison$",
        ),
        (
            _cfg(execute={"atol": float("inf")}),
            r"^execute\.atol: expected a finite number >= 0 or null, found inf;",
        ),
    ],
)
def test_check_errors(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_composed_bad_values_are_rejected_by_run_before_any_stage(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"^execute\.repeats: expected >= 1, found 0"):
        jaxaot.run(jaxaot.compose(["program=axpy", "execute.repeats=0"]), run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


_NO_JAX = textwrap.dedent(
    """
    import sys
    import jaxaot
    from jaxaot.errors import ArgSpecError, ConfigError

    bad = [
        (["program=axpy", "stop_after=link"], ConfigError, "stop_after"),
        (["program=axpy", "compile.backend=metal"], ConfigError, "compile.backend"),
        (["program=axpy", "program.args=[x32[3]]"], ArgSpecError, "unknown dtype 'x32'"),
        (["program=axpy", "program.args=[ij,1]"], ArgSpecError, "static_argnums"),
        (["program=axpy", "stage_out.static_argnums=[7]"], ConfigError, "out of range"),
        (["program=axpy", "+jax.config.jax_enable_x64=banana"], ConfigError, "found 'banana'"),
        (["program=axpy", "program.args=[f32[1e3],1]"], ArgSpecError, "dimension '1e3'"),
        (["program=axpy", "program.args=[f32[]~heavy,1]"], ArgSpecError, "suffix '~heavy'"),
        (["program=axpy", "execute.rtol=nan"], ConfigError, "execute.rtol"),
    ]
    for overrides, error, words in bad:
        try:
            jaxaot.run(jaxaot.compose(overrides), run_dir="never")
        except error as exc:
            assert words in str(exc), (words, str(exc))
        else:
            raise AssertionError(f"{overrides} was accepted")
    try:
        jaxaot.validate({"program": {"name": "p", "target": "m:f"}, "execute": {"bogus": 1}})
    except ConfigError as exc:
        assert "execute.bogus" in str(exc), str(exc)
    loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
    print("JAX MODULES:", loaded)
    """
)


def test_bad_configs_fail_before_jax_is_imported(tmp_path: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_JAX],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "JAX MODULES: []" in proc.stdout
    assert not (tmp_path / "never").exists()


def test_the_cli_says_unknown_key_for_a_plus_override_in_one_line(tmp_path: Any) -> None:
    proc = run_cli(["program=axpy", "+foo=bar", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "jaxaot: error: foo: unknown key; the top level has compile, debug, execute, jax, lower, mesh, "
        "program, resume_from, snapshot, stage_out, start_at, stop_after, store, trust, verbose"
    ]
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_register_configs_keeps_its_entries_and_restores_a_removed_one() -> None:
    """register_configs runs once per run; a second run in one process (the jaxaot server's
    children) keeps the entries it made instead of rebuilding every schema (~50 ms)."""
    from hydra.core.config_store import ConfigStore
    from jaxaot.schema import register_configs

    register_configs()
    repo = ConfigStore.instance().repo
    first, program = repo["base_config.yaml"], repo["program"]["base_program.yaml"]
    register_configs()
    assert repo["base_config.yaml"] is first and repo["program"]["base_program.yaml"] is program
    del repo["base_config.yaml"]
    register_configs()
    again = ConfigStore.instance().repo["base_config.yaml"]
    assert again is not first and again.node == first.node
