"""jaxaot.compose remembers a composition within one process (jaxaot.sweeps.remembered): a
remembered one equals Hydra's own, and whatever it was read from (a config file, a structured
config in Hydra's ConfigStore, the working directory) changing makes it composed again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from jaxaot.sweeps import config_sources, remembered
from omegaconf import OmegaConf


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many compositions were keyed and how many of them were taken again; racy files
    (changed within the last 2 s) keyed as any other, so that a test need not wait."""
    monkeypatch.setattr(config_sources, "RACY_NS", 0)
    remembered.forget()
    seen = {"keyed": 0, "hits": 0}
    real = remembered.composition_key

    def key(*args: Any, **kwargs: Any) -> str | None:
        k = real(*args, **kwargs)
        if k is not None:
            seen["keyed"] += 1
            seen["hits"] += k in remembered._LOCAL
        return k

    monkeypatch.setattr(remembered, "composition_key", key)
    yield seen
    remembered.forget()


def _copied_conf(conf: Path) -> Path:
    """jaxaot's config folder copied to ``conf`` (a folder whose files a test may edit)."""
    from jaxaot.api import conf_dir

    base = Path(conf_dir())
    for item in base.rglob("*.yaml"):
        dest = conf / item.relative_to(base)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(item.read_bytes())
    return conf


def _hydras_own(overrides: list[str], **kwargs: Any) -> dict[str, Any]:
    """The composition as Hydra's own path composes it: no memo, no kept repository."""
    from jaxaot.sweeps import compose_cache

    remembered.forget()
    real = compose_cache.repository_for
    compose_cache.repository_for = lambda *a, **k: None  # type: ignore[assignment]
    try:
        return OmegaConf.to_container(jaxaot.compose(overrides, **kwargs), resolve=False)  # type: ignore[return-value]
    finally:
        compose_cache.repository_for = real  # type: ignore[assignment]


def test_a_remembered_composition_is_hydras_own_with_its_value_overrides(
    counted: dict[str, int],
) -> None:
    jaxaot.compose(["program=mlp", "execute.seed=1"])
    overrides = ["program=mlp", "execute.seed=7", "stop_after=compile", "+program.kwargs.k=3"]
    again = OmegaConf.to_container(jaxaot.compose(overrides), resolve=False)
    assert counted == {"keyed": 2, "hits": 1}
    assert again["execute"]["seed"] == 7 and again["stop_after"] == "compile"  # type: ignore[index]
    assert again == _hydras_own(overrides)
    assert OmegaConf.to_container(jaxaot.compose(["program=axpy"]), resolve=False) == _hydras_own(
        ["program=axpy"]
    )


def test_an_edited_config_file_is_read_again(tmp_path: Path, counted: dict[str, int]) -> None:
    conf = _copied_conf(tmp_path / "conf")
    mlp = conf / "program" / "mlp.yaml"
    first = jaxaot.compose(["program=mlp"], config_dir=conf)
    assert jaxaot.compose(["program=mlp"], config_dir=conf) == first
    assert counted["hits"] == 1
    mlp.write_text(mlp.read_text().replace("3-layer gelu MLP", "edited MLP"))
    edited = jaxaot.compose(["program=mlp", "+program.kwargs.q=1"], config_dir=conf)
    assert counted["hits"] == 1  # the edit made another key
    assert edited.program.description.startswith("edited MLP")


def test_a_config_repository_is_built_again_when_what_it_read_changes(
    tmp_path: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repository that tells group from value overrides, and whose sources a key covers,
    is kept across compositions while its files are as they were: a primary config that gains
    a ``hydra.searchpath`` is read again, so the added folder is in the key and an edit there
    is seen (a kept repository would key without it and serve the first composition)."""
    from jaxaot.compat import hydra as compat_hydra
    from jaxaot.sweeps import compose_cache

    compose_cache.clear()
    built: list[str | None] = []
    real = compat_hydra.caching_repo

    def counting(loader: Any, config_name: str | None) -> Any:
        built.append(config_name)
        return real(loader, config_name)

    monkeypatch.setattr(compat_hydra, "caching_repo", counting)
    conf = _copied_conf(tmp_path / "conf")
    extra = tmp_path / "extra" / "program"
    extra.mkdir(parents=True)
    (extra / "added.yaml").write_text("name: added\ntarget: jax.numpy:sin\nargs: ['f32[4]']\n")
    jaxaot.compose(["program=mlp"], config_dir=conf)
    jaxaot.compose(["program=axpy"], config_dir=conf)
    assert len(built) == 1  # kept while conf/ is as it was
    primary = conf / "config.yaml"
    searchpath = f"hydra:\n  searchpath:\n    - file://{tmp_path / 'extra'}\n"
    primary.write_text(primary.read_text().replace("hydra:\n", searchpath, 1))
    assert jaxaot.compose(["program=added"], config_dir=conf).program.name == "added"
    assert len(built) == 2
    (extra / "added.yaml").write_text("name: edited\ntarget: jax.numpy:sin\nargs: ['f32[4]']\n")
    assert jaxaot.compose(["program=added"], config_dir=conf).program.name == "edited"
    assert len(built) == 3 and counted["hits"] == 0
    assert jaxaot.compose(["program=added"], config_dir=conf).program.name == "edited"
    assert len(built) == 3 and counted["hits"] == 1


def test_a_search_path_that_resolves_elsewhere_is_read_again(
    tmp_path: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A primary config's ``hydra.searchpath`` with an interpolation leads where the
    environment says at each composition: the folder it leads to now is read, and a
    composition from another one is not taken again."""
    conf = _copied_conf(tmp_path / "conf")
    for name in ("a", "b"):
        group = tmp_path / name / "program"
        group.mkdir(parents=True)
        (group / "picked.yaml").write_text(
            f"name: from_{name}\ntarget: jax.numpy:sin\nargs: ['f32[4]']\n"
        )
    primary = conf / "config.yaml"
    searchpath = "hydra:\n  searchpath:\n    - file://${oc.env:PICKED_CONF}\n"
    primary.write_text(primary.read_text().replace("hydra:\n", searchpath, 1))
    got = []
    for name in ("a", "b", "a"):
        monkeypatch.setenv("PICKED_CONF", str(tmp_path / name))
        got.append(jaxaot.compose(["program=picked"], config_dir=conf).program.name)
    assert got == ["from_a", "from_b", "from_a"]
    assert counted["hits"] == 1  # the third, from the same folder as the first


def test_compositions_are_remembered_once_hydra_is_known_again(tmp_path: Path) -> None:
    """A process whose first composition ran while the Hydra in use was one jaxaot does not
    know (the memo not installed) remembers later ones once it is known."""
    import subprocess
    import sys

    from conftest import cli_env

    code = """
import jaxaot
from jaxaot.compat import hydra as compat
from jaxaot.sweeps import config_sources, remembered
known = compat.hydra_version
compat.hydra_version = lambda: (1, 4, 0)
jaxaot.compose(["program=axpy"])
print(len(remembered._LOCAL))
compat.hydra_version = known
config_sources.RACY_NS = 0
jaxaot.compose(["program=axpy"])
jaxaot.compose(["program=axpy"])
print(len(remembered._LOCAL))
"""
    env = cli_env(JAXAOT_UNTESTED_HYDRA="1")  # the import policy's guards on the faked version
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1"]


def test_a_structured_config_stored_since_is_read_again(counted: dict[str, int]) -> None:
    from hydra.core.config_store import ConfigStore

    before = jaxaot.compose(["program=mlp"])
    node = OmegaConf.to_container(before.program, resolve=False)
    node["name"] = "stored_in_process"  # type: ignore[index]
    ConfigStore.instance().store(group="program", name="mlp_stored", node=node)
    got = jaxaot.compose(["program=mlp_stored"])
    assert got.program.name == "stored_in_process"
    ConfigStore.instance().store(group="program", name="mlp_stored", node={**node, "name": "again"})  # type: ignore[dict-item]
    assert jaxaot.compose(["program=mlp_stored"]).program.name == "again"


def test_another_working_directory_is_another_key(
    tmp_path: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    jaxaot.compose(["program=mlp"])
    monkeypatch.chdir(tmp_path)
    jaxaot.compose(["program=mlp"])
    assert counted == {"keyed": 2, "hits": 0}
    os.chdir(tmp_path)
    jaxaot.compose(["program=mlp"])
    assert counted == {"keyed": 3, "hits": 1}


def test_the_import_policy_checks_a_remembered_composition_with_every_override(
    tmp_path: Path,
) -> None:
    """With the policy's guard installed before the first compose (``jaxaot.cli.main``
    imported), the memo goes beneath it: a value override that widens the policy
    (``trust.allow_imports``) is seen, on a miss and on a hit, and a composition without it
    is refused on a hit as on a miss, naming the config file that set the refused name."""
    import subprocess
    import sys

    from conftest import cli_env

    conf = _copied_conf(tmp_path / "conf")
    (conf / "experiment" / "cb.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /program: axpy\n\n"
        "hydra:\n  callbacks:\n    x:\n      _target_: json.JSONDecoder\n"
    )
    code = f"""
import jaxaot.cli.main  # installs the import policy's guards first
import jaxaot
from jaxaot.errors import ConfigError
from jaxaot.sweeps import config_sources, remembered
config_sources.RACY_NS = 0
allow = ["experiment=cb", "trust.allow_imports=[json.JSONDecoder]"]
for _ in range(2):
    print(jaxaot.compose(allow, config_dir={str(conf)!r}).program.name)
for _ in range(2):
    try:
        jaxaot.compose(["experiment=cb"], config_dir={str(conf)!r})
        print("composed")
    except ConfigError as exc:
        print("refused", "json.JSONDecoder" in str(exc), "(from experiment/cb.yaml" in str(exc))
print(len(remembered._LOCAL))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # A refusal names the config file that set the name, on a remembered composition too.
    refused = ["refused", "True", "True"]
    assert proc.stdout.split() == ["axpy", "axpy", *refused, *refused, "1"]


def _options(conf: Path, group: str, names: str) -> None:
    """``conf/<group>/<x>.yaml`` for each letter ``x`` of ``names``: each sets the program's
    description to its letter."""
    (conf / group).mkdir(parents=True, exist_ok=True)
    for x in names:
        (conf / group / f"{x}.yaml").write_text(
            f"# @package _global_\nprogram:\n  description: {x}\n"
        )


def test_a_group_folder_reached_through_a_relinked_symlink_is_read_again(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    """``conf/zz`` leads, through a link outside the config folder, to a group folder the
    walk reaches anyway (``conf/pa``); pointed at another one (``conf/pb``), nothing under
    ``conf/`` was written, yet the composition is another."""
    conf = _copied_conf(tmp_path / "conf")
    for group, text in (("pa", "from-A"), ("pb", "from-B")):
        (conf / group).mkdir()
        (conf / group / "opt.yaml").write_text(
            f"# @package _global_\nprogram:\n  description: {text}\n"
        )
    pointer = tmp_path / "ptr"
    pointer.symlink_to(conf / "pa")
    (conf / "zz").symlink_to(pointer)
    overrides = ["program=axpy", "+zz=opt"]
    assert jaxaot.compose(overrides, config_dir=conf).program.description == "from-A"
    (tmp_path / "ptr.new").symlink_to(conf / "pb")
    (tmp_path / "ptr.new").replace(pointer)
    assert jaxaot.compose(overrides, config_dir=conf).program.description == "from-B"
    assert counted["hits"] == 0


def test_a_group_named_like_pythons_cache_folder_is_read_again(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    """Hydra reads a group folder named ``__pycache__`` as any other: its files are in the key;
    the bytecode Python writes there is not (an import does not make the next one compose)."""
    conf = _copied_conf(tmp_path / "conf")
    (conf / "__pycache__").mkdir()
    option = conf / "__pycache__" / "opt.yaml"
    option.write_text("# @package _global_\nprogram:\n  description: first\n")
    overrides = ["program=axpy", "+__pycache__=opt"]
    assert jaxaot.compose(overrides, config_dir=conf).program.description == "first"
    (conf / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"bytecode")  # an import's
    assert jaxaot.compose(overrides, config_dir=conf).program.description == "first"
    assert counted["hits"] == 1
    option.write_text("# @package _global_\nprogram:\n  description: second, edited\n")
    assert jaxaot.compose(overrides, config_dir=conf).program.description == "second, edited"
    assert counted["hits"] == 1


def test_a_defaults_choice_that_any_resolver_picks_is_not_remembered(
    tmp_path: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A defaults-list entry chosen by a user's resolver (its name may hold a ``-``) depends on
    more than the files: composed each time, so the environment of now picks."""
    conf = _copied_conf(tmp_path / "conf")
    _options(conf, "pl", "ab")
    primary = conf / "config.yaml"
    text = primary.read_text()
    assert "  - _self_\n" in text
    primary.write_text(text.replace("  - _self_\n", "  - _self_\n  - pl: ${pick-env:}\n"))
    OmegaConf.register_new_resolver("pick-env", lambda: os.environ["PICK"])
    try:
        got = []
        for pick in ("a", "b", "a"):
            monkeypatch.setenv("PICK", pick)
            got.append(jaxaot.compose(["program=axpy"], config_dir=conf).program.description)
    finally:
        OmegaConf.clear_resolver("pick-env")
    assert got == ["a", "b", "a"]
    assert counted["hits"] == 0


def test_a_shuffled_group_list_is_hydras_draw_each_time(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    """``+pl=shuffle([a,b,c,d,e])`` loads the five options in an order Hydra draws from
    Python's ``random`` as it parses the line (the last one loaded sets the description): each
    composition is that draw, once, as Hydra makes it; none is remembered."""
    import random

    conf = _copied_conf(tmp_path / "conf")
    _options(conf, "pl", "abcde")
    got, drawn = [], []
    for seed in range(6):
        random.seed(seed)
        overrides = ["program=axpy", "+pl=shuffle([a,b,c,d,e])"]
        got.append(jaxaot.compose(overrides, config_dir=conf).program.description)
        random.seed(seed)
        order = list("abcde")
        random.shuffle(order)  # Hydra's shuffle of a list, as hydra/_internal/grammar/functions
        drawn.append(order[-1])
    assert got == drawn
    assert len(set(got)) > 1 and counted["hits"] == 0
    for _ in range(2):  # a key named so calls nothing: remembered as any other
        jaxaot.compose(["program=axpy", "+program.kwargs.shuffle=true"], config_dir=conf)
    assert counted["hits"] == 1


@pytest.mark.slow  # Hydra's own compose, several times: not the fast tier
def test_hydras_own_fields_are_as_hydra_fills_them_on_a_remembered_composition(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    """Hydra appends the override lines to the ``hydra.overrides`` lists the config files
    give, and sets ``hydra.runtime.choices``, ``hydra.runtime.version`` and
    ``hydra.job.config_name`` after it applies the overrides: a composition taken again is
    the same, and an override of one of those fields is what Hydra makes of it."""
    import hydra
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    conf = _copied_conf(tmp_path / "conf")
    primary = conf / "config.yaml"
    text = primary.read_text()
    assert "hydra:\n  run:" in text
    preset = "hydra:\n  overrides:\n    task: [preset, 'seed-was-${execute.seed}']\n  run:"
    primary.write_text(text.replace("hydra:\n  run:", preset))
    remembered.remember_in_process()

    def composed(overrides: list[str]) -> Any:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose(config_name="config", overrides=overrides, return_hydra_config=True)

    for _ in range(2):
        cfg = composed(["program=axpy", "execute.seed=3"])
        task = OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False)
        assert task == ["preset", "seed-was-${execute.seed}", "program=axpy", "execute.seed=3"]
        assert cfg.hydra.overrides.task[1] == "seed-was-3"
    assert counted["hits"] == 1
    for overrides in (
        ["hydra.runtime.version=0.0", "hydra.job.config_name=other"],
        ["hydra.job={config_name: other}", "++hydra.runtime={version: '0.0'}"],
        ["++hydra={job: {config_name: other}}"],
    ):
        cfg = composed(["program=axpy", *overrides])
        assert cfg.hydra.runtime.version == hydra.__version__
        assert cfg.hydra.job.config_name == "config"
    cfg = composed(["program=axpy", "++hydra.runtime.choices.program=zzz"])
    assert cfg.hydra.runtime.choices.program == "axpy"
    with pytest.raises(ConfigCompositionException):  # a key Hydra's struct lacks, then
        composed(["program=axpy", "hydra.runtime.choices.program=zzz"])
    GlobalHydra.instance().clear()
