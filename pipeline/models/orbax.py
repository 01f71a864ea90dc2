"""An orbax checkpoint as an argument: shapes, dtypes (and optionally shardings) from its
metadata, the values restored only when the program runs.

In a config::

    program:
      args:
        - {_init_: jaxaot.models.orbax:checkpoint, path: ckpts/run1/1000, item: params}
        - f32[8,128]

``stage_out``, ``lower`` and ``compile`` see :func:`abstract` (``checkpoint.jaxaot_abstract``):
the tree of ``jax.ShapeDtypeStruct`` orbax's metadata describes (the tree metadata file and
each array's zarr header; no array data is read). ``execute`` calls :func:`materialize`
(``checkpoint.jaxaot_materialize``) with the executable's input shardings of that argument:
orbax restores every array straight into its sharding, each device reading its own slices.
Called plainly (Python), :func:`checkpoint` restores onto the default device.

``path`` is a local directory, read as given (relative to the directory jaxaot runs in), as
``.npy`` argument files are: either a tree item (a directory with orbax's ``_METADATA`` file,
what ``ocp.StandardCheckpointer().save``/``ocp.PyTreeCheckpointer().save`` write), or one step
of a ``CheckpointManager`` (``<root>/<step>``, its items in subdirectories). ``item`` is a
``/``-joined path: for a step directory its first part names the item (``params``, ``state``;
optional when the step has one tree item); the remaining parts are keys into the tree
(``state/params``), so one subtree is the argument and only its arrays are read. ``dtype``
casts every floating array on read (``bf16`` to run an f32 checkpoint in bfloat16).
``saved_shardings=true`` gives the abstract arrays the shardings they were saved with (their
mesh rebuilt on this process's devices); by default the run's ``lower.in_shardings`` decide.

The tree is the one orbax restores: dicts stay dicts, tuples come back as lists, Python
numbers (a ``step`` counter) as Python numbers (abstractly a weakly typed scalar, as jax.jit
traces a Python number). A string leaf is refused (an argument is arrays and numbers).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.errors import ArgSpecError

METADATA = "_METADATA"  # orbax's tree metadata file in an item directory
STEP_METADATA = "_CHECKPOINT_METADATA"  # written in every finished step directory
TMP_MARK = ".orbax-checkpoint-tmp"  # an unfinished save's directory name contains this
FLAX_LEGACY = "checkpoint"  # flax.training.checkpoints' single msgpack file


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """orbax logs every restore at INFO through absl's logger ("Created
    BasePyTreeCheckpointHandler", read throughput): kept out of a run's log."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class _Source:
    item_dir: Path  # the tree item directory (has _METADATA)
    keys: tuple[str, ...]  # keys into that tree selecting the argument
    label: str  # "path" or "path, item 'x'" for messages
    prefix: tuple[str, ...] = ()  # the step's item name, for messages


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return []


def _locate(path: Any, item: Any) -> _Source:
    if not isinstance(path, str | os.PathLike) or not str(path).strip():
        raise ArgSpecError(
            f"path: expected an orbax checkpoint directory (a string), found {path!r}"
        )
    text = os.fspath(path)
    if "://" in str(text):
        raise ArgSpecError(
            f"path {text!r}: only local directories are read (as .npy argument files are); "
            "copy or mount the checkpoint and give its local path"
        )
    folder = Path(text).absolute()  # orbax refuses relative paths
    keys = tuple(k for k in str(item).split("/") if k) if item is not None else ()
    if item is not None and not keys:
        raise ArgSpecError(
            f"item {item!r}: expected an item name or a /-joined path into the tree "
            "(params, state/params), or no item"
        )
    if not folder.exists():
        raise ArgSpecError(
            f"path {text!r} does not exist (relative paths are read from {os.getcwd()}); "
            "expected an orbax checkpoint directory"
        )
    if not folder.is_dir():
        raise ArgSpecError(
            f"path {text!r} is a file; expected an orbax checkpoint directory (the folder "
            "orbax saved, holding _METADATA, or a CheckpointManager step folder)"
        )
    if TMP_MARK in folder.name:
        raise ArgSpecError(
            f"path {text!r} is an unfinished orbax save (its name has {TMP_MARK!r}); "
            "expected a finished checkpoint: wait for the save, or use the step it finalized"
        )
    if (folder / METADATA).is_file():
        return _Source(folder, keys, f"path {text!r}")
    trees = [p.name for p in _children(folder) if (p / METADATA).is_file()]
    if trees:
        others = [
            p.name
            for p in _children(folder)
            if p.name not in trees and not p.name.startswith((".", "_"))
        ]
        not_trees = f" (not array trees: {', '.join(others)})" if others else ""
        if not keys:
            if len(trees) == 1:
                return _Source(folder / trees[0], (), f"path {text!r}, item {trees[0]!r}")
            raise ArgSpecError(
                f"path {text!r} holds several items: {', '.join(trees)}{not_trees}; "
                f"expected item: one of them (item: {trees[0]})"
            )
        if keys[0] not in trees:
            raise ArgSpecError(
                f"item {item!r}: path {text!r} has no tree item {keys[0]!r}; its items are "
                f"{', '.join(trees)}{not_trees}"
            )
        return _Source(folder / keys[0], keys[1:], f"path {text!r}", keys[:1])
    steps = sorted(
        (p.name for p in _children(folder) if (p / STEP_METADATA).is_file()),
        key=lambda name: (not name.isdigit(), int(name) if name.isdigit() else 0, name),
    )
    if steps:
        shown = ", ".join(steps[:8]) + (", ..." if len(steps) > 8 else "")
        raise ArgSpecError(
            f"path {text!r} is a CheckpointManager directory with steps {shown}; expected one "
            f"step's directory (path: {Path(text) / steps[-1]})"
        )
    if (folder / FLAX_LEGACY).is_file():
        raise ArgSpecError(
            f"path {text!r} holds a Flax msgpack checkpoint (flax.training.checkpoints), not an "
            "orbax tree; expected a directory orbax saved (ocp.StandardCheckpointer().save)"
        )
    raise ArgSpecError(
        f"path {text!r} is not an orbax checkpoint: it has no {METADATA} file and no item "
        "folder with one; expected the folder ocp.StandardCheckpointer().save or "
        "PyTreeCheckpointer().save wrote, or a CheckpointManager step folder"
    )


def _tree_metadata(source: _Source) -> Any:
    """The item's tree of orbax value metadata (ArrayMetadata, ScalarMetadata, ...): read from
    ``_METADATA`` and each array's zarr header, never from the array data."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        with _quiet():
            return ocp.PyTreeCheckpointHandler().metadata(epath.Path(source.item_dir)).tree
    except Exception as exc:
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ArgSpecError(
            f"{source.label}: orbax cannot read its metadata ({type(exc).__name__}: {why}); "
            "expected a finished orbax checkpoint"
        ) from None


def _select(tree: Any, source: _Source) -> Any:
    node = tree
    for depth, key in enumerate(source.keys):
        where = "/".join(source.prefix + source.keys[: depth + 1])
        if isinstance(node, dict):
            if key not in node:
                have = ", ".join(sorted(map(str, node))) or "no keys"
                raise ArgSpecError(
                    f"item: {source.label} has no {where!r} (the tree there has: {have})"
                )
            node = node[key]
        elif isinstance(node, list | tuple):
            if not key.isdigit() or int(key) >= len(node):
                raise ArgSpecError(
                    f"item: {source.label} has no {where!r}: the tree there is a list of "
                    f"{len(node)}; expected an index 0..{len(node) - 1}"
                )
            node = node[int(key)]
        else:
            raise ArgSpecError(
                f"item: {source.label} has no {where!r}: the tree ends in a leaf above it"
            )
    return node


def _cast_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    import jax.numpy as jnp
    from jax import dtypes
    from jaxaot.config.argspec import canonical_dtype

    name = canonical_dtype(str(dtype), "dtype")
    out = dtypes.canonicalize_dtype(jnp.dtype(name))
    if not jnp.issubdtype(out, jnp.floating):
        raise ArgSpecError(
            f"dtype: {dtype!r} is not a floating type; expected one floating arrays are cast "
            "to (bf16, f16, f32), or no dtype"
        )
    return out


@dataclass(frozen=True)
class _Leaf:
    """One selected leaf: its path (for messages), orbax metadata and abstract value."""

    path: str
    meta: Any
    abstract: Any


def _leaves(
    path: Any, item: Any, dtype: Any, saved_shardings: bool
) -> tuple[_Source, Any, Any, list[_Leaf]]:
    """(source, the full metadata tree, the abstract selected tree, its leaves)."""
    import jax
    from jax import dtypes
    from jaxaot.config.tree_paths import join
    from orbax.checkpoint import metadata as ocp_meta

    source = _locate(path, item)
    cast = _cast_dtype(dtype)
    full = _tree_metadata(source)
    selected = _select(full, source)
    flat, treedef = jax.tree_util.tree_flatten_with_path(selected)
    out: list[_Leaf] = []
    for keys, meta in flat:
        where = join("/".join(source.prefix + source.keys), keys) or "(the whole item)"
        if isinstance(meta, ocp_meta.ScalarMetadata):
            # A Python number: jax.jit traces it weakly typed, in the canonical dtype.
            abstract = jax.ShapeDtypeStruct(
                (), dtypes.canonicalize_dtype(meta.dtype), weak_type=True
            )
        elif isinstance(meta, ocp_meta.ArrayMetadata):
            dt = (
                cast
                if cast is not None and jax.numpy.issubdtype(meta.dtype, jax.numpy.floating)
                else None
            )
            final = dt if dt is not None else meta.dtype
            if dtypes.canonicalize_dtype(final) != final:
                # jax.Array holds no 64-bit values with x64 off: they would be truncated.
                hint = ", or dtype: f32" if jax.numpy.issubdtype(final, jax.numpy.floating) else ""
                raise ArgSpecError(
                    f"{source.label}: the leaf {where!r} is {final} and jax_enable_x64 is off "
                    f"(its values would be truncated); expected +jax.config.jax_enable_x64=true"
                    f"{hint}"
                )
            sharding = _saved_sharding(meta, where, source) if saved_shardings else None
            abstract = jax.ShapeDtypeStruct(tuple(meta.shape), final, sharding=sharding)
        else:
            kind = type(meta).__name__.removesuffix("Metadata").lower() or "value"
            raise ArgSpecError(
                f"{source.label}: the leaf {where!r} is a {kind}, not an array or number; "
                "expected a tree of arrays (select a subtree with item: that has none)"
            )
        out.append(_Leaf(where, meta, abstract))
    tree = jax.tree_util.tree_unflatten(treedef, [leaf.abstract for leaf in out])
    return source, full, tree, out


def _saved_sharding(meta: Any, where: str, source: _Source) -> Any:
    """The sharding ``meta`` was saved with, on this process's devices; None where it was
    saved on one device or without a sharding (numpy arrays)."""
    from orbax.checkpoint.metadata import NamedShardingMetadata

    saved = meta.sharding
    if not isinstance(saved, NamedShardingMetadata):
        return None
    try:
        return saved.to_jax_sharding()
    except Exception as exc:
        import jax

        mesh = dict(zip(saved.axis_names, (int(n) for n in saved.shape), strict=False))
        raise ArgSpecError(
            f"saved_shardings: {source.label}: {where!r} was saved over the mesh {mesh}, which "
            f"this process's {len(jax.devices())} device(s) cannot rebuild "
            f"({type(exc).__name__}); expected saved_shardings: false with "
            "lower.in_shardings, or the saving run's devices"
        ) from None


def abstract(path: Any, item: Any = None, dtype: Any = None, saved_shardings: bool = False) -> Any:
    """The argument as ``jax.ShapeDtypeStruct``s, from the checkpoint's metadata alone."""
    return _leaves(path, item, dtype, bool(saved_shardings))[2]


def materialize(
    shardings: Any,
    path: Any,
    item: Any = None,
    dtype: Any = None,
    saved_shardings: bool = False,
) -> Any:
    """The argument restored, each array into its sharding in ``shardings`` (a tree like the
    argument's, one sharding for all, or None: the abstract value's sharding, else the
    default device)."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint.metadata import ScalarMetadata

    source, full, tree, leaves = _leaves(path, item, dtype, bool(saved_shardings))
    targets = _shardings_per_leaf(shardings, tree, len(leaves), source)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    item_tree: list[Any] = []
    args: list[Any] = []
    for leaf, sharding in zip(leaves, targets, strict=True):
        if isinstance(leaf.meta, ScalarMetadata):
            item_tree.append(0)  # a Python number, restored as saved
            args.append(ocp.RestoreArgs())
            continue
        target = sharding or leaf.abstract.sharding or default
        item_tree.append(jax.ShapeDtypeStruct(leaf.abstract.shape, leaf.abstract.dtype))
        args.append(
            ocp.ArrayRestoreArgs(
                sharding=target,
                dtype=leaf.abstract.dtype if leaf.abstract.dtype != leaf.meta.dtype else None,
                global_shape=leaf.abstract.shape,
            )
        )
    treedef = jax.tree_util.tree_structure(tree)
    restore_item = _embed(full, source.keys, jax.tree_util.tree_unflatten(treedef, item_tree))
    restore_args = _embed(full, source.keys, jax.tree_util.tree_unflatten(treedef, args))
    try:
        with _quiet():
            restored = ocp.PyTreeCheckpointer().restore(
                source.item_dir,
                args=ocp.args.PyTreeRestore(item=restore_item, restore_args=restore_args),
            )
    except ArgSpecError:
        raise
    except Exception as exc:
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ArgSpecError(
            f"{source.label}: orbax could not restore it ({type(exc).__name__}: {why})"
        ) from None
    return _select(restored, source)


def _shardings_per_leaf(shardings: Any, tree: Any, n: int, source: _Source) -> list[Any]:
    import jax

    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    flat = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding)
    )
    if len(flat) != n:
        raise ArgSpecError(
            f"{source.label}: {len(flat)} shardings for {n} arrays; expected one sharding per "
            "leaf of the restored tree"
        )
    return flat


def _embed(full: Any, keys: tuple[str, ...], sub: Any) -> Any:
    """``full`` with ``sub`` at ``keys`` and orbax's PLACEHOLDER at every other leaf, so orbax
    restores the selected subtree and reads nothing else."""
    import jax
    import orbax.checkpoint as ocp

    if not keys:
        return sub
    key, rest = keys[0], keys[1:]
    if isinstance(full, dict):
        return {
            k: _embed(v, rest, sub) if k == key else jax.tree.map(lambda _: ocp.PLACEHOLDER, v)
            for k, v in full.items()
        }
    return [
        _embed(v, rest, sub) if i == int(key) else jax.tree.map(lambda _: ocp.PLACEHOLDER, v)
        for i, v in enumerate(full)
    ]


def checkpoint(
    path: Any, item: Any = None, dtype: Any = None, saved_shardings: bool = False
) -> Any:
    """The argument restored onto the default device (or the shardings it was saved with,
    ``saved_shardings=True``): what the plain call gives, outside jaxaot."""
    return materialize(None, path, item, dtype, saved_shardings)


checkpoint.jaxaot_abstract = abstract  # type: ignore[attr-defined]
checkpoint.jaxaot_materialize = materialize  # type: ignore[attr-defined]
