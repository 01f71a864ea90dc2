"""Each stage implements the stage contract, and the engine runs any stage the same way.

These pin: the root config is the shared sections plus each stage's options; the engine names
no stage; every (start_at, stop_after) pair gives the statuses it should; the compile-ahead
overlap is there; store and resume share one compatibility rule; and the compile key of a
reference program is byte for byte what existing stores hold.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
from pathlib import Path
from typing import Generic, Protocol

import jaxaot
import pytest
from conftest import REPO
from jaxaot.config import sections
from jaxaot.config.order import STAGES
from jaxaot.schema import JaxaotConfig
from jaxaot.stages import NODE_BY_NAME, NODES, contract
from jaxaot.stages.contract import Cached, Stage, compat_mismatch

SHARED = {"program", "mesh", "store", "snapshot", "trust", "jax"}


def test_the_root_config_is_the_shared_sections_plus_each_nodes_options() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(JaxaotConfig)}
    sections_of_nodes = {n.name: n.Options.__name__ for n in NODES}
    assert {k: fields[k] for k in sections_of_nodes} == sections_of_nodes
    run_keys = {"stop_after", "start_at", "resume_from", "debug", "verbose"}
    assert set(fields) == SHARED | set(sections_of_nodes) | run_keys
    for name in SHARED - {"jax"}:
        assert fields[name] in vars(sections), name


def test_nodes_are_the_stages_in_order_and_declare_what_they_own() -> None:
    assert tuple(n.name for n in NODES) == STAGES
    owned = [s for n in NODES for s in n.sections]
    assert len(owned) == len(set(owned))  # a config section belongs to one node
    assert set(owned) <= {f.name for f in dataclasses.fields(JaxaotConfig)}
    for n in NODES:
        assert isinstance(n, Stage)
        assert n.show.verb and n.show.noun and n.show.line({}) is not None
        assert all(i in NODE_BY_NAME and STAGES.index(i) < STAGES.index(n.name) for i in n.inputs)
        assert set(n.live_inputs) <= set(n.inputs)


def _string_constants(path: Path) -> set[str]:
    """String literals in code, not in type annotations (``Literal["compile"]`` overloads)."""
    tree = ast.parse(path.read_text())
    annotations = [
        a
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for a in [
            node.returns,
            *(arg.annotation for arg in ast.walk(node.args) if isinstance(arg, ast.arg)),
        ]
        if a is not None
    ]
    skip = {id(n) for a in annotations for n in ast.walk(a)}
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    }


@pytest.mark.parametrize("module", ["engine/runner.py", "engine/resume.py"])
def test_the_engine_names_no_stage(module: str) -> None:
    """One loop for every node: no ``if stage == "compile"`` left in the engine (a planted one
    is caught: see below)."""
    named = _string_constants(REPO / "pipeline" / module) & set(STAGES)
    assert not named, f"pipeline/{module} names {sorted(named)}"


def test_store_and_resume_share_one_compatibility_rule() -> None:
    backend = {"jax": "0.10.2", "jaxlib": "0.10.2", "platform": "cpu", "platform_version": "x"}
    compile_stage = NODE_BY_NAME["compile"]
    assert isinstance(compile_stage, Cached)
    mine = compile_stage.compat(backend)
    assert compat_mismatch(backend, mine) is None
    why = compat_mismatch({**backend, "jax": "0.9.0"}, mine)
    assert why == "jax '0.9.0' (here '0.10.2')"


# Each start_at x stop_after: what every stage's status is, and whether the result is right.
PAIRS = [(a, b) for a in STAGES for b in STAGES if STAGES.index(a) <= STAGES.index(b)]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("src") / "run"
    cfg = jaxaot.compose(["program=axpy", "store.enabled=false"])
    assert jaxaot.run(cfg, run_dir=out).ok
    return out


@pytest.mark.parametrize(("start_at", "stop_after"), PAIRS)
def test_every_start_and_stop_gives_the_statuses_it_should(
    source_run: Path, tmp_path: Path, start_at: str, stop_after: str
) -> None:
    overrides = [f"start_at={start_at}", f"stop_after={stop_after}", "store.enabled=false"]
    if start_at != "stage_out":
        overrides.append(f"resume_from={source_run}")
    result = jaxaot.run(jaxaot.compose(["program=axpy", *overrides]), run_dir=tmp_path / "r")
    first, last = STAGES.index(start_at), STAGES.index(stop_after)
    want = {}
    for i, stage in enumerate(STAGES):
        if i < first:  # stage_out is traced again when lower runs (it needs the program)
            want[stage] = "ran" if (stage, start_at) == ("stage_out", "lower") else "resumed"
        else:
            want[stage] = "ran" if i <= last else "skipped"
    got = {s: r["status"] for s, r in result.manifest["stages"].items()}
    assert got == want
    assert set(result.records) == {s for s in STAGES if want[s] != "skipped"}
    if stop_after == "execute":
        assert int(result["execute"].outputs) == 10


def test_compile_ahead_still_overlaps_lowering(tmp_path: Path) -> None:
    """A cold compile starts while lowering still exports and writes its texts."""
    cfg = jaxaot.compose(["program=mlp", "stop_after=compile"])
    compile_rec = jaxaot.run(cfg, run_dir=tmp_path / "r").manifest["stages"]["compile"]
    assert compile_rec["status"] == "ran"
    assert "overlapped_seconds" in compile_rec


def test_a_checkpoint_from_another_jax_is_not_loaded_by_the_stores_rule(
    source_run: Path, tmp_path: Path
) -> None:
    """The store's compatibility rule (jax, jaxlib, platform, platform version) applies to a
    checkpoint too: a checkpoint made by another jax is compiled again, with the reason."""
    src = tmp_path / "src"
    import shutil

    shutil.copytree(source_run, src)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["backend"]["jax"] = "0.0.1"
    (src / "manifest.json").write_text(json.dumps(manifest))
    cfg = jaxaot.compose(["program=axpy", f"resume_from={src}", "start_at=execute"])
    result = jaxaot.run(cfg, run_dir=tmp_path / "r")
    stage = result.manifest["stages"]["compile"]
    assert stage["status"] in ("ran", "cached")
    assert any("jax '0.0.1'" in w and "not loaded, compiled again" in w for w in stage["warnings"])
    assert int(result["execute"].outputs) == 10


# The compile key's inputs for program=axpy with the run's backend and environment fixed: the
# bytes hashed into a store key. A change here orphans every existing store: bump
# stages/compile.py's _KEY_VERSION on purpose, and update the pin with it. Key version 2 (the
# flat `pipeline` package, commit ae7c3d6, up to the flags parsed as XLA parses them) pinned
# d9abdfd774dc2ab2b4419a9374f54ab2bd2f93049741b51fa8a2988bb292b7a3; version 3's environment has
# the flag variables per platform, env, host CPU and HLO transformations (key_environment).
# Version 4 pinned 1ac8ccac5fc61aa622f8fbe8fe04012f15d7cba7e34407e16419b0040190ad02; version 5
# changed key_version only (memory_breakdown.json and every compile's shardings.json stored),
# pinned 9796ba951bc86cf123c21684b0377e713847b348d229a70c4e489966c76a39fa. Version 6: a CPU
# backend keys the executable's device ids, not the host's device count.
GOLDEN_AXPY_KEY = "68eb8ea2a072ea68dabb2debd556c91e59deb7b5d77f59bc0735c79168c4c1da"  # v6
# key_environment("cpu")'s shape with every value fixed.
PINNED_ENVIRONMENT = {
    "flags": {"XLA_FLAGS": {"effective": {}, "debug_options_sha256": "pinned"}},
    "env": {},
    "hlo_transformations": [],
    "jax_config": {"jax_enable_x64": False},
    "host_cpu": {"machine": "pinned"},
}


def test_the_compile_key_of_a_reference_program_is_pinned(tmp_path: Path) -> None:
    from jaxaot.stages import compile as compile_stage
    from jaxaot.util.fsio import canonical_json

    result = jaxaot.run(
        jaxaot.compose(["program=axpy", "stop_after=lower"]), run_dir=tmp_path / "r"
    )
    lowered = result["lower"]
    cfg = jaxaot.validate(jaxaot.compose(["program=axpy"]))
    target = compile_stage.prepare(cfg.compile, lowered)
    backend = {"platform": "cpu", "platform_version": "pinned", "jax": "j", "jaxlib": "l"}
    inputs = compile_stage.cache_key(cfg.compile, lowered, target, backend, PINNED_ENVIRONMENT)
    assert sorted(inputs) == [
        "backend",
        "compiler_options",
        "convention",
        "donate_argnums",
        "environment",
        "form",
        "key_version",
        "mesh",
        "module_sha256",
        "platforms",
        "stage",
    ]
    digest = hashlib.sha256(canonical_json(inputs).encode()).hexdigest()
    assert digest == GOLDEN_AXPY_KEY, json.dumps(inputs, indent=1, sort_keys=True)
    # The pinned environment has the shape the run's has (a new part needs a new pin).
    from jaxaot.stages.jaxenv import key_environment

    live = key_environment("cpu")
    assert sorted(live) == sorted(PINNED_ENVIRONMENT)
    assert sorted(live["flags"]["XLA_FLAGS"]) == ["debug_options_sha256", "effective"]


def test_the_stage_name_check_catches_a_planted_branch(tmp_path: Path) -> None:
    planted = tmp_path / "runner.py"
    planted.write_text(
        "def step(node: \"Literal['lower']\") -> None:\n"
        '    if node.name == "compile":\n'
        "        pass\n"
    )
    assert _string_constants(planted) & set(STAGES) == {"compile"}


# What each stage is, exactly: a misspelt member drops a capability silently at runtime
# (runtime_checkable's isinstance says no), so it is pinned here.
CAPABILITIES = {
    "stage_out": {"Stage", "Loadable"},
    "lower": {"Stage", "Loadable"},
    "compile": {"Stage", "Loadable", "Cached", "Ahead", "Prepared", "OnResume", "Finishing"},
    "execute": {"Stage", "Prepared"},
}


def _protocol_members(proto: type) -> dict[str, object]:
    """A capability protocol's members (its own and those of the protocols it extends): name
    -> the declared function, or None for an attribute."""
    members: dict[str, object] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol, Generic) or not getattr(cls, "_is_protocol", False):
            continue
        members |= {a: None for a in getattr(cls, "__annotations__", {}) if not a.startswith("_")}
        members |= {
            a: v for a, v in vars(cls).items() if not a.startswith("_") and inspect.isfunction(v)
        }
    return members


def _parameters(fn: object) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]  # type: ignore[arg-type]


@pytest.mark.parametrize("node", NODES, ids=[n.name for n in NODES])
def test_each_stage_has_exactly_its_capabilities_and_every_member_of_each(node: Stage) -> None:
    protocols = [getattr(contract, name) for name in sorted(CAPABILITIES["compile"])]
    assert {p.__name__ for p in protocols if isinstance(node, p)} == CAPABILITIES[node.name]
    declared: set[str] = set()
    for proto in protocols:
        if proto.__name__ not in CAPABILITIES[node.name]:
            continue
        for name, fn in _protocol_members(proto).items():
            declared.add(name)
            assert hasattr(node, name), f"{node.name} lacks {proto.__name__}.{name}"
            if fn is not None:  # a method: as many parameters (the runner passes them in order)
                assert len(_parameters(getattr(node, name))) == len(_parameters(fn)), name
    # Every public method of the stage is a member of a capability it has: a misspelt one
    # would be an extra name here.
    extra = {
        a
        for a in dir(type(node))
        if not a.startswith("_") and inspect.isroutine(getattr(type(node), a))
    } - declared
    assert not extra, f"{node.name}: {sorted(extra)} belong to no capability it has"
