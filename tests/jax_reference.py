"""Helpers for the tests that compare a jaxaot run with the plain JAX program run in the same
test (tests/test_aot_*.py). Not a test module: importable as ``jax_reference``."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jaxaot.config.argspec import concrete_bound
from jaxaot.stages.inputs import spec_inputs


def run_inputs(result: Any) -> tuple[list[Any], dict[str, Any]]:
    """The inputs a run executed with, built again from its specs and seed (at its
    ``compile.shapes`` sizes)."""
    staged = result.records["stage_out"]
    sizes = result.manifest["config"]["compile"]["shapes"]
    args, kwargs = spec_inputs(concrete_bound(staged.bound, sizes), 0)
    return list(args), dict(kwargs)


def assert_same(got: Any, want: Any, *, structure: bool = False) -> None:
    """The same leaves bit for bit, dtypes included (and, with ``structure``, the same pytree
    structure once ``want``'s leaves are NumPy arrays)."""
    if structure:
        assert jax.tree.structure(got) == jax.tree.structure(jax.tree.map(np.asarray, want))
    g, w = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def specs_of(shardings: Any) -> Any:
    """Shardings as (spec, memory kind): comparable across meshes of the same devices."""
    return jax.tree.map(lambda s: (tuple(s.spec), s.memory_kind), shardings)


def cpu_mesh(n: int = 2, name: str = "data") -> Any:
    """A 1-D auto-axes mesh over the first ``n`` CPU devices (a run starts them)."""
    return jax.make_mesh((n,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
