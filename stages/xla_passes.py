"""HLO module transformations registered with ``jax.extend.xla.register_hlo_module_transformation``
(jax 0.10.2): Python compiler passes XLA runs inside every compile of the process. They change
the executable, and no key has them (JAX's persistent-cache key does not either), so the
compile key has each live registration, in the order XLA runs them, with what identifies its
callback (:func:`identify`). Where a registration cannot be identified, or may have happened
before jaxaot could see it, the compile runs without the store (:class:`Unkeyable`).

jaxlib's registry (``jaxlib._xla``, 0.10.2) has no way to list its entries, so :func:`watch`
wraps its four functions and mirrors it: ``register_xla_transform(name, stage, callback)`` (the
in-process CPU client) and ``register_xla_transform_c_api(client, name, stage, callback)`` (a
plugin's client, called when that backend starts) append to a queue per stage; XLA runs the
PRE_SCHEDULER queue, then POST_SCHEDULER, each in order; a name may repeat, and
``clear_xla_transform[_c_api]`` removes the first entry of that name and stage.

Where jax.extend.xla was imported before :func:`watch` (flax and equinox import it), what was
registered before then is read back where it can be (:func:`_rule_out_earlier`): a plugin's
registrations from jax's backend-initialization hooks, and the CPU registry by a probe compile;
anything it cannot establish keeps the store off, as :func:`blind` says.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import logging
import site
import sys
import sysconfig
import threading
import types
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import Unkeyable
from jaxaot.util.code_names import global_names


@dataclass(frozen=True)
class _Entry:
    platform: str  # "cpu" for the in-process registry, else the plugin client's platform
    stage: int
    name: str
    callback: Any


_lock = threading.Lock()
_entries: list[_Entry] = []
_watching = False
_blind: str | None = None  # why registrations made before watch() cannot be ruled out
_PLATFORM = {"gpu": "cuda"}  # a client's platform name -> the lowering platform


def watch() -> None:
    """Start mirroring jaxlib's registry (once per process; call before any program code runs:
    registrations made earlier cannot be listed). Imports jax."""
    global _watching, _blind
    with _lock:
        if _watching:
            return
        _watching = True
        _xla = compat_jax.xla_transform_registry()
        if _xla is None:
            return  # this jaxlib has no registry
        if compat_jax.xla_transform_imported():
            _blind = _rule_out_earlier()
        _wrap(_xla)


_EARLIER = (
    "jax.extend.xla was imported before jaxaot could watch its HLO module transformations, "
    "so one registered before then cannot be ruled out"
)
_HOOK = "register_hlo_module_transformation.<locals>.register_on_client"
_PROBE_BYTES = 1 << 18  # the probe module's constant: what a callback would be handed, at least


def _rule_out_earlier() -> str | None:
    """Registrations made through jax.extend.xla before :func:`watch`, mirrored where they can
    be read: None when every one is in ``_entries``, else why the store stays off. A plugin's
    are jax's backend-initialization hooks (jax 0.10.2: ``register_on_client`` closures over
    name, stage_int, callback and platforms_list, run on every backend already initialized and
    on each one initialized later, which then calls the wrapped registry). The in-process CPU
    registry cannot be listed: :func:`_cpu_probe` compiles a module and sees whether a Python
    callback was handed it."""
    hooks = compat_jax.backend_initialization_hooks()
    try:
        backends = compat_jax.started_backends()
    except (ImportError, AttributeError):
        hooks = None
    if hooks is None:
        return f"{_EARLIER} (jax's backend-initialization hooks cannot be read)"
    found = []
    for hook in hooks:
        if getattr(hook, "__qualname__", None) != _HOOK:
            continue
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=False))
        try:
            name, stage = cells["name"].cell_contents, cells["stage_int"].cell_contents
            callback = cells["callback"].cell_contents
            platforms = list(cells["platforms_list"].cell_contents)
        except (KeyError, ValueError, TypeError):
            return f"{_EARLIER} (a registration hook's closure cannot be read)"
        for client in backends:  # the hook ran on each; later backends call the wrapper
            if getattr(client, "platform", None) in platforms:
                found.append(_Entry(_platform(client), int(stage), str(name), callback))
    why = _cpu_probe(backends)
    if why is not None:
        return f"{_EARLIER} ({why})"
    _entries[:0] = found
    return None


def _cpu_probe(backends: list[Any]) -> str | None:
    """None when a compile on the CPU client hands no Python callback its module: XLA calls a
    registered callback with the serialized HloModuleProto as ``bytes``, on a thread of its own
    (jaxlib 0.10.2), where ``sys.setprofile``/``threading.setprofile`` see nothing, so the probe
    traces Python's allocations instead: the module holds a constant of ``_PROBE_BYTES`` random
    bytes, and the compile's allocation peak tells whether a copy of it was made. Else why
    not."""
    import os
    import tracemalloc

    try:
        client, devices, options = compat_jax.cpu_probe_client(backends)
        n = _PROBE_BYTES
        t = f"tensor<{n}xi8>"
        module = (
            f"module @jaxaot_probe {{\n  func.func public @main() -> {t} {{\n"
            f'    %0 = stablehlo.constant dense<"0x{os.urandom(n).hex()}"> : {t}\n'
            f"    return %0 : {t}\n  }}\n}}\n"
        ).encode()
    except Exception as e:  # any failure: the registry stays unknown
        return f"the CPU probe could not be set up: {type(e).__name__}: {e}"
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        client.compile_and_load(module, devices, options)
        peak = tracemalloc.get_traced_memory()[1] - base
    except Exception as e:
        return f"the CPU probe's compile failed: {type(e).__name__}: {e}"
    finally:
        if not tracing:
            tracemalloc.stop()
    if peak >= n // 2:
        return f"a compile on CPU handed a {n}-byte module to Python ({peak} bytes allocated)"
    return None


def _wrap(xla: Any) -> None:
    register, clear = xla.register_xla_transform, xla.clear_xla_transform
    register_c, clear_c = xla.register_xla_transform_c_api, xla.clear_xla_transform_c_api

    @functools.wraps(register)
    def register_xla_transform(name: str, stage: int, callback: Any) -> Any:
        out = register(name, stage, callback)
        with _lock:
            _entries.append(_Entry("cpu", int(stage), name, callback))
        return out

    @functools.wraps(clear)
    def clear_xla_transform(name: str, stage: int) -> Any:
        cleared = clear(name, stage)
        if cleared:
            _drop("cpu", name, int(stage))
        return cleared

    @functools.wraps(register_c)
    def register_xla_transform_c_api(client: Any, name: str, stage: int, callback: Any) -> Any:
        out = register_c(client, name, stage, callback)
        with _lock:
            _entries.append(_Entry(_platform(client), int(stage), name, callback))
        return out

    @functools.wraps(clear_c)
    def clear_xla_transform_c_api(client: Any, name: str, stage: int) -> Any:
        cleared = clear_c(client, name, stage)
        if cleared:
            _drop(_platform(client), name, int(stage))
        return cleared

    xla.register_xla_transform = register_xla_transform
    xla.clear_xla_transform = clear_xla_transform
    xla.register_xla_transform_c_api = register_xla_transform_c_api
    xla.clear_xla_transform_c_api = clear_xla_transform_c_api


def _platform(client: Any) -> str:
    name = str(getattr(client, "platform", "?"))
    return _PLATFORM.get(name, name)


def _drop(platform: str, name: str, stage: int) -> None:
    with _lock:
        for i, e in enumerate(_entries):
            if (e.platform, e.name, e.stage) == (platform, name, stage):
                del _entries[i]
                return


def key_of(platform: str) -> list[dict[str, Any]]:
    """The transformations XLA runs in a compile for ``platform``, in the order it runs them,
    each with its callback's identity; :class:`Unkeyable` where that cannot be told. A plugin's
    registrations on every client it had in this process are included (a miss, never a wrong
    hit, after a backend restarts)."""
    watch()  # not watched yet: only if nothing could have registered (else "blind")
    if _blind is not None:
        raise Unkeyable(f"compiled without the store: {_blind}")
    with _lock:
        entries = [e for e in _entries if e.platform == platform]
    out = []
    for e in sorted(entries, key=lambda e: e.stage):  # stable: registration order per stage
        ident = identify(e.callback)
        if ident is None:
            raise Unkeyable(
                f"compiled without the store: the HLO module transformation {e.name!r} "
                f"({type(e.callback).__name__} {_qualname(e.callback)}) cannot be identified; "
                "register a plain function (its code, constants, closure, defaults and the "
                "globals it reads are keyed; a module it reads must be the standard library's "
                "or an installed distribution's, not user code) to use the store"
            )
        out.append({"stage": e.stage, "name": e.name, "callback": ident})
    return out


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj)[:60])}"


_DEPTH = 6  # functions reached through globals and closures, identified this deep


def identify(
    fn: Any, _depth: int = 0, _seen: frozenset[int] = frozenset()
) -> dict[str, Any] | None:
    """What a callback's behaviour depends on, as JSON: for a plain function its module,
    qualified name, code (bytecode, constants, names; not line numbers), defaults, closure, the
    globals it reads (values, or functions identified in turn) and the sha256 of its module's
    source file; for a ``functools.partial`` its function and arguments. None for anything else
    (a callable object, a bound method, a builtin) or a value of a kind not listed in
    :func:`_value`."""
    if _depth > _DEPTH:
        return None
    if id(fn) in _seen:  # recursion: the function is being identified already
        return {"recursive": _qualname(fn)}
    seen = _seen | {id(fn)}
    if isinstance(fn, functools.partial):
        inner = identify(fn.func, _depth + 1, seen)
        args = _value(list(fn.args), _depth, seen)
        kwargs = _value(dict(fn.keywords), _depth, seen)
        if inner is None or args is None or kwargs is None:
            return None
        return {"partial": inner, "args": args, "keywords": kwargs}
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    parts: dict[str, Any] = {
        "module": fn.__module__,
        "qualname": fn.__qualname__,
        "code": _code_sha256(code),
    }
    values = {
        "defaults": list(fn.__defaults__ or ()),
        "kwdefaults": dict(fn.__kwdefaults__ or {}),
        "closure": [_cell(c) for c in fn.__closure__ or ()],
        "globals": {
            n: fn.__globals__[n] for n in sorted(global_names(code)) if n in fn.__globals__
        },
    }
    for what, value in values.items():
        ident = _value(value, _depth, seen)
        if ident is None:
            return None
        parts[what] = ident
    source = _source_sha256(fn)
    if source is not None:
        parts["source_sha256"] = source
    return parts


_EMPTY = object()


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not yet assigned
        return _EMPTY


def _value(v: Any, depth: int, seen: frozenset[int]) -> Any:
    """A JSON identity of a value a callback reads, or None when its kind is not known to be
    identified by its contents."""
    if v is _EMPTY:
        return "<empty cell>"
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float | complex | bytes):
        return {type(v).__name__: repr(v)}
    if isinstance(v, enum.Enum):
        return {"enum": f"{type(v).__module__}.{type(v).__qualname__}.{v.name}"}
    if isinstance(v, list | tuple | frozenset | set):
        items = [_value(x, depth, seen) for x in v]
        if any(x is None and y is not None for x, y in zip(items, v, strict=True)):
            return None
        if isinstance(v, frozenset | set):
            items = sorted(items, key=repr)
        return {type(v).__name__: items}
    if isinstance(v, dict):
        pairs = [[_value(k, depth, seen), _value(x, depth, seen)] for k, x in v.items()]
        if any(
            (a is None and k is not None) or (b is None and x is not None)
            for (a, b), (k, x) in zip(pairs, v.items(), strict=True)
        ):
            return None
        return {"dict": sorted(pairs, key=repr)}
    if isinstance(v, types.ModuleType):
        return _module(v.__name__, getattr(v, "__file__", None))
    if isinstance(v, type):
        return {"class": _qualname(v), "source_sha256": _source_sha256(v)}
    if isinstance(v, logging.Logger):
        return {"logger": v.name}  # writes logs, never the module
    if isinstance(v, types.FunctionType | functools.partial):
        return identify(v, depth + 1, seen)
    if isinstance(v, types.BuiltinFunctionType):
        return {"builtin": _qualname(v)}
    if type(v).__module__ == "numpy" and hasattr(v, "tobytes") and hasattr(v, "dtype"):
        data = hashlib.sha256(v.tobytes()).hexdigest()
        return {"numpy": str(v.dtype), "shape": list(getattr(v, "shape", ())), "sha256": data}
    return None


@functools.cache
def _module(name: str, file: str | None) -> dict[str, Any] | None:
    """A module a callback reads, where what it holds is fixed by a version: the standard
    library (Python's version) or a file of an installed distribution (its name, version and
    the sha256 of its RECORD, which lists every file's sha256). None for any other module (user
    code, an editable install): its source and its attributes may change at run time, and no
    name or version says so."""
    top = name.partition(".")[0]
    if file is None:  # built into the interpreter, or a namespace package
        return {"module": name, "python": sys.version} if name in sys.builtin_module_names else None
    path = Path(file).resolve()
    sites = [Path(p).resolve() for p in {*site.getsitepackages(), *_sysconfig_sites()}]
    in_site = any(path.is_relative_to(d) for d in sites)
    if top in sys.stdlib_module_names and not in_site:
        stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
        return {"module": name, "python": sys.version} if path.is_relative_to(stdlib) else None
    for dist_name in _distributions().get(top, ()) if in_site else ():  # not a source tree
        dist = metadata.distribution(dist_name)
        root = Path(str(dist.locate_file(""))).resolve()
        if not path.is_relative_to(root) or not dist.version:
            continue
        if path.relative_to(root).as_posix() in {f.as_posix() for f in dist.files or ()}:
            record = dist.read_text("RECORD")
            digest = hashlib.sha256(record.encode()).hexdigest() if record else None
            return {
                "module": name,
                "distribution": dist_name,
                "version": dist.version,
                "record_sha256": digest,
            }
    return None


def _sysconfig_sites() -> set[str]:
    paths = sysconfig.get_paths()
    return {paths["purelib"], paths["platlib"]}


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return {k: sorted(set(v)) for k, v in metadata.packages_distributions().items()}


def _code_sha256(code: types.CodeType) -> str:
    h = hashlib.sha256()
    for part in _code_parts(code):
        h.update(part)
    return h.hexdigest()


def _code_parts(code: types.CodeType) -> list[bytes]:
    out = [
        code.co_code,
        repr(
            (
                code.co_names,
                code.co_varnames,
                code.co_freevars,
                code.co_cellvars,
                code.co_argcount,
                code.co_posonlyargcount,
                code.co_kwonlyargcount,
                code.co_flags,
            )
        ).encode(),
    ]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.append(b"code:" + _code_sha256(const).encode())
        else:
            out.append(f"{type(const).__name__}:{const!r}".encode())
    return out


def _source_sha256(obj: Any) -> str | None:
    """The sha256 of the source file that defines ``obj``, where there is one: any edit to the
    module (a helper, a constant) changes the key."""
    try:
        path = inspect.getsourcefile(obj)
        if path is None:
            return None
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except (OSError, TypeError):
        return None


def registered() -> list[dict[str, Any]]:
    """Every registration seen, for the manifest (names, stages, platforms; no identities)."""
    with _lock:
        return [
            {
                "platform": e.platform,
                "stage": e.stage,
                "name": e.name,
                "callback": _qualname(e.callback),
            }
            for e in _entries
        ]


def blind() -> str | None:
    """Why registrations made before :func:`watch` cannot be ruled out, or None."""
    return _blind


__all__ = ["blind", "identify", "key_of", "registered", "watch"]
