"""Programs for tests/test_aot_records.py and tests/test_jax_formats.py: what an executable's
records say (dead arguments, formats) and JAX's own layout and memory-kind tests as programs.

Not a test module: importable as ``aot_records_programs:<name>`` (``tests/`` is on sys.path).
"""

from __future__ import annotations

import jax


def dead(x: jax.Array, y: jax.Array, z: jax.Array) -> jax.Array:
    """``y`` is unused: dead-argument elimination drops it unless keep_unused."""
    return x * 2 + z


def dead_tree(params: dict[str, jax.Array], x: jax.Array, *, scale: jax.Array) -> jax.Array:
    """A dict argument with an unused leaf, and a traced keyword argument."""
    return params["w"] * x * scale


def transpose(x: jax.Array) -> jax.Array:
    """jax tests/layout_test.py ``f(x) = x.T`` (test_default_layout, test_in_layouts_out_layouts,
    test_sharding_and_layouts)."""
    return x.T


def transpose_two(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """layout_test.py test_auto_layout's ``apply``."""
    return x.T, y.T


def six(
    x: jax.Array, y: jax.Array, z: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """layout_test.py test_dce_in_layouts: four of six arguments unused."""
    return z * 2, b.T


def double_first(x: jax.Array, y: jax.Array) -> jax.Array:
    """layout_test.py test_no_error_dced_args: ``y`` unused."""
    return x * 2


def sin(x: jax.Array) -> jax.Array:
    """memories_test.py: an element-wise program between memory kinds."""
    return jax.numpy.sin(x)


def add_one(x: jax.Array) -> jax.Array:
    """memories_test.py test_default_memory_kind / host outputs: ``x + 1``."""
    return x + 1


def identity(x: jax.Array) -> jax.Array:
    """layout_test.py test_layout_donation: ``f(x) = x``, its argument donated."""
    return x


def square(x: jax.Array) -> jax.Array:
    """layout_test.py test_layout_donation_matching_in_and_out: ``f(x) = x * x``."""
    return x * x
