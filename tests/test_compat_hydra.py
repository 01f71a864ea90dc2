"""jaxaot.compat.hydra: every private Hydra name it touches exists on the installed Hydra, and
on a Hydra outside HYDRA_KNOWN (the version reader faked) the speed patches are off with the
same configs, and the import policy refuses in one line instead of running unguarded."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env
from hydra.types import HydraContext, RunMode
from jaxaot.compat import hydra as compat
from jaxaot.errors import ConfigError
from jaxaot.sweeps import compose_cache
from jaxaot.sweeps.compose_cache import SweepConfigLoader, with_sweep_loader
from omegaconf import OmegaConf

NEWER = (1, 4, 0)


def _resolve(module: str, attribute: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", compat.PRIVATE_NAMES, ids=lambda n: f"{n.module}:{n.attribute}")
def test_each_private_name_exists_on_the_installed_hydra(name: compat.PrivateName) -> None:
    try:
        _resolve(name.module, name.attribute)  # JobReturn._return_value's default is None
    except (ImportError, AttributeError):
        if not name.optional:
            raise
        assert compat.logging_configurator() is __import__("logging.config").config.DictConfigurator


def test_the_installed_hydra_is_read_from_its_metadata_and_known() -> None:
    import hydra

    assert compat.hydra_version() == tuple(int(p) for p in hydra.__version__.split(".")[:3])
    assert compat.hydra_known()  # the suite runs the patches it ships


@pytest.mark.parametrize(
    ("version", "known"),
    [((1, 3, 1), False), ((1, 3, 2), True), ((1, 3, 9), True), ((1, 4, 0), False), ((2, 0), False)],
)
def test_known_range_is_half_open(monkeypatch: Any, version: tuple[int, ...], known: bool) -> None:
    monkeypatch.setattr(compat, "hydra_version", lambda: version)
    assert compat.hydra_known() is known


def test_a_newer_hydra_refuses_the_import_policy_in_one_line(monkeypatch: Any) -> None:
    from jaxaot.config.trust import install_composition_guards, install_instantiation_guards

    monkeypatch.setattr(compat, "hydra_version", lambda: NEWER)
    for install in (install_composition_guards, install_instantiation_guards):
        with pytest.raises(ConfigError) as info:
            install()
        text = str(info.value)
        assert "\n" not in text
        assert text == (
            "hydra-core 1.4.0 is installed; jaxaot's import policy for _target_ and Hydra's "
            "imports is known to hold on hydra-core >=1.3.2,<1.4.0 only, and does not run "
            "unchecked; fix: pip install 'hydra-core>=1.3.2,<1.4' (or, to run on this Hydra "
            "with the policy on the same hooks, set JAXAOT_UNTESTED_HYDRA=1)"
        )


def test_untested_hydra_runs_with_the_policy_when_the_user_says_so(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """``JAXAOT_UNTESTED_HYDRA=1`` (the user's environment): on a Hydra outside the range whose
    hooks are all there, a run composes and runs with the import policy on (a config's
    ``_target_`` outside it is still refused) and the speed patches off; a hook that is gone
    still refuses, naming it."""
    import jaxaot

    monkeypatch.setattr(compat, "hydra_version", lambda: NEWER)
    monkeypatch.setenv(compat.ENV_UNTESTED, "1")
    result = jaxaot.run(jaxaot.compose(["program=axpy"]), run_dir=tmp_path / "run")
    assert result.manifest["status"] == "ok"
    assert not compat.hydra_known()  # so every speed patch is off (test below)
    with pytest.raises(ConfigError, match=r"hydra\.callbacks\.x\._target_='os\.system'"):
        jaxaot.compose(["program=axpy", "+hydra.callbacks.x={_target_: os.system}"])

    from jaxaot.config.trust import install_composition_guards

    gone = compat.PrivateName("hydra._internal.instantiate._instantiate2", "_gone", "trust")
    monkeypatch.setattr(compat, "PRIVATE_NAMES", (*compat.PRIVATE_NAMES, gone))
    with pytest.raises(ConfigError) as info:
        install_composition_guards()
    assert str(info.value) == (
        "hydra-core 1.4.0 is installed and JAXAOT_UNTESTED_HYDRA=1 is set, but the import "
        "policy cannot hook hydra._internal.instantiate._instantiate2._gone (gone in this "
        "Hydra); fix: pip install 'hydra-core>=1.3.2,<1.4'"
    )


def _fake_newer(tmp_path: Path) -> None:
    """A ``python -m fake_newer`` that runs the ``jaxaot`` command in this process (not a
    server's) with hydra-core's version read as 1.4.0."""
    (tmp_path / "fake_newer.py").write_text(
        "import jaxaot.compat.hydra as compat\n"
        f"compat.hydra_version = lambda: {NEWER!r}\n"
        "from jaxaot.cli.main import main\n"
        "main()\n"
    )


def test_the_cli_on_a_newer_hydra_refuses_before_composing(tmp_path: Path) -> None:
    _fake_newer(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "fake_newer", "program=axpy"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("jaxaot: error: hydra-core 1.4.0 is installed;"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "pip install 'hydra-core>=1.3.2,<1.4'" in proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_a_launcher_worker_on_a_newer_hydra_fails_to_load_the_task_function(
    tmp_path: Path,
) -> None:
    """A worker of a jaxaot command line (its trust settings in the environment) that imports
    the task function's module on a Hydra the policy does not know: the import fails."""
    from jaxaot.config.trust import ENV_COMMAND_LINE

    code = (
        "import jaxaot.compat.hydra as compat\n"
        f"compat.hydra_version = lambda: {NEWER!r}\n"
        "import jaxaot.cli.main\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=cli_env(**{ENV_COMMAND_LINE: "{}"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "ConfigError: hydra-core 1.4.0 is installed;" in proc.stderr


def test_a_newer_hydra_gets_no_speed_patch(monkeypatch: Any) -> None:
    from jaxaot.cli.server import compositions

    patched = [
        ("hydra._internal.hydra", "Hydra.get_mode"),
        ("hydra._internal.config_loader_impl", "ConfigLoaderImpl.get_group_options"),
        ("hydra._internal.config_loader_impl", "ConfigLoaderImpl.load_configuration"),
        ("hydra.core.default_element", "InputDefault._resolve_interpolation_impl"),
    ]
    monkeypatch.setattr(compat, "hydra_version", lambda: NEWER)
    before = [_resolve(*name) for name in patched]
    assert not compat.skip_mode_probe()
    assert not compat.share_help_repository()
    made: list[Any] = []
    assert not compat.wrap_load_configuration(lambda real: made.append(real) or real)
    compositions.install({}, -1)  # a served run: composes as Hydra does
    assert made == [] and [_resolve(*name) for name in patched] == before


@pytest.mark.slow  # Hydra's own sweep compositions, seconds
def test_a_newer_hydras_sweep_jobs_compose_as_hydra_does_with_no_cache(
    loader: Any, monkeypatch: Any
) -> None:
    master = loader.load_configuration("config", [], RunMode.MULTIRUN)
    jobs = [["execute.seed=3"], ["program=mlp", "execute.seed=1"], ["experiment=autotune_cpu"]]
    cached = [SweepConfigLoader(loader).load_sweep_config(master, j) for j in jobs]
    assert compose_cache.stats()["composed"] > 0
    compose_cache.clear()
    monkeypatch.setattr(compat, "hydra_version", lambda: NEWER)
    context = HydraContext(config_loader=loader, callbacks=None)  # type: ignore[arg-type]
    assert with_sweep_loader(context) is context  # the sweepers validate and launch as Hydra's
    fast = SweepConfigLoader(loader)
    assert fast.split("config", ["execute.seed=3"]) is None
    for job, kept in zip(jobs, cached, strict=True):
        got = fast.load_sweep_config(master, job)
        expected = loader.load_sweep_config(master, job)
        assert OmegaConf.to_container(got) == OmegaConf.to_container(expected), job
        assert OmegaConf.to_container(got) == OmegaConf.to_container(kept), job
    fast.validate_batch(master, jobs)
    assert fast._validated == {}  # the launcher composes each job again, as Hydra's does
    assert compose_cache.stats() == {"composed": 0, "reused": 0}


@pytest.mark.slow  # a Hydra sweep (validation and in-process launches of a stop_after job)
def test_the_basic_sweeper_on_a_newer_hydra_validates_as_hydras_own(
    loader: Any, monkeypatch: Any
) -> None:
    from hydra_plugins.jaxaot_basic_sweeper.basic_sweeper import JaxaotBasicSweeper

    master = loader.load_configuration("config", [], RunMode.MULTIRUN)
    monkeypatch.setattr(compat, "hydra_version", lambda: NEWER)
    sweeper = JaxaotBasicSweeper(max_batch_size=None)
    sweeper.config = master
    sweeper.hydra_context = HydraContext(config_loader=loader, callbacks=None)  # type: ignore[arg-type]
    sweeper.validate_batch_is_legal([["execute.seed=1"], ["program=mlp"]])
    with pytest.raises(Exception, match="no_such_key"):
        sweeper.validate_batch_is_legal([["execute.no_such_key=1"]])
    assert compose_cache.stats() == {"composed": 0, "reused": 0}
