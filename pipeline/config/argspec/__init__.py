"""Argument specs: the leaves of ``program.args`` / ``program.kwargs``, parsed without JAX.

A leaf is one of
- an array type written the way JAX prints it: ``f32[128,512]``, ``bf16[2,8]``, ``i32[]``;
- a mapping ``{shape, dtype, init, scale, low, high, seed}`` (``init`` may be a ``.npy`` path);
- a ``.npy`` path (shape and dtype read from the file's header);
- a literal (number, bool, string, or a list/dict of them at a static position).

A dimension may be symbolic (shape polymorphism): ``f32[b,512]``, ``f32[2*b,c]``, constrained
by ``stage_out.shape_constraints`` (``["b >= 16"]``); the program lowers to one polymorphic
``jax.export`` artifact, and ``compile.shapes`` (``{b: 32}``) gives the sizes it is compiled and
executed at. A dimension is checked against the grammar ``jax.export.symbolic_shape`` reads
(pipeline/config/dim_expr.py: names, integers, ``+ - *``, ``^``, ``floordiv/mod/max/min(a, b)``)
here, so that a typo is refused naming the argument.

An array type may end in ``~weak`` (``f32[]~weak``; in a mapping ``weak_type: true``): the
argument is weakly typed, as a Python scalar is, so it takes the other operand's dtype in
promotion. ``~strong`` (``weak_type: false``) says the default: the dtype as written.

Leaves may sit in nested lists and dicts (pytrees), and in any other pytree container named by
import path with a tagged mapping (:class:`PytreeNode`)::

    {_pytree_: tuple, _args_: [f32[2], f32[3]]}        # (a, b)
    {_pytree_: mypkg.mod:Point, x: f32[4], y: f32[4]}  # Point(x=..., y=...)

The class (a NamedTuple, a dataclass registered with ``jax.tree_util``, any registered class)
is built as ``cls(*_args_, **fields)``; its import path goes through the trust policy
(pipeline/config/trust/) like ``program.target``. As in JAX, static-ness comes from
``static_argnums``/``static_argnames``, never from the type: a literal at a non-static position
is traced as a weakly typed scalar and executed with its value.

A value may also be derived from the program's own code (``_init_``, ``_call_``, ``_ref_``,
``_key_``, ``_get_``: pipeline/config/derived.py), and from Python a ``jax.ShapeDtypeStruct``
stands for an array spec of its shape and dtype, an array for itself (:class:`Given`).

The package, one module per concept, each importing only those listed before it:

- dtypes.py: dtype spellings, bits and exact byte sizes, the int64 limit XLA sizes arrays in;
- leaf_types.py: the parsed forms (ArraySpec, Literal, Given, PytreeNode) and symbolic dimensions;
- grammar.py: parsing a config value into those forms;
- trees.py: walking and building a parsed tree, and static arguments' values;
- binding.py: BoundArgs, bind and bind_config (static, traced, donated), concrete_bound;
- memory.py: this process's memory and whether a run's inputs fit in it;
- quoting.py: quoting array types in a command-line override for Hydra.
"""

from __future__ import annotations

from jaxaot.config.argspec.binding import BoundArgs, bind, bind_config, concrete_bound
from jaxaot.config.argspec.dtypes import (
    DTYPES,
    MAX_ARRAY_BYTES,
    SIXTY_FOUR_BIT,
    canonical_dtype,
    dtype_bits,
    nbytes,
    short_name,
)
from jaxaot.config.argspec.grammar import (
    INITS,
    SPEC_KEYS,
    SUFFIXES,
    is_spec_mapping,
    parse_leaf_or_tree,
    parse_type,
)
from jaxaot.config.argspec.leaf_types import (
    PYTREE_ARGS,
    PYTREE_KEY,
    ArraySpec,
    Given,
    Literal,
    PytreeNode,
    eval_dim,
    from_python,
    symbols,
)
from jaxaot.config.argspec.memory import check_inputs_fit, human_size, memory_bytes
from jaxaot.config.argspec.quoting import quote_array_types
from jaxaot.config.argspec.trees import build, leaves, map_tree, specs, to_static_value

__all__ = [
    "DTYPES",
    "INITS",
    "MAX_ARRAY_BYTES",
    "PYTREE_ARGS",
    "PYTREE_KEY",
    "SIXTY_FOUR_BIT",
    "SPEC_KEYS",
    "SUFFIXES",
    "ArraySpec",
    "BoundArgs",
    "Given",
    "Literal",
    "PytreeNode",
    "bind",
    "bind_config",
    "build",
    "canonical_dtype",
    "check_inputs_fit",
    "concrete_bound",
    "dtype_bits",
    "eval_dim",
    "from_python",
    "human_size",
    "is_spec_mapping",
    "leaves",
    "map_tree",
    "memory_bytes",
    "nbytes",
    "parse_leaf_or_tree",
    "parse_type",
    "quote_array_types",
    "short_name",
    "specs",
    "symbols",
    "to_static_value",
]
