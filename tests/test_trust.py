"""The import policy (``jaxaot.config.trust``): an allow list, set from the user's side only,
over every name jaxaot or Hydra imports. Each bypass an audit found has a test here that runs
it the way it ran and shows it refused: nothing imported, nothing run, one line."""

from __future__ import annotations

import functools
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import jaxaot
import numpy as np
import pytest
from conftest import REPO, cli_env, run_cli
from jaxaot.config.trust import (
    BUILTIN_RULES,
    ENV_COMMAND_LINE,
    install_instantiation_guards,
    make_policy,
    user_policy,
)
from jaxaot.config.xla_metadata import Scoped
from jaxaot.errors import ConfigError, TargetError
from jaxaot.stages.stage_out import resolve_target


@pytest.fixture(autouse=True)
def users_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No rules from the developer's own environment or user file; the user file's folder."""
    for name in ("JAXAOT_ALLOW_IMPORTS", "JAXAOT_TRUST_STORE", ENV_COMMAND_LINE):
        monkeypatch.delenv(name, raising=False)
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    return xdg / "jaxaot"


def _validate(*overrides: str) -> Any:
    return jaxaot.validate(jaxaot.compose(["program=axpy", *overrides]))


def _allow_line(name: str) -> str:
    return (
        f"if you trust it, add trust.allow_imports=[{name}] to the command line or set "
        f"JAXAOT_ALLOW_IMPORTS={name}"
    )


# --- the default is an allow list ------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        # Not on the old deny list, and each ran code or touched files with exit 0.
        "yaml:unsafe_load",
        "timeit:timeit",
        "cProfile:run",
        "profile:run",
        "distutils.spawn:spawn",
        pytest.param("joblib:load", marks=pytest.mark.extra("sweep")),
        "logging.config:fileConfig",
        "numpy:fromfile",
        "gzip:open",
        "urllib.request:urlopen",
        # The old deny list's, still refused.
        "os:system",
        "subprocess:run",
        "builtins:eval",
        "builtins:__import__",
        "importlib:import_module",
        "pickle:loads",
        "ctypes:CDLL",
        "socket:socket",
        "shutil:rmtree",
        "numpy:load",
    ],
)
def test_names_outside_the_allow_list_are_refused(target: str) -> None:
    with pytest.raises(ConfigError) as info:
        _validate(f"program.target={target}")
    message = str(info.value)
    name = target.replace(":", ".")
    assert message.startswith(
        f"program.target={target!r} imports {name!r}, which the import policy does not allow: "
        f"{name.split('.')[0]!r} is "
    )
    assert "neither the JAX ecosystem nor this project's own code" in message
    assert message.endswith(_allow_line(name))
    assert "\n" not in message


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        ("jax.numpy:load", "jax.numpy.load"),
        ("jax.numpy:save", "jax.numpy.save"),
        ("jax.profiler:start_trace", "jax.profiler"),
        ("jax.profiler:start_server", "jax.profiler"),
        (
            "jax.experimental.serialize_executable:deserialize_and_load",
            "jax.experimental.serialize_executable",
        ),
        ("jax.config:update", "jax.config"),
        ("jax:print_environment_info", "jax.print_environment_info"),
        ("jax.distributed:initialize", "jax.distributed"),
        (
            "jax.experimental.compilation_cache.compilation_cache:set_cache_dir",
            "jax.experimental.compilation_cache",
        ),
        ("jax._src.numpy.lax_numpy:load", "jax._src.numpy.lax_numpy.load"),
        ("flax.training.checkpoints:restore_checkpoint", "flax.training.checkpoints"),
        ("equinox:tree_deserialise_leaves", "equinox.tree_deserialise_leaves"),
    ],
)
def test_file_process_network_and_pickle_surfaces_of_allowed_packages_are_refused(
    target: str, rule: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _validate(f"program.target={target}")
    name = target.replace(":", ".")
    why = next(r.why for r in BUILTIN_RULES if r.prefix == rule and not r.allow)
    assert str(info.value) == (
        f"program.target={target!r} imports {name!r}, which the import policy refuses "
        f"(rule {rule!r}: {why}); {_allow_line(name)}"
    )


@pytest.mark.parametrize(
    ("target", "resolved"),
    [
        ("jax.numpy:can_cast", "numpy.can_cast"),  # jax.numpy re-exports some of NumPy's
        ("jax.numpy:array_repr", "numpy.array_repr"),
        ("jax:devices", "jax._src.xla_bridge.devices"),
    ],
)
def test_an_allowed_looking_name_that_resolves_outside_is_refused(
    target: str, resolved: str
) -> None:
    with pytest.raises(TargetError) as info:
        resolve_target(target, policy=make_policy())
    assert str(info.value).startswith(f"program.target={target!r} resolves to {resolved!r}, which")


@pytest.mark.parametrize(
    "target",
    [
        "jax.numpy:einsum",
        "jax.nn:dot_product_attention",
        "jax.lax:add",
        "jax.scipy.special:logsumexp",
        "jax.random:normal",
        "jaxaot.examples.axpy:axpy",
        "jaxaot.examples.transformer:_rms_norm",
    ],
)
def test_the_jax_ecosystem_and_the_examples_are_allowed(target: str) -> None:
    assert callable(resolve_target(target, policy=make_policy()))
    _validate(f"program.target={target}")


def test_every_shipped_hydra_callback_passes_the_default() -> None:
    # Every shipped program passes it: tests/test_shipped_configs.py, which composes and
    # validates each one.
    policy = make_policy()
    for name in (
        "jaxaot.sweeps.callbacks.SweepCallback",
        "jaxaot.sweeps.snapshot_check.SnapshotSweepCheck",
    ):
        assert policy.decide(name, "hydra").allowed
        assert not policy.decide(name, "target").allowed  # a Hydra callback, not a program


def test_a_rule_matches_whole_components_and_the_longest_decides() -> None:
    policy = make_policy(["os.path"], ["jax.numpy"])
    assert policy.decide("os.path.join").allowed
    assert not policy.decide("os.system").allowed
    assert not policy.decide("jax.numpy.einsum").allowed  # the user's deny beats "jax"
    assert policy.decide("jax.lax.add").allowed
    assert not make_policy().decide("jaxtyping.Array").allowed  # "jax" is not a prefix of it
    # A user rule beats a built-in one of the same length; "*" drops the built-in rules.
    assert make_policy(["jax.profiler"]).decide("jax.profiler.start_trace").allowed
    star = make_policy(["*"], ["subprocess"])
    assert star.decide("os.system").allowed
    assert not star.decide("subprocess.run").allowed


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["trust.allow_imports=[os]", "trust.deny_imports=[os]"],
            r"^trust\.allow_imports and trust\.deny_imports both list \['os'\]",
        ),
        (
            ["trust.allow_imports=['os path']"],
            r"^trust\.allow_imports: expected dotted module prefixes",
        ),
        (["trust.deny_imports=['']"], r"^trust\.deny_imports: expected dotted module prefixes"),
    ],
)
def test_bad_rules_are_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _validate(*overrides)


def test_a_dunder_path_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"reaches through the dunder attribute '__class__'"):
        _validate("program.target=jaxaot.examples.axpy:axpy.__class__")


# --- the user's own code ---------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder on sys.path with modules that re-export dangerous names."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "trust_alias_mod.py").write_text(
        textwrap.dedent(
            """
            import functools
            import os
            run = os.system
            evaluate = eval
            later = functools.partial(os.system, "true")
            def double(x):
                return x * 2
            """
        )
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "trust_alias_mod", raising=False)
    return folder


def test_the_projects_own_modules_are_allowed(project: Path) -> None:
    assert callable(resolve_target("trust_alias_mod:double", policy=make_policy()))


@pytest.mark.parametrize(
    ("attr", "resolved"),
    [
        ("os.system", "os"),
        ("run", "posix.system"),
        ("evaluate", "builtins.eval"),
        ("later", "posix.system"),
    ],
)
def test_what_user_code_resolves_to_is_judged_too(project: Path, attr: str, resolved: str) -> None:
    target = f"trust_alias_mod:{attr}"
    with pytest.raises(TargetError) as info:
        resolve_target(target, policy=make_policy())
    assert str(info.value).startswith(f"program.target={target!r} resolves to {resolved!r}")
    assert _allow_line(f"trust_alias_mod.{attr}") in str(info.value)
    # Allowed explicitly, the name is trusted with whatever it resolves to.
    assert callable(resolve_target(target, policy=make_policy([f"trust_alias_mod.{attr}"])))


def test_a_scoped_target_is_resolved_under_its_configs_policy(project: Path) -> None:
    from jaxaot.stages.jax_metadata import with_metadata

    entry = Scoped("trust_alias_mod:run", fuse_limit=True, policy=make_policy())
    refused = pytest.raises(TargetError, match=r"lower\.scoped_metadata\[0\]\.target=.*resolves to")
    with refused, with_metadata({}, [entry]):
        pass


def test_a_denied_module_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "trust_marker_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef f(x):\n    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"which trust\.deny_imports refuses"):
        jaxaot.run(
            jaxaot.compose(
                [
                    "program=axpy",
                    "program.target=trust_marker_mod:f",
                    "trust.deny_imports=[trust_marker_mod]",
                ]
            ),
            run_dir=tmp_path / "run",
        )
    assert not marker.exists() and "trust_marker_mod" not in sys.modules
    assert not (tmp_path / "run").exists()


def test_project_modules_named_like_the_standard_librarys_are_user_code(tmp_path: Path) -> None:
    """A project's ``code.py`` and ``nt.py`` run (the old deny list refused them); the
    standard library's ``code`` is refused, and so is ``io`` whatever the project holds:
    Python imports its own at start-up, so that name always means the standard library's."""
    user = tmp_path / "user"
    user.mkdir()
    for name in ("code", "nt"):
        (user / f"{name}.py").write_text("def f(x):\n    return x * 2\n")
    for name in ("code", "nt"):
        proc = run_cli(
            [
                f"program.target={name}:f",
                "program.args=[{shape: [3], dtype: f32, init: arange}]",
                f"hydra.run.dir={tmp_path / name}",
            ],
            cwd=user,
        )
        assert proc.returncode == 0, proc.stderr
        with np.load(tmp_path / name / "execute" / "outputs.npz") as out:
            np.testing.assert_array_equal(out["out0"], [0.0, 2.0, 4.0])
    (user / "io.py").write_text("def f(x):\n    return x\n")
    stdlib = run_cli(["program.target=code:interact", "program.args=[]"], cwd=tmp_path)
    assert stdlib.returncode == 1
    assert "'code' is the standard library's (" in stdlib.stderr, stdlib.stderr
    shadowed = run_cli(["program.target=io:f", "program.args=[f32[3]]"], cwd=user)
    assert shadowed.returncode == 1
    assert "'io' is the standard library's (frozen into Python)" in shadowed.stderr, shadowed.stderr


# --- the policy comes from the user's side only ----------------------------------------------


def test_allow_imports_on_the_command_line_lets_a_name_in_and_it_runs(compose_run: Any) -> None:
    with pytest.raises(ConfigError, match=r"trust\.allow_imports=\[builtins\.abs\]"):
        _validate("program.target=builtins:abs", "program.args=[f32[3]]")
    result = compose_run(
        "program=axpy",
        "program.target=builtins:abs",
        "program.args=[{shape: [3], dtype: f32, init: arange}]",
        "trust.allow_imports=[builtins.abs]",
    )
    assert result.ok
    with np.load(result.run_dir / "execute" / "outputs.npz") as out:
        np.testing.assert_array_equal(out["out0"], np.abs(np.arange(3, dtype=np.float32)))
    assert json.loads((result.run_dir / "manifest.json").read_text())["config"]["trust"] == {
        "allow_imports": ["builtins.abs"],
        "deny_imports": [],
    }


def test_the_environment_and_the_user_file_allow_and_deny(
    users_side: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXAOT_ALLOW_IMPORTS", "builtins.abs, operator")
    _validate("program.target=builtins:abs")
    _validate("program.target=operator:add")
    monkeypatch.delenv("JAXAOT_ALLOW_IMPORTS")
    users_side.mkdir(parents=True)
    (users_side / "trust.yaml").write_text(
        "allow_imports: [builtins.abs]\ndeny_imports: [jax.lax]\n"
    )
    _validate("program.target=builtins:abs")
    with pytest.raises(ConfigError) as info:
        _validate("program.target=jax.lax:add")
    assert str(info.value) == (
        f"program.target='jax.lax:add' imports 'jax.lax.add', which deny_imports in "
        f"{users_side / 'trust.yaml'} refuses (rule 'jax.lax')"
    )
    (users_side / "trust.yaml").write_text("allow: [x]\n")
    with pytest.raises(ConfigError, match=r"trust\.yaml: expected a mapping with allow_imports"):
        _validate()


@pytest.fixture
def travelling(tmp_path: Path) -> Path:
    """A config folder that travels, whose presets widen their own policy."""
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "open.yaml").write_text(
        "# @package _global_\ntrust:\n  allow_imports: ['*']\nprogram:\n  target: os:system\n"
    )
    (conf / "experiment" / "trusting.yaml").write_text(
        "# @package _global_\nstore:\n  trust: true\n"
    )
    (conf / "experiment" / "denying.yaml").write_text(
        "# @package _global_\ntrust:\n  deny_imports: [jax.numpy]\n"
    )
    (conf / "experiment" / "sweeps.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      trust.allow_imports: '[os]'\n"
    )
    (conf / "experiment" / "env.yaml").write_text(
        "# @package _global_\nhydra:\n  job:\n    env_set:\n      JAXAOT_ALLOW_IMPORTS: '*'\n"
    )
    return conf


def test_a_travelling_preset_widening_its_own_policy_runs_nothing(
    tmp_path: Path, travelling: Path
) -> None:
    marker = tmp_path / "pwned"
    proc = run_cli(
        [
            "--config-dir",
            str(travelling),
            "experiment=open",
            f"program.args=['touch {marker}']",
            "stage_out.static_argnums=[0]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        f"jaxaot: error: trust.allow_imports=['*'] comes from experiment/open.yaml in "
        f"file://{travelling}: only your command line, environment or "
        f"{tmp_path / 'xdg' / 'jaxaot' / 'trust.yaml'} may change what jaxaot trusts, never a "
        "config; if you trust it, give trust.allow_imports=['*'] on the command line or set "
        "JAXAOT_ALLOW_IMPORTS='*'"
    ]
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("preset", "message"),
    [
        (
            "trusting",
            r"^store\.trust=true comes from experiment/trusting\.yaml in file://.*JAXAOT_TRUST_STORE=1$",
        ),
        ("denying", r"^trust\.deny_imports=\[jax\.numpy\] comes from experiment/denying\.yaml"),
        ("sweeps", r"^hydra\.sweeper\.params\.trust\.allow_imports: a sweep parameter sets trust"),
        ("env", r"^hydra\.job\.env_set\.JAXAOT_ALLOW_IMPORTS='\*' \(from experiment/env\.yaml"),
    ],
)
def test_no_config_sets_trust_store_trust_sweeps_or_the_environment(
    travelling: Path, preset: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        jaxaot.compose(
            ["program=axpy", f"experiment={preset}"], config_dir=_with_shipped(travelling)
        )


def _with_shipped(conf: Path) -> Path:
    """``conf`` plus the shipped config, as one primary config folder (jaxaot.compose's
    ``config_dir`` replaces the shipped one)."""
    import shutil

    from jaxaot.api import conf_dir

    merged = conf.parent / "merged"
    if not merged.exists():
        shutil.copytree(conf_dir(), merged, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
        shutil.copytree(conf, merged, dirs_exist_ok=True)
    return merged


def test_the_command_line_wins_over_a_preset_and_is_what_the_run_records(travelling: Path) -> None:
    cfg = jaxaot.compose(
        ["program=axpy", "experiment=open", "trust.allow_imports=[os.getpid]"],
        config_dir=_with_shipped(travelling),
    )
    assert list(cfg.trust.allow_imports) == ["os.getpid"]


def test_store_trust_on_the_command_line_is_the_users(compose_run: Any) -> None:
    assert _validate("store.trust=true").store.trust is True


def test_the_user_file_may_not_lie_in_a_config_search_path(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "jaxaot").mkdir(parents=True)
    (conf / "jaxaot" / "trust.yaml").write_text("allow_imports: ['*']\n")
    proc = run_cli(
        [
            "--config-dir",
            str(conf),
            "program=axpy",
            "stop_after=stage_out",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
        env=cli_env(XDG_CONFIG_HOME=str(conf)),
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"jaxaot: error: {conf / 'jaxaot' / 'trust.yaml'} lies inside the config search path "
        f"file://{conf}: a config folder that travels would carry its own import policy; move "
        "the file out, or point XDG_CONFIG_HOME elsewhere"
    )


def test_a_sweep_over_the_policy_is_refused() -> None:
    from jaxaot.config.trust.sources import parse_argv

    with pytest.raises(ConfigError, match=r"^trust\.allow_imports: one value on the command line"):
        parse_argv(["-m", "trust.allow_imports=[a],[b]"])
    assert parse_argv(["-m", "trust.allow_imports=[a]", "store.trust=true"]).store_trust is True


def test_a_resumed_runs_config_does_not_widen_the_policy(compose_run: Any, tmp_path: Path) -> None:
    first = compose_run("program=axpy", "stop_after=compile").run_dir
    manifest = json.loads((first / "manifest.json").read_text())
    manifest["config"]["trust"] = {"allow_imports": ["*"], "deny_imports": []}
    manifest["config"]["program"]["target"] = "os:system"
    (first / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"^program\.target='os:system' imports 'os\.system'"):
        jaxaot.run(
            jaxaot.compose([f"resume_from={first}", "start_at=execute"]), run_dir=tmp_path / "again"
        )


# --- what Hydra instantiates -----------------------------------------------------------------


def _refused_and_not_run(proc: Any, marker: Path, key: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"jaxaot: error: {key}="), proc.stderr
    assert "'distutils.spawn.spawn', which the import policy does not allow" in lines[0]
    assert _allow_line("distutils.spawn.spawn") in lines[0]
    assert not marker.exists()


def test_a_nested_target_in_a_hydra_callback_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    callback = (
        "+hydra.callbacks.x={_target_: jaxaot.sweeps.callbacks.SweepCallback, "
        f"y: {{_target_: distutils.spawn.spawn, cmd: [touch, {marker}]}}}}"
    )
    proc = run_cli(["program=axpy", callback, f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    _refused_and_not_run(proc, marker, "hydra.callbacks.x.y._target_")


def test_a_nested_target_in_the_sweeper_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    sweeper = f"+hydra.sweeper.x={{_target_: distutils.spawn.spawn, cmd: [touch, {marker}]}}"
    proc = run_cli(
        ["-m", "program=axpy", sweeper, f"hydra.sweep.dir={tmp_path / 's'}"], cwd=tmp_path
    )
    _refused_and_not_run(proc, marker, "hydra.sweeper.x._target_")


def _run_with_job_logging(tmp_path: Path, config: str, *overrides: str) -> Any:
    """``jaxaot`` with ``hydra/job_logging=evil`` from a ``--config-dir`` holding ``config``."""
    conf = tmp_path / "conf" / "hydra" / "job_logging"
    conf.mkdir(parents=True)
    (conf / "evil.yaml").write_text(textwrap.dedent(config))
    return run_cli(
        [
            "--config-dir",
            str(tmp_path / "conf"),
            "hydra/job_logging=evil",
            "program=axpy",
            *overrides,
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
    )


def test_a_logging_factory_from_a_config_dir_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    proc = _run_with_job_logging(
        tmp_path,
        f"""
        version: 1
        handlers:
          console: {{class: logging.StreamHandler, stream: ext://sys.stdout}}
          x: {{"()": distutils.spawn.spawn, cmd: [touch, {marker}]}}
        root: {{handlers: [console]}}
        """,
    )
    _refused_and_not_run(proc, marker, "hydra.job_logging.handlers.x.()")
    assert "(from hydra/job_logging/evil.yaml in file://" in proc.stderr


def test_a_search_path_module_is_not_imported(tmp_path: Path) -> None:
    """``pkg://<module>`` makes Hydra import the module: the standard library's ``this``
    prints the Zen of Python when imported."""
    proc = run_cli(["program=axpy", "hydra.searchpath=[pkg://this]"], cwd=tmp_path)
    assert proc.returncode == 1
    assert "Beautiful is better" not in proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "jaxaot: error: hydra.searchpath entry 'pkg://this' (hydra.searchpath in command-line)="
        "'this' imports 'this', which the import policy does not allow"
    ), proc.stderr


def test_hydras_own_resolution_is_guarded_at_any_depth(tmp_path: Path) -> None:
    """Behind the composed-config check, Hydra's own resolution of ``_target_`` and of
    logging names goes through the policy too."""
    from hydra.utils import instantiate
    from jaxaot.compat.hydra import logging_configurator

    install_instantiation_guards()
    marker = tmp_path / "pwned"
    nested = {
        "_target_": "jax.numpy.zeros",
        "y": {"_target_": "distutils.spawn.spawn", "cmd": ["touch", str(marker)]},
    }
    with pytest.raises(
        ConfigError, match=r"^Hydra _target_ at y='distutils\.spawn\.spawn' imports"
    ):
        instantiate(nested)
    factory = {
        "version": 1,
        "handlers": {"x": {"()": "distutils.spawn.spawn", "cmd": ["touch", str(marker)]}},
    }
    with pytest.raises(ValueError) as info:
        logging_configurator()(factory).configure()
    assert "a Hydra logging config" in str(info.value.__cause__)
    assert not marker.exists()
    assert instantiate({"_target_": "jax.numpy.zeros", "shape": [2]}).shape == (2,)


def test_the_cli_refuses_yaml_unsafe_load_with_a_command_in_a_config_string(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    proc = run_cli(
        [
            "program=axpy",
            "program.target=yaml:unsafe_load",
            f"program.args=['!!python/object/apply:os.system [\"touch {marker}\"]']",
            "stage_out.static_argnums=[0]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "jaxaot: error: program.target='yaml:unsafe_load' imports 'yaml.unsafe_load', which the "
        "import policy does not allow: 'yaml' is an installed package ("
    )
    assert lines[0].endswith(_allow_line("yaml.unsafe_load"))
    assert not marker.exists()
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.extra("sweep")
def test_a_launched_jobs_policy_is_the_submitting_command_lines(tmp_path: Path) -> None:
    """A joblib worker runs the job under the command line that started the sweep."""
    marker = tmp_path / "pwned"
    args = [
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=1",
        "program=axpy",
        "program.target=os:system",
        f"program.args=['touch {marker}']",
        "stage_out.static_argnums=[0]",
        "execute.seed=1,2",
        # the target runs as it is traced; the later stages and the report's plots add nothing
        "stop_after=stage_out",
        "hydra.callbacks.sweep.plots=false",
    ]
    refused = run_cli([*args, f"hydra.sweep.dir={tmp_path / 's1'}"], cwd=tmp_path)
    assert refused.returncode == 1 and not marker.exists()
    assert "program.target='os:system' imports 'os.system'" in refused.stdout + refused.stderr
    allowed = run_cli(
        [*args, "trust.allow_imports=[os.system]", f"hydra.sweep.dir={tmp_path / 's2'}"],
        cwd=tmp_path,
    )
    assert allowed.returncode == 0, allowed.stderr
    assert marker.exists()


def test_the_readme_table_lists_every_built_in_rule() -> None:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Trust model") : text.index("## Sweeps, launchers")]
    missing = [r.prefix for r in BUILTIN_RULES if f"`{r.prefix}`" not in section]
    assert not missing, f"README's trust table leaves out {missing}"
    assert user_policy().rules == ()  # nothing from this test's environment


def test_partial_objects_are_judged_by_what_they_wrap() -> None:
    from jaxaot.config.trust.policy import resolved_names

    assert resolved_names([], functools.partial(os.system, "x"))[-1] == "posix.system"


# --- what a config may make a process write or run outside Python imports ----------------------


def test_a_logging_file_handler_from_a_config_dir_writes_only_log_files(tmp_path: Path) -> None:
    """A ``.pth`` file in site-packages is code Python runs at every start-up."""
    pth = tmp_path / "site" / "zz.pth"
    pth.parent.mkdir()
    proc = _run_with_job_logging(
        tmp_path,
        f"""
        version: 1
        formatters:
          code: {{format: "import os;os.system('touch {tmp_path / "pwned"}') #%(message)s"}}
        handlers:
          f: {{class: logging.FileHandler, formatter: code, filename: {pth}}}
        root: {{handlers: [f]}}
        """,
        "stop_after=stage_out",
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"jaxaot: error: hydra.job_logging.handlers.f.filename={str(pth)!r} (from "
        f"hydra/job_logging/evil.yaml in file://{tmp_path / 'conf'}) is a logging file handler's "
        "file not ending in .log: a log handler may write only *.log files (Python runs a .pth "
        "file's lines at start-up, a shell its rc file); name a file ending in .log"
    )
    assert not pth.exists() and not (tmp_path / "pwned").exists()
    default = run_cli(
        ["program=axpy", "stop_after=stage_out", f"hydra.run.dir={tmp_path / 'ok'}"],
        cwd=tmp_path,
    )
    assert default.returncode == 0, default.stderr
    assert (tmp_path / "ok" / "jaxaot.log").is_file()


def test_a_handler_filename_resolved_when_logging_is_configured_is_checked_too(
    tmp_path: Path,
) -> None:
    import logging.config

    install_instantiation_guards()
    pth = tmp_path / "zz.pth"
    configurator = logging.config.DictConfigurator({"version": 1})
    with pytest.raises(ConfigError, match=r"'.*zz\.pth' \(from a logging config\) is a logging"):
        configurator.configure_handler({"class": "logging.FileHandler", "filename": str(pth)})
    assert not pth.exists()
    handler = configurator.configure_handler(
        {"class": "logging.FileHandler", "filename": str(tmp_path / "job.log")}
    )
    handler.close()
    assert (tmp_path / "job.log").is_file()


def _preset(tmp_path: Path, body: str) -> Path:
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True, exist_ok=True)
    (conf / "experiment" / "p.yaml").write_text("# @package _global_\n" + textwrap.dedent(body))
    return _with_shipped(conf)


@pytest.mark.parametrize(
    "name",
    [
        "PJRT_NAMES_AND_LIBRARY_PATHS",
        "TPU_LIBRARY_PATH",
        "CUDA_INJECTION64_PATH",
        "NCCL_NET_PLUGIN",
        "GCONV_PATH",
        "XLA_FLAGS",
        "LIBTPU_INIT_ARGS",
        # where tracked runs go, and who answers a bucket's or a tracking server's requests
        "MLFLOW_TRACKING_URI",
        "MLFLOW_S3_ENDPOINT_URL",
        "HTTPS_PROXY",
        "http_proxy",
        "REQUESTS_CA_BUNDLE",
    ],
)
def test_env_set_of_what_jax_xla_cuda_or_glibc_load_is_refused(tmp_path: Path, name: str) -> None:
    merged = _preset(tmp_path, f"hydra:\n  job:\n    env_set:\n      {name}: /tmp/x\n")
    with pytest.raises(ConfigError, match=rf"^hydra\.job\.env_set\.{name}='/tmp/x' \(from "):
        jaxaot.compose(["program=axpy", "experiment=p"], config_dir=merged)
    cfg = jaxaot.compose(
        ["program=axpy", "experiment=p", f"hydra.job.env_set.{name}=/tmp/y"], config_dir=merged
    )
    assert cfg is not None


def test_a_cuda_data_dir_whose_ptxas_runs_comes_from_the_command_line(tmp_path: Path) -> None:
    key = "compile.compiler_options.xla_gpu_cuda_data_dir"
    merged = _preset(tmp_path, "compile:\n  compiler_options:\n    xla_gpu_cuda_data_dir: /tmp/c\n")
    with pytest.raises(ConfigError) as info:
        jaxaot.compose(["program=axpy", "experiment=p"], config_dir=merged)
    assert str(info.value) == (
        f"{key}='/tmp/c' (from experiment/p.yaml in file://{merged}) names the folder whose "
        f"bin/ptxas jaxaot and XLA run; a config may not: give {key}=/tmp/c on the command "
        "line, or drop it (the installed nvidia-cuda-nvcc-cu12 is used)"
    )
    cfg = jaxaot.compose(["program=axpy", "experiment=p", f"{key}=/tmp/c"], config_dir=merged)
    assert str(cfg.compile.compiler_options.xla_gpu_cuda_data_dir) == "/tmp/c"
    sweep = f"hydra:\n  sweeper:\n    params:\n      +{key}: /tmp/a,/tmp/b\n"
    with pytest.raises(ConfigError, match=rf"^hydra\.sweeper\.params\.\+{key}: a sweep parameter"):
        jaxaot.compose(["program=axpy", "experiment=p"], config_dir=_preset(tmp_path / "s", sweep))
    assert _validate(f"+{key}=/tmp/d").compile.compiler_options["xla_gpu_cuda_data_dir"]


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ("setup: ['touch /tmp/pwned']", "hydra.launcher.setup"),
        (
            "additional_parameters: {wrap: 'touch /tmp/pwned'}",
            "hydra.launcher.additional_parameters.wrap",
        ),
    ],
)
def test_a_preset_may_not_write_the_slurm_batch_script(tmp_path: Path, body: str, key: str) -> None:
    merged = _preset(
        tmp_path,
        f"defaults:\n  - override /hydra/launcher: slurm\nhydra:\n  launcher:\n    {body}\n",
    )
    with pytest.raises(ConfigError, match=rf"^{key}=.* \(from experiment/p\.yaml in file://"):
        jaxaot.compose(["program=axpy", "experiment=p"], config_dir=merged)
    line = body.replace(": ", "=", 1) if "additional" not in body else f"{key}='touch /tmp/pwned'"
    if "additional" not in body:
        line = f"hydra.launcher.{line}"
    assert jaxaot.compose(["program=axpy", "experiment=p", line], config_dir=merged) is not None


@pytest.mark.extra("sweep")
def test_the_shipped_slurm_launcher_and_its_command_line_options_compose(tmp_path: Path) -> None:
    jaxaot.compose(  # no ConfigError: the command line's options
        [
            "program=axpy",
            "hydra/launcher=slurm",
            "hydra.launcher.setup=['source ~/venv/bin/activate']",
            "+hydra.launcher.additional_parameters.constraint=avx512",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"(?s)^hydra\.launcher\.setup\[0\]=.* holds a line break"
    ):
        jaxaot.compose(["program=axpy", "hydra/launcher=slurm", "hydra.launcher.setup=['a\nb']"])
