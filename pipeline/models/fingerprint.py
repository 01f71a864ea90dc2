"""Stable fingerprints of static Python data: the same text in every process for the same data.

Static data closed over by an adapted function (an optimizer's closures, an activation function,
a Flax NNX graphdef, an Equinox module's static fields, a linen module instance) keys the stored
program, so two runs whose static data differ must never share an entry, and two processes
holding the same data must agree. ``fingerprint(obj, path)`` returns a JSON-able structure built
from:

- literals by value (floats by ``repr``, which is exact), containers element by element (sets
  and dict entries sorted), dataclasses field by field, other objects attribute by attribute;
- functions by qualified name, code (bytecode, constants, names, recursively), defaults, closure
  cell values and, for user code, the globals the code reads; a library function importable by
  its qualified name by that name and the library's version;
- classes by qualified name (and, for user code, their methods' code);
- concrete arrays by dtype, shape and a sha256 of their bytes.

A ``repr`` that contains a memory address is never used. What has no stable fingerprint (a
traced value, an object with no fields whose repr names an address) raises ``NoFingerprint``
naming the path inside ``obj`` and why.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
import sys
import sysconfig
import types
from typing import Any

from jaxaot.util.code_names import global_names

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_MAX_DEPTH = 100


class NoFingerprint(Exception):
    """``path``: where inside the argument; ``why``: one line."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def digest(items: Any) -> str:
    """sha256 of the canonical JSON of a fingerprint structure."""
    text = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(obj: Any, path: str) -> Any:
    try:
        return _Fingerprinter(path).fp(obj, "", 0)
    except RecursionError:
        raise NoFingerprint(path, "nested too deeply to fingerprint") from None


@functools.cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(sorted(roots))


def _is_library(module_name: str | None) -> bool:
    """A module of the standard library or an installed distribution (not the user's code)."""
    if not module_name or module_name == "__main__":  # a script, `python -c`, a notebook
        return False
    mod = sys.modules.get(module_name)
    if mod is None:
        return False
    file = getattr(mod, "__file__", None)
    if file is None:
        return True  # built into the interpreter
    return file.startswith(_library_roots()) or "site-packages" in file


def _version(module_name: str) -> str | None:
    top = sys.modules.get(module_name.partition(".")[0])
    version = getattr(top, "__version__", None)
    return version if isinstance(version, str) else None


def _named(obj: Any) -> tuple[str, str] | None:
    """(module, qualname) when ``obj`` is what importing that name gives."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return (module, qualname) if found is obj else None


def _array_types() -> tuple[type, ...]:
    import numpy as np

    jax = sys.modules.get("jax")
    return (np.ndarray, jax.Array) if jax is not None else (np.ndarray,)


class _Fingerprinter:
    def __init__(self, path: str) -> None:
        self.path = path
        self.memo: dict[int, Any] = {}
        self.active: dict[int, int] = {}  # objects being fingerprinted -> depth (cycles)
        self.keep: list[Any] = []  # memo keys stay valid while this runs

    def fail(self, where: str, why: str) -> NoFingerprint:
        return NoFingerprint(self.path + where, why)

    def fp(self, x: Any, where: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail(where, f"nested more than {_MAX_DEPTH} levels deep")
        if x is None or isinstance(x, (bool, str)):
            return x
        if type(x) is int:
            return ["int", str(x)]
        if isinstance(x, float):
            return ["float", repr(x)]
        if isinstance(x, (int, complex, bytes)):
            return [type(x).__name__, repr(x)]
        key = id(x)
        if key in self.memo:
            return self.memo[key]
        if key in self.active:
            return ["cycle", depth - self.active[key]]
        self.active[key] = depth
        try:
            out = self._fp(x, where, depth + 1)
        finally:
            del self.active[key]
        self.memo[key] = out
        self.keep.append(x)
        return out

    def _fp(self, x: Any, where: str, depth: int) -> Any:
        import numpy as np

        jax = sys.modules.get("jax")
        if jax is not None and isinstance(x, jax.core.Tracer):
            raise self.fail(where, "a traced value held as static data (it would be baked in)")
        if isinstance(x, np.dtype):
            return ["dtype", str(x)]
        if isinstance(x, np.generic):
            return ["scalar", str(x.dtype), repr(x.item())]
        if isinstance(x, _array_types()):
            return self._array(x, where)
        if jax is not None and isinstance(x, jax.ShapeDtypeStruct):
            sharding = getattr(x, "sharding", None)
            return ["sds", list(x.shape), str(x.dtype), self.fp(sharding, where, depth)]
        if isinstance(x, enum.Enum):
            return ["enum", self._type(type(x), where, depth), x.name]
        if isinstance(x, type):
            return self._type(x, where, depth)
        if isinstance(x, types.ModuleType):
            return ["module", x.__name__]
        if isinstance(x, types.FunctionType):
            return self._function(x, where, depth)
        if isinstance(x, types.MethodType):
            return [
                "method",
                self.fp(x.__func__, where, depth),
                self.fp(x.__self__, where + ".__self__", depth),
            ]
        if isinstance(x, types.CodeType):
            return self._code(x, where, depth)
        if isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            named = _named(x)
            owner = getattr(x, "__self__", None)
            if named is not None:
                return ["ref", *named, _version(named[0])]
            if owner is not None and not isinstance(owner, types.ModuleType):
                return ["builtin-method", x.__name__, self.fp(owner, where + ".__self__", depth)]
            raise self.fail(where, f"builtin {x!r} cannot be found by its name")
        if isinstance(x, functools.partial):
            return [
                "partial",
                self.fp(x.func, where + ".func", depth),
                self.fp(x.args, where + ".args", depth),
                self.fp(x.keywords, where + ".keywords", depth),
            ]
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):  # a NamedTuple
            names: tuple[str, ...] = type(x)._fields  # type: ignore[attr-defined]
            fields = [[f, self.fp(getattr(x, f), f"{where}.{f}", depth)] for f in names]
            return ["namedtuple", self._type(type(x), where, depth), fields]
        if type(x) in (tuple, list):
            return [
                type(x).__name__,
                [self.fp(v, f"{where}[{i}]", depth) for i, v in enumerate(x)],
            ]
        if isinstance(x, (set, frozenset)):
            items = [self.fp(v, f"{where}{{}}", depth) for v in x]
            return [type(x).__name__, sorted(items, key=_canonical)]
        if type(x) is dict:
            return ["dict", self._items(x, where, depth)]
        if jax is not None:
            special = self._jax_object(x, jax)
            if special is not None:
                return special
        named = _named(x)
        if named is not None and _is_library(named[0]):
            return ["ref", *named, _version(named[0])]  # a library's module-level object
        return self._object(x, where, depth)

    def _items(self, d: Any, where: str, depth: int) -> list[Any]:
        items = [
            [self.fp(k, where, depth), self.fp(v, f"{where}[{k!r}]", depth)] for k, v in d.items()
        ]
        return sorted(items, key=lambda kv: _canonical(kv[0]))

    def _array(self, x: Any, where: str) -> Any:
        import numpy as np

        jax = sys.modules.get("jax")
        if jax is not None and isinstance(x, jax.Array):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            if not x.is_fully_addressable:
                raise self.fail(where, "an array not fully addressable from this process")
        data = np.asarray(x)
        blob = hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
        return ["array", str(data.dtype), list(data.shape), blob]

    def _type(self, cls: type, where: str, depth: int) -> Any:
        module, qualname = cls.__module__, cls.__qualname__
        if _is_library(module) and _named(cls) is not None:
            return ["class", module, qualname, _version(module)]
        # The user's own class: its methods' code is part of what it does.
        members = []
        for name, member in sorted(vars(cls).items()):
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if isinstance(member, types.FunctionType):
                members.append([name, self.fp(member, f"{where}<{qualname}.{name}>", depth)])
        bases = [self.fp(b, where, depth) for b in cls.__bases__ if b is not object]
        return ["class", module, qualname, bases, members]

    def _function(self, f: types.FunctionType, where: str, depth: int) -> Any:
        module = f.__module__
        named = _named(f)
        library = _is_library(module)
        if library and named is not None:
            return ["ref", *named, _version(module)]
        label = f"{where}<{f.__qualname__}>"
        out: list[Any] = ["function", module, f.__qualname__]
        out.append(self._code(f.__code__, label, depth))
        out.append(self.fp(f.__defaults__, label + ".__defaults__", depth))
        out.append(self.fp(f.__kwdefaults__, label + ".__kwdefaults__", depth))
        cells = []
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:
                cells.append([name, "<empty cell>"])
                continue
            cells.append([name, self.fp(value, f"{label}.{name}", depth)])
        out.append(cells)
        if library:
            out.append(_version(module))
        else:
            globs = []
            for name in sorted(global_names(f.__code__)):
                if name in f.__globals__:
                    globs.append([name, self.fp(f.__globals__[name], f"{label}.{name}", depth)])
            out.append(globs)
        return out

    def _code(self, code: types.CodeType, where: str, depth: int) -> Any:
        consts = [
            self._code(c, where, depth)
            if isinstance(c, types.CodeType)
            else self.fp(c, where, depth)
            for c in code.co_consts
        ]
        return [
            "code",
            code.co_qualname if hasattr(code, "co_qualname") else code.co_name,
            hashlib.sha256(code.co_code).hexdigest(),
            consts,
            list(code.co_names),
            list(code.co_varnames),
            list(code.co_freevars),
            list(code.co_cellvars),
            [code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags],
        ]

    def _jax_object(self, x: Any, jax: Any) -> Any:
        sharding = jax.sharding
        if isinstance(x, sharding.Mesh):
            return [
                "mesh",
                list(x.axis_names),
                list(x.devices.shape),
                [int(d) for d in x.device_ids.flat],
                [str(t) for t in getattr(x, "axis_types", ())],
            ]
        if isinstance(x, sharding.AbstractMesh):
            return ["abstract-mesh", repr(x)]
        if isinstance(x, sharding.PartitionSpec):
            return ["pspec", repr(x)]
        if isinstance(x, sharding.NamedSharding):
            return ["named-sharding", self._jax_object(x.mesh, jax), repr(x.spec)]
        if isinstance(x, jax.tree_util.PyTreeDef):
            return self._treedef(x, "", 0)
        return None

    def _treedef(self, treedef: Any, where: str, depth: int) -> Any:
        data = treedef.node_data()
        node = (
            None
            if data is None
            else [self.fp(data[0], where, depth), self.fp(data[1], where, depth)]
        )
        return ["treedef", node, [self._treedef(c, where, depth) for c in treedef.children()]]

    def _object(self, x: Any, where: str, depth: int) -> Any:
        cls = type(x)
        kind = self._type(cls, where, depth)
        if dataclasses.is_dataclass(x):
            fields = [
                [f.name, self.fp(getattr(x, f.name, None), f"{where}.{f.name}", depth)]
                for f in dataclasses.fields(x)
            ]
            return ["dataclass", kind, fields]
        attrs: dict[str, Any] = {}
        if hasattr(x, "__dict__"):
            attrs.update(vars(x))
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()):
                special = slot in ("__dict__", "__weakref__")
                if isinstance(slot, str) and not special and hasattr(x, slot):
                    attrs[slot] = getattr(x, slot)
        if attrs:
            fields = [[k, self.fp(v, f"{where}.{k}", depth)] for k, v in sorted(attrs.items())]
            return ["object", kind, fields]
        if hasattr(x, "__dict__") or "__slots__" in vars(cls):
            return ["object", kind, []]  # an instance with no state: its class says it all
        text = repr(x)
        if cls.__repr__ is not object.__repr__ and not _ADDRESS.search(text):
            return ["repr", kind, text]
        raise self.fail(
            where,
            f"a {cls.__module__}.{cls.__qualname__} has no fields to fingerprint and its repr "
            "names a memory address",
        )


def _canonical(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"))
