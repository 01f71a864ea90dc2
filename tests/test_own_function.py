"""A changed program.target gets its arguments from the user, never from the program it
replaced (pipeline/engine/own_args.py)."""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env, run_cli
from jaxaot.errors import ConfigError
from omegaconf import OmegaConf

MODULE = textwrap.dedent(
    """
    import jax.numpy as jnp

    def loss(params, tokens, n):
        return jnp.sum(params) * n

    def argless():
        return jnp.ones(3)

    def keyword_only(*, x):
        return x * 2

    def optional(x=None):
        return jnp.zeros(2)

    def scaled(x, mode: str, n: int, *, k: "float"):
        for _ in range(n):
            x = jnp.tanh(x) + k
        return x * 2 if mode == "double" else x
    """
)


@pytest.fixture
def own_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user's module ``ownmod_<n>`` importable from ``tmp_path`` (the user's own code)."""
    name = f"ownmod_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


FILL_IN = (
    "with each <...> an array spec such as f32[256,256] or a literal such as 3, and a parameter "
    "used as a Python value (a string, range(n)) in stage_out.static_argnums"
)


def test_a_target_without_args_names_its_parameters_and_one_placeholder_each(
    own_module: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        _run([f"program.target={own_module}:loss"])
    assert str(info.value) == (
        f"program.args: {own_module}:loss takes (params, tokens, n) and program.args was not "
        "given; the arguments composed are program=transformer's, for "
        "jaxaot.examples.transformer:forward. Fix: "
        f"program.target={own_module}:loss 'program.args=[<params>,<tokens>,<n>]' {FILL_IN}; "
        "or program=transformer to keep its arguments"
    )


def _run(overrides: list[str]) -> None:
    """compose() then run(): a refusal waits for run(), as program.args may be set in Python."""
    jaxaot.run(jaxaot.compose(overrides), run_dir=Path(tempfile.mkdtemp()) / "run")


def _fix(message: str) -> str:
    """The command a refusal says to run: after ``Fix: ``, before the words on filling it in."""
    return message.split("Fix: ", 1)[1].split(" with each <...>", 1)[0]


def test_the_fix_filled_in_runs(own_module: str, tmp_path: Path) -> None:
    """Python-typed parameters (``mode: str``, ``n: int``, ``k: "float"``) are asked for as
    Python values and made static: the command, its placeholders replaced, traces as given."""
    with pytest.raises(ConfigError) as info:
        _run([f"program.target={own_module}:scaled"])
    fix = _fix(str(info.value))
    assert fix == (
        f"program.target={own_module}:scaled 'program.args=[<x>,\"<mode>\",<n:int>]' "
        "'+program.kwargs.k=<k:float>' stage_out.static_argnums=[1,2] "
        "stage_out.static_argnames=[k]"
    )
    for placeholder, value in (("<x>", "f32[4]"), ("<mode>", "double"), ("<n:int>", "2")):
        fix = fix.replace(placeholder, value)
    cfg = jaxaot.compose([*shlex.split(fix.replace("<k:float>", "0.5")), "stop_after=stage_out"])
    jaxaot.run(cfg, run_dir=tmp_path / "run")
    signature = json.loads((tmp_path / "run" / "stage_out" / "signature.json").read_text())
    assert signature["static"] == [
        {"path": "args[1]", "value": "double"},
        {"path": "args[2]", "value": 2},
        {"path": "kwargs['k']", "value": 0.5},
    ]
    assert [leaf["path"] for leaf in signature["inputs"]] == ["args[0]"]


def test_a_library_function_is_refused_with_its_variadic_parameter() -> None:
    with pytest.raises(ConfigError) as info:
        _run(["program.target=jax.numpy:einsum"])
    text = str(info.value)
    assert text.startswith("program.args: jax.numpy:einsum takes (subscripts, *operands, ...)")
    assert _fix(text) == "program.target=jax.numpy:einsum 'program.args=[<subscripts>,<*operands>]'"
    assert text.endswith(
        f"{FILL_IN} (<*operands>: any number of them); or program=transformer to keep its arguments"
    )


def test_a_target_that_cannot_be_imported_leads_with_why() -> None:
    with pytest.raises(ConfigError) as info:
        _run(["program.target=no_such_module_xyz:f"])
    text = str(info.value)
    assert text.startswith(
        "program.target='no_such_module_xyz:f': cannot import module 'no_such_module_xyz' "
        "(No module named 'no_such_module_xyz'); is its package installed, on PYTHONPATH or in "
        "the current directory? program.args was not given either (the arguments composed are "
        "program=transformer's, for jaxaot.examples.transformer:forward). Fix: "
        "program.target=no_such_module_xyz:f 'program.args=[<one per parameter>]' with each"
    ), text
    assert text.endswith("; or program=transformer to keep its arguments")


def test_a_target_the_policy_refuses_is_refused_naming_it() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^program.target='yaml:unsafe_load' imports 'yaml.unsafe_load', which the "
        r"import policy does not allow: .* program.args was not given either",
    ):
        _run(["program.target=yaml:unsafe_load"])


def test_a_keyword_only_parameter_is_asked_for_as_a_keyword(own_module: str) -> None:
    with pytest.raises(ConfigError) as info:
        _run([f"program.target={own_module}:keyword_only"])
    assert str(info.value).startswith(
        f"program.kwargs: {own_module}:keyword_only takes (*, x) and program.kwargs was not given"
    )
    assert f"Fix: program.target={own_module}:keyword_only '+program.kwargs.x=<x>' with" in str(
        info.value
    )


@pytest.mark.parametrize("function", ["argless", "optional"])
def test_a_function_without_required_parameters_gets_no_arguments(
    own_module: str, function: str
) -> None:
    cfg = jaxaot.compose([f"program.target={own_module}:{function}"])
    assert OmegaConf.to_container(cfg.program.args) == []
    assert OmegaConf.to_container(cfg.program.kwargs) == {}
    assert cfg.program.name == function


@pytest.mark.parametrize(
    "overrides",
    [
        ["'program.args=[f32[3],f32[3],i32[]]'"],  # given on the command line
        ["program=transformer"],  # named: its arguments, on purpose
        ["program=mlp", "program.args=[f32[3],f32[3],3]"],
        # given, and equal to a shipped option's (axpy's [3, 4]): still the user's
        ["program.args=[3, 4]"],
    ],
)
def test_arguments_the_user_chose_are_kept(own_module: str, overrides: list[str]) -> None:
    cfg = jaxaot.compose([f"program.target={own_module}:loss", *[o.strip("'") for o in overrides]])
    assert cfg.program.target == f"{own_module}:loss" and cfg.program.name == "loss"


def test_experiments_and_shipped_programs_compose() -> None:
    for overrides in (
        [],
        ["program=mlp"],
        ["experiment=decoder_8b"],
        ["experiment=llama3_8b"],
        ["experiment=transformer_dp_mp"],
    ):
        jaxaot.compose(overrides)


def test_the_cli_prints_the_refusal_in_one_line_and_runs_nothing(
    own_module: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [f"program.target={own_module}:loss", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=cli_env(PYTHONPATH=f"{tmp_path}:{cli_env()['PYTHONPATH']}"),
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"jaxaot: error: program.args: {own_module}:loss takes (params, tokens, n) and "
        "program.args was not given; the arguments composed are program=transformer's, for "
        "jaxaot.examples.transformer:forward. Fix: "
        f"program.target={own_module}:loss 'program.args=[<params>,<tokens>,<n>]' {FILL_IN}; "
        "or program=transformer to keep its arguments"
    ], proc.stderr
    assert not (run_dir / "manifest.json").exists()


def test_compose_leaves_program_args_to_python(own_module: str, tmp_path: Path) -> None:
    """compose() with a new target and no program.args, then the arguments set in Python (as
    compose's docstring shows): it runs; left unset, run() refuses before anything starts."""
    import jax
    import jax.numpy as jnp

    cfg = jaxaot.compose([f"program.target={own_module}:loss", "stop_after=stage_out"])
    cfg.program.args = [jax.ShapeDtypeStruct((3,), jnp.float32), jnp.ones(2), 2]
    cfg.stage_out.static_argnums = [2]
    result = jaxaot.run(cfg, run_dir=tmp_path / "set")
    assert result.manifest["stages"]["stage_out"]["status"] == "ran"
    unset = jaxaot.compose([f"program.target={own_module}:loss", "stop_after=stage_out"])
    with pytest.raises(ConfigError, match=rf"^program.args: {own_module}:loss takes"):
        jaxaot.run(unset, run_dir=tmp_path / "unset")
    assert not (tmp_path / "unset").exists()


def test_a_config_file_that_swaps_the_target_keeps_its_programs_arguments(tmp_path: Path) -> None:
    """An experiment choosing program=transformer and its own target (a variant taking the
    transformer's arguments) is the user's choice: only a program.target override is checked."""
    (tmp_path / "variant_mod.py").write_text("def fwd(params, tokens):\n    return tokens * 2\n")
    exp = tmp_path / "cd" / "experiment"
    exp.mkdir(parents=True)
    (exp / "variant.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /program: transformer\n"
        "program:\n  target: variant_mod:fwd\n"
    )
    proc = run_cli(
        ["--config-dir", str(tmp_path / "cd"), "experiment=variant", "stop_after=stage_out"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "stage_out  ran" in proc.stdout
