"""Shardings by leaf path and logical-axis rules (jaxaot.config.path_shardings), on real trees:
optax states, a flax TrainState, NamedTuples, Equinox modules and flax linen partition
metadata, compared with flax's own mapping and with the lowered module."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, NamedTuple

import pytest
from conftest import extra_reason

pytest.importorskip("equinox", reason=extra_reason("models"))

import equinox as eqx
import flax.core.meta as flax_meta
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxaot.config.path_shardings import LogicalRules, parse_logical_rules, resolve
from jaxaot.config.sharding import Spec
from jaxaot.config.tree_paths import join, leaf_paths
from jaxaot.errors import ConfigError

MESH = {"fsdp": 4, "model": 2}
AXES = ("fsdp", "model")


def sds(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


PARAMS = {"layers": {"wq": sds(16, 8), "b": sds(6)}, "embed": sds(32, 16)}


def _resolve(tops: list[tuple[str, Any]], value: Any, rules: Any = None, **kw: Any) -> Any:
    logical = parse_logical_rules(rules, AXES) if rules is not None else LogicalRules()
    return resolve(tops, value, key="lower.in_shardings", mesh=MESH, logical=logical, **kw)


def _by_path(tops: list[tuple[str, Any]], trees: list[Any]) -> dict[str, Spec]:
    return {
        p: s
        for (top, tree), specs in zip(tops, trees, strict=True)
        for (p, _), s in zip(leaf_paths(tree, top), jax.tree.leaves(specs), strict=True)
    }


# --- leaf paths ---------------------------------------------------------------------------------


def test_leaf_paths_name_dict_keys_attributes_and_indices() -> None:
    state = jax.eval_shape(optax.adamw(1e-3).init, PARAMS)
    assert [p for p, _ in leaf_paths(state, "opt_state")] == [
        "opt_state/0/count",
        "opt_state/0/mu/embed",
        "opt_state/0/mu/layers/b",
        "opt_state/0/mu/layers/wq",
        "opt_state/0/nu/embed",
        "opt_state/0/nu/layers/b",
        "opt_state/0/nu/layers/wq",
    ]
    assert [p for p, _ in leaf_paths({0: sds(2), 1: [sds(3)]})] == ["0", "1/0"]


# --- patterns -----------------------------------------------------------------------------------


def test_optax_adamw_state_sharded_like_params() -> None:
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, PARAMS)
    tops = [("params", PARAMS), ("opt_state", opt_state)]
    value = {
        "params/layers/wq": ["fsdp", "model"],
        "params/embed": ["model", "fsdp"],
        "opt_state/**": "like params",
    }
    (params_specs, opt_specs), res = _resolve(tops, value)
    # The spec trees are shaped like the arguments: optax's own containers, one spec per leaf.
    assert jax.tree.structure(opt_specs) == jax.tree.structure(opt_state)
    adam = opt_specs[0]
    assert isinstance(adam, optax.ScaleByAdamState)
    for moment in (adam.mu, adam.nu):
        assert (
            moment
            == params_specs
            == {
                "layers": {"wq": Spec(("fsdp", "model")), "b": Spec()},
                "embed": Spec(("model", "fsdp")),
            }
        )
    assert adam.count == Spec()  # no counterpart in params: replicated, not listed
    assert res.unmatched == ["params/layers/b"]
    assert res.sources["opt_state/0/mu/layers/wq"] == "'opt_state/**': like params/layers/wq"


def test_scalars_no_rule_decides_are_replicated_and_not_listed() -> None:
    """optax's count and nnx.Optimizer's step have nothing to split: no warning about them."""
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, PARAMS)
    tops = [("opt_state", opt_state), ("step", jax.ShapeDtypeStruct((), jnp.uint32))]
    (opt_specs, step), res = _resolve(tops, {"opt_state/**/wq": ["fsdp", "model"]})
    assert opt_specs[0].count == step == Spec()
    assert res.sources["step"] == res.sources["opt_state/0/count"] == "a scalar: replicated"
    assert res.unmatched == [
        f"opt_state/0/{m}/{p}" for m in ("mu", "nu") for p in ("embed", "layers/b")
    ]


def test_star_is_one_component_double_star_any_number_and_inner_nodes_cover_subtrees() -> None:
    tree = {"a": {"kernel": sds(8, 4), "x": {"kernel": sds(8, 4)}}, "Dense_0": {"kernel": sds(8)}}
    tops = [("p", tree)]
    _, res = _resolve(tops, {"p/*/kernel": ["fsdp"], "p/**": None})
    assert res.specs["p/a/kernel"] == Spec(("fsdp",))
    assert res.specs["p/Dense_0/kernel"] == Spec(("fsdp",))
    assert res.specs["p/a/x/kernel"] == Spec()  # * is one component
    _, res = _resolve(tops, {"p/**/kernel": ["model"]})
    assert {res.specs[p] for p in res.specs} == {Spec(("model",))}
    _, res = _resolve(tops, {"p/Dense_*": ["model"], "p/a": ["fsdp", "model"]})
    assert res.specs == {
        "p/Dense_0/kernel": Spec(("model",)),
        "p/a/kernel": Spec(("fsdp", "model")),  # an inner node's pattern covers its subtree
        "p/a/x/kernel": Spec(("fsdp", "model")),
    }


def test_first_match_in_config_order_wins_and_positional_names_work() -> None:
    tops = [("params", PARAMS)]
    first = {"params/layers/b": None, "params/layers/wq": ["model"], "params/**": ["fsdp"]}
    _, res = _resolve(tops, first)
    assert res.specs["params/layers/wq"] == Spec(("model",))
    assert res.specs["params/embed"] == Spec(("fsdp",))
    _, res = _resolve(tops, {"params/*/b": None, "params/**": ["fsdp"], "params/**/wq": ["model"]})
    assert res.specs["params/layers/wq"] == Spec(("fsdp",))
    assert res.notes == [
        "lower.in_shardings['params/**/wq']: every leaf it matches is decided by an earlier pattern"
    ]
    _, res = _resolve(tops, {"args[0]/embed": ["model"]}, aliases=["args[0]"])
    assert res.specs["params/embed"] == Spec(("model",))


def test_flax_train_state_opt_state_like_params() -> None:
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(8)(nn.relu(nn.Dense(32)(x)))

    model = MLP()
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((4, 16)))

    def create(v: Any) -> train_state.TrainState:
        return train_state.TrainState.create(
            apply_fn=model.apply, params=v["params"], tx=optax.adam(1e-3)
        )

    state = jax.eval_shape(create, variables)
    tops = [("state", state)]
    value = {
        "state/params/**/kernel": ["fsdp", "model"],
        "state/opt_state/**": "like state/params",
    }
    (specs,), res = _resolve(tops, value)
    assert isinstance(specs, train_state.TrainState)
    assert specs.params["Dense_0"]["kernel"] == Spec(("fsdp", "model"))
    assert specs.opt_state[0].mu["Dense_1"]["kernel"] == Spec(("fsdp", "model"))
    assert specs.opt_state[0].nu["Dense_0"]["bias"] == Spec()
    # TrainState's step is a scalar: replicated, never listed (nothing to split).
    assert sorted(res.unmatched) == ["state/params/Dense_0/bias", "state/params/Dense_1/bias"]
    assert specs.step == Spec() and res.sources["state/step"] == "a scalar: replicated"
    # The spec tree is a valid jax.jit in_shardings for the state: the same structure.
    amesh = AbstractMesh((4, 2), AXES)
    shardings = jax.tree.map(lambda s: NamedSharding(amesh, P(*s.entries)), specs)

    def step(s: train_state.TrainState) -> Any:
        return jax.tree.map(lambda x: x + 1, (s.params, s.opt_state))

    lowered = (
        jax.jit(step, in_shardings=(shardings,)).trace(state).lower(lowering_platforms=("cpu",))
    )
    text = lowered.as_text()
    signature = text[text.index("func.func public @main") :].split("{\n")[0]
    # The two kernels of params, mu and nu; the biases and the count replicated (the step is
    # unused: not an argument of the module).
    assert signature.count('<@mesh, [{"fsdp"}, {"model"}]>') == 6, signature
    assert signature.count("<@mesh, [{}]>") == 6, signature
    assert signature.count("<@mesh, []>") == 1, signature


class Batch(NamedTuple):
    tokens: jax.Array
    mask: jax.Array


def test_namedtuple_and_equinox_module_leaves() -> None:
    # The model's arrays as shapes (eqx's init traced, nothing computed).
    model = eqx.filter_eval_shape(eqx.nn.MLP, 16, 8, 32, depth=2, key=jax.random.key(0))
    # What jax.jit traces for an Equinox module: its arrays, the rest None (eqx.filter_jit).
    arrays = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct)),
    )
    tops = [("model", arrays), ("batch", Batch(sds(8, 16), sds(8)))]
    value = {
        "model/layers/*/weight": [None, "fsdp"],
        "model/layers/0/bias": ["model"],
        "batch/tokens": ["fsdp"],
    }
    (model_specs, batch_specs), res = _resolve(tops, value)
    assert isinstance(model_specs, eqx.nn.MLP) and isinstance(batch_specs, Batch)
    assert model_specs.layers[1].weight == Spec((None, "fsdp"))
    assert model_specs.layers[0].bias == Spec(("model",))
    assert batch_specs == Batch(Spec(("fsdp",)), Spec())
    assert "batch/mask" in res.unmatched and "model/layers/2/bias" in res.unmatched


def test_like_with_a_different_shape_is_replicated_and_noted() -> None:
    tops = [("params", {"w": sds(16, 8)}), ("stats", {"w": sds(16)})]
    _, res = _resolve(tops, {"params/w": ["fsdp"], "stats/**": "like params"})
    assert res.specs["stats/w"] == Spec()
    assert "counterpart params/w has shape [16, 8], this leaf [16]" in res.notes[0]


# --- logical-axis rules, compared with flax -----------------------------------------------------


def _boxed_linen() -> Any:
    def part(names: tuple[str, ...]) -> Any:
        return nn.with_partitioning(nn.initializers.lecun_normal(), names)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.Dense(
                32,
                kernel_init=part(("embed", "mlp")),
                bias_init=nn.with_partitioning(nn.initializers.zeros, ("mlp",)),
            )(x)
            h = nn.Dense(16, kernel_init=part(("mlp", "embed")))(h)
            return nn.Dense(24, kernel_init=part(("embed", "vocab")))(h)

    return jax.eval_shape(Block().init, jax.random.key(0), jnp.zeros((4, 16)))


def _logical_axes(boxed: Any, top: str) -> dict[str, tuple[str | None, ...]]:
    """Leaf path -> names of each flax ``Partitioned`` box (what the adapt seam provides)."""
    flat = jax.tree_util.tree_flatten_with_path(
        boxed, is_leaf=lambda x: isinstance(x, flax_meta.Partitioned)
    )[0]
    return {join(top, k): v.names for k, v in flat if isinstance(v, flax_meta.Partitioned)}


def _norm(spec: P) -> tuple[Any, ...]:
    """A PartitionSpec's entries without trailing Nones, one-name tuples as the name."""
    out = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


RULE_SETS = [
    [["embed", "fsdp"], ["mlp", "model"]],
    [["embed", "fsdp"], ["mlp", "fsdp"], ["mlp", "model"]],  # mlp falls back to model
    [["mlp", "fsdp"], ["embed", "fsdp"], ["embed", "model"]],  # rule order, not dim order
    [["mlp", ["fsdp", "model"]], ["embed", "fsdp"]],
    [["embed", None], ["embed", "fsdp"], ["mlp", "model"]],  # null: replicated, no fallback
    [["vocab", "model"], ["mlp", "model"]],  # embed has no rule: replicated
]


@pytest.mark.parametrize("rules", RULE_SETS)
def test_logical_rules_on_linen_metadata_match_flax(rules: list[Any]) -> None:
    boxed = _boxed_linen()
    params = flax_meta.unbox(boxed)
    tops = [("variables", params)]
    (specs,), res = _resolve(tops, None, rules, logical_axes=_logical_axes(boxed, "variables"))
    flax_rules = [(n, tuple(m) if isinstance(m, list) else m) for n, m in rules]
    amesh = AbstractMesh((4, 2), AXES)
    want = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), amesh, flax_rules)
    ours = jax.tree.map(lambda s: NamedSharding(amesh, P(*s.entries)), specs)
    assert jax.tree.structure(ours) == jax.tree.structure(want)
    for got, exp in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
        assert _norm(got.spec) == _norm(exp.spec)
        assert got.is_equivalent_to(exp, 2)
    # The leaf without metadata (the last layers' biases) is replicated and listed.
    assert res.unmatched == ["variables/params/Dense_1/bias", "variables/params/Dense_2/bias"]

    # The lowered module is the same as with flax's shardings.
    def fn(v: Any) -> Any:
        return jax.tree.map(lambda x: x * 2, v)

    def lowered(shardings: Any) -> str:
        traced = jax.jit(fn, in_shardings=(shardings,), out_shardings=shardings).trace(params)
        return str(traced.lower(lowering_platforms=("cpu",)).as_text(debug_info=False))

    assert lowered(ours) == lowered(want)


def test_logical_to_mesh_axes_agrees_with_flax_on_every_small_case() -> None:
    names = ["embed", "mlp", "heads", None]
    rules_pool = [
        ("embed", "fsdp"),
        ("mlp", "fsdp"),
        ("mlp", "model"),
        ("heads", "model"),
        ("embed", ("fsdp", "model")),
        ("heads", None),
    ]
    checked = 0
    for n_rules in range(1, 4):
        for rules in itertools.permutations(rules_pool, n_rules):
            for dims in itertools.permutations(names, 3):
                leaf = {"w": sds(8, 8, 8)}
                logical = parse_logical_rules([[n, m] for n, m in rules], AXES)
                (_,), res = resolve(
                    [("x", leaf)],
                    None,
                    key="lower.in_shardings",
                    mesh=MESH,
                    logical=logical,
                    logical_axes={"x/w": dims},
                )
                want = nn.logical_to_mesh_axes(dims, list(rules))
                got = res.specs["x/w"]
                assert _norm(P(*got.entries)) == _norm(want), (rules, dims)
                checked += 1
    assert checked > 1000


def test_logical_names_in_patterns_and_explicit_patterns_beat_metadata() -> None:
    boxed = _boxed_linen()
    params = flax_meta.unbox(boxed)
    tops = [("v", params)]
    rules = [["embed", "fsdp"], ["mlp", "model"], ["vocab", "model"]]
    value = {
        "v/params/Dense_2/kernel": None,  # metadata says [embed, vocab]; the pattern wins
        "v/params/Dense_1/bias": ["embed"],  # a logical name in a spec
    }
    (specs,), res = _resolve(tops, value, rules, logical_axes=_logical_axes(boxed, "v"))
    p = specs["params"]
    assert p["Dense_2"]["kernel"] == Spec()
    assert p["Dense_1"]["bias"] == Spec(("fsdp",))
    assert p["Dense_0"]["kernel"] == Spec(("fsdp", "model"))  # from metadata
    assert res.sources["v/params/Dense_0/kernel"] == "metadata [embed, mlp]"
    assert res.unmatched == ["v/params/Dense_2/bias"]


def test_a_rule_that_does_not_divide_falls_back_and_is_noted() -> None:
    # flax assigns 'model' to a dimension of 3 and jax.jit refuses it; here the next rule for
    # the name applies (or none: replicated), and the fallback is noted.
    tops = [("p", {"w": sds(3, 8)})]
    rules = [["heads", "model"], ["heads", "fsdp"], ["embed", "fsdp"]]
    _, res = _resolve(tops, {"p/w": ["heads", "embed"]}, rules)
    assert res.specs["p/w"] == Spec((None, "fsdp"))  # heads: neither model nor fsdp divides 3
    assert res.notes == [
        "p/w: dimension 0 (heads, size 3) replicated: mesh axes [model], [fsdp] do not divide it"
    ]
    _, res = _resolve([("p", {"w": sds(4, 8)})], {"p/w": ["heads", "embed"]}, rules)
    assert res.specs["p/w"] == Spec(("model", "fsdp"))


# --- errors: one line naming the key and pattern ------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"params/embed": ["fsdq"]},
            r"^lower\.in_shardings\['params/embed'\]: spec \[fsdq\] names 'fsdq', which is "
            r"neither a mesh axis \['fsdp', 'model'\] \(mesh\.axes\) nor a logical name",
        ),
        (
            {"parms/**": ["fsdp"]},
            r"^lower\.in_shardings\['parms/\*\*'\]: matches no leaf of the arguments; expected "
            r"a pattern over their leaf paths \(params/embed, params/layers/b, params/layers/wq, "
            r"opt_state/0/count, \.\.\. \(10 in all\)\), or remove it$",
        ),
        (
            {"params/layers/b": ["fsdp", "model"]},
            r"^lower\.in_shardings\['params/layers/b'\]: spec \[fsdp, model\] has 2 entries but "
            r"params/layers/b has rank 1 \(shape \[6\]\); expected at most 1",
        ),
        (
            {"params/layers/b": [["fsdp", "model"]]},
            r"^lower\.in_shardings\['params/layers/b'\]: dimension 0 of params/layers/b has size "
            r"6, which mesh axes \['fsdp', 'model'\] \(together 8 devices\) do not divide",
        ),
        (
            {"params/embed": [["fsdp", "model"], None]},
            None,  # 32 is a multiple of 8: fine
        ),
        (
            {"opt_state/**": "like parms"},
            r"^lower\.in_shardings\['opt_state/\*\*'\]: like parms: no leaf is at or under "
            r"'parms'",
        ),
        (
            {"**": "like params"},
            r"^lower\.in_shardings\['\*\*'\]: params/embed matches 'like params', which is this "
            r"leaf itself; expected an earlier pattern",
        ),
        (
            {"params/**": "like opt_state/0/mu", "opt_state/**": "like params"},
            r"^lower shardings: 'like' rules go round in a circle: params/embed -> "
            r"opt_state/0/mu/embed -> params/embed",
        ),
        ({"params/a**": None}, r"^lower\.in_shardings\['params/a\*\*'\]: expected /-separated"),
        ({"params": "like p/*"}, r"^lower\.in_shardings\['params'\]: expected 'like <argument"),
        ({"params": {"embed": ["fsdp"]}}, r"^lower\.in_shardings\['params'\]: expected null"),
        ({"params": [["embed", "fsdp"]]}, r"logical axis 'embed' in a list"),
    ],
)
def test_errors_name_the_key_and_pattern(value: Any, message: str | None) -> None:
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, PARAMS)
    tops = [("params", PARAMS), ("opt_state", opt_state)]
    rules = [["embed", "fsdp"]]
    if message is None:
        _resolve(tops, value, rules)
        return
    with pytest.raises(ConfigError, match=message) as err:
        _resolve(tops, value, rules)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("rules", "names", "message"),
    [
        ([["embed", "fsdq"]], None, r"^lower\.logical_axis_rules\[0\]: 'embed' maps to mesh axis"),
        ([["embed"]], None, r"^lower\.logical_axis_rules\[0\]: expected \[logical name, mesh"),
        ("embed", None, r"^lower\.logical_axis_rules: expected a list of \[logical name"),
        ([["embed", "fsdp"]], ("embed", "embed"), r"^p/w: library metadata \[embed, embed\] "),
        ([["embed", "fsdp"]], ("embed", None, None), r"^p/w: library metadata .* has 3 entries"),
    ],
)
def test_rule_and_metadata_errors(rules: Any, names: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _resolve([("p", {"w": sds(8, 8)})], None, rules, logical_axes={"p/w": names})


def test_metadata_names_without_a_rule_replicate_that_dimension() -> None:
    (_,), res = _resolve(
        [("p", {"w": sds(8, 8)})], None, [["mlp", "model"]], logical_axes={"p/w": ("norm", "mlp")}
    )
    assert res.specs["p/w"] == Spec((None, "model")) and res.unmatched == []


def test_metadata_naming_mesh_axes_applies_without_rules() -> None:
    # nn.with_partitioning with mesh-axis names: flax's get_partition_spec is the sharding.
    def part(names: tuple[Any, ...]) -> Any:
        return nn.with_partitioning(nn.initializers.lecun_normal(), names)

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.Dense(32, kernel_init=part(("fsdp", "model")))(x)
            return nn.Dense(8, kernel_init=part((("fsdp", "model"), None)))(h)

    boxed = jax.eval_shape(Two().init, jax.random.key(0), jnp.zeros((2, 16)))
    (specs,), res = _resolve(
        [("v", flax_meta.unbox(boxed))], None, logical_axes=_logical_axes(boxed, "v")
    )
    want = nn.get_partition_spec(boxed)
    got = jax.tree.map(lambda s: P(*s.entries), specs)
    assert jax.tree.map(_norm, got) == jax.tree.map(_norm, want)
    assert specs["params"]["Dense_1"]["kernel"] == Spec((("fsdp", "model"),))
    assert res.unmatched == ["v/params/Dense_0/bias", "v/params/Dense_1/bias"]


def _validate(*overrides: str) -> Any:
    import jaxaot

    return jaxaot.validate(jaxaot.compose(["program=mlp", *overrides]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["mesh=data4_model2", "lower.in_shardings={params/**: [fsdp]}"],
            r"lower\.in_shardings\['params/\*\*'\]: spec \[fsdp\] names 'fsdp', which is neither",
        ),
        (
            ["mesh=data4_model2", "lower.logical_axis_rules=[[embed, fsdp]]"],
            r"lower\.logical_axis_rules\[0\]: 'embed' maps to mesh axis 'fsdp', which is not in",
        ),
        (
            ["lower.logical_axis_rules=[[embed, data]]"],
            r"lower\.logical_axis_rules needs a mesh",
        ),
        (
            [
                "mesh=data4_model2",
                "lower.logical_axis_rules=[[embed, data]]",
                "lower.in_shardings=[null, [data]]",
            ],
            r"lower\.in_shardings is a positional list; expected it as a mapping",
        ),
        (
            ["mesh=data4_model2", "lower.out_shardings={output/**: [embed]}"],
            r"lower\.out_shardings\['output/\*\*'\]: spec \[embed\] names 'embed'",
        ),
    ],
)
def test_config_errors_before_jax(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _validate(*overrides)


def test_the_mapping_form_and_rules_validate() -> None:
    cfg = _validate(
        "mesh=data4_model2",
        "lower.logical_axis_rules=[[embed, data], [mlp, model], [batch, [data, model]]]",
        "lower.in_shardings={params/**/w: [embed, mlp], x: [batch], params/*/b: like params}",
        "lower.out_shardings={output: [batch]}",
    )
    assert list(cfg.lower.in_shardings) == ["params/**/w", "x", "params/*/b"]  # config order
    assert cfg.lower.logical_axis_rules[2] == ["batch", ["data", "model"]]


# --- the pipeline: config -> lowered and compiled shardings --------------------------------------


def _tree(init: str = "normal") -> str:
    def arr(*shape: int) -> str:
        return f"{{shape: {list(shape)}, dtype: f32, init: {init}}}"

    return f"{{layers: {{w1: {arr(16, 32)}, b1: {arr(32)}}}, out: {arr(32, 8)}}}"


ADAMW_ARGS = (
    f"program.args=[{_tree()}, {{_pytree_: tuple, _args_: [{{_pytree_: 'optax:ScaleByAdamState',"
    f" count: {{shape: [], dtype: i32, init: zeros}}, mu: {_tree()}, nu: {_tree('ones')}}},"
    " {_pytree_: 'optax:EmptyState'}, {_pytree_: 'optax:EmptyState'}]},"
    " {_pytree_: 'path_sharding_programs:Batch', tokens: f32[8,16], targets: f32[8,8]}]"
)


def test_adamw_train_step_by_patterns_and_logical_rules(compose_run: Any, monkeypatch: Any) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # path_sharding_programs
    result = compose_run(
        "program.target=path_sharding_programs:train_step",
        ADAMW_ARGS,
        "mesh=data4_model2",
        "lower.logical_axis_rules=[[embed, data], [mlp, model], [batch, data]]",
        "lower.in_shardings={params/layers/w1: [embed, mlp], params/out: [mlp, null],"
        " opt_state/**: like params, batch/*: [batch]}",
        "lower.out_shardings={output/0: like params, output/1: like opt_state}",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    assert result["execute"].check["ok"]
    shardings = json.loads((result.run_dir / "compile" / "shardings.json").read_text())
    ins = {r["path"]: r["sharding"] for r in shardings["inputs"]}
    assert ins["args[0]['layers']['w1']"] == "P('data', 'model')"
    assert ins["args[0]['out']"] == "P('model',)"
    assert ins["args[1][0].mu['layers']['w1']"] == "P('data', 'model')"
    assert ins["args[1][0].nu['out']"] == "P('model',)"
    assert ins["args[1][0].count"] == "P()"
    assert ins["args[2].tokens"] == ins["args[2].targets"] == "P('data',)"
    outs = {r["path"]: r["sharding"] for r in shardings["outputs"]}
    assert outs["[0]['layers']['w1']"] == outs["[1][0].nu['layers']['w1']"] == "P('data', 'model')"
    assert outs["[2]"] == "P()"
    record = json.loads((result.run_dir / "lower" / "path_shardings.json").read_text())
    assert record["unmatched_inputs"] == ["params/layers/b1"]
    assert record["unmatched_outputs"] == []  # output/2, the loss, is a scalar: not listed
    by = {r["path"]: r["by"] for r in record["inputs"]}
    assert by["opt_state/0/mu/layers/w1"] == "'opt_state/**': like params/layers/w1"
    warnings = result.manifest["stages"]["lower"]["warnings"]
    assert any("1 leaf matches no pattern" in w and "params/layers/b1" in w for w in warnings)


def test_explicit_axes_take_the_mapping_form(compose_run: Any, monkeypatch: Any) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # aot_api_programs
    result = compose_run(
        "program.target=aot_api_programs:resharded",
        "program.args=[f32[8,2]]",
        "mesh.shape=[4]",
        "mesh.axes=[data]",
        "mesh.axis_types=[explicit]",
        "lower.in_shardings={x: [data]}",
        "stop_after=compile",
    )
    staged = result.records["stage_out"]
    assert staged.args[0].sharding.spec == P("data")
    outs = result.records["compile"].compiled.output_shardings
    assert [s.spec for s in outs] == [P("data"), P()]


LINEN_RULES = [["embed", "data"], ["mlp", "data"], ["mlp", "model"], ["vocab", "model"]]


def test_linen_model_from_its_init_sharded_by_rules_as_flax_would(
    compose_run: Any, monkeypatch: Any
) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # path_sharding_programs
    import path_sharding_programs as progs  # type: ignore[import-not-found]

    rules = [*LINEN_RULES, ["batch", "data"]]
    result = compose_run(
        "program.target=path_sharding_programs:forward",
        "program.args=[{_init_: 'path_sharding_programs:init_block', _args_: [{_key_: 0}]},"
        " f32[8,16]]",
        "mesh=data4_model2",
        f"lower.logical_axis_rules={json.dumps(rules).replace(chr(34), '')}",
        "lower.in_shardings={x: [batch]}",
        "execute.check=reference",
        "execute.warmup=0",
        "execute.repeats=1",
    )
    assert result["execute"].check["ok"]
    # Plain JAX and flax: the boxed variables sharded by flax's own mapping, traced under
    # flax's rules (the hidden activation's logical constraint: batch has no free axis left).
    flax_rules = [(n, m) for n, m in rules]
    amesh = AbstractMesh((4, 2), ("data", "model"))
    boxed = jax.eval_shape(progs.init_block, jax.random.key(0))
    want = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), amesh, flax_rules)
    x_sharding = NamedSharding(amesh, P("data"))
    with nn.logical_axis_rules(flax_rules), jax.sharding.use_abstract_mesh(amesh):
        plain = jax.jit(progs.forward, in_shardings=(want, x_sharding)).trace(boxed, sds(8, 16))
        plain_text = plain.lower(lowering_platforms=("cpu",)).as_text()
    ours = (result.run_dir / "lower" / "module.stablehlo.mlir").read_text()

    def annotations(text: str) -> list[tuple[str, str]]:
        """Each argument sharding and sharding constraint, in module order."""
        return re.findall(r"(sdy\.sharding_constraint|sdy\.sharding =)[^<]*<@mesh, ([^>]*)>", text)

    assert annotations(ours) == annotations(plain_text)
    assert ("sdy.sharding_constraint", '[{}, {"data"}]') in annotations(ours)
    compiled = json.loads((result.run_dir / "compile" / "shardings.json").read_text())
    specs = [r["sharding"] for r in compiled["inputs"]]
    assert specs == [str(s.spec) for s in jax.tree.leaves(want)] + ["P('data',)"]


# --- the positional form (and none) on derived values and arrays given from Python ----------

INIT_ARGS = "program.args=[{_init_: 'jax.numpy:ones', _args_: [[64, 256]]}, f32[64,256]]"


@pytest.mark.parametrize(
    ("shardings", "want"),
    [
        ([], (P(), P())),  # a mesh and no lower.in_shardings: everything replicated
        (["lower.in_shardings=[[data, model], [data]]"], (P("data", "model"), P("data"))),
        (["lower.in_shardings=[data]"], (P("data"), P("data"))),  # one spec for every array
    ],
)
def test_positional_specs_stand_for_a_derived_value(
    compose_run: Any, shardings: list[str], want: tuple[P, P]
) -> None:
    result = compose_run(
        "program=axpy", INIT_ARGS, "mesh=data4_model2", *shardings, "stop_after=compile"
    )
    got = result.records["compile"].compiled.input_shardings[0]
    assert tuple(_norm(s.spec) for s in got) == tuple(_norm(p) for p in want)


def test_a_positional_spec_for_a_derived_value_is_checked_against_its_arrays(
    compose_run: Any,
) -> None:
    with pytest.raises(ConfigError) as err:
        compose_run(
            "program=axpy",
            INIT_ARGS,
            "mesh=data4_model2",
            "lower.in_shardings=[[data, null, model], null]",
            "stop_after=lower",
        )
    assert str(err.value).startswith("lower.in_shardings: program.args[0] (f32[64,256]): spec")
    assert "has 3 entries but the array has rank 2" in str(err.value)


@pytest.mark.parametrize("shardings", [None, [["data", "model"], ["data"]]])
def test_an_array_given_from_python_takes_positional_specs(tmp_path: Any, shardings: Any) -> None:
    import jaxaot
    import numpy as np

    cfg = jaxaot.compose(["program=axpy", "mesh=data4_model2", "stop_after=compile"])
    cfg.program.args = [np.ones((64, 256), np.float32), np.zeros((64, 256), np.float32)]
    cfg.lower.in_shardings = shardings
    result = jaxaot.run(cfg, run_dir=tmp_path / "run")
    got = [_norm(s.spec) for s in result["compile"].compiled.input_shardings[0]]
    want = [P(), P()] if shardings is None else [P("data", "model"), P("data")]
    assert got == [_norm(p) for p in want]


def test_stage_out_traces_under_the_same_flax_rules_as_lower(
    compose_run: Any, monkeypatch: Any
) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # path_sharding_programs
    rules = [*LINEN_RULES, ["batch", "data"]]
    result = compose_run(
        "program.target=path_sharding_programs:forward",
        "program.args=[{_init_: 'path_sharding_programs:init_block', _args_: [{_key_: 0}]},"
        " f32[8,16]]",
        "mesh=data4_model2",
        f"lower.logical_axis_rules={json.dumps(rules).replace(chr(34), '')}",
        "lower.in_shardings={x: [batch]}",
        "stop_after=lower",
    )
    jaxpr = (result.run_dir / "stage_out" / "jaxpr.txt").read_text()
    module = (result.run_dir / "lower" / "module.stablehlo.mlir").read_text()
    # The hidden activation's logical constraint (batch, mlp), mapped by the rules: batch has
    # no free axis left once mlp took data, so (None, 'data'), as flax maps it; and the
    # boxed variables' constraints: as many as the lowered module has.
    found = re.findall(r"sharding_constraint\[.*?spec=P\(([^)]*)\)\)", jaxpr, re.S)
    assert "None, 'data'" in found
    assert len(found) == module.count("sdy.sharding_constraint") > 1
