"""adapt(): library objects in arguments, compared side by side with nnx.jit, eqx.filter_jit and
plain jax.jit on the same step (same outputs bit for bit, same compiled FLOPs)."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from conftest import FAST_CPU_CODEGEN, extra_reason

pytest.importorskip("equinox", reason=extra_reason("models"))

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jaxaot.config.tree_paths import argument_paths
from jaxaot.stages.adapt import adapt, purify
from jaxaot.stages.stage_out import resolve_target

X = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 10


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, axes: tuple[str, str] | None = None) -> None:
        init = nnx.initializers.lecun_normal()
        if axes is not None:
            init = nnx.with_partitioning(init, axes, eager_sharding=False)
        self.l1 = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.l1(x))
        for layer in self.layers:
            h = jax.nn.relu(layer(h))
        return self.out(h)


def nnx_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    def loss(m: MLP) -> jax.Array:
        return jnp.mean(m(x) ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


def fresh() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def module_text(lowered: Any) -> str:
    """StableHLO text without the module's name and the result names (which name the function
    and its Python output structure)."""
    text = re.sub(r' \{jax\.result_info = "[^"]*"\}', "", lowered.as_text())
    return re.sub(r"module @\S+", "module @m", text)


def leaves_equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def test_plain_arguments_pass_through_untouched() -> None:
    def f(p: dict[str, jax.Array], s: float) -> jax.Array:
        return p["w"] * s

    params = {"w": jnp.ones(3)}
    opt_state = optax.adam(1e-3).init(params)  # tuples of NamedTuples of arrays
    a = adapt(f, (params, 2.0), {"o": opt_state}, ["p", "s"])
    assert a.fn is f
    assert a.args[0] is params and a.args[1] == 2.0 and a.kwargs["o"] is opt_state
    assert (a.fingerprint, a.static_leaves, a.unfingerprintable) == ("", [], None)
    assert not a.returns_updates


def test_nnx_train_step_matches_nnx_jit_bit_for_bit_and_in_flops() -> None:
    model, opt = fresh()
    a = adapt(nnx_step, (model, opt, X), {}, ["model", "optimizer", "x"])
    assert a.returns_updates
    assert jax.tree.structure(a.args[0]) == jax.tree.structure(
        {
            "l1": {"bias": 0, "kernel": 0},
            "layers": {str(i): {"bias": 0, "kernel": 0} for i in (0, 1)},
            "out": {"bias": 0, "kernel": 0},
        }
    )
    assert [p for p, _ in a.static_leaves] == ["model", "optimizer"]
    jitted = jax.jit(a.fn)
    # Each side's executable compiled once, alike (conftest.FAST_CPU_CODEGEN: the optimized HLO
    # and its FLOPs are the default level's): its FLOPs, and its step run.
    ours = jitted.lower(*a.args).compile(FAST_CPU_CODEGEN)
    loss, updates = a.split_output(ours(*a.args))

    ref_model, ref_opt = fresh()
    # nnx.jit's executable: its step run on the NNX objects
    theirs = nnx.jit(nnx_step).lower(ref_model, ref_opt, X).compile(FAST_CPU_CODEGEN)
    ref_loss = theirs(ref_model, ref_opt, X)
    assert np.array_equal(loss, ref_loss)
    assert leaves_equal(updates["model"], nnx.to_pure_dict(nnx.state(ref_model)))
    ref_opt_state = nnx.to_pure_dict(nnx.state(ref_opt, nnx.OptState))
    assert np.array_equal(updates["optimizer"]["step"], ref_opt.step[...])
    assert leaves_equal(updates["optimizer"]["opt_state"], ref_opt_state["opt_state"])
    assert not np.array_equal(updates["model"]["l1"]["kernel"], model.l1.kernel[...])

    assert jax.export.export(jitted)(*a.args).serialize()  # plain dicts: resumable as it is
    assert flops(ours) == flops(theirs)
    # The update is live: dropping it lets XLA remove the optimizer's arithmetic.
    loss_only = jax.jit(lambda *args: a.fn(*args)[0]).lower(*a.args).compile(FAST_CPU_CODEGEN)
    assert flops(loss_only) < flops(ours)


def test_nnx_forward_returns_no_parameter_copies() -> None:
    model = MLP(nnx.Rngs(0))
    a = adapt(lambda model, x: model(x), (model, X), {}, ["model", "x"])
    out, updates = a.split_output(jax.jit(a.fn)(*a.args))
    assert updates == {}
    theirs_compiled = nnx.jit(lambda m, x: m(x)).lower(model, X).compile()  # run, and measured
    assert np.array_equal(out, theirs_compiled(model, X))
    ours = jax.jit(a.fn).lower(*a.args).compile().memory_analysis()
    theirs = theirs_compiled.memory_analysis()
    assert ours.output_size_in_bytes == out.nbytes  # nnx.jit returns every parameter too
    assert theirs.output_size_in_bytes > ours.output_size_in_bytes


def test_nnx_shared_variables_stay_shared_across_arguments() -> None:
    class Holder(nnx.Module):
        def __init__(self, lin: nnx.Linear) -> None:
            self.lin = lin

    def bump(a: Holder, b: Holder) -> jax.Array:
        a.lin.kernel[...] = a.lin.kernel[...] + 1
        return b.lin.kernel[...]  # the same Variable, seen through the other argument

    def run() -> tuple[Holder, Holder]:
        shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        return Holder(shared), Holder(shared)

    h1, h2 = run()
    start = h1.lin.kernel[...]
    a = adapt(bump, (h1, h2), {}, ["a", "b"])
    assert a.args[1] == {}  # stored once, under the first argument
    out, updates = a.split_output(jax.jit(a.fn)(*a.args))
    assert np.array_equal(out, start + 1)
    assert np.array_equal(updates["a"]["lin"]["kernel"], start + 1)
    assert np.array_equal(out, nnx.jit(bump)(*run()))
    h1, h2 = run()  # as keywords, split in call order, given back by jax.jit sorted by name
    k = adapt(lambda *, b, a: bump(a, b), (), {"b": h2, "a": h1})
    assert k.kwargs["a"] == {}
    out, updates = k.split_output(jax.jit(k.fn)(**k.kwargs))
    assert np.array_equal(out, start + 1) and np.array_equal(updates["b"]["lin"]["kernel"], out)
    # Flax 0.12's tree mode (an NNX Module as a plain pytree) copies the shared Variable:
    t1, t2 = run()
    assert not np.array_equal(jax.jit(bump)(t1, t2), start + 1)


def test_nnx_abstract_and_concrete_adapt_alike() -> None:
    abstract = nnx.eval_shape(lambda: fresh())
    concrete = fresh()
    xs = jax.ShapeDtypeStruct(X.shape, X.dtype)
    a = adapt(nnx_step, (*abstract, xs), {}, ["model", "optimizer", "x"])
    c = adapt(nnx_step, (*concrete, X), {}, ["model", "optimizer", "x"])
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(a.args))
    assert jax.tree.structure(a.args) == jax.tree.structure(c.args)
    assert a.fingerprint == c.fingerprint != ""
    traced = jax.jit(a.fn).trace(*a.args)
    assert jax.tree.structure(traced.out_info) == jax.tree.structure(jax.eval_shape(c.fn, *c.args))


def test_nnx_logical_axes_from_variable_metadata() -> None:
    model = MLP(nnx.Rngs(0), axes=("embed", "mlp"))
    a = adapt(lambda model, x: model(x), (model, X), {}, ["model", "x"])
    assert a.logical_axes["model/l1/kernel"] == ("embed", "mlp")
    assert a.logical_axes["model/l1/bias"] is None
    assert "model/layers/1/kernel" in a.logical_axes
    assert set(a.logical_axes) == {p for p, _ in argument_paths(a.args[:1], {}, ["model"])}


def test_equinox_abstract_module_partitions_like_the_concrete_one() -> None:
    key = jax.random.key(0)
    model = eqx.nn.MLP(4, 2, 8, 2, key=key)
    abstract = eqx.filter_eval_shape(eqx.nn.MLP, 4, 2, 8, 2, key=key)
    # eqx.is_array is False for a ShapeDtypeStruct: its own partition makes every weight static.
    assert jax.tree.leaves(eqx.filter(abstract, eqx.is_array)) == []
    fwd = lambda m, x: m(x)  # noqa: E731
    a = adapt(fwd, (abstract, jax.ShapeDtypeStruct((4,), jnp.float32)), {}, ["model", "x"])
    c = adapt(fwd, (model, X[0]), {}, ["model", "x"])
    assert len(jax.tree.leaves(a.args[0])) == 6  # 3 weights, 3 biases
    # in eqx.filter_jit's order, so the lowered module takes its arguments in the same order
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert all(x is y for x, y in zip(jax.tree.leaves(c.args[0]), arrays, strict=True))
    assert jax.tree.structure(a.args) == jax.tree.structure(c.args)
    assert a.fingerprint == c.fingerprint != ""
    assert ("model/activation", "custom_jvp jax._src.nn.functions.relu") in c.static_leaves
    assert np.array_equal(jax.jit(c.fn)(*c.args), eqx.filter_jit(fwd)(model, X[0]))
    params, static = eqx.partition(model, eqx.is_array)
    plain = jax.jit(lambda params, x: fwd(eqx.combine(params, static), x))
    assert module_text(jax.jit(c.fn).lower(*c.args)) == module_text(plain.lower(params, X[0]))
    gelu = eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.gelu, key=key)
    assert adapt(fwd, (gelu, X[0]), {}, ["model", "x"]).fingerprint != c.fingerprint


class Scaled(eqx.Module):
    weight: jax.Array
    scale: float  # a Python number inside a module: static, as eqx.filter_jit has it

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.weight * x * self.scale


def test_equinox_python_numbers_are_static_inside_modules_only() -> None:
    def f(m: Scaled, x: jax.Array, s: float) -> jax.Array:
        return m(x) * s

    m = Scaled(jnp.ones(4), 3.0)
    a = adapt(f, (m, X[0], 2.0), {}, ["m", "x", "s"])
    assert jax.tree.leaves(a.args[0]) == [m.weight]
    assert a.args[2] == 2.0  # traced, as jax.jit traces it
    assert ("m/scale", "float 3.0") in a.static_leaves
    assert np.array_equal(jax.jit(a.fn)(*a.args), eqx.filter_jit(f)(m, X[0], 2.0))
    other = adapt(f, (Scaled(jnp.ones(4), 4.0), X[0], 2.0), {}, ["m", "x", "s"])
    assert other.fingerprint != a.fingerprint
    assert adapt(f, (m, X[0], 5.0), {}, ["m", "x", "s"]).fingerprint == a.fingerprint


def test_equinox_train_step_returns_the_model_as_arrays() -> None:
    key = jax.random.key(1)
    model = eqx.nn.MLP(4, 2, 8, 1, key=key)
    tx = optax.sgd(0.1)

    def step(model: eqx.nn.MLP, opt_state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = tx.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    a = adapt(step, (model, opt_state, X), {}, ["model", "opt_state", "x"])
    new_model, _ = jax.jit(a.fn)(*a.args)
    ref_model, _ = eqx.filter_jit(step)(model, opt_state, X)
    assert new_model["activation"] is None  # static leaves do not come back from an executable
    for ours, theirs in zip(new_model["layers"], ref_model.layers, strict=True):
        assert np.array_equal(ours["weight"], theirs.weight)
        assert np.array_equal(ours["bias"], theirs.bias)
    assert not np.array_equal(new_model["layers"][0]["weight"], model.layers[0].weight)
    from jaxaot.stages.output_types import register_output_types

    exported = jax.export.export(jax.jit(a.fn))(*a.args)
    register_output_types(exported)  # optax's NamedTuples, as the lowering stage does
    assert exported.serialize()


def linen_state(lr: float) -> train_state.TrainState:
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(3, kernel_init=init)(x)

    module = Dense()
    params = module.init(jax.random.key(1), X)
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=optax.adamw(lr))


def ts_step(state: train_state.TrainState, x: jax.Array) -> train_state.TrainState:
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def test_train_state_static_fields_closed_over_and_keyed() -> None:
    from jaxaot.stages.output_types import register_output_types

    state = linen_state(1e-3)
    a = adapt(ts_step, (state, X), {}, ["state", "x"])
    assert [p for p, _ in a.static_leaves] == ["state/apply_fn", "state/tx"]
    assert list(a.args[0]) == ["step", "params", "opt_state"]
    leaves = zip(jax.tree.leaves(a.args), jax.tree.leaves((state, X)), strict=True)
    assert all(x is y for x, y in leaves)  # jax.jit's order of the TrainState
    assert a.logical_axes["state/params/params/Dense_0/kernel"] == ("embed", "mlp")
    assert a.logical_axes["state/opt_state/0/mu/params/Dense_0/kernel"] == ("embed", "mlp")
    paths = {p for p, _ in argument_paths(a.args, a.kwargs, ["state", "x"])}
    assert set(a.logical_axes) <= paths and "state/params/params/Dense_0/bias" in paths
    out = jax.jit(a.fn)(*a.args)
    ref = jax.jit(ts_step)(state, X)
    assert leaves_equal(out["params"], ref.params)
    assert leaves_equal(out["opt_state"], ref.opt_state)
    ours = module_text(jax.jit(a.fn).lower(*a.args))
    assert ours == module_text(jax.jit(ts_step).lower(state, X))  # the same program
    assert adapt(ts_step, (linen_state(2e-3), X), {}, ["state", "x"]).fingerprint != a.fingerprint
    # A new process builds new closures: equal data gives the same key (see test_fingerprint).
    assert adapt(ts_step, (linen_state(1e-3), X), {}, ["state", "x"]).fingerprint == a.fingerprint
    # What the lowering stage serializes: the adapted program exports, the TrainState one not.
    exported = jax.export.export(jax.jit(a.fn))(*a.args)
    register_output_types(exported)
    again = jax.export.deserialize(exported.serialize())
    assert again.in_tree == exported.in_tree
    with pytest.raises(ValueError, match="is not a Python literal"):
        plain = jax.export.export(jax.jit(ts_step))(state, X)
        register_output_types(plain)
        plain.serialize()


class Act(nn.Module):
    act: Any = nn.relu

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        return self.act(nn.Dense(4, kernel_init=kernel_init)(x))


def test_linen_module_apply_as_target() -> None:
    apply = resolve_target("flax.linen:Module.apply")
    assert apply is nn.Module.apply
    module = Act()
    variables = module.init(jax.random.key(0), X)
    assert isinstance(variables["params"]["Dense_0"]["kernel"], nn.Partitioned)
    a = adapt(apply, (module, variables, X), {}, None)
    assert a.args[0] is None and [p for p, _ in a.static_leaves] == ["args[0]"]
    assert isinstance(a.args[1]["params"]["Dense_0"]["kernel"], jax.Array)  # unboxed
    assert a.logical_axes == {"args[1]/params/Dense_0/kernel": (None, "model")}
    assert np.array_equal(jax.jit(a.fn)(*a.args), jax.jit(module.apply)(variables, X))
    gelu = adapt(apply, (Act(act=nn.gelu), variables, X), {}, None)
    assert gelu.fingerprint != a.fingerprint
    assert adapt(apply, (Act(), variables, X), {}, None).fingerprint == a.fingerprint


def test_unfingerprintable_static_data_is_named_and_never_matches() -> None:
    lock = threading.Lock()
    a = adapt(lambda x, lock: x, (X,), {"lock": lock})
    assert a.unfingerprintable is not None and a.unfingerprintable.path == "lock"
    assert "memory address" in a.unfingerprintable.why
    assert a.fingerprint.startswith("unfingerprintable:")
    assert adapt(lambda x, lock: x, (X,), {"lock": lock}).fingerprint != a.fingerprint
    assert np.array_equal(jax.jit(a.fn)(*a.args, **a.kwargs), X)


def test_static_subtrees_are_listed_once_and_positions_kept() -> None:
    tx = optax.adamw(1e-3)

    def f(x: jax.Array, cfg: Any, *, scale: float) -> jax.Array:
        return x * scale if cfg["name"] == "double" else x

    a = adapt(f, (X, {"name": "double", "tx": tx}), {"scale": 2.0})
    assert a.args[1] is None and a.kwargs == {"scale": 2.0}
    assert [p for p, _ in a.static_leaves] == ["args[1]"]
    assert np.array_equal(jax.jit(a.fn)(*a.args, **a.kwargs), X * 2)


def test_purify_lets_eval_shape_and_jit_return_nnx_and_equinox_objects() -> None:
    class Holder(nnx.Module):
        def __init__(self, lin: nnx.Linear) -> None:
            self.lin = lin

    def init(key: jax.Array) -> tuple[Holder, Holder, eqx.nn.MLP]:
        shared = nnx.Linear(2, 2, rngs=nnx.Rngs(key))
        mlp = eqx.nn.MLP(2, 2, 4, 1, key=key)
        return Holder(shared), Holder(shared), mlp

    def run(transform: Any) -> Any:
        box: dict[str, Any] = {}

        def inner(seed: jax.Array) -> Any:
            pure, box["rebuild"] = purify(init(seed))
            return pure

        return box, transform(inner, jax.random.key(0))

    box, pure = run(jax.eval_shape)  # abstract
    h1, h2, mlp = box["rebuild"](pure)
    assert h1.lin is h2.lin
    t1, t2 = jax.eval_shape(lambda key: init(key)[:2], jax.random.key(0))
    assert t1.lin is not t2.lin  # NNX modules as plain pytrees: the shared Linear copied
    assert isinstance(h1.lin.kernel.get_value(), jax.ShapeDtypeStruct)
    assert mlp.activation is jax.nn.relu and isinstance(mlp.layers[0].weight, jax.ShapeDtypeStruct)
    box, pure = run(lambda f, seed: jax.jit(f)(seed))
    concrete = box["rebuild"](pure)
    assert concrete[0].lin is concrete[1].lin
    assert np.array_equal(concrete[0].lin.kernel[...], init(jax.random.key(0))[0].lin.kernel[...])
    a = adapt(lambda a, b, m: 0, (h1, h2, mlp), {})
    c = adapt(lambda a, b, m: 0, concrete, {})
    assert jax.tree.structure(a.args) == jax.tree.structure(c.args)
    assert a.fingerprint == c.fingerprint


def test_nnx_logical_names_need_no_mesh_inside_lazy_sharding() -> None:
    from jaxaot.models.nnx import lazy_sharding

    def build() -> nnx.Linear:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        return nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="mesh"):
        build()  # Flax 0.12 shards at creation by default
    with lazy_sharding():
        layer = nnx.eval_shape(build)
    assert adapt(lambda m: 0, (layer,), {}, ["m"]).logical_axes["m/kernel"] == ("embed", "mlp")


def test_nnx_get_abstract_model_and_jax_eval_shape_models_adapt() -> None:
    mesh = jax.make_mesh((1, 1), ("embed", "mlp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    graphdef, state = nnx.get_abstract_model(lambda: MLP(nnx.Rngs(0), ("embed", "mlp")), mesh)
    a = adapt(lambda m, x: m(x), (nnx.merge(graphdef, state), X), {}, ["model", "x"])
    kernel = a.args[0]["l1"]["kernel"]
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.sharding.spec == jax.P("embed", "mlp")  # the ShapeDtypeStruct as it came
    assert a.logical_axes["model/l1/kernel"] == ("embed", "mlp")
    # jax.eval_shape of a constructor (tree mode) is fine while no Variable is shared:
    abstract = jax.eval_shape(lambda: MLP(nnx.Rngs(0)))
    b = adapt(lambda m, x: m(x), (abstract, X), {}, ["model", "x"])
    c = adapt(lambda m, x: m(x), (MLP(nnx.Rngs(0)), X), {}, ["model", "x"])
    assert jax.tree.structure(b.args) == jax.tree.structure(c.args)
    assert b.fingerprint == c.fingerprint
