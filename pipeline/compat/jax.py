"""Every private JAX and jaxlib touch of jaxaot, public path first, gated by version.

Importing this module imports no JAX: each function imports what it reads. Versions are read
from the installed distributions' metadata (:func:`jax_version`, :func:`jaxlib_version`), so a
gate costs no JAX import either. :data:`PRIVATE_NAMES` lists each private name read here with
the jax versions that have it (tests/test_compat.py resolves the ones the installed jax should
have). Where a name is missing, a feature that cannot run without it is refused in one line
(:func:`need`, :func:`jax_internal`); one that has another way takes it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from jaxaot.errors import BackendError, VersionError, one_line

Version = tuple[int, ...]

# The jax (and jaxlib) releases jaxaot supports: [floor, ceiling).
JAX_RANGE: tuple[Version, Version] = ((0, 6, 2), (0, 11, 0))
# The release whose private layout every function here was written against and tested on.
JAX_TESTED: Version = (0, 10, 2)

# Feature gates: the first jax release with each public path.
TRACED_OUT_TREE = (0, 8, 1)  # jax.stages.Traced.out_tree (``_out_tree`` before)
USE_ABSTRACT_MESH = (0, 7, 2)  # jax.sharding.use_abstract_mesh (jax._src.mesh's before)
SET_MESH = (0, 7, 1)  # jax.set_mesh (jax.sharding.use_mesh before)
JAXPRS_IN_PARAMS = (0, 10, 0)  # jax.extend.core.jaxprs_in_params (jax._src.core's before)
CTX_MESH = (0, 10, 0)  # jax._src.pjit.get_ctx_mesh: the device context a jit records
HLO_MODULE = (0, 10, 2)  # jaxlib._hlo: the HLO module printer and parser
# jax.experimental.layout's Layout and Format.layout (DeviceLocalLayout, .device_local_layout
# before)
LAYOUT = (0, 7, 0)
# The fields of a layout, as jax 0.10.2 names them (before 0.7.1: _tiling; before 0.9.1:
# _sub_byte_element_size_in_bits), in the order jax 0.10.2 keeps them.
LAYOUT_FIELDS = ("major_to_minor", "tiling", "sub_byte_element_size_in_bits")
# Lowered.compile(device_assignment=) and Compiled.out_info: from jax 0.7.0.
COMPILE_DEVICES = (0, 7, 0)
COMPILED_OUT_INFO = (0, 7, 0)
SPEC_REPR = (0, 9, 1)  # str(PartitionSpec) is "P(...)" ("PartitionSpec(...)" before)

# jax.export's compatibility window: a serialized export deserializes in the JAX releases of the
# 6 months after it was made (JAX's export docs, "Compatibility guarantees"); from jax 0.11 an
# older one is refused. An export is flagged once it is EXPORT_WARN_DAYS old.
EXPORT_WINDOW_DAYS = 183
EXPORT_WARN_DAYS = 150


class Private(NamedTuple):
    """A private name read here: ``owner`` a module (``name`` its attribute, "" for the module
    itself) or one of the JAX objects tests/test_compat.py builds (``Lowered``, ``Compiled``,
    ``Traced``, ``ArgInfo``, ``Dim``: ``name`` a dotted attribute path on it), present in jax
    ``since`` <= version < ``until``."""

    owner: str
    name: str
    since: Version = JAX_RANGE[0]
    until: Version | None = None


PRIVATE_NAMES: tuple[Private, ...] = (
    Private("jax._src.xla_bridge", "_platform_aliases"),
    Private("jax._src.xla_bridge", "known_platforms"),
    Private("jax._src.xla_bridge", "canonicalize_platform"),
    Private("jax._src.xla_bridge", "_backends"),
    Private("jax._src.xla_bridge", "backends_are_initialized"),
    Private("jax._src.xla_bridge", "_backend_initialization_hooks", JAX_TESTED),
    Private("jax._src.xla_bridge", "_discover_and_register_pjrt_plugins"),
    Private("jax._src.interpreters.mlir", "_platforms_with_donation"),
    Private("jax._src.pjit", "get_ctx_mesh", CTX_MESH),
    Private("jax._src.mesh", "use_abstract_mesh", JAX_RANGE[0], USE_ABSTRACT_MESH),
    Private("jax._src.config", "traceback_in_locations_limit"),
    Private("jax._src.core", "jaxprs_in_params", JAX_RANGE[0], JAXPRS_IN_PARAMS),
    Private("jax._src.export.serialization", "_serialize_exported"),
    Private("jax._src.export._export", "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE"),
    Private("jax._src.export._export", "serialization_registry"),
    Private("jax._src.export._export", "deserialization_registry"),
    Private("jax._src.lax.lax", "_convert_element_type"),
    Private("jax._src.lib", "lapack"),
    Private("jax._src.lib", "gpu_solver"),
    Private("jaxlib.lapack", "_lapack"),
    Private("jax._src.lib", "xla_client"),
    Private("jax._src.lib", "_xla", JAX_TESTED),
    Private("jax._src.lib.mlir", "ir"),
    Private("jax._src.lib.mlir", "passmanager"),
    Private("jaxlib.xla_client", "CompileOptions"),
    Private("jaxlib.xla_client", "custom_call_targets"),
    Private("jaxlib.xla_client", "_xla"),
    Private("jaxlib._hlo", "HloPrintOptions", HLO_MODULE),
    Private("jaxlib._hlo", "hlo_module_from_text", HLO_MODULE),
    Private("jaxlib._hlo", "HloComputation.instructions", HLO_MODULE),
    Private("jaxlib._jax", "HloPrintOptions", JAX_RANGE[0], HLO_MODULE),
    Private("jaxlib._jax", "hlo_module_from_text", JAX_RANGE[0], HLO_MODULE),
    Private("jaxlib._jax", "hlo_module_cost_analysis"),
    Private("Traced", "_out_tree", JAX_RANGE[0], TRACED_OUT_TREE),
    Private("Lowered", "_lowering"),
    Private("Lowered", "_lowering.compile_args"),
    Private("Lowered", "_lowering._executable"),
    Private("Lowered", "_lowering._device_list", (0, 8, 3)),
    Private("Lowered", "_lowering.const_args", (0, 8, 3)),
    Private("Lowered", "_lowering.hlo"),
    Private("Compiled", "_executable"),
    Private("Compiled", "_executable._kept_var_idx"),
    Private("Compiled", "_executable.out_avals", JAX_RANGE[0], COMPILED_OUT_INFO),
    Private("ArgInfo", "_aval"),
    Private("Layout", "_tiling", JAX_RANGE[0], (0, 7, 1)),
    Private("Layout", "_sub_byte_element_size_in_bits", JAX_RANGE[0], (0, 9, 1)),
    Private("Dim", "_evaluate"),
    # JAX's persistent compilation cache: its key, entry format and the options it adds.
    Private("jax._src.compilation_cache", "get_cache_key"),
    Private("jax._src.compilation_cache", "combine_executable_and_time"),
    Private("jax._src.compilation_cache", "compress_executable"),
    Private("jax._src.interpreters.mlir", "make_ir_context"),
    Private("jax._src.cache_key", "IgnoreCallbacks"),
    Private("jax._src.cache_key", "xla_flags_to_exclude_from_cache_key"),
    Private("jax._src.config", "remove_custom_partitioning_ptr_from_cache_key"),
    Private("jax._src.config", "persistent_cache_enable_xla_caches"),
    Private("jaxlib.xla_client", "AutotuneCacheMode"),
)

# Private modules a run imports on its way (lowering rules): the server imports them ahead.
_PREIMPORT = (
    Private("jax._src.checkify", ""),
    Private("jax._src.pallas.core", ""),
    Private("jax._src.pallas.mosaic.interpret.params", "", JAX_TESTED),
    Private("jaxlib.mlir.dialects.mhlo", ""),
    Private("jaxlib.mlir.dialects.builtin", ""),
)
PRIVATE_NAMES += _PREIMPORT


def preimport() -> tuple[str, ...]:
    """The private modules of :data:`PRIVATE_NAMES` a run imports, that this jax has."""
    return tuple(p.owner for p in _PREIMPORT if p.since <= jax_version())


def _parse(text: str) -> Version:
    """``"0.10.2"`` as ``(0, 10, 2)``; a pre-release (``"0.10.2.dev20260101"``, ``"0.6.2rc1"``)
    as just below its release (``(0, 10, 1, 9999)``): a nightly carries the next version's
    number before that version's features land."""
    out: list[int] = []
    for part in text.split(".")[:3]:
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
    if re.search(r"(dev|rc|a|b)\d*", text.split("+")[0].split(".", 2)[-1]) is None:
        return tuple(out)
    while len(out) < 3:
        out.append(0)
    for i in (2, 1, 0):  # the release before: 0.7.0 -> 0.6.9999, 0.10.2 -> 0.10.1
        if out[i] > 0:
            return (*out[:i], out[i] - 1, *([9999] * (2 - i)), 9999)
    return tuple(out)


@functools.cache
def _installed(dist: str) -> Version:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _parse(version(dist))
    except PackageNotFoundError:
        return ()


def installed_text(dist: str = "jax") -> str:
    """The installed ``dist``'s (jax or jaxlib) version for messages: as its metadata writes it
    (``0.10.2.dev20260101``), or the numbers the gates read where those differ."""
    from importlib.metadata import PackageNotFoundError, version

    gated = jax_version() if dist == "jax" else jaxlib_version()
    try:
        raw = version(dist)
    except PackageNotFoundError:
        return text(gated)
    return raw if _parse(raw) == gated else text(gated)


def jax_version() -> Version:
    """The installed jax's version, from its metadata (no JAX import); () when none is."""
    return _installed("jax")


def jaxlib_version() -> Version:
    """The installed jaxlib's version, from its metadata (no jaxlib import); () when none is."""
    return _installed("jaxlib")


def text(version: Version) -> str:
    """``(0, 8, 1)`` as ``"0.8.1"``."""
    return ".".join(map(str, version)) or "none"


def at_least(version: Version) -> bool:
    """Whether the installed jax is ``version`` or newer."""
    return jax_version() >= version


def need(feature: str, version: Version, what: str) -> None:
    """Refuse ``feature`` in one line unless the installed jax is ``version`` or newer:
    ``what`` says what of that jax the feature uses."""
    if at_least(version):
        return
    raise VersionError(
        f"{feature} needs jax>={text(version)} ({what}); installed: jax "
        f"{installed_text()}; fix: pip install 'jax>={text(version)}'"
    )


def jax_internal(what: str, use: str, exc: BaseException) -> BackendError:
    """The one-line error for a private JAX internal that the installed JAX lacks or lays out
    otherwise: jaxaot refuses rather than run on without it."""
    lo, hi = JAX_RANGE
    return BackendError(
        f"jax {installed_text()}: {what}, which jaxaot uses to {use}, is missing or changed "
        f"({one_line(exc)}); expected jax {text(JAX_TESTED)}, which has it (jax>={text(lo)},"
        f"<{text(hi[:2])} as jaxaot requires): install that jax, or a jaxaot made for this one"
    )


def check_supported() -> None:
    """Refuse in one line a jax older than :data:`JAX_RANGE`'s floor (jax 0.6.2: before it,
    ``jax.experimental.layout`` has no ``Format``, arrays no ``.format``, and ``jax.export``
    imports absl-py without declaring it)."""
    need("jaxaot", JAX_RANGE[0], "jax.experimental.layout.Format, Array.format, jax.export")


# --- tracing and lowering objects ------------------------------------------------------------


def traced_out_tree(traced: Any) -> Any:
    """``jax.stages.Traced.out_tree`` (public since jax 0.8.1; ``_out_tree`` before)."""
    if at_least(TRACED_OUT_TREE):
        return traced.out_tree
    return traced._out_tree


def use_abstract_mesh(amesh: Any) -> Any:
    """``jax.sharding.use_abstract_mesh(amesh)`` (public since jax 0.7.2; jax._src.mesh's
    before): the context that traces and lowers against ``amesh``."""
    if at_least(USE_ABSTRACT_MESH):
        import jax

        return jax.sharding.use_abstract_mesh(amesh)
    from jax._src import mesh

    return mesh.use_abstract_mesh(amesh)


def set_mesh(mesh: Any) -> Any:
    """``jax.set_mesh(mesh)`` (since jax 0.7.1; ``jax.sharding.use_mesh`` before): the
    context in which a jit runs on ``mesh`` (a concrete mesh) and traces against it."""
    import jax

    if at_least(SET_MESH):
        return jax.set_mesh(mesh)
    return jax.sharding.use_mesh(mesh)  # type: ignore[attr-defined,unused-ignore]


def jaxprs_in_params(params: Mapping[str, Any]) -> list[Any]:
    """The jaxprs an equation's parameters hold (a ``cond``'s branches, a ``scan``'s body):
    ``jax.extend.core.jaxprs_in_params`` (public in jax 0.10), ``jax._src.core``'s before."""
    if at_least(JAXPRS_IN_PARAMS):
        from jax.extend import core

        return list(core.jaxprs_in_params(params))
    from jax._src import core as jax_core

    return list(jax_core.jaxprs_in_params(params))


def layout_class() -> Any:
    """jax's class of one array's layout on a device (``Layout.AUTO``, ``Layout(major_to_minor)``):
    ``jax.experimental.layout.Layout`` (jax 0.7 on), ``DeviceLocalLayout`` before."""
    from jax.experimental import layout

    return layout.Layout if at_least(LAYOUT) else layout.DeviceLocalLayout  # type: ignore[attr-defined,unused-ignore]


def format_layout(fmt: Any) -> Any:
    """The layout of a ``jax.experimental.layout.Format`` (``.layout``; ``.device_local_layout``
    before jax 0.7), or None where it has none or is no Format."""
    return getattr(fmt, "layout" if at_least(LAYOUT) else "device_local_layout", None)


def layout_fields(layout: Any) -> dict[str, Any]:
    """A layout's fields under jax 0.10.2's names (:data:`LAYOUT_FIELDS`), read from the
    public attribute where this jax has it, its private spelling where it has not."""
    return {
        name: getattr(layout, name) if hasattr(layout, name) else getattr(layout, f"_{name}")
        for name in LAYOUT_FIELDS
    }


def compile_takes_devices() -> bool:
    """Whether ``Lowered.compile`` takes ``device_assignment=`` (binds a lowering against an
    AbstractMesh to devices; jax without it compiles such a program through its export)."""
    return at_least(COMPILE_DEVICES)


def out_info(stage: Any) -> Any:
    """``out_info`` of a ``jax.stages.Lowered`` or ``Compiled``: its outputs as
    ShapeDtypeStructs with their formats. A Compiled has it since jax 0.8.x; before, it is made
    as jax 0.8.3 makes it, from the executable's output avals and the public output formats."""
    if at_least(COMPILED_OUT_INFO) or not hasattr(stage, "_executable"):
        return stage.out_info
    import jax
    from jax.experimental.layout import Format

    formats = jax.tree.leaves(stage.output_formats, is_leaf=lambda x: isinstance(x, Format))
    avals = stage._executable.out_avals
    structs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=f)
        for a, f in zip(avals, formats, strict=True)
    ]
    return stage.out_tree.unflatten(structs)


def spec_text(spec: Any) -> str:
    """A ``PartitionSpec`` as jax 0.9.1 on prints it (``P('fsdp', None)``), on every jax."""
    text = str(spec)
    if not at_least(SPEC_REPR) and text.startswith("PartitionSpec("):
        return "P(" + text.removeprefix("PartitionSpec(")
    return text


def lowering_of(stage: Any) -> Any:
    """The private lowering object (``MeshComputation``) of a ``jax.stages.Lowered``; None
    where it has none. JAX hands back its cached one for a program lowered before."""
    return getattr(stage, "_lowering", None)


def lowering_backend(lowered: Any) -> Any:
    """The client a ``jax.stages.Lowered`` compiles with (its compile arguments' backend)."""
    return lowered._lowering.compile_args["backend"]


def kept_var_idx(stage: Any) -> Any:
    """The flat inputs a ``jax.stages.Lowered`` (its compile arguments) or ``Compiled`` (its
    executable, a deserialized one too) keeps; None where it does not say."""
    lowering = getattr(stage, "_lowering", None)
    kept = getattr(lowering, "compile_args", {}).get("kept_var_idx") if lowering else None
    if kept is None:
        kept = getattr(getattr(stage, "_executable", None), "_kept_var_idx", None)
    return kept


def arg_aval(arg_info: Any) -> Any:
    """The abstract value of a ``jax.stages.ArgInfo``."""
    return arg_info._aval


def evaluate_dim(dim: Any, sizes: Mapping[str, int]) -> int:
    """A symbolic dimension's value at ``sizes`` (symbol -> size)."""
    return int(dim._evaluate(dict(sizes)))


def _rebound(live: Any, comp: Any, args: dict[str, Any]) -> Any:
    """A copy of ``live`` whose lowering is a copy of ``comp`` with compile arguments ``args``
    and no compile cache of its own yet (``live`` untouched)."""
    rebound = copy.copy(comp)
    rebound.compile_args = args
    rebound._executable = None  # the copy must not share the original's compile cache
    out = copy.copy(live)
    out._lowering = rebound
    return out


def lowered_for_client(live: Any, client: Any) -> Any | None:
    """``live`` (a ``jax.stages.Lowered``) as the same lowering compiled by ``client``: a copy
    whose compile arguments name ``client`` as the backend. None where the lowering is bound
    to this host's devices, hoists constants to arguments (that executable cannot be
    serialized), or is laid out otherwise."""
    try:
        comp = live._lowering
        args = comp.compile_args
        if not isinstance(args, dict) or "backend" not in args:
            return None
        if comp._device_list is not None:  # bound to this host's devices (no AbstractMesh)
            return None
        if getattr(comp, "const_args", None):  # constants hoisted to arguments
            return None
        return _rebound(live, comp, {**args, "backend": client})
    except AttributeError:
        return None


def lowered_with_context_mesh(live: Any, bind: Callable[[Any], Any]) -> Any:
    """``live`` with the AbstractMesh of its context bound to a concrete mesh (``bind(amesh)``):
    a copy whose compile arguments' ``context_mesh`` is that mesh. ``live`` itself where its
    context is no non-empty AbstractMesh, or where a program with arguments (their shardings
    name the mesh) is laid out otherwise; a :func:`jax_internal` error where one without is."""
    import jax
    from jax.sharding import AbstractMesh

    what = "jax.stages.Lowered._lowering's compile_args['context_mesh'] and _executable"
    use = "bind a mesh lowering's context mesh to the devices it compiles for"
    comp: Any = getattr(live, "_lowering", None)
    args = getattr(comp, "compile_args", None)
    if not isinstance(args, dict) or "context_mesh" not in args:
        if jax.tree.leaves(live.args_info):
            return live
        found = "no _lowering" if comp is None else "no compile_args['context_mesh']"
        raise jax_internal(what, use, AttributeError(found))
    context = args["context_mesh"]
    if not isinstance(context, AbstractMesh) or context.empty:
        return live
    if not hasattr(comp, "_executable"):  # the compile cache the copy must not share
        raise jax_internal(what, use, AttributeError("no _executable"))
    return _rebound(live, comp, {**args, "context_mesh": bind(context)})


# --- the device context a jit records --------------------------------------------------------

_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0  # contexts open in any thread; the patch is in place while it is above 0
_ORIGINAL: list[Any] = []  # jax's get_ctx_mesh while the patch is in place
_TRACING = threading.local()  # .depth: contexts open in this thread


def need_context_mesh() -> None:
    """Refuse in one line, on a jax before 0.10.0, a mesh program without arguments: its jit
    records no AbstractMesh in context as its devices (whatever the axis types), so it would be
    lowered for one device."""
    need(
        "A mesh program without arguments",
        CTX_MESH,
        "a jit that records the AbstractMesh in context as its devices: jax._src.pjit.get_ctx_mesh",
    )


def _ctx_mesh_module() -> Any:
    """jax's private ``pjit`` module, checked to have the ``get_ctx_mesh(use_resource_env)``
    (jax 0.10.2: the device context a jit records) that :func:`auto_context_mesh` replaces,
    or a one-line error naming the jax version."""
    import inspect

    need_context_mesh()
    use = "lower a program without arguments for its mesh's devices"
    try:
        from jax._src import pjit

        original = pjit.get_ctx_mesh
        params = list(inspect.signature(original).parameters)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise jax_internal("jax._src.pjit.get_ctx_mesh", use, exc) from None
    if params != ["use_resource_env"]:
        found = TypeError(f"get_ctx_mesh takes ({', '.join(params)}), not (use_resource_env)")
        raise jax_internal("jax._src.pjit.get_ctx_mesh", use, found)
    return pjit


@contextlib.contextmanager
def auto_context_mesh() -> Iterator[None]:
    """A jit traced in this thread inside this context, with an AbstractMesh in its context
    and no concrete mesh, records that mesh as its device context.

    jax's private ``pjit.get_ctx_mesh`` is module state: it is replaced while any thread is
    inside this context, by a function that answers as jax's own does except in a thread
    inside it (a thread-local count), where it gives the context AbstractMesh jax's own
    leaves out. A trace in another thread, or in this one outside the context, gets jax's own
    answer."""
    import jax

    global _PATCH_DEPTH
    pjit = _ctx_mesh_module()
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            original = pjit.get_ctx_mesh

            def get_ctx_mesh(use_resource_env: bool) -> Any:
                found = original(use_resource_env)
                if getattr(_TRACING, "depth", 0) and found.empty and not use_resource_env:
                    context = jax.sharding.get_abstract_mesh()  # thread-local: this trace's own
                    if not context.empty:
                        return context
                return found

            _ORIGINAL.append(original)
            pjit.get_ctx_mesh = get_ctx_mesh
        _PATCH_DEPTH += 1
    _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _TRACING.depth -= 1
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                pjit.get_ctx_mesh = _ORIGINAL.pop()


# --- platforms, backends, plugins ------------------------------------------------------------


def platform_rules() -> tuple[dict[str, str], list[str], Callable[[str], str]]:
    """JAX's platform aliases (cuda -> gpu, ...), its known platform names and its
    ``canonicalize_platform`` (jax has no public list of either), or a one-line error."""
    try:
        from jax._src import xla_bridge

        aliases = dict(xla_bridge._platform_aliases)
        known = sorted(xla_bridge.known_platforms())
        canonicalize = xla_bridge.canonicalize_platform
    except (ImportError, AttributeError, TypeError) as exc:
        raise jax_internal(
            "jax._src.xla_bridge's _platform_aliases, known_platforms or canonicalize_platform",
            "read lower.platforms as JAX does",
            exc,
        ) from None
    return aliases, known, canonicalize


def platforms_with_donation() -> Any:
    """The platforms JAX implements donation for (``mlir._platforms_with_donation``), or a
    one-line error."""
    try:
        from jax._src.interpreters import mlir

        return mlir._platforms_with_donation
    except (ImportError, AttributeError) as exc:
        raise jax_internal(
            "jax._src.interpreters.mlir._platforms_with_donation",
            "record which arguments are donated",
            exc,
        ) from None


def started_backends() -> list[Any]:
    """The clients of the JAX backends started in this process (none started: [])."""
    from jax._src import xla_bridge

    return list(getattr(xla_bridge, "_backends", {}).values())


def backends_started() -> bool:
    """Whether JAX has started its backends (True where this JAX cannot say)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:
        return True


def plugins_discovered() -> bool:
    """Whether JAX has discovered its PJRT plugins (each plugin's ``initialize()`` ran, reading
    the environment as it was then); True where this JAX cannot say."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._plugins_registered)
    except Exception:
        return True


def backend_initialization_hooks() -> list[Any] | None:
    """The callbacks JAX runs on each backend it starts (a plugin's HLO module
    transformations register through them); None where this JAX has none to read."""
    try:
        from jax._src import xla_bridge

        return list(xla_bridge._backend_initialization_hooks)
    except (ImportError, AttributeError):
        return None


def discover_pjrt_plugins() -> None:
    """Have JAX discover and register its PJRT plugins now (no public call); nothing where
    this JAX has no such step."""
    from jax._src import xla_bridge

    discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if discover is not None:
        discover()


def xla_transform_registry() -> Any:
    """jaxlib's registry of HLO module transformations (``jax._src.lib._xla`` with
    ``register_xla_transform``); None where this jaxlib has none."""
    try:
        from jax._src.lib import _xla
    except ImportError:
        return None
    if _xla is None or not hasattr(_xla, "register_xla_transform"):
        return None
    return _xla


def xla_transform_imported() -> bool:
    """Whether JAX's module that registers HLO module transformations has been imported."""
    import sys

    return "jax._src.xla_transform" in sys.modules


def cpu_probe_client(backends: Sequence[Any]) -> tuple[Any, Any, Any]:
    """(a CPU client, a device list of its first device, fresh compile options) for a probe
    compile: the started CPU backend's client, else a new one-device client of its own."""
    from jaxlib import xla_client as xc

    client = next((c for c in backends if getattr(c, "platform", None) == "cpu"), None)
    if client is None:  # the in-process registry is the process's, not a client's
        client = xc._xla.get_tfrt_cpu_client(asynchronous=False, num_devices=1)
    devices = xc._xla.DeviceList(tuple(client.devices()[:1]))
    return client, devices, xc.CompileOptions()


def compile_options() -> Any:
    """A fresh ``CompileOptions`` (jaxlib fills its debug options from the XLA flags read)."""
    from jax._src.lib import xla_client

    return xla_client.CompileOptions()


# --- the module: MLIR, HLO, export ------------------------------------------------------------


def mlir_ir() -> tuple[Any, Any]:
    """jaxlib's MLIR bindings: the ``ir`` and ``passmanager`` modules."""
    from jax._src.lib.mlir import ir, passmanager

    return ir, passmanager


def _hlo_module() -> Any:
    """jaxlib's module with the HLO printer and parser: ``jaxlib._hlo`` (jaxlib 0.10.2),
    ``jaxlib._jax`` before. Imports no JAX."""
    name = "jaxlib._hlo" if jaxlib_version() >= HLO_MODULE else "jaxlib._jax"
    return importlib.import_module(name)


def _jax_module() -> Any:
    """jaxlib's extension with ``hlo_module_cost_analysis`` (``jaxlib._jax``)."""
    return importlib.import_module("jaxlib._jax")


def hlo_module(lowered: Any) -> Any:
    """The HLO module of a ``jax.stages.Lowered`` (one conversion from StableHLO)."""
    return lowered._lowering.hlo().as_hlo_module()


def hlo_module_to_text(module: Any, *, debug: bool, keep_large: bool) -> str:
    """``module`` printed as ``as_text(dialect="hlo")`` prints it (short parsable):
    ``debug`` with op names and source locations, ``keep_large`` with every constant's
    elements (else those of more than a few are ``{...}``)."""
    opts = _hlo_module().HloPrintOptions.short_parsable()
    opts.print_metadata = debug
    opts.print_large_constants = keep_large
    return str(module.to_string(opts))


def hlo_module_from_text(text: str) -> Any:
    """XLA's parse of HLO module text (imports jaxlib, not JAX)."""
    return _hlo_module().hlo_module_from_text(text)


def hlo_instructions(text: str) -> dict[str, list[str]] | None:
    """Each computation of the HLO module ``text`` (parsed by XLA) and its instructions as XLA
    prints them; None where jaxlib cannot list them (before jaxlib 0.10.2 an HloComputation
    has no ``instructions()``). Imports jaxlib, not JAX."""
    if jaxlib_version() < HLO_MODULE:
        return None
    module = hlo_module_from_text(text)
    return {c.name: [x.to_string() for x in c.instructions()] for c in module.computations()}


def hlo_module_cost_analysis(client: Any, module: Any) -> Any:
    """XLA's cost analysis of an HLO module by ``client``."""
    return _jax_module().hlo_module_cost_analysis(client, module)


def export_serializer() -> Callable[..., Any] | None:
    """jax.export's flatbuffer writer (``serialization._serialize_exported(builder,
    exported, vjp_order)``: no public sizing of the buffer); None where it is laid out
    otherwise."""
    try:
        from jax._src.export import serialization

        return serialization._serialize_exported
    except (ImportError, AttributeError):
        return None


def export_registries() -> tuple[dict[Any, Any], dict[str, Any]]:
    """jax.export's (serialization, deserialization) registries of pytree node classes."""
    from jax._src.export import _export

    return _export.serialization_registry, _export.deserialization_registry


def stable_custom_call_targets() -> frozenset[str]:
    """The custom-call targets jax.export guarantees stable; empty where the list moved."""
    try:
        from jax._src.export import _export

        return frozenset(_export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE)
    except (ImportError, AttributeError):
        return frozenset()


def registered_custom_call_targets() -> set[str]:
    """The custom-call targets jaxlib's modules that jax already imported register (None
    where a plugin is absent: importing others here would start CUDA probes and print their
    warnings), and the Python callbacks registered with XLA."""
    from jax._src import lib as jaxlib_modules
    from jax._src.lib import xla_client

    names: set[str] = set()
    for module in ("lapack", "gpu_linalg", "gpu_solver", "gpu_sparse", "gpu_prng", "cpu_sparse"):
        registrations = getattr(getattr(jaxlib_modules, module, None), "registrations", None)
        if callable(registrations):
            for targets in registrations().values():
                names.update(name for name, *_ in targets)
    for platform in ("cpu", "CUDA", "ROCM"):
        try:
            names.update(xla_client.custom_call_targets(platform))
        except Exception:
            continue
    return names


def init_lapack() -> None:
    """Load jaxlib's LAPACK kernels (idempotent; about 0.1 s the first time)."""
    from jax._src.lib import lapack

    lapack._lapack.initialize()


def init_hybrid_kernels() -> None:
    """Load jaxlib's GPU hybrid solver kernels, where the GPU plugin is installed."""
    from jax._src.lib import gpu_solver

    if gpu_solver is not None:
        gpu_solver.initialize_hybrid_kernels()


def traceback_in_locations_limit(limit: int) -> Any:
    """A context in which a trace records at most ``limit`` Python frames per location
    (thread-local; JAX has no public context manager for the option)."""
    from jax._src import config

    return config.traceback_in_locations_limit(limit)


def weakly_typed(arr: Any) -> Any:
    """``arr`` as a weakly typed JAX array (JAX has no public constructor of one)."""
    from jax._src.lax.lax import _convert_element_type

    return _convert_element_type(arr, arr.dtype, weak_type=True)


def source_summary(source_info: Any) -> str:
    """The user frame of an equation's source info, as JAX summarizes it."""
    from jax.extend import source_info_util

    return str(source_info_util.summarize(source_info)).strip()


def export_age_note(created: float | None, made_by: str | None, now: float) -> str | None:
    """What a user should know about an export made at ``created`` (seconds since the epoch)
    with jax ``made_by``, read at ``now``: None while it is well inside JAX's window."""
    if created is None:
        return None
    days = int((now - created) // 86400)
    if days < EXPORT_WARN_DAYS:
        return None
    import datetime

    made = datetime.datetime.fromtimestamp(created, datetime.UTC).date().isoformat()
    state = "past" if days >= EXPORT_WINDOW_DAYS else "near the end of"
    by = f" with jax {made_by}" if made_by else ""
    return (
        f"its jax.export (made {made}{by}, {days} days ago) is {state} "
        f"JAX's {EXPORT_WINDOW_DAYS}-day window for reading exports (jax >= 0.11 refuses older "
        "ones); lower it again (start_at=lower) to keep a checkpoint that future JAX reads"
    )


# --- JAX's persistent compilation cache -------------------------------------------------------


def jax_cache_key(module: Any, devices: Sequence[Any], options: Any, client: Any) -> str:
    """The key JAX's persistent compilation cache files an executable under, computed by JAX's
    own function (``jax._src.compilation_cache.get_cache_key``): the module's bytecode without
    locations, jaxlib's version, ``client``'s platform and platform version, the XLA flags of
    this process (``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``, ``--xla*`` arguments), ``options``
    serialized, ``devices``' topology and the compression JAX uses. Custom-partitioning
    callbacks are left out of the module as jax's ``jax_remove_custom_partitioning_ptr_from_
    cache_key`` says."""
    import numpy as np
    from jax._src import cache_key, compilation_cache, config

    ignore = (
        cache_key.IgnoreCallbacks.CUSTOM_PARTITIONING
        if config.remove_custom_partitioning_ptr_from_cache_key.value
        else cache_key.IgnoreCallbacks.NO
    )
    array = np.empty(len(devices), dtype=object)
    array[:] = list(devices)
    return str(compilation_cache.get_cache_key(module, array, options, client, ignore))


def jax_cache_flags(words: Sequence[str]) -> list[str]:
    """The XLA flag words JAX's key hashes (sorted, as it hashes them): all but the dump and
    host-device-count flags it leaves out (``cache_key.xla_flags_to_exclude_from_cache_key``)."""
    from jax._src import cache_key

    excluded = set(cache_key.xla_flags_to_exclude_from_cache_key)
    return sorted(w for w in words if w.split("=")[0] not in excluded)


def jax_cache_entry(executable: bytes, compile_seconds: float) -> bytes:
    """A JAX persistent cache entry: the compile time (whole seconds) and the serialized
    executable, compressed as JAX compresses them (zstandard where installed, else zlib)."""
    from jax._src import compilation_cache

    combined = compilation_cache.combine_executable_and_time(executable, int(compile_seconds))
    return bytes(compilation_cache.compress_executable(combined))


def jax_cache_debug_options(options: Any, cache_dir: str) -> None:
    """Set on ``options`` the debug options jax 0.10.2's ``compiler.get_compile_options`` adds
    to every compile while the persistent cache is on at ``cache_dir`` (XLA's GPU autotune and
    kernel caches under it, per ``jax_persistent_cache_enable_xla_caches``), which JAX's key
    hashes: the same program keys differently under two cache directories."""
    import pathlib

    from jax._src import config
    from jax._src.lib import xla_client

    path = pathlib.Path(cache_dir)
    enabled = config.persistent_cache_enable_xla_caches.value or ""
    debug = options.executable_build_options.debug_options
    if enabled == "all" or "xla_gpu_kernel_cache_file" in enabled:
        debug.xla_gpu_kernel_cache_file = str(path / "xla_gpu_kernel_cache_file")
        debug.xla_gpu_enable_llvm_module_compilation_parallelism = True
    if enabled == "all" or "xla_gpu_per_fusion_autotune_cache_dir" in enabled:
        debug.xla_gpu_per_fusion_autotune_cache_dir = str(
            path / "xla_gpu_per_fusion_autotune_cache_dir"
        )
        # Process 0's mode (JAX's key clears this field).
        debug.xla_gpu_experimental_autotune_cache_mode = xla_client.AutotuneCacheMode.UPDATE


def parse_module(text: str) -> Any:
    """An MLIR module parsed from ``text`` in a context with JAX's dialects registered."""
    ir, _ = mlir_ir()
    from jax._src.interpreters import mlir

    context = mlir.make_ir_context()
    with context:
        return ir.Module.parse(text)


def export_module(exported: Any) -> Any:
    """A ``jax.export.Exported``'s module, deserialized into an MLIR module in a context with
    JAX's dialects registered."""
    from jax._src.interpreters import mlir

    with mlir.make_ir_context():
        return exported.mlir_module(serialized=False)


def module_name(module: Any) -> str:
    """An MLIR module's ``sym_name`` (``jit_f``): the name JAX files its cache entry under."""
    ir, _ = mlir_ir()
    with module.context:
        return str(ir.StringAttr(module.operation.attributes["sym_name"]).value)
