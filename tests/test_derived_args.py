"""Arguments derived from a model's own init: ``_init_``, ``_call_``, ``_ref_``, ``_key_``.

Each run is compared with plain JAX running the same init and step (bit for bit): the init
functions and programs are in tests/derived_programs.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import derived_programs as progs
import jax
import jax.numpy as jnp
import jaxaot
import numpy as np
import pytest
from jaxaot.config.argspec import Literal, bind, concrete_bound
from jaxaot.config.derived import CallNode, InitNode, KeyNode, RefNode
from jaxaot.errors import ArgSpecError, ConfigError, JaxaotError, StoreError
from jaxaot.stages import adapt as adapt_module
from jaxaot.stages import derived_values, stage_out
from jaxaot.stages.adapt import Adapted, Unfingerprintable

T = "program.target=derived_programs"
PARAMS = "{_init_: 'derived_programs:init', _args_: [{_key_: 0}], din: 3, dout: 4}"
OPT = (
    "{_init_: {_call_: 'derived_programs:Momentum', learning_rate: 0.1}, _method_: init, "
    "_args_: [{_ref_: 'program.args[0]'}]}"
)
X = "{shape: [2, 3], init: arange}"
QUICK = ("execute.warmup=0", "execute.repeats=1")


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr(progs, "CALLS", {})
    monkeypatch.setattr(progs, "SHARDINGS", [])
    monkeypatch.setattr(
        derived_values, "_HOST_OBJECTS", {}
    )  # _call_ objects: built afresh per test


def _x() -> np.ndarray:
    return np.arange(6, dtype=np.float32).reshape(2, 3)


def _same(got: Any, want: Any) -> None:
    g, w = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _plain_train() -> Any:
    params = jax.jit(progs.init, static_argnums=(1, 2))(jax.random.key(0), 3, 4)
    opt = progs.Momentum(0.1).init(params)
    return jax.jit(progs.train_step)(params, opt, _x())


# --- grammar: parsed without imports, refused in one line naming the config path -------------


def test_tags_parse_anywhere_a_leaf_may_be() -> None:
    bound = bind(
        [
            {"_init_": "m:init", "_args_": [{"_key_": 3}], "din": 2},
            {"state": {"_ref_": "program.args.0"}, "tx": {"_call_": "optax:sgd", "_args_": [0.1]}},
        ],
        {"opt": {"_init_": {"_ref_": "program.args[1].tx"}, "_method_": "init"}},
    )
    p, opt = bound.args[0], bound.kwargs["opt"]
    assert p == InitNode("m:init", None, (KeyNode(3),), (("din", Literal(2)),))
    assert bound.args[1]["state"] == RefNode("program.args[0]")
    assert isinstance(bound.args[1]["tx"], CallNode)
    assert opt.target == RefNode("program.args[1].tx") and opt.method == "init"
    # Strings inside an _init_'s arguments are its own business, not traced literals.
    bind([{"_init_": "m:init", "name": "dense"}], {})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [{"_init_": "m:init", "_arg_": [1]}],
            r"^program.args\[0\]: unknown tag key '_arg_'; expected one of _init_, _call_, "
            r"_ref_, _key_, _get_, _pytree_ \(with _args_, _method_\)$",
        ),
        ([{"_int_": "m:init"}], r"^program.args\[0\]: unknown tag key '_int_'"),
        (
            [{"_ref_": "program.args[0].w"}],
            r"^program.args\[0\]._ref_: no node 'program.args\[0\].w' in the config",
        ),
        (
            [
                {"_ref_": "program.args[1]"},
                {"_init_": "m:f", "_args_": [{"_ref_": "program.args[0]"}]},
            ],
            r"a _ref_ cycle \(program.args\[0\] -> program.args\[1\] -> "
            r"program.args\[1\]._args_\[0\] -> program.args\[0\]\)",
        ),
        ([{"_ref_": "args[0]"}], r"^program.args\[0\]._ref_: expected a config path"),
        ([{"_key_": -1}], r"^program.args\[0\]._key_: expected an int seed >= 0"),
        ([{"_init_": "init"}], r"^program.args\[0\]._init_: expected 'package.module:function'"),
        ([{"_init_": "m:f", "_method_": "1x"}], r"^program.args\[0\]._method_: expected an attr"),
        ([{"_init_": "m:f", "_call_": "m:g"}], r"^program.args\[0\]: one tag per mapping"),
        ([{"_key_": 0, "seed": 1}], r"^program.args\[0\]: a _key_ takes no other keys"),
    ],
)
def test_grammar_errors_name_the_path(args: list[Any], message: str) -> None:
    with pytest.raises(ArgSpecError, match=message) as err:
        bind(args, {})
    assert "\n" not in str(err.value)


def test_symbolic_dimensions_in_an_inits_arguments_take_the_compiled_sizes() -> None:
    bound = bind([{"_init_": "m:init", "_args_": ["f32[b,3]"], "like": {"x": "f32[2*b]"}}], {})
    (node,) = concrete_bound(bound, {"b": 5}).args
    assert node.args[0].shape == (5, 3)
    assert node.kwargs[0][1]["x"].shape == (10,)


def test_derived_value_at_a_static_position_is_refused() -> None:
    with pytest.raises(ArgSpecError, match=r"^program.args\[0\] is marked static but is a derived"):
        bind([{"_call_": "optax:sgd"}], {}, static_argnums=[0])


# --- stage_out, lower, compile see shapes; execute makes the values ----------------------------


def test_init_feeds_a_second_init_through_ref_and_runs_once(compose_run: Any) -> None:
    result = compose_run(
        f"{T}:train_step", f"program.args=[{PARAMS}, {OPT}, {X}]", "execute.check=reference", *QUICK
    )
    # Stage out traced each function once (eval_shape), execute called each once more (jit):
    # the params init feeds both program.args[0] and the optimizer's init without running again.
    assert progs.CALLS == {"init": 2, "Momentum": 1, "Momentum.init": 2}
    want = _plain_train()
    got = result["execute"].outputs
    _same(got, want)
    assert type(got[1]).__name__ == "MomentumState"  # the NamedTuple comes back as it was
    signature = result["stage_out"].signature
    assert [i["path"] for i in signature["inputs"]] == [
        "args[0]['b']",
        "args[0]['w']",
        "args[1].count",
        "args[1].mu['b']",
        "args[1].mu['w']",
        "args[2]",
    ]
    assert result["stage_out"].derived.evaluation.calls == {
        "program.args[0]": 1,
        "program.args[1]": 1,
    }


def test_key_is_a_real_key_argument(compose_run: Any) -> None:
    result = compose_run(f"{T}:noisy", f"program.args=[{{_key_: 7}}, {X}]", *QUICK)
    want = jax.jit(progs.noisy)(jax.random.key(7), _x())
    _same(result["execute"].outputs, want)


def test_hooks_replace_eval_shape_and_jit(compose_run: Any) -> None:
    result = compose_run(f"{T}:total", "program.args=[{_init_: 'derived_programs:hooked', n: 5}]")
    assert progs.CALLS == {"abstract_hook": 1, "materialize_hook": 1}
    (given,) = progs.SHARDINGS  # one sharding per array leaf: the executable's input's
    assert given == [result["compile"].compiled.input_shardings[0][0]]
    assert float(result["execute"].outputs) == 10.0


def test_a_4_gib_init_costs_nothing_to_lower(compose_run: Any) -> None:
    spec = "{_init_: 'derived_programs:huge', n: 1073741824}"  # 2**30 float32: 4 GiB
    before = _peak_rss_reset()
    result = compose_run(f"{T}:total", f"program.args=[{spec}]", "stop_after=lower")
    grown = _peak_rss() - before
    assert result["stage_out"].signature["inputs"][0]["type"] == "f32[1073741824]"
    assert progs.CALLS == {"huge": 1}  # traced once, never called with values
    assert grown < (4 << 30) // 8, f"peak RSS grew {grown >> 20} MiB lowering a 4 GiB init"


def _peak_rss_reset() -> int:
    """The current RSS, with the peak reset to it (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")
    return _status_kib("VmRSS") << 10


def _peak_rss() -> int:
    return _status_kib("VmHWM") << 10


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_derived_values_must_fit_in_memory_to_execute() -> None:
    big = {"program.args[0]": {"w": jax.ShapeDtypeStruct((1 << 28,), jnp.float32)}}
    with pytest.raises(ArgSpecError, match=r"^program.args\[0\] is 1.0 GiB .* stop_after=compile"):
        derived_values.check_fit(big, "cpu", memory=1 << 29)
    derived_values.check_fit(big, "cpu", memory=1 << 31)
    derived_values.check_fit(big, "cuda", memory=1 << 29)  # made on the devices, sharded


@pytest.mark.parametrize(
    "spec",
    [
        "{_init_: 'derived_programs:refusing', step: 7}",
        "{_init_: {_call_: 'derived_programs:Refusing', step: 7}, _method_: init}",
    ],
)
def test_jaxaots_own_error_from_a_derived_callable_gets_the_path(
    compose_run: Any, spec: str
) -> None:
    # Its class is kept (a ConfigError stays one) and the config path leads the line.
    with pytest.raises(ConfigError) as err:
        compose_run(f"{T}:total", f"program.args=[{spec}]", "stop_after=stage_out")
    assert type(err.value) is ConfigError
    assert str(err.value).startswith("program.args[0]")
    assert str(err.value).endswith(": step 7: no such checkpoint step")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "{_init_: 'derived_programs:broken', din: 7}",
            r"program.args\[0\]: derived_programs:broken\(din=7\) raised ValueError: no layer of "
            r"width 7 \(called under jax.eval_shape\)",
        ),
        (
            "{_init_: {_call_: 'derived_programs:Momentum', learning_rate: 0.1}, _method_: start}",
            r"program.args\[0\]._method_: derived_programs:Momentum\(...\) \(Momentum\) has no "
            r"attribute 'start' \(it has: beta, init, learning_rate, update\)",
        ),
        (
            "{_call_: 'derived_programs:Momentum', learning_rate: {_init_: 'derived_programs:huge', n: 2}}",
            r"program.args\[0\].learning_rate: an _init_ value \(derived arrays\) where a _call_",
        ),
        (
            "{_init_: 'derived_programs:nowhere'}",
            r"program.args\[0\]._init_='derived_programs:nowhere': 'derived_programs' has no "
            r"attribute 'nowhere'",
        ),
    ],
)
def test_evaluation_errors_name_the_path(compose_run: Any, spec: str, message: str) -> None:
    with pytest.raises(JaxaotError, match=message) as err:
        compose_run(f"{T}:total", f"program.args=[{spec}]", "stop_after=stage_out")
    assert "\n" not in str(err.value)


# --- a mesh: each init result is made with the executable's shardings -----------------------


def test_sharded_init_lands_with_the_executables_shardings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[tuple[Any, Any]] = []
    real = derived_values.materialize

    def recording(fn: Any, args: Any, kwargs: Any, shardings: Any) -> Any:
        out = real(fn, args, kwargs, shardings)
        made.append((shardings, out))
        return out

    monkeypatch.setattr(derived_values, "materialize", recording)
    cfg = jaxaot.compose([f"{T}:matmuls", "mesh=data2_model4", *QUICK])
    x_spec = {"shape": [4, 8], "init": "arange"}
    cfg.program.args = [{"_init_": "derived_programs:init_2d", "_args_": [{"_key_": 1}]}, x_spec]
    cfg.lower.in_shardings = {"params/**": ["data", "model"], "x": [None, "data"]}
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    exe = result["compile"].compiled
    want_sh = exe.input_shardings[0][0]
    ((shardings, params),) = made
    assert shardings is not None  # jit made each leaf on its devices, never whole on one
    for name in ("a", "c"):
        leaf = params[name]
        assert leaf.sharding.is_equivalent_to(want_sh[name], leaf.ndim)
        assert len(leaf.addressable_shards) == 8
        assert {s.data.shape for s in leaf.addressable_shards} == {
            (leaf.shape[0] // 2, leaf.shape[1] // 4)
        }
    # Plain JAX, the same init and the same shardings: bit for bit.
    plain_params = jax.jit(progs.init_2d)(jax.random.key(1))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    want = jax.jit(progs.matmuls, in_shardings=exe.input_shardings[0])(plain_params, x)
    _same(result["execute"].outputs, want)


def test_init_leaves_placed_elsewhere_are_moved_where_the_executable_takes_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Leaves made with other shardings than the executable takes (here replicated: an init
    # whose leaves could not be matched to the executable's inputs, and were placed by jit on
    # committed inputs) are moved where the executable takes them.
    real = derived_values.out_shardings
    replicated = jax.sharding.PartitionSpec()

    def elsewhere(by_id: Any, leaves: Any) -> Any:
        return [jax.sharding.NamedSharding(s.mesh, replicated) for s in real(by_id, leaves)]

    monkeypatch.setattr(derived_values, "out_shardings", elsewhere)
    cfg = jaxaot.compose([f"{T}:matmuls", "mesh=data2_model4", *QUICK])
    x_spec = {"shape": [4, 8], "init": "arange"}
    cfg.program.args = [{"_init_": "derived_programs:init_2d", "_args_": [{"_key_": 1}]}, x_spec]
    cfg.lower.in_shardings = {"params/**": ["data", "model"], "x": [None, "data"]}
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    exe = result["compile"].compiled
    plain_params = jax.jit(progs.init_2d)(jax.random.key(1))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    want = jax.jit(progs.matmuls, in_shardings=exe.input_shardings[0])(plain_params, x)
    _same(result["execute"].outputs, want)


# --- resume, the store, the Python API -------------------------------------------------------


def test_resume_from_a_lowering_re_derives_the_arguments(compose_run: Any, tmp_path: Path) -> None:
    args = f"program.args=[{PARAMS}, {OPT}, {X}]"
    first = compose_run(f"{T}:train_step", args, "stop_after=lower", run_dir=tmp_path / "a")
    second = compose_run(
        f"resume_from={first.run_dir}", "start_at=compile", *QUICK, run_dir=tmp_path / "b"
    )
    assert second.manifest["stages"]["stage_out"]["status"] == "resumed"
    assert second["stage_out"].traced is None  # re-derived by eval_shape, not traced again
    _same(second["execute"].outputs, _plain_train())


def test_resume_with_other_static_data_is_refused(
    compose_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = f"program.args=[{PARAMS}, {X}]"
    fingerprint = ["graph-A"]
    real = stage_out.adapt

    def fingerprinted(*a: Any, **k: Any) -> Adapted:
        out = real(*a, **k)
        return Adapted(out.fn, out.args, out.kwargs, fingerprint=fingerprint[0])

    monkeypatch.setattr(stage_out, "adapt", fingerprinted)
    monkeypatch.setattr(adapt_module, "adapt", fingerprinted)  # execute's (concrete values)
    first = compose_run(f"{T}:forward", args, "stop_after=lower", run_dir=tmp_path / "a")
    sig = json.loads((first.run_dir / "stage_out" / "signature.json").read_text())
    assert sig["static_fingerprint"] == "graph-A"
    resume = (f"resume_from={first.run_dir}", "start_at=compile", *QUICK)
    same = compose_run(*resume, run_dir=tmp_path / "b")
    assert same.ok
    fingerprint[0] = "graph-B"
    with pytest.raises(StoreError, match=r"differs from what the checkpoint was traced with"):
        compose_run(*resume, run_dir=tmp_path / "c")


def test_unfingerprintable_static_data_runs_but_cannot_resume(
    compose_run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = stage_out.adapt

    def opaque(*a: Any, **k: Any) -> Adapted:
        out = real(*a, **k)
        why = Unfingerprintable("params/act", "a lambda has no stable fingerprint")
        return Adapted(out.fn, out.args, out.kwargs, unfingerprintable=why)

    monkeypatch.setattr(stage_out, "adapt", opaque)
    args = f"program.args=[{PARAMS}, {X}]"
    first = compose_run(f"{T}:forward", args, "stop_after=lower", run_dir=tmp_path / "a")
    warnings = first.manifest["stages"]["stage_out"]["warnings"]
    assert any("params/act: a lambda has no stable fingerprint" in w for w in warnings)
    with pytest.raises(StoreError, match=r"no stable fingerprint \(params/act: a lambda"):
        compose_run(f"resume_from={first.run_dir}", "start_at=compile", run_dir=tmp_path / "b")


def test_store_on_and_off_give_the_same_outputs(compose_run: Any, isolated_store: Path) -> None:
    args = (f"{T}:train_step", f"program.args=[{PARAMS}, {OPT}, {X}]", *QUICK)
    cold = compose_run(*args)
    warm = compose_run(*args)
    off = compose_run(*args, "store.enabled=false")
    assert warm.manifest["stages"]["compile"]["status"] == "cached"
    assert off.manifest["stages"]["compile"]["status"] == "ran"
    _same(warm["execute"].outputs, cold["execute"].outputs)
    _same(off["execute"].outputs, cold["execute"].outputs)
    _same(cold["execute"].outputs, _plain_train())


def test_python_api_takes_shape_dtype_structs_and_arrays(tmp_path: Path) -> None:
    cfg = jaxaot.compose([f"{T}:forward", *QUICK])
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    cfg.program.args = [
        {"w": jnp.asarray(w), "b": jax.ShapeDtypeStruct((4,), jnp.float32)},
        jax.ShapeDtypeStruct((2, 3), jnp.float32),
    ]
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    sig = result["stage_out"].signature
    assert [(i["path"], i["type"]) for i in sig["inputs"]] == [
        ("args[0]['b']", "f32[4]"),
        ("args[0]['w']", "f32[3,4]"),
        ("args[1]", "f32[2,3]"),
    ]
    from jaxaot.stages.inputs import spec_inputs

    (params, x), _ = spec_inputs(result["stage_out"].bound, 0)
    np.testing.assert_array_equal(np.asarray(params["w"]), w)  # the array, as given
    want = jax.jit(progs.forward)(params, x)
    _same(result["execute"].outputs, want)


def test_python_objects_read_back_from_a_manifest_are_refused() -> None:
    text = str(jax.ShapeDtypeStruct((2, 3), jnp.float32))  # as the manifest's JSON writes it
    with pytest.raises(ArgSpecError, match=r"^program.args\[0\]: 'ShapeDtypeStruct\(.* given to"):
        bind([text], {})


def test_python_api_takes_derived_nodes(tmp_path: Path) -> None:
    cfg = jaxaot.compose([f"{T}:forward", *QUICK])
    cfg.program.args = [
        {"_init_": "derived_programs:init", "_args_": [{"_key_": 0}], "din": 3, "dout": 4},
        _x(),
    ]
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    params = jax.jit(progs.init, static_argnums=(1, 2))(jax.random.key(0), 3, 4)
    _same(result["execute"].outputs, jax.jit(progs.forward)(params, _x()))


def test_execute_inputs_cannot_fill_derived_values(compose_run: Any) -> None:
    with pytest.raises(JaxaotError, match=r"execute.inputs: the arguments hold derived values"):
        compose_run(f"{T}:forward", f"program.args=[{PARAMS}, {X}]", "execute.inputs=[x.npy]")
