"""Output pytree classes through ``jax.export``: registered for serialization when a lowering is
exported, and imported (through the import policy) when a lowering is loaded.
"""

from __future__ import annotations

from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import StoreError

# Containers jax.export serializes itself.
_BUILTIN_NODES = (tuple, list, dict, type(None))


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _node_classes(treedef: Any) -> list[type]:
    """The NamedTuple and other user pytree classes in a structure (outer first, each once)."""
    import collections

    found: list[type] = []
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None:
            cls = data[0]
            builtin = cls in _BUILTIN_NODES or cls in (
                collections.OrderedDict,
                collections.defaultdict,
            )
            if not builtin and cls not in found:
                found.append(cls)
        stack.extend(reversed(node.children()))
    return found


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _aux_to_bytes(aux: Any) -> bytes:
    # A registered class's aux data (a dataclass's static fields, a user's own): stored as a
    # Python literal, read back with ast.literal_eval, so loading runs no code.
    import ast

    text = repr(aux)
    try:
        same = ast.literal_eval(text) == aux
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ValueError(f"pytree aux data {text[:80]} is not a Python literal")
    return text.encode()


def _aux_from_bytes(data: bytes) -> Any:
    import ast

    return ast.literal_eval(data.decode())


def _register_class(cls: type, name: str) -> None:
    """Let jax.export (de)serialize ``cls`` under ``name``; once per process."""
    serialization, deserialization = compat_jax.export_registries()
    if cls in serialization:
        return  # registered before (by us, or by the user under a name of their own)
    stale = deserialization.get(name)
    if stale is not None and stale[0] is not cls:
        # The same module:class imported again (a reloaded module): the new class replaces it.
        del deserialization[name]
        serialization.pop(stale[0], None)
    import jax

    if _is_namedtuple(cls):
        jax.export.register_namedtuple_serialization(cls, serialized_name=name)
    else:
        jax.export.register_pytree_node_serialization(
            cls,
            serialized_name=name,
            serialize_auxdata=_aux_to_bytes,
            deserialize_auxdata=_aux_from_bytes,
        )


def register_output_types(exported: Any) -> list[str]:
    """Register the NamedTuples and user pytree classes (registered dataclasses, classes of
    ``jax.tree_util.register_pytree_node``) in the export's input and output structures
    (jaxlib's EighResult, SVDResult, QRResult, a user's own), so that ``serialize`` accepts
    them; return their names.

    A class defined inside a function cannot be imported by a later run: left unregistered, so
    the export fails as before (with jax's message) instead of writing an unloadable file.
    """
    names = []
    for cls in _node_classes(exported.in_tree) + _node_classes(exported.out_tree):
        if "<locals>" in cls.__qualname__:
            continue
        name = _class_name(cls)
        _register_class(cls, name)
        names.append(name)
    return names


def import_pytree_classes(names: list[str], policy: Any) -> None:
    """Import and register the pytree classes a checkpointed export names (lowered.json),
    each under the run's import policy (``trust.*``) like any name a config gives."""
    import importlib

    from jaxaot.config.trust import check_name, check_resolved

    key = "resume_from: lowered.json pytree class"
    for name in names:
        module, _, qualname = name.partition(":")
        check_name(name, key, policy)  # before anything is imported
        try:
            obj: Any = importlib.import_module(module)
            modules = [obj]
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise StoreError(
                f"resume_from: the lowering's arguments or outputs hold a pytree class {name!r} "
                f"that cannot be imported here ({exc}); start at stage_out instead"
            ) from None
        check_resolved(name, key, policy, modules, obj)
        if not isinstance(obj, type):
            raise StoreError(
                f"resume_from: {name!r} named in lowered.json is not a pytree class (found "
                f"{type(obj).__name__}); start at stage_out instead"
            )
        _register_class(obj, name)


__all__ = [
    "import_pytree_classes",
    "register_output_types",
]
