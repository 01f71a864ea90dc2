"""The import policy (``jaxaot.config.trust``): every importable name in a config goes through it."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import jaxaot
import numpy as np
import pytest
from conftest import run_cli
from jaxaot.config.trust import (
    DEFAULT_DENIED,
    check_hydra_callbacks,
    guard_hydra_callbacks,
    make_policy,
)
from jaxaot.config.xla_metadata import Scoped
from jaxaot.errors import ConfigError, TargetError
from jaxaot.stages.stage_out import resolve_target
from omegaconf import OmegaConf


def _validate(*overrides: str) -> Any:
    return jaxaot.validate(jaxaot.compose(["program=axpy", *overrides]))


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        ("os:system", "os"),
        ("os.path:join", "os"),
        ("posix:system", "posix"),
        ("subprocess:run", "subprocess"),
        ("shutil:rmtree", "shutil"),
        ("sys:exit", "sys"),
        ("builtins:eval", "builtins"),
        ("builtins:exec", "builtins"),
        ("builtins:__import__", "builtins"),
        ("builtins:open", "builtins"),
        ("importlib:import_module", "importlib"),
        ("runpy:run_path", "runpy"),
        ("pickle:loads", "pickle"),
        ("marshal:loads", "marshal"),
        ("ctypes:CDLL", "ctypes"),
        ("signal:raise_signal", "signal"),
        ("multiprocessing:Process", "multiprocessing"),
        ("pty:spawn", "pty"),
        ("socket:socket", "socket"),
        ("code:interact", "code"),
        ("pdb:set_trace", "pdb"),
        ("numpy:load", "numpy.load"),
    ],
)
def test_process_control_and_code_execution_targets_are_refused(target: str, rule: str) -> None:
    with pytest.raises(ConfigError) as info:
        _validate(f"program.target={target}")
    message = str(info.value)
    name = target.replace(":", ".")
    assert message == (
        f"program.target={target!r} imports {name!r}, which the built-in import deny list "
        f"refuses (rule {rule!r}: process control, code execution, file access); if this config "
        f"is trusted, allow it with trust.allow_imports=[{name}]"
    )
    assert "\n" not in message


def test_a_rule_matches_whole_components_only() -> None:
    policy = make_policy([], [])
    assert policy.rule_for("osmosis.f") == (True, None)
    assert policy.rule_for("os.path.join") == (False, "os")
    assert policy.rule_for("jax.numpy.einsum") == (True, None)
    assert policy.rule_for("jax.numpy.load") == (False, "jax.numpy.load")
    assert {"os", "subprocess", "sys", "builtins", "importlib", "pickle"} <= set(DEFAULT_DENIED)
    _validate("program.target=osmosis:f")  # only the string is checked at validation


def test_the_longest_rule_decides_and_allow_wins_a_tie() -> None:
    policy = make_policy(["os.path"], ["jax.numpy"])
    assert policy.rule_for("os.path.join") == (True, "os.path")
    assert policy.rule_for("os.system") == (False, "os")
    assert policy.rule_for("jax.numpy.einsum") == (False, "jax.numpy")
    assert make_policy(["jax.numpy.einsum"], ["jax.numpy"]).rule_for("jax.numpy.einsum") == (
        True,
        "jax.numpy.einsum",
    )
    assert make_policy(["os"], []).rule_for("os.system") == (True, "os")


def test_allow_imports_lets_a_refused_target_in_and_it_runs(compose_run: Any) -> None:
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


def test_allow_star_drops_the_builtin_list_but_not_the_configs_own_denials() -> None:
    typed = _validate("program.target=subprocess:run", "trust.allow_imports=['*']")
    assert typed.trust.allow_imports == ["*"]
    with pytest.raises(
        ConfigError, match=r"which trust\.deny_imports refuses \(rule 'subprocess'\)"
    ):
        _validate(
            "program.target=subprocess:run",
            "trust.allow_imports=['*']",
            "trust.deny_imports=[subprocess]",
        )


def test_deny_imports_adds_rules_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        _validate("program.target=jax.numpy:einsum", "trust.deny_imports=[jax.numpy]")
    assert str(info.value) == (
        "program.target='jax.numpy:einsum' imports 'jax.numpy.einsum', which "
        "trust.deny_imports refuses (rule 'jax.numpy')"
    )


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


def test_a_scoped_metadata_target_goes_through_the_same_check() -> None:
    entry = '+lower.scoped_metadata=[{target: "pickle:loads", fuse_limit: true}]'
    with pytest.raises(ConfigError) as info:
        _validate(entry)
    assert str(info.value).startswith(
        "lower.scoped_metadata[0].target='pickle:loads' imports 'pickle.loads', which the "
        "built-in import deny list refuses"
    )
    typed = _validate(entry, "trust.allow_imports=[pickle.loads]")
    assert typed.lower.scoped_metadata[0]["target"] == "pickle:loads"


def test_a_dunder_path_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"reaches through the dunder attribute '__class__'"):
        _validate("program.target=jaxaot.examples.axpy:axpy.__class__")


@pytest.fixture
def alias_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A harmless-looking module that re-exports os and eval under innocent names."""
    (tmp_path / "trust_alias_mod.py").write_text(
        textwrap.dedent(
            """
            import os
            run = os.system
            evaluate = eval
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trust_alias_mod", raising=False)
    return "trust_alias_mod"


@pytest.mark.parametrize(
    ("attr", "resolved"),
    [("os.system", "os"), ("run", "posix.system"), ("evaluate", "builtins.eval")],
)
def test_what_a_target_resolves_to_is_checked_too(
    alias_module: str, attr: str, resolved: str
) -> None:
    target = f"{alias_module}:{attr}"
    policy = make_policy([], [])
    with pytest.raises(TargetError) as info:
        resolve_target(target, policy=policy)
    assert str(info.value).startswith(f"program.target={target!r} resolves to {resolved!r}")
    assert f"trust.allow_imports=[{alias_module}.{attr}]" in str(info.value)
    # Allowed explicitly, the config's name is trusted with whatever it resolves to.
    assert callable(resolve_target(target, policy=make_policy([f"{alias_module}.{attr}"], [])))


def test_a_scoped_target_is_resolved_under_its_configs_policy(alias_module: str) -> None:
    from jaxaot.stages.jax_metadata import with_metadata

    entry = Scoped(f"{alias_module}:run", fuse_limit=True, policy=make_policy([], []))
    refused = pytest.raises(TargetError, match=r"lower\.scoped_metadata\[0\]\.target=.*resolves to")
    with refused, with_metadata({}, [entry]):
        pass


def test_a_denied_module_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "trust_marker_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef f(x):\n    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="trust_marker_mod"):
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


def test_hydra_callback_targets_are_checked_before_hydra_instantiates_them() -> None:
    from hydra._internal.callbacks import Callbacks

    guard_hydra_callbacks()
    guard_hydra_callbacks()  # idempotent
    evil = {"hydra": {"callbacks": {"x": {"_target_": "os.getpid"}}}}
    with pytest.raises(ConfigError, match=r"^hydra\.callbacks\.x\._target_='os\.getpid' imports"):
        Callbacks(OmegaConf.create(evil))
    allowed = OmegaConf.create({**evil, "trust": {"allow_imports": ["os.getpid"]}})
    check_hydra_callbacks(allowed)
    shipped = jaxaot.compose([], config_name="config")
    check_hydra_callbacks(
        OmegaConf.create(
            {
                "hydra": {
                    "callbacks": {"sweep": {"_target_": "jaxaot.sweeps.callbacks.SweepCallback"}}
                },
                "trust": shipped.trust,
            }
        )
    )


def test_the_cli_refuses_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    proc = run_cli(
        [
            "program=axpy",
            "program.target=os:system",
            f"program.args=['touch {marker}']",
            "stage_out.static_argnums=[0]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [
        "jaxaot: error: program.target='os:system' imports 'os.system', which the built-in "
        "import deny list refuses (rule 'os': process control, code execution, file access); "
        "if this config is trusted, allow it with trust.allow_imports=[os.system]"
    ]
    assert not marker.exists()
    assert not (tmp_path / "run" / "manifest.json").exists()
