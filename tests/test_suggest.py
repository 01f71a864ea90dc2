"""Did you mean (pipeline/config/suggest.py): mistyped groups, options and keys name the closest
ones in one line, and the internal ``base_*`` schemas are never listed nor selectable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jaxaot
import pytest
from conftest import run_cli
from jaxaot.config.suggest import (
    FREE,
    Names,
    closest,
    config_dirs_of,
    config_names,
    fix_key,
    internal_choices,
    is_internal,
    key_exists,
    keys_of,
    one_line,
    suggestion,
    unknown_name,
    unknown_option,
)
from jaxaot.errors import ConfigError
from jaxaot.schema import JaxaotConfig, register_configs, validate

# --- pure: a hand-made repository and key tree ----------------------------------------------

NAMES = Names(
    groups={
        "program": ("axpy", "mlp", "transformer"),
        "execute": ("default",),
        "hydra/launcher": ("basic", "joblib", "submitit_local"),
        "hydra/sweeper": ("basic", "jaxaot_optuna"),
        "sweeper": ("default",),
    },
    keys={
        "program": {"target": None, "args": None, "kwargs": FREE},
        "execute": {"repeats": None, "warmup": None},
        "stop_after": None,
        "debug": None,
        "hydra": {"job": {"name": None}},
    },
)


@pytest.mark.parametrize(
    ("path", "value", "line"),
    [
        (
            "progam",
            "mlp",
            "unknown config group 'progam' (did you mean program=mlp? groups: execute, program, sweeper)",
        ),
        (
            "progam",
            "mpl",
            "unknown config group 'progam' (did you mean program=mlp? groups: execute, program, sweeper)",
        ),
        (
            "progam",
            None,
            "unknown config group 'progam' (did you mean program? groups: execute, program, sweeper)",
        ),
        ("stop_afer", "lower", "unknown key 'stop_afer' (did you mean stop_after?)"),
        ("execute.repeat", "3", "unknown key 'execute.repeat' (did you mean execute.repeats?)"),
        ("progam.target", "a:b", "unknown key 'progam.target' (did you mean program.target?)"),
        ("hydra.job.nam", "x", "unknown key 'hydra.job.nam' (did you mean hydra.job.name?)"),
        (
            "hydra/launchr",
            "jobib",
            "unknown config group 'hydra/launchr' (did you mean hydra/launcher=joblib? groups: "
            "execute, hydra/launcher, hydra/sweeper, program, sweeper)",
        ),
        ("execute.zzzzzz", "1", "unknown key 'execute.zzzzzz' (execute has repeats, warmup)"),
        (
            "zzzzzz",
            "1",
            "unknown key or config group 'zzzzzz' (top-level keys: debug, execute, hydra, program, "
            "stop_after; groups: execute, program, sweeper)",
        ),
    ],
)
def test_an_unknown_name_gets_the_closest_names(path: str, value: str | None, line: str) -> None:
    assert unknown_name(path, value, NAMES) == line


def test_an_unknown_option_lists_the_options_without_internal_schemas() -> None:
    options = ("axpy", "base_program", "mlp", "transformer")
    assert unknown_option("program", "mpl", options) == (
        "program=mpl: no such option (did you mean mlp? options: axpy, mlp, transformer)"
    )
    assert unknown_option("program", "base_program", options) == (
        "program=base_program: base_program is an internal schema, not an option "
        "(options: axpy, mlp, transformer)"
    )
    assert unknown_option("program", "zzz", options, "experiment/mine") == (
        "program=zzz (in experiment/mine): no such option (options: axpy, mlp, transformer)"
    )


def test_an_option_of_a_namesake_group_names_that_group() -> None:
    """``sweeper=jaxaot_optuna``: jaxaot's own ``sweeper`` group has no such option, Hydra's
    ``hydra/sweeper`` has; a near name there counts too, a near name here comes first."""
    options = NAMES.groups["sweeper"]
    assert unknown_option("sweeper", "jaxaot_optuna", options, names=NAMES) == (
        "sweeper=jaxaot_optuna: no such option (did you mean hydra/sweeper=jaxaot_optuna? "
        "options: default)"
    )
    assert unknown_option("sweeper", "optuan", options, names=NAMES) == (
        "sweeper=optuan: no such option (did you mean hydra/sweeper=jaxaot_optuna? "
        "options: default)"
    )
    assert unknown_option("sweeper", "defalt", options, names=NAMES) == (
        "sweeper=defalt: no such option (did you mean default? options: default)"
    )
    assert unknown_option("sweeper", "zzz", options, names=NAMES) == (
        "sweeper=zzz: no such option (options: default)"
    )


def test_one_line_without_a_suggestion_joins_the_error_and_its_causes() -> None:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer\n    full_key: x.y\nConfig search path:\n\tpkg") from inner
    except ValueError as exc:
        assert one_line(exc, None) == "outer ('inner')"
        assert one_line(exc, NAMES) == "outer ('inner')"
    assert one_line(RuntimeError(), None) == "RuntimeError"


def test_closest_prefers_case_then_ratio_then_a_prefixed_tail() -> None:
    assert closest("Program", ["program", "progra"]) == ["program"]
    assert closest("repeat", ["repeats", "warmup"]) == ["repeats"]
    assert closest("optuan", ["basic", "jaxaot_optuna"]) == ["jaxaot_optuna"]
    assert closest("zzz", ["basic", "jaxaot_optuna"]) == []


def test_key_paths_walk_sections_and_accept_anything_in_free_mappings() -> None:
    assert key_exists("program.kwargs.anything.deep", NAMES.keys)
    assert key_exists("program.args[0]", NAMES.keys)
    assert not key_exists("execute.repeat", NAMES.keys)
    assert fix_key("progam.kwargs.x", NAMES.keys) == "program.kwargs.x"
    assert fix_key("exqqqq.repeats", NAMES.keys) is None


def test_the_schema_key_tree_has_sections_leaves_and_free_mappings() -> None:
    tree = keys_of(JaxaotConfig)
    assert tree["program"]["kwargs"] == FREE and tree["program"]["target"] is None
    assert tree["compile"]["compiler_options"] == FREE
    assert "repeats" in tree["execute"] and tree["stop_after"] is None


def test_other_errors_get_no_suggestion() -> None:
    assert suggestion(ValueError("something else"), NAMES) is None


def test_config_dirs_are_read_from_the_command_line(tmp_path: Path) -> None:
    argv = ["-cd", str(tmp_path), "--config-dir=/no/such/dir", "program=mlp"]
    assert config_dirs_of(argv) == [str(tmp_path)]


# --- the shipped config: Hydra's own errors through suggestion() ----------------------------


def _composition_error(*overrides: str) -> BaseException:
    with pytest.raises(Exception) as info:
        jaxaot.compose(list(overrides))
    return info.value


@pytest.fixture(scope="module")
def names() -> Names:
    register_configs()
    return config_names(schema=JaxaotConfig)


@pytest.mark.extra("sweep")  # joblib's launcher config comes with the sweep extra
def test_the_shipped_groups_leave_out_internal_schemas(names: Names) -> None:
    assert "mlp" in names.groups["program"] and "joblib" in names.groups["hydra/launcher"]
    assert not any(o.startswith("base_") for opts in names.groups.values() for o in opts)
    assert "trust" not in names.groups and "hydra" not in names.groups  # schema-only groups


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["progam=mlp"], "unknown config group 'progam' (did you mean program=mlp? groups: "),
        (["execute.repeat=3"], "unknown key 'execute.repeat' (did you mean execute.repeats?)"),
        (["stop_afer=lower"], "unknown key 'stop_afer' (did you mean stop_after?)"),
        (["~execute.repet"], "unknown key 'execute.repet' (did you mean execute.repeats?)"),
        (
            ["program=mpl"],
            "program=mpl: no such option (did you mean mlp? options: attention, axpy, ",
        ),
        (
            ["hydra/launcher=jobib"],
            "hydra/launcher=jobib: no such option (did you mean joblib? options: basic, ",
        ),
        (
            ["hydra/sweeper=optuan"],
            "hydra/sweeper=optuan: no such option (did you mean jaxaot_optuna? options: ",
        ),
        (
            ["hydra/launchr=joblib"],
            "unknown config group 'hydra/launchr' (did you mean hydra/launcher=joblib? groups: ",
        ),
    ],
)
def test_hydra_s_errors_become_did_you_mean(names: Names, overrides: list[str], line: str) -> None:
    got = suggestion(_composition_error(*overrides), names)
    assert got is not None and got.startswith(line), got
    assert "base_" not in got and "\n" not in got


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+execute.repet=3", "unknown key 'execute.repet' (did you mean execute.repeats?)"),
        ("+progam=mlp", "unknown config group 'progam' (did you mean program=mlp? groups: "),
        ("+stop_afer=lower", "unknown key 'stop_afer' (did you mean stop_after?)"),
    ],
)
def test_a_mistyped_plus_key_names_the_closest(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(jaxaot.compose(["program=axpy", override]))
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["progam=mlp"], "unknown config group 'progam' (did you mean program=mlp? groups: "),
        (["program=mpl"], "program=mpl: no such option (did you mean mlp? options: attention, "),
        (["+execute.repet=3"], "unknown key 'execute.repet' (did you mean execute.repeats?)"),
        (
            ["sweeper=jaxaot_optuna"],
            "sweeper=jaxaot_optuna: no such option (did you mean hydra/sweeper=jaxaot_optuna? ",
        ),
    ],
)
def test_compose_raises_the_cli_s_line(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as info:
        jaxaot.compose(overrides)
    text = str(info.value)
    assert text.startswith(line) and "base_" not in text and "To append" not in text, text


def test_an_internal_schema_is_not_an_option() -> None:
    with pytest.raises(ConfigError, match=r"^program=base_program: base_program is an internal "):
        jaxaot.compose(["program=base_program"])
    assert internal_choices(["mesh=base_mesh"]) is not None
    assert internal_choices(["program=mlp", "resume_from=base_x"]) is None


# --- the command line: one line on stderr ------------------------------------------------------


def _stderr_lines(proc: Any) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("jaxaot:")]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["progam=mlp"],
            "jaxaot: error: unknown config group 'progam' (did you mean program=mlp? groups: ",
        ),
        (
            ["execute.repeat=3"],
            "jaxaot: error: unknown key 'execute.repeat' (did you mean execute.repeats?)",
        ),
        (
            ["program=base_program"],
            "jaxaot: error: program=base_program: base_program is an internal",
        ),
        (
            ["-m", "sweeper=jaxaot_optuna", "program=axpy"],
            "jaxaot: error: sweeper=jaxaot_optuna: no such option (did you mean "
            "hydra/sweeper=jaxaot_optuna? options: default)",
        ),
    ],
)
def test_the_cli_prints_one_did_you_mean_line(tmp_path: Path, args: list[str], line: str) -> None:
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 1
    [got] = _stderr_lines(proc)
    assert got.startswith(line), proc.stderr
    assert "+progam" not in proc.stderr and "To append" not in proc.stderr


def test_a_users_own_base_named_option_is_an_option(tmp_path: Path) -> None:
    """Only jaxaot's registered schemas are internal: a user's base_small.yaml (--config-dir) is
    chosen like any option, and a typo of it is 'no such option', not 'internal schema'."""
    (tmp_path / "cd" / "program").mkdir(parents=True)
    (tmp_path / "cd" / "program" / "base_small.yaml").write_text(
        "defaults:\n  - axpy\n  - _self_\nname: base_small\n"
    )
    register_configs()
    assert not is_internal("base_small", "program") and is_internal("base_program", "program")
    ok = run_cli(
        ["--config-dir", str(tmp_path / "cd"), "program=base_small", "stop_after=stage_out"],
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    typo = run_cli(["--config-dir", str(tmp_path / "cd"), "program=base_smal"], cwd=tmp_path)
    assert "internal schema" not in typo.stderr and "did you mean base_small?" in typo.stderr
