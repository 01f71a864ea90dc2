"""Export a run's executable into JAX's own persistent compilation cache.

A job that calls plain ``jax.jit`` with ``jax_compilation_cache_dir=DIR`` (no jaxaot) loads an
executable from DIR when JAX's key for its compile is a file there (``<key>-cache``: the
compile time in 4 big-endian bytes and the serialized executable, compressed with zstandard
where installed, else zlib; jax 0.10.2 ``compilation_cache.py``). :func:`export_run` files a
jaxaot run's executable under the key JAX computes, with JAX's own key function, from:

- the module that was compiled: ``lower/module.stablehlo.mlir`` parsed back and proven to be
  the very module compiled (its bytecode without locations hashes to the run's
  ``module_sha256``; MLIR's printer leaves out empty argument and result attribute lists,
  which are put back where that makes the hash match);
- the compile options the executable was compiled with, as the executable itself records them
  (PjRt's ``ExecutableAndOptionsProto``), less what the compile adds to its record
  (``argument_layouts``, ``allow_in_place_mlir_modification``, the build options'
  ``result_layout``: JAX never sets them), plus the debug options JAX adds to every compile
  while its cache is on at DIR (their value names DIR: a key is for one cache path, written as
  the job writes it);
- this process's client, devices and XLA flags, which must be the job's: the key hashes the
  platform version, the devices' topology (a CPU client's device count), ``XLA_FLAGS``,
  ``LIBTPU_INIT_ARGS`` and ``--xla*`` arguments; the XLA_FLAGS JAX hashes must be the
  compile's (the run's manifest records them).

A job whose own lowering, options, client or flags differ computes another key and compiles
as before: an export can only be missed, never hit by another program. Refused, one line each:
an executable compiled through its ``jax.export`` (a module plain ``jax.jit`` never lowers) or
with the run's own dump/trace options (``compile.dump``/``breakdown``), a module text with
elided constants, a TPU topology or other deviceless compile (JAX keys the
real client's platform version and topology, which a compile-only client cannot vouch for),
a platform other than cpu (the only one this is tested on), another jaxlib, client or
XLA_FLAGS than the compile's. Refused too, for what changes the executable outside JAX's key
(jaxaot's compile key has each): HLO module transformations registered for the platform during
the compile (or ones that could not be ruled out), another host CPU than this one (XLA:CPU
compiles for the host's CPU; export on the host the jobs run on), a manifest that records
neither, and a module with host callbacks or custom partitioning (their Python callbacks are
the compiling process's: JAX never files such an executable, and a loaded one gets none).
"""

from __future__ import annotations

import json
import os
import pickletools
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import one_line
from jaxaot.util import protowire
from jaxaot.util.fsio import sha256_bytes
from jaxaot.util.host_cpu import host_cpu

# What a compile adds to the options PjRt records with an executable (xla/pjrt/proto/
# compile_options.proto): CompileOptionsProto's argument_layouts (1) and
# allow_in_place_mlir_modification (9), ExecutableBuildOptionsProto's result_layout (2).
_ADDED_OPTIONS = frozenset({1, 9})
_BUILD_OPTIONS = 3
_ADDED_BUILD_OPTIONS = frozenset({2})
PLATFORMS = ("cpu",)
# How MLIR's printer writes a constant it elides (``dense_resource<__elided__>``).
ELIDED = "__elided__"
# Custom calls that hand the compile a Python callback of the compiling process: host
# callbacks (jax.debug.print, pure_callback, io_callback: jax 0.10.2 lowers them to
# xla_ffi[_partitioned]_python_<device>_callback, older jax to xla_python_<device>_callback)
# and custom_partitioning's CustomSPMDPartitioning.
PYTHON_CALLBACKS = re.compile(r'custom_call @"?(CustomSPMDPartitioning|xla_\w*python\w*callback)\b')
CACHE_SUFFIX = "-cache"  # jax._src.lru_cache's file names
ATIME_SUFFIX = "-atime"


class Refused(Exception):
    """A run whose executable cannot be filed under the key plain ``jax.jit`` computes."""


@dataclass(frozen=True)
class Exported:
    """One run's outcome: ``key`` the JAX cache key, ``state`` written/present/refused."""

    run_dir: str
    state: str
    key: str = ""
    reason: str = ""

    def line(self) -> str:
        if self.state == "refused":
            return f"refused {self.run_dir}: {self.reason}"
        return f"{self.state} {self.key} ({self.run_dir})"


# --- reading the run -------------------------------------------------------------------------


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise Refused(f"no {path.parent.name}/{path.name}") from None
    except ValueError as exc:
        raise Refused(f"{path.parent.name}/{path.name} is not JSON ({exc})") from None


def _verified(run: Path, name: str, artifacts: dict[str, Any]) -> bytes:
    """``run/name``'s bytes, checked against the size and sha256 its manifest records."""
    want = artifacts.get(name)
    if not isinstance(want, dict):
        raise Refused(f"its manifest records no {name}")
    try:
        data = (run / name).read_bytes()
    except FileNotFoundError:
        raise Refused(f"no {name}") from None
    if len(data) != want.get("size") or sha256_bytes(data) != want.get("sha256"):
        raise Refused(f"{name} differs from its manifest's size/sha256 (changed since the run)")
    return data


def _spans(data: bytes) -> list[tuple[int, Any, bytes]]:
    """A protobuf message's top-level fields as (number, value, the field's own bytes)."""
    try:
        return [(number, value, raw) for number, _, value, raw in protowire.spans(data)]
    except protowire.WireError as exc:
        raise Refused(f"the serialized executable is not a protobuf message ({exc})") from None


def xla_executable(blob: bytes) -> bytes:
    """The client's serialized executable inside jaxaot's ``executable.bin`` (a pickle of
    ``jax.experimental.serialize_executable``'s payload and trees), read without unpickling:
    the payload's one ``('exec', bytes)`` persistent id."""
    try:
        payload = next(bytes(a) for _, a, _ in pickletools.genops(blob) if isinstance(a, bytes))
        ops = list(pickletools.genops(payload))
    except (StopIteration, ValueError) as exc:
        raise Refused(f"executable.bin is not a serialized jax executable ({exc})") from None
    found = [
        bytes(arg)
        for i, (op, arg, _) in enumerate(ops)
        if isinstance(arg, bytes | bytearray) and i >= 2 and ops[i - 2][1] == "exec"
    ]
    if len(found) != 1:
        raise Refused(f"executable.bin holds {len(found)} executables, expected 1")
    return found[0]


def recorded(executable: bytes) -> tuple[str, bytes]:
    """(the module name, the CompileOptionsProto) an IFRT-on-PjRt serialized executable records
    (jaxlib 0.10.2: a length-prefixed IFRT header naming ``pjrt_ifrt`` and, in field 7, the
    executable's name; then PjRt's ExecutableAndOptionsProto: 1 the executable, 2 its compile
    options)."""
    try:
        n, i = protowire.varint(executable, 0)
    except protowire.WireError as exc:
        raise Refused(f"the serialized executable has no header ({exc})") from None
    header = _spans(executable[i : i + n])
    if not any(num == 2 and value == b"pjrt_ifrt" for num, value, _ in header):
        raise Refused("the serialized executable is not jaxlib 0.10.2's pjrt_ifrt format")
    names = [
        value.decode("utf-8", "replace")
        for num, value, _ in header
        if num == 7 and isinstance(value, bytes)
    ]
    options = [
        value
        for num, value, _ in _spans(executable[i + n :])
        if num == 2 and isinstance(value, bytes)
    ]
    if len(names) != 1 or len(options) != 1:
        raise Refused(
            "the serialized executable records no name or no compile options; compile it again "
            "(start_at=compile)"
        )
    return names[0], options[0]


def compile_options_as_passed(recorded: bytes, cache_dir: str) -> Any:
    """The options JAX passed to the compile, from those the executable records, with the debug
    options JAX adds while its persistent cache is on at ``cache_dir``."""
    kept = []
    for number, value, field in _spans(recorded):
        if number in _ADDED_OPTIONS:
            continue
        if number == _BUILD_OPTIONS and isinstance(value, bytes):
            build = b"".join(f for n, _, f in _spans(value) if n not in _ADDED_BUILD_OPTIONS)
            field = protowire.length_delimited(_BUILD_OPTIONS, build)
        kept.append(field)
    options = compat_jax.compile_options().ParseFromString(b"".join(kept))
    compat_jax.jax_cache_debug_options(options, cache_dir)
    return options


def compiled_module(text: str, module_sha256: str) -> Any:
    """The module a run compiled, parsed from its StableHLO ``text`` and proven to be it: its
    bytecode without locations (renamed as the digest renames it) hashes to ``module_sha256``."""
    if ELIDED in text:
        raise Refused(
            "its module text elides large constants; lower again with "
            "lower.elide_constants_over=null to keep them"
        )
    callback = PYTHON_CALLBACKS.search(text)
    if callback:
        raise Refused(
            f"its module calls {callback.group(1)}, a Python callback of the compiling "
            "process (JAX's key names none and a loaded executable gets none: JAX never files "
            "one); not exported"
        )
    try:
        module = compat_jax.parse_module(text)
    except Exception as exc:
        raise Refused(
            f"lower/module.stablehlo.mlir does not parse ({one_line(exc)[:300]})"
        ) from None
    if not _restore_empty_attrs(module, module_sha256):
        raise Refused(
            "lower/module.stablehlo.mlir does not parse back to the module compiled (no "
            "placement of the empty attribute lists MLIR's printer leaves out hashes to its "
            "module_sha256)"
        )
    return module


# The most placements of empty argument attribute lists tried (one digest each).
MAX_TRIES = 4096


def _restore_empty_attrs(module: Any, module_sha256: str) -> bool:
    """Put back into ``module`` (stripped of locations) the empty argument and result attribute
    lists MLIR's printer leaves out, so that its digest is ``module_sha256``; whether some
    placement does. JAX gives every function it lowers result attributes, and argument
    attributes to some (jax 0.10.2 ``mlir.lower_jaxpr_to_fun``): placements of empty argument
    lists over the functions printed without them are tried, most first (every function, then
    all but one, ...), at most MAX_TRIES."""
    import hashlib
    import io
    import itertools

    ir, passmanager = compat_jax.mlir_ir()
    with module.context:
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
        name = module.operation.attributes["sym_name"]
        functions = []
        for op in module.body.operations:
            if op.operation.name == "func.func":
                kind = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                functions.append((op, len(kind.inputs), len(kind.results)))

        def empties(n: int) -> Any:
            return ir.ArrayAttr.get([ir.DictAttr.get({}) for _ in range(n)])

        def digest() -> str:
            module.operation.attributes["sym_name"] = ir.StringAttr.get("main_module")
            sink = io.BytesIO()
            module.operation.write_bytecode(sink)
            module.operation.attributes["sym_name"] = name
            return hashlib.sha256(sink.getvalue()).hexdigest()

        if digest() == module_sha256:
            return True
        open_args = [(op, n) for op, n, _ in functions if n and "arg_attrs" not in op.attributes]
        for op, _, n in functions:
            if n and "res_attrs" not in op.attributes:
                op.attributes["res_attrs"] = empties(n)
        placements = itertools.chain.from_iterable(
            itertools.combinations(open_args, size) for size in range(len(open_args), -1, -1)
        )
        for chosen in itertools.islice(placements, MAX_TRIES):
            for op, n in chosen:
                op.attributes["arg_attrs"] = empties(n)
            if digest() == module_sha256:
                return True
            for op, _ in chosen:
                del op.attributes["arg_attrs"]
    return False


# --- the key and the entry ---------------------------------------------------------------------


def _client_and_devices(backend: dict[str, Any], device_ids: list[int]) -> tuple[Any, list[Any]]:
    import jax

    platform = backend.get("platform")
    try:
        devices = jax.devices(platform)
    except RuntimeError as exc:  # JAX_PLATFORMS names other platforms only
        raise Refused(
            f"this process has no {platform} client ({exc}); run the export with "
            f"JAX_PLATFORMS={platform}"
        ) from None
    client = devices[0].client
    if backend.get("jaxlib") != compat_jax.installed_text("jaxlib"):
        raise Refused(
            f"compiled with jaxlib {backend.get('jaxlib')}, this process has "
            f"{compat_jax.installed_text('jaxlib')} (JAX's key hashes jaxlib's version)"
        )
    if backend.get("platform_version") != client.platform_version:
        raise Refused(
            f"compiled on {platform} {backend.get('platform_version')!r}, this process's client "
            f"is {client.platform_version!r}"
        )
    by_id = {d.id: d for d in devices}
    missing = [i for i in device_ids if i not in by_id]
    if missing:
        raise Refused(
            f"it runs on {platform} devices {device_ids}; this process has {len(by_id)} "
            "(export with the job's device count)"
        )
    return client, [by_id[i] for i in device_ids]


def entry_for(run: Path, cache_dir: str) -> tuple[str, bytes]:
    """(JAX's key, the cache entry) for the executable of the run in ``run``."""
    manifest = _json(run / "manifest.json")
    stage = (manifest.get("stages") or {}).get("compile") or {}
    artifacts = {k.removeprefix("compile/"): v for k, v in (stage.get("artifacts") or {}).items()}
    if "executable.bin" not in artifacts:
        raise Refused("its compile stage kept no executable.bin")
    backend = manifest.get("backend") or {}
    if backend.get("topology"):
        raise Refused(
            f"compiled deviceless for topology {backend['topology']}: JAX keys the platform "
            "version and topology fingerprint of the job's real client, which a compile-only "
            "client cannot vouch for"
        )
    if backend.get("platform") not in PLATFORMS:
        raise Refused(
            f"platform {backend.get('platform')!r}: exporting is tested on {', '.join(PLATFORMS)} "
            "only"
        )
    _same_flags(manifest)
    _same_compiler(manifest, backend["platform"])
    compiled = json.loads(_verified(run / "compile", "compiled.json", artifacts))
    lower = ((manifest.get("stages") or {}).get("lower") or {}).get("artifacts") or {}
    lower = {k.removeprefix("lower/"): v for k, v in lower.items()}
    lowered = json.loads(_verified(run / "lower", "lowered.json", lower))
    digest = lowered.get("module_sha256")
    if not isinstance(digest, str) or compiled.get("module_sha256") != digest:
        raise Refused(
            "compile/compiled.json and lower/lowered.json do not name one module; compile it "
            "again (start_at=lower)"
        )
    _compiled_its_lowering(manifest, lowered, backend["platform"])
    executable = xla_executable(_verified(run / "compile", "executable.bin", artifacts))
    name, options_proto = recorded(executable)
    options = compile_options_as_passed(options_proto, cache_dir)
    text = _verified(run / "lower", "module.stablehlo.mlir", lower).decode()
    module = compiled_module(text, digest)
    own = compat_jax.module_name(module)
    if name != own:
        raise Refused(
            f"the executable was compiled from {name!r}, the run's lowering is {own!r} (compiled "
            "through its jax.export: a module plain jax.jit never lowers)"
        )
    client, devices = _client_and_devices(backend, list(compiled.get("device_ids") or [0]))
    key = compat_jax.jax_cache_key(module, devices, options, client)
    seconds = float(stage.get("seconds") or 0.0)
    return key, compat_jax.jax_cache_entry(executable, seconds)


def _compiled_its_lowering(
    manifest: dict[str, Any], lowered: dict[str, Any], platform: str
) -> None:
    """Refuse a run whose compile stage compiled its ``jax.export`` rather than the lowering
    (the compile stage's ``exported`` form, :func:`jaxaot.stages.compile.prepare`): a lowering
    loaded from a checkpoint, for several platforms, or with symbolic dimensions; and one that
    compiled with options for its own dump or trace (XLA's dump options, which JAX's key
    clears)."""
    export = "compiled through its jax.export (jax.jit(exported.call)): a module plain jax.jit "
    lower = ((manifest.get("stages") or {}).get("lower") or {}).get("status")
    if lower != "ran":
        raise Refused(f"its lower stage {lower or 'did not run'}: {export}never lowers")
    if list(lowered.get("platforms") or []) != [platform]:
        raise Refused(f"lowered for {lowered.get('platforms')}: {export}never lowers")
    compile = (manifest.get("config") or {}).get("compile") or {}
    own = [f"compile.{k}" for k in ("dump", "breakdown") if compile.get(k)]
    if own:
        raise Refused(
            f"compiled with this run's own dump/trace options ({', '.join(own)}), which the "
            "executable records and JAX's key leaves out; export a run without them"
        )
    shapes = compile.get("shapes") or {}
    if shapes:
        raise Refused(f"polymorphic, compiled at compile.shapes={shapes}: {export}never lowers")


def _same_flags(manifest: dict[str, Any]) -> None:
    """Refuse a run compiled under other XLA_FLAGS than this process's (JAX's key hashes this
    process's; XLA reads every flag of the compile's, not only those the executable records)."""
    recorded = ((manifest.get("environment") or {}).get("flag_variables") or {}).get("XLA_FLAGS")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("words"), list):
        raise Refused("its manifest records no XLA_FLAGS; compile it again (start_at=compile)")
    dumps = [w for w in recorded["words"] if w.startswith("--xla_dump")]
    if dumps:
        raise Refused(
            f"compiled with XLA dump flags in XLA_FLAGS ({' '.join(dumps)}), which the "
            "executable records and JAX's key leaves out; export a run without them"
        )
    then = compat_jax.jax_cache_flags(recorded["words"])
    now = compat_jax.jax_cache_flags(os.environ.get("XLA_FLAGS", "").split())
    if then != now:
        raise Refused(
            f"compiled with XLA_FLAGS {' '.join(then) or '(none)'}, this process has "
            f"{' '.join(now) or '(none)'} (export with the job's XLA_FLAGS)"
        )


def _same_compiler(manifest: dict[str, Any], platform: str) -> None:
    """Refuse a run whose compile ran what JAX's key does not cover (jaxaot's compile key has
    both): HLO module transformations registered for ``platform`` (XLA ran them inside the
    compile; plain jax.jit without them would load their output), and another host CPU than
    this one (XLA:CPU compiles for the host's CPU)."""
    env = manifest.get("environment") or {}
    rerun = "compile it again here (start_at=compile) to export it"
    unknown = env.get("hlo_transformations_unknown")
    if unknown:
        raise Refused(
            f"HLO module transformations may have run in its compile ({unknown}); JAX's key does "
            "not cover them: export a run compiled without any"
        )
    passes = env.get("hlo_transformations")
    if not isinstance(passes, list):
        raise Refused(f"its manifest records no environment.hlo_transformations; {rerun}")
    ran = [
        str(p.get("name")) if isinstance(p, dict) else repr(p)
        for p in passes
        if not isinstance(p, dict) or p.get("platform") == platform
    ]
    if ran:
        raise Refused(
            f"compiled with HLO module transformations registered for {platform} "
            f"({', '.join(ran)}): XLA ran them inside the compile and JAX's key does not cover "
            "them, so plain jax.jit without them would load their output; export a run "
            "compiled without them"
        )
    then = env.get("host_cpu")
    if not isinstance(then, dict):
        raise Refused(
            "its manifest records no environment.host_cpu (XLA:CPU compiles for the host's CPU, "
            f"which JAX's key does not cover); {rerun}"
        )
    now = host_cpu()
    if then != now:
        differ = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))
        shown = "; ".join(
            k if k in ("flags", "Features") else f"{k} {then.get(k)!r}, here {now.get(k)!r}"
            for k in differ
        )
        raise Refused(
            f"compiled for another host CPU ({shown}): XLA:CPU compiles for the host's CPU and "
            "JAX's key does not cover it; export on the host the jobs run on, from a run "
            "compiled there"
        )


def _write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` whole or not at all (a temporary file renamed), with the mode the
    umask gives, as JAX writes its entries."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_run(run_dir: str | Path, cache_dir: str) -> Exported:
    """File the executable of the run in ``run_dir`` in JAX's cache at ``cache_dir`` (the path
    exactly as the job sets ``jax_compilation_cache_dir``). An entry already there is kept, as
    JAX keeps one."""
    run = Path(run_dir)
    try:
        key, entry = entry_for(run, cache_dir)
    except Refused as exc:
        return Exported(str(run), "refused", reason=str(exc))
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{key}{CACHE_SUFFIX}"
    if target.exists():
        return Exported(str(run), "present", key)
    # The access time first: JAX's eviction (jax_compilation_cache_max_size) reads one for
    # every entry.
    _write(root / f"{key}{ATIME_SUFFIX}", time.time_ns().to_bytes(8, "little"))
    _write(target, entry)
    return Exported(str(run), "written", key)


def export_runs(run_dirs: list[str | Path], cache_dir: str) -> list[Exported]:
    """:func:`export_run` for each run directory, in order."""
    return [export_run(run, cache_dir) for run in run_dirs]


def report(results: list[Exported]) -> tuple[list[str], int]:
    """The lines ``jaxaot-store export-jax-cache`` prints (one per run) and its exit status:
    1 when any run was refused, else 0."""
    return [r.line() for r in results], int(any(r.state == "refused" for r in results))
