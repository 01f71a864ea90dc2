"""An Equinox classifier as an Equinox user writes one: ``eqx.nn.MLP`` applied per example
(``jax.vmap``), cross-entropy from optax, and the train step of Equinox's own examples
(``eqx.filter_value_and_grad``, ``optimizer.update`` on the array leaves,
``eqx.apply_updates``).

The model is the library's class itself (``eqx.nn.MLP(in_size, out_size, width_size, depth,
key=...)``): its weights are array leaves, its activations (functions) are leaves too, which is
why the optimizer state is built from ``eqx.filter(model, eqx.is_array)`` (in
conf/program/eqx_mlp_train.yaml, from YAML: ``{_init_: equinox:filter, _args_: [model,
{_get_: equinox:is_array}]}``) and why jax.jit cannot take the module as it is
(``eqx.filter_jit`` can; so can jaxaot).
"""

from __future__ import annotations

import equinox as eqx
import jax
import optax


def forward(model: eqx.nn.MLP, x: jax.Array) -> jax.Array:
    """Logits ``[B, out_size]`` of a batch ``x`` ``[B, in_size]``."""
    return jax.vmap(model)(x)


def loss(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer labels ``y`` ``[B]``."""
    return optax.softmax_cross_entropy_with_integer_labels(forward(model, x), y).mean()


def train_step(
    model: eqx.nn.MLP,
    opt_state: optax.OptState,
    x: jax.Array,
    y: jax.Array,
    optimizer: optax.GradientTransformation,
) -> tuple[eqx.nn.MLP, optax.OptState, jax.Array]:
    """One optimizer step; returns ``(new_model, new_opt_state, loss before the step)``."""
    value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


__all__ = ["forward", "loss", "train_step"]
