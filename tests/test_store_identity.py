"""Issue 12: the store and checkpoints never hand back a wrong or stale executable.

Programs that lower to ONE module (an argument pruned as unused, outputs reordered, regrouped,
list vs tuple, dict vs positional inputs) and one program under other compiler options or XLA
flags run through one shared store; every output must equal the store-off output bit for bit,
and every lookup must be a hit of the very same program or a miss. An entry that verifies but
cannot serve the run (another program's executable, a pickled class that is gone) is warned
about once, dropped and recompiled; a checkpoint's is not loaded and the export is compiled.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jaxaot
import numpy as np
import pytest
from conftest import cli_env, read_manifest, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxaot.stages import jaxenv
from jaxaot.stages.xla_flags import FlagSource
from jaxaot.store.cache import Store
from jaxaot.util import memo

POSITIONAL = "program.args=[{shape:[4],dtype:f32,init:ones},{shape:[4],dtype:f32,init:arange}]"
AS_DICT = "program.args=[{a:{shape:[4],dtype:f32,init:ones},b:{shape:[4],dtype:f32,init:arange}}]"


# A family whose members lower to one module (or nearly): only the calling convention differs.
def use_first(x: Any, y: Any) -> Any:
    return x * 2


def use_second(x: Any, y: Any) -> Any:
    return y * 2


def pair(x: Any, y: Any) -> Any:
    return x * 2, y * 2


def swapped(x: Any, y: Any) -> Any:
    return y * 2, x * 2


def as_list(x: Any, y: Any) -> Any:
    return [x * 2, y * 2]


def grouped_left(x: Any, y: Any) -> Any:
    return ((x * 2, y * 2),)


def grouped_right(x: Any, y: Any) -> Any:
    return (x * 2,), (y * 2,)


def dict_first(d: Any) -> Any:
    return d["a"] * 2


def dict_second(d: Any) -> Any:
    return d["b"] * 2


PROGRAMS = {
    f.__name__: POSITIONAL
    for f in (use_first, use_second, pair, swapped, as_list, grouped_left, grouped_right)
}
PROGRAMS |= {"dict_first": AS_DICT, "dict_second": AS_DICT}
# Programs with an unused input: lower.keep_unused=true makes another executable of these only.
PRUNING = frozenset({"use_first", "use_second", "dict_first", "dict_second"})


def _same_program(case: tuple[str, bool, bool]) -> tuple[str, bool, bool]:
    """The executable a case needs: keep_unused is a no-op where every input is used."""
    name, fast_math, keep_unused = case
    return name, fast_math, keep_unused and name in PRUNING


def _overrides(name: str, fast_math: bool, keep_unused: bool) -> list[str]:
    out = [
        f"program.target={__name__}:{name}",
        PROGRAMS[name],
        "execute.repeats=1",
        "execute.warmup=0",
    ]
    if fast_math:
        out.append("compile.compiler_options={xla_cpu_enable_fast_math:true}")
    if keep_unused:
        out.append("lower.keep_unused=true")
    return out


def _leaves(tree: Any) -> tuple[str, list[np.ndarray]]:
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return str(treedef), [np.asarray(x) for x in leaves]


def _same_bits(a: Any, b: Any) -> bool:
    (ta, la), (tb, lb) = _leaves(a), _leaves(b)
    return ta == tb and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def _compile(result: jaxaot.RunResult) -> dict[str, Any]:
    return dict(result.manifest["stages"]["compile"])


CASES = st.tuples(st.sampled_from(sorted(PROGRAMS)), st.booleans(), st.booleans())


def test_one_shared_store_serves_only_the_same_program(tmp_path: Path) -> None:
    reference: dict[tuple[str, bool, bool], Any] = {}  # store off: compiled fresh every time
    program_of_key: dict[str, tuple[str, bool, bool]] = {}
    key_of_program: dict[tuple[str, bool, bool], str] = {}
    composed: dict[tuple[str, bool, bool], Any] = {}  # Hydra composes each case once

    def run(case: tuple[str, bool, bool], store: bool) -> jaxaot.RunResult:
        if case not in composed:
            composed[case] = jaxaot.compose(_overrides(*case))
        cfg = copy.deepcopy(composed[case])
        cfg.store.enabled = store
        return jaxaot.run(cfg, run_dir=tmp_path / f"api{len(list(tmp_path.glob('api*')))}")

    # ~0.3 s a run (two for a case seen first) and ~0.5 s a composition: 12 examples of up to
    # 3 runs, ~15-20 s.
    @settings(max_examples=12, deadline=None, database=None)
    @given(st.lists(CASES, min_size=1, max_size=3))
    def check(steps: list[tuple[str, bool, bool]]) -> None:
        for case in steps:
            if case not in reference:
                off = run(case, store=False)
                assert _compile(off)["status"] == "ran"
                reference[case] = off["execute"].outputs
            result = run(case, store=True)
            stage = _compile(result)
            key = stage["key"]
            assert not stage["warnings"], stage["warnings"]
            program = _same_program(case)
            if key in program_of_key:
                # A hit, and only ever of the very program and options that stored it.
                assert program_of_key[key] == program
                assert stage["status"] == "cached"
            else:
                assert stage["status"] == "ran"  # a miss: compiled and stored
                program_of_key[key] = program
            assert key_of_program.setdefault(program, key) == key  # one program, one key
            assert _same_bits(result["execute"].outputs, reference[case]), case

    check()
    assert len(program_of_key) == len(key_of_program)


def test_kept_arguments_agree_between_lowering_export_and_loaded_executable() -> None:
    import jax
    from jax.experimental import serialize_executable
    from jaxaot.stages.compile import kept_inputs

    spec = jax.ShapeDtypeStruct((4,), np.float32)
    for fn, kept in ((use_first, (0,)), (use_second, (1,))):
        lowered = jax.jit(fn).trace(spec, spec).lower()
        exported = jax.export.export(jax.jit(fn))(spec, spec)
        loaded = serialize_executable.deserialize_and_load(
            *serialize_executable.serialize(lowered.compile())
        )
        assert kept_inputs(lowered) == tuple(exported.module_kept_var_idx) == kept
        assert kept_inputs(loaded) == kept


def test_issue_repro_use_first_then_use_second_on_the_cli(tmp_path: Path) -> None:
    (tmp_path / "prog12.py").write_text(
        "def use_first(x, y):\n    return x * 2\n\n\ndef use_second(x, y):\n    return y * 2\n"
    )
    env = cli_env(PYTHONPATH=f"{cli_env()['PYTHONPATH']}:{tmp_path}")
    outs = []
    for name in ("use_first", "use_second"):
        proc = run_cli(
            [f"program.target=prog12:{name}", POSITIONAL, f"hydra.run.dir={tmp_path / name}"],
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert read_manifest(tmp_path / name)["stages"]["compile"]["status"] == "ran"
        outs.append(np.load(tmp_path / name / "execute" / "outputs.npz")["out0"])
    assert outs[0].tolist() == [2, 2, 2, 2]
    assert outs[1].tolist() == [0, 2, 4, 6]


FAST_MATH_PROGRAM = (
    "import jax.numpy as jnp\n\n"
    "def f(x):\n    return jnp.exp(x) * jnp.log1p(x) / jnp.sqrt(x + 1.0) + jnp.tanh(x)\n"
)


def test_xla_flags_are_keyed_and_an_executable_is_never_served_across_them(tmp_path: Path) -> None:
    (tmp_path / "fastmath_prog.py").write_text(FAST_MATH_PROGRAM)
    base = cli_env(PYTHONPATH=f"{cli_env()['PYTHONPATH']}:{tmp_path}")
    args = [
        "program.target=fastmath_prog:f",
        "program.args=[{shape:[4096],dtype:f32,init:uniform,low:0.001,high:50}]",
        "execute.repeats=1",
    ]
    fast = {**base, "XLA_FLAGS": "--xla_cpu_enable_fast_math=true --xla_dump_to=" + str(tmp_path)}
    runs = (("fast", fast, "ran"), ("plain", base, "ran"), ("fast_again", fast, "cached"))
    outs, manifests = {}, {}
    for name, env, status in runs:
        proc = run_cli([*args, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        manifests[name] = read_manifest(tmp_path / name)
        assert manifests[name]["stages"]["compile"]["status"] == status, name
        outs[name] = np.load(tmp_path / name / "execute" / "outputs.npz")["out0"]
    env_fast = manifests["fast"]["environment"]
    assert env_fast["xla_flags"] == ["--xla_cpu_enable_fast_math=true"]
    assert env_fast["xla_flags_not_in_key"] == [f"--xla_dump_to={tmp_path}"]
    assert manifests["plain"]["environment"]["xla_flags"] == []
    # The flag changes the numerics, so serving one to the other would have been visible.
    assert outs["fast"].tobytes() != outs["plain"].tobytes()
    assert outs["fast_again"].tobytes() == outs["fast"].tobytes()


def _sources(xla_flags: str) -> dict[str, FlagSource]:
    """What XLA read at start-up (jaxenv fixes it once per process: see its docstring)."""
    return {
        "XLA_FLAGS": FlagSource("XLA_FLAGS", xla_flags),
        "LIBTPU_INIT_ARGS": FlagSource("LIBTPU_INIT_ARGS", ""),
    }


def test_output_only_xla_flags_do_not_change_the_key(compose_run: Any, monkeypatch: Any) -> None:
    args = ("program=axpy", "program.args=[f32[4],f32[4]]", "stop_after=compile")
    monkeypatch.setattr(jaxenv, "_warned_changed", True)  # the variable itself is unchanged
    keys = {}
    for name, flags in (
        ("none", ""),
        ("dump", "--xla_dump_to=/tmp/d --xla_dump_hlo_as_text"),
        ("fast", "--xla_cpu_enable_fast_math=true"),
    ):
        monkeypatch.setattr(jaxenv, "_in_effect", _sources(flags))
        keys[name] = _compile(compose_run(*args))["key"]
    assert keys["none"] == keys["dump"] != keys["fast"]


def test_manifest_records_xla_flags_and_every_jax_config_value(compose_run: Any) -> None:
    import jax

    env = compose_run("program=axpy", "stop_after=compile").manifest["environment"]
    assert set(env["jax_config"]) == set(jax.config.values)
    assert env["jax_config"]["jax_enable_x64"] is False
    assert env["jax_config"]["jax_default_matmul_precision"] is None
    assert isinstance(env["xla_flags"], list) and isinstance(env["xla_flags_not_in_key"], list)
    assert "jax_log_compiles" in env["jax_config_not_in_key"]
    assert "jax_enable_x64" not in env["jax_config_not_in_key"]


def test_a_jax_config_value_changes_the_key(compose_run: Any) -> None:
    import jax

    args = ("program=axpy", "program.args=[f32[4],f32[4]]", "stop_after=compile")
    first = _compile(compose_run(*args))["key"]
    with jax.default_matmul_precision("highest"):
        other = _compile(compose_run(*args))["key"]
    with jax.log_compiles(True):  # output only: the same key
        same = _compile(compose_run(*args))["key"]
    assert first == same != other


def _entry(store: Path, key: str) -> Path:
    return store / "v1" / "compile" / key[:2] / key


def test_another_programs_entry_under_this_key_is_warned_once_dropped_and_recompiled(
    compose_run: Any, isolated_store: Path
) -> None:
    first = compose_run(*_overrides("use_first", False, False))
    second = compose_run(*_overrides("use_second", False, False))
    k1, k2 = _compile(first)["key"], _compile(second)["key"]
    assert k1 != k2
    # Plant use_first's (intact, verified) executable under use_second's key.
    planted = _entry(isolated_store, k2)
    for f in planted.iterdir():
        f.unlink()
    for f in _entry(isolated_store, k1).iterdir():
        planted.joinpath(f.name).write_bytes(f.read_bytes())
    doc = json.loads((planted / "entry.json").read_text())
    (planted / "entry.json").write_text(json.dumps({**doc, "key": k2}))

    again = compose_run(*_overrides("use_second", False, False))
    stage = _compile(again)
    assert stage["status"] == "ran"
    (warning,) = stage["warnings"]
    assert f"compile/{k2[:12]} unusable" in warning and "kept (0,), expected (1,)" in warning
    assert "entry removed" in warning
    assert again["execute"].outputs.tolist() == [0, 2, 4, 6]
    assert Store(isolated_store).verify().ok
    clean = compose_run(*_overrides("use_second", False, False))
    assert (_compile(clean)["status"], _compile(clean)["warnings"]) == ("cached", [])
    assert clean["execute"].outputs.tolist() == [0, 2, 4, 6]


class Pair(NamedTuple):  # the class a stored out_tree pickles by reference
    left: Any
    right: Any


def test_a_pickled_class_that_is_gone_is_a_miss_not_a_failed_run(
    compose_run: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    monkeypatch.syspath_prepend(str(mods))
    (mods / "pair_types12.py").write_text(
        "from typing import Any, NamedTuple\n\nclass Pair(NamedTuple):\n    left: Any\n"
        "    right: Any\n"
    )
    (mods / "pair_prog12.py").write_text(
        "from pair_types12 import Pair\n\ndef f(x, y):\n    return Pair(x * 2, y + 1)\n"
    )
    args = ("program.target=pair_prog12:f", POSITIONAL, "execute.repeats=1")
    first = compose_run(*args)
    assert _compile(first)["status"] == "ran"
    # The class moves into the program's module: same name, same pytree, same key, but the
    # stored pickle names pair_types12.Pair, which is gone.
    (mods / "pair_types12.py").write_text("")
    (mods / "pair_prog12.py").write_text(
        "from typing import Any, NamedTuple\n\nclass Pair(NamedTuple):\n    left: Any\n"
        "    right: Any\n\ndef f(x, y):\n    return Pair(x * 2, y + 1)\n"
    )
    for name in ("pair_types12", "pair_prog12"):
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    memo.clear()  # as in a new process: the executable is unpickled from the store
    again = compose_run(*args)
    stage = _compile(again)
    assert stage["key"] == _compile(first)["key"]
    assert stage["status"] == "ran"
    (warning,) = stage["warnings"]
    assert "does not load here" in warning and "Pair" in warning
    out = again["execute"].outputs
    assert type(out).__name__ == "Pair" and out.right.tolist() == [1, 2, 3, 4]
    memo.clear()
    clean = compose_run(*args)
    assert (_compile(clean)["status"], _compile(clean)["warnings"]) == ("cached", [])


def _replace_artifact(run_dir: Path, rel: str, data: bytes) -> None:
    import hashlib

    (run_dir / rel).write_bytes(data)
    manifest = read_manifest(run_dir)
    for stage in manifest["stages"].values():
        if rel in stage["artifacts"]:
            stage["artifacts"][rel] = {
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
            }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_executable_of_another_program_is_not_loaded(compose_run: Any) -> None:
    a = compose_run(*_overrides("use_first", False, False), "store.enabled=false").run_dir
    b = compose_run(*_overrides("use_second", False, False), "store.enabled=false").run_dir
    foreign = (a / "compile" / "executable.bin").read_bytes()
    _replace_artifact(b, "compile/executable.bin", foreign)
    resumed = compose_run(f"resume_from={b}", "start_at=execute", "store.enabled=false")
    stage = _compile(resumed)
    assert stage["status"] == "ran"
    assert any(
        "checkpoint executable unusable here" in w and "kept (0,)" in w for w in stage["warnings"]
    )
    assert resumed["execute"].outputs.tolist() == [0, 2, 4, 6]
    assert (b / "compile" / "executable.bin").read_bytes() == foreign  # the checkpoint is kept


def test_a_resumed_compile_is_keyed_by_the_export_not_by_a_side_file(compose_run: Any) -> None:
    runs = {
        n: compose_run(*_overrides(n, False, False), "stop_after=lower").run_dir
        for n in ("use_first", "use_second")
    }
    keys = {}
    for name, src in runs.items():
        resumed = compose_run(f"resume_from={src}", "start_at=compile")
        keys[name] = _compile(resumed)["key"]
        assert not _compile(resumed)["warnings"]  # the compiled convention is the key's
        assert resumed["execute"].outputs.tolist() == (
            [2] * 4 if name == "use_first" else [0, 2, 4, 6]
        )
    assert keys["use_first"] != keys["use_second"]
    # lowered.json claims use_first's module hash: the key (from exported.bin) does not care.
    src = runs["use_second"]
    meta = json.loads((src / "lower" / "lowered.json").read_text())
    meta["module_sha256"] = "0" * 64
    _replace_artifact(src, "lower/lowered.json", json.dumps(meta).encode())
    again = compose_run(f"resume_from={src}", "start_at=compile")
    assert (_compile(again)["key"], _compile(again)["status"]) == (keys["use_second"], "cached")
    assert again["execute"].outputs.tolist() == [0, 2, 4, 6]


def _run_from(depth: int, cfg: Any, run_dir: Path) -> jaxaot.RunResult:
    """``jaxaot.run`` called ``depth`` frames below here: another Python stack above the trace."""
    import jax

    if depth:
        return _run_from(depth - 1, cfg, run_dir)
    jax.clear_caches()  # traced again, as in another process: not JAX's lowering of an earlier run
    return jaxaot.run(cfg, run_dir=run_dir)


@pytest.mark.parametrize(
    "through",
    [
        "lower.platforms=[cpu,tpu]",  # compiled for CPU through the export
        pytest.param("compile.topology=v5e:2x2", marks=pytest.mark.extra("tpu")),
    ],
)
def test_an_export_is_keyed_without_the_callers_stack(tmp_path: Path, through: str) -> None:
    """A compile through the export is keyed by what it compiles, without the locations (they
    run up to whoever called jaxaot): called from another stack it is a store hit, and what it
    runs is a compile's without the store, bit for bit."""
    cfg = jaxaot.compose(["program=mlp", through, "execute.repeats=1", "execute.warmup=0"])
    runs = [_run_from(depth, copy.deepcopy(cfg), tmp_path / f"r{depth}") for depth in (0, 3)]
    exported = [(r.run_dir / "lower" / "exported.bin").read_bytes() for r in runs]
    assert exported[0] != exported[1]  # the stacks in the locations differ
    assert [_compile(r)["status"] for r in runs] == ["ran", "cached"]
    assert _compile(runs[0])["key"] == _compile(runs[1])["key"]
    if "topology" in through:
        assert runs[1]["compile"].cost == runs[0]["compile"].cost
        return
    fresh = copy.deepcopy(cfg)
    fresh.store.enabled = False
    alone = jaxaot.run(fresh, run_dir=tmp_path / "alone")
    assert _compile(alone)["status"] == "ran"
    assert _same_bits(runs[1]["execute"].outputs, alone["execute"].outputs)


def test_an_exports_digest_follows_the_program_not_its_locations() -> None:
    import jax
    from jax import export
    from jaxaot.stages.module_text import export_digest

    def exported(k: float, depth: int = 0) -> Any:
        if depth:
            return exported(k, depth - 1)
        return export.export(jax.jit(lambda x: x * k))(jax.ShapeDtypeStruct((3,), np.float32))

    one = exported(2.0)
    assert one.serialize() != exported(2.0, depth=2).serialize()
    assert export_digest(one) == export_digest(exported(2.0, depth=2))
    assert export_digest(one) == export_digest(export.deserialize(one.serialize()))
    assert export_digest(one) != export_digest(exported(3.0))  # the constant differs
    wider = export.export(jax.jit(lambda x: x * 2.0))(jax.ShapeDtypeStruct((4,), np.float32))
    assert export_digest(one) != export_digest(wider)


def test_a_changed_xla_flags_variable_in_process_is_warned_and_not_keyed(
    monkeypatch: Any, caplog: Any
) -> None:
    import logging

    # XLA read XLA_FLAGS (empty) when the backend started; setting it now changes nothing.
    monkeypatch.setattr(jaxenv, "_in_effect", _sources(""))
    monkeypatch.setattr(jaxenv, "_warned_changed", False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    with caplog.at_level(logging.WARNING, logger="jaxaot"):
        jaxenv._note_flags()
        jaxenv._note_flags()
    assert len([r for r in caplog.records if "changed after XLA read it" in r.getMessage()]) == 1
    # What the backend compiles with, not the variable.
    assert jaxenv.flags_in_effect()["XLA_FLAGS"].effective == {}
