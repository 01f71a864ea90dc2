"""jaxaot.sweeps.compose_cache: sweep jobs get exactly the config Hydra composes, from one composition."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from jaxaot.sweeps import compose_cache
from jaxaot.sweeps.compose_cache import SweepConfigLoader
from omegaconf import DictConfig, OmegaConf

# Hydra's own sweep composition (its config loader and launcher), seconds a test: not the
# fast tier.
pytestmark = pytest.mark.slow


Masters = dict[tuple[str, ...], DictConfig]


@pytest.fixture(scope="module")
def masters() -> Masters:
    """Hydra's multirun master configs by their hydra overrides, each composed once for the
    module (:func:`_master`)."""
    return {}


def _master(loader: Any, masters: Masters, *hydra_overrides: str) -> DictConfig:
    """The multirun master config Hydra composes for ``hydra_overrides``: a copy of the one
    the module composed, so that no test sees another's changes."""
    key = tuple(hydra_overrides)
    if key not in masters:
        masters[key] = loader.load_configuration("config", list(key), RunMode.MULTIRUN)
    return copy.deepcopy(masters[key])


def _plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


JOBS = [
    ["execute.seed=3"],
    ["execute.seed=4", "stop_after=compile"],
    ["program=mlp", "execute.seed=1"],
    ["program=mlp", "execute.seed=2"],
    ["program=axpy", "program.args=[3,4]", "stage_out.static_argnums=[0]"],
    ["compile.compiler_options.xla_cpu_enable_fast_math=true"],
    ["+compile.compiler_options.xla_cpu_use_thunk_runtime=false", "execute.repeats=2"],
    ["mesh=data8", "program=mlp"],
    ["experiment=autotune_cpu"],
    ["hydra.job.chdir=true", "execute.warmup=0"],
    ["hydra/launcher=joblib", "execute.seed=5"],
]


@pytest.mark.parametrize("master_overrides", [(), ("hydra.job.config.override_dirname.kv_sep=:",)])
def test_every_job_equals_hydras_own_composition(
    loader: Any, masters: Masters, master_overrides: tuple[str, ...]
) -> None:
    master = _master(loader, masters, *master_overrides)
    fast = SweepConfigLoader(loader)
    for job in JOBS:
        expected = loader.load_sweep_config(master, list(job))
        got = fast.load_sweep_config(master, list(job))
        assert _plain(got) == _plain(expected), job
        assert got.hydra.job.override_dirname == expected.hydra.job.override_dirname
        assert OmegaConf.is_struct(got) and not OmegaConf.is_readonly(got.hydra)


def test_value_only_jobs_share_one_composition(loader: Any, masters: Masters) -> None:
    master = _master(loader, masters)
    fast = SweepConfigLoader(loader)
    cfgs = [fast.load_sweep_config(master, [f"execute.seed={s}"]) for s in range(6)]
    assert [c.execute.seed for c in cfgs] == list(range(6))
    assert compose_cache.stats() == {"composed": 1, "reused": 5}
    cfgs[0].execute.seed = 99  # each job owns its copy
    assert fast.load_sweep_config(master, ["execute.seed=1"]).execute.seed == 1
    fast.load_sweep_config(master, ["program=mlp", "execute.seed=1"])
    assert compose_cache.stats()["composed"] == 2


def test_bad_override_fails_like_hydra(loader: Any, masters: Masters) -> None:
    master = _master(loader, masters)
    fast = SweepConfigLoader(loader)
    for job in (["execute.no_such_key=1"], ["execute.seed=abc"], ["program=no_such_program"]):
        with pytest.raises(ConfigCompositionException) as slow_err:
            loader.load_sweep_config(master, job)
        with pytest.raises(ConfigCompositionException) as fast_err:
            fast.load_sweep_config(master, job)
        assert str(fast_err.value.__cause__ or fast_err.value) == str(
            slow_err.value.__cause__ or slow_err.value
        ), job


def test_searchpath_overrides_take_hydras_path(
    loader: Any, masters: Masters, tmp_path: Path
) -> None:
    master = _master(loader, masters)
    fast = SweepConfigLoader(loader)
    job = [f"hydra.searchpath=[file://{tmp_path}]", "execute.seed=2"]
    assert _plain(fast.load_sweep_config(master, job)) == _plain(
        loader.load_sweep_config(master, job)
    )
    assert compose_cache.stats() == {"composed": 0, "reused": 0}


def test_loader_pickles_for_process_launchers(loader: Any, masters: Masters) -> None:
    master = _master(loader, masters)
    here = SweepConfigLoader(loader)
    here.validate_batch(master, [["execute.seed=1"], ["execute.seed=2"]])
    shipped = pickle.dumps(here)
    assert len(shipped) < len(pickle.dumps(loader)) + 200  # no kept configs or repositories
    fast = pickle.loads(shipped)
    assert fast.load_sweep_config(master, ["execute.seed=7"]).execute.seed == 7


def test_overrides_are_classified_by_one_repository(
    loader: Any, masters: Masters, monkeypatch: Any
) -> None:
    master = _master(loader, masters)
    fast = SweepConfigLoader(loader)
    fast.load_sweep_config(master, ["execute.seed=0"])
    calls = []
    make_repo = loader._parse_overrides_and_create_caching_repo
    monkeypatch.setattr(
        loader,
        "_parse_overrides_and_create_caching_repo",
        lambda name, lines: calls.append(lines) or make_repo(name, lines),
    )
    cfgs = [
        fast.load_sweep_config(master, [f"execute.seed={s}", "stop_after=lower"]) for s in range(4)
    ]
    assert calls == []  # building a repository deep-copies every config source (~30 ms)
    assert [(c.execute.seed, c.stop_after) for c in cfgs] == [(s, "lower") for s in range(4)]


def test_launcher_takes_the_configs_validation_composed(
    loader: Any, masters: Masters, tmp_path: Path, monkeypatch: Any
) -> None:
    master = _master(loader, masters)
    fast = SweepConfigLoader(loader)
    batch = [["execute.seed=1"], ["program=mlp", "execute.seed=2"], ["execute.seed=3"]]
    fast.validate_batch(master, batch)
    after_validation = compose_cache.stats()
    monkeypatch.chdir(tmp_path)  # the launcher's jobs see the working directory of launch time
    for job in batch:
        got = fast.load_sweep_config(master, list(job))
        assert _plain(got) == _plain(loader.load_sweep_config(master, list(job))), job
        assert got.hydra.runtime.cwd == str(tmp_path)
    assert compose_cache.stats() == after_validation  # nothing composed or copied again
    again = fast.load_sweep_config(master, ["execute.seed=1"])  # taken once only
    assert (
        again.execute.seed == 1
        and compose_cache.stats()["reused"] == after_validation["reused"] + 1
    )


def test_validation_raises_like_hydra_and_keeps_one_bounded_batch(
    loader: Any, masters: Masters, monkeypatch: Any
) -> None:
    master = _master(loader, masters)
    fast = SweepConfigLoader(loader)
    with pytest.raises(ConfigCompositionException):
        fast.validate_batch(master, [["execute.seed=1"], ["execute.no_such_key=1"]])
    monkeypatch.setattr(compose_cache, "_MAX_KEPT", 2)
    fast.validate_batch(master, [[f"execute.seed={s}"] for s in range(5)])
    assert len(fast._validated) == 2
    fast.validate_batch(master, [["execute.seed=9"]])  # a new batch drops the last one's
    assert [k[1] for k in fast._validated] == [("execute.seed=9",)]


@pytest.mark.parametrize(
    ("overrides", "target"),
    [
        ([], "hydra_plugins.jaxaot_basic_sweeper.basic_sweeper.JaxaotBasicSweeper"),
        (
            ["experiment=autotune_cpu"],
            "hydra_plugins.jaxaot_optuna_sweeper.optuna_sweeper.JaxaotOptunaSweeper",
        ),
        (["hydra/sweeper=basic"], "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"),
    ],
)
def test_default_sweeper_yields_to_experiments_and_the_command_line(
    tmp_path: Path, overrides: list[str], target: str
) -> None:
    proc = run_cli([*overrides, "--cfg", "hydra", "--package", "hydra.sweeper"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"_target_: {target}" in proc.stdout


def test_a_second_sweep_in_one_process_reads_a_config_edited_since_the_first(
    tmp_path: Path,
) -> None:
    """Each sweep composes its defaults lists from the files as they are then: a config file
    edited between two sweeps in one process (a notebook, a test session) is what the second
    sweep's jobs get, not the first sweep's composition."""
    import shutil

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from jaxaot.api import conf_dir
    from jaxaot.schema import register_configs

    register_configs()
    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    mlp = conf / "program" / "mlp.yaml"

    def sweep_job() -> str:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
                loader = GlobalHydra.instance().config_loader()
                master = loader.load_configuration("config", [], RunMode.MULTIRUN)
                job = SweepConfigLoader(loader).load_sweep_config(master, ["program=mlp"])
                return str(job.program.description)
        finally:
            GlobalHydra.instance().clear()

    assert sweep_job().startswith("3-layer gelu MLP")
    mlp.write_text(mlp.read_text().replace("3-layer gelu MLP", "edited MLP"))
    assert sweep_job().startswith("edited MLP")


def test_kept_override_parses_are_hydras_and_each_caller_gets_its_own() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    lines = ["program=mlp", "+x.y=[1,{a: 2}]", "~execute.seed", "compile.topology=choice(a,b)"]
    hydras = OverridesParser.create().parse_overrides(lines)
    first = compose_cache.parse_overrides(lines)
    assert first == hydras  # dataclass equality: key, type, value, package, input line
    first[0].key_or_group = "lower"  # a caller changing its copy changes no later parse
    first[1]._value[1]["a"] = 3
    assert compose_cache.parse_overrides(lines) == hydras
    with pytest.raises(OverrideParseException) as theirs:
        OverridesParser.create().parse_overrides(["program=mlp", "a=[1"])
    for _ in range(2):  # refused each time, never kept
        with pytest.raises(OverrideParseException) as ours:
            compose_cache.parse_overrides(["program=mlp", "a=[1"])
        assert str(ours.value) == str(theirs.value)
    assert "a=[1" not in compose_cache._PARSED
    # Hydra shuffles a list as it parses it: each parse draws anew from Python's random
    line = "x=shuffle([1,2,3,4,5,6,7,8,9,10,11,12])"
    orders = {tuple(compose_cache.parse_overrides([line])[0].value()) for _ in range(4)}
    assert len(orders) > 1 and line not in compose_cache._PARSED
