"""Process-level JAX set-up that must happen before a backend starts, and backend facts.

Device counts and x64 are process-global in JAX. jaxaot sets them per run: for the CPU
backend the virtual device count (``jax_num_cpu_devices``) can only change before the backend
initializes, so when a later run in the same process (a sweep job under the basic launcher)
needs another count, the backends are cleared and started again.

It also says what of the process a compiled executable depends on, for the compile
key and the run manifest: the flag variables the compiling backend reads, parsed as XLA and
libtpu parse them (:mod:`jaxaot.stages.xla_flags`; XLA reads them once per process, when the
first backend starts), XLA's own parse of ``XLA_FLAGS``, the environment variables and host CPU
the compiler reads, the registered HLO module transformations
(:mod:`jaxaot.stages.xla_passes`) and JAX's config values.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import BackendError, ConfigError
from jaxaot.stages import xla_inputs, xla_passes
from jaxaot.stages.xla_flags import (
    FLAG_ENV_VARS,
    OUTPUT_ONLY_XLA_FLAGS,
    READ_BY,
    XLA_FLAGS,
    FlagSource,
    ParsedFlags,
    error_line,
    parse,
    read_source,
)
from jaxaot.stages.xla_inputs import debug_options_sha256, host_cpu, keyed_env
from jaxaot.util import memo

log = logging.getLogger("jaxaot")

_PLATFORM_OF_BACKEND = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


def platform_of(backend: str) -> str:
    """The lowering platform for a compile backend (``gpu`` lowers for ``cuda``)."""
    return _PLATFORM_OF_BACKEND[backend]


# JAX config values that cannot change a lowering, an executable or its calling convention:
# logging, dumps, caches of JAX's own, timeouts, guards and checks made at dispatch, and what
# the compile key has in another form (platform, device count). Every other config value is
# in the key, so an option a later JAX adds is keyed until it is listed here (a miss, never a
# wrong hit).
CONFIG_NOT_IN_KEY = frozenset(
    {
        "jax_array_garbage_collection_guard",
        "jax_backend_target",
        "jax_captured_constants_report_frames",
        "jax_captured_constants_warn_bytes",
        "jax_check_proxy_envs",
        "jax_check_tracer_leaks",
        "jax_compilation_cache_check_contents",
        "jax_compilation_cache_dir",
        "jax_compilation_cache_expect_pgle",
        "jax_compilation_cache_include_metadata_in_key",
        "jax_compilation_cache_max_size",
        "jax_compiler_detailed_logging_min_ops",
        "jax_cpu_get_global_topology_timeout_minutes",
        "jax_cpu_get_local_topology_timeout_minutes",
        "jax_cross_host_transfer_socket_address",
        "jax_cross_host_transfer_timeout_seconds",
        "jax_cross_host_transfer_transfer_size",
        "jax_cross_host_transport_addresses",
        "jax_cuda_visible_devices",
        "jax_debug_leaked_clients_on_clear_backends",
        "jax_debug_log_modules",
        "jax_default_device",
        "jax_distributed_debug",
        "jax_dump_ir_modes",
        "jax_dump_ir_to",
        "jax_enable_compilation_cache",
        "jax_enable_preemption_service",
        "jax_explain_cache_misses",
        "jax_hlo_source_file_canonicalization_regex",
        "jax_include_debug_info_in_dumps",
        "jax_include_full_tracebacks_in_locations",
        "jax_log_checkpoint_residuals",
        "jax_log_compiles",
        "jax_logging_level",
        "jax_num_cpu_devices",
        "jax_oneapi_visible_devices",
        "jax_pallas_verbose_errors",
        "jax_persistent_cache_enable_xla_caches",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_platform_name",
        "jax_platforms",
        "jax_pprint_use_color",
        "jax_raise_persistent_cache_errors",
        "jax_rocm_visible_devices",
        "jax_share_binary_between_hosts_timeout_ms",
        "jax_source_url_schema",
        "jax_thread_guard",
        "jax_traceback_filtering",
        "jax_traceback_in_locations_limit",
        "jax_tracer_error_num_traceback_frames",
        "jax_transfer_guard",
        "jax_transfer_guard_device_to_device",
        "jax_transfer_guard_device_to_host",
        "jax_transfer_guard_host_to_device",
    }
)


# What the flag variables held when this module was imported, and (set by the first
# `configure`) what they held when XLA read them: XLA parses XLA_FLAGS (and the file it names)
# once per process, when the first backend starts; clear_backends() does not read it again
# (probed on jaxlib 0.10.2).
def _flag_sources() -> dict[str, FlagSource]:
    return {name: read_source(name) for name in FLAG_ENV_VARS}


_AT_IMPORT = _flag_sources()
_ENV_AT_IMPORT = xla_inputs.env_snapshot()  # the variables keyed_env reads, read as XLA_FLAGS is
if "jax" in sys.modules:  # a server warming up, a library user: watch before anything registers
    xla_passes.watch()
_in_effect: dict[str, FlagSource] | None = None
_env_in_effect: dict[str, str] | None = None
_warned_changed = False


def _backends_started() -> bool:
    return compat_jax.backends_started()  # True where JAX cannot say: the earliest snapshot


def _note_flags() -> None:
    """Fix the flags in effect for this process (the first call: the variables and the file
    XLA_FLAGS names, read now, just before the backends start), refuse a flag file XLA could
    not read (XLA would end the process), and warn once when the environment says otherwise
    later (a changed XLA_FLAGS, or a changed file, has no effect after start-up)."""
    global _in_effect, _env_in_effect, _warned_changed
    now = _flag_sources()
    if _in_effect is None:
        started = _backends_started()
        _in_effect = now if not started else _AT_IMPORT
        _env_in_effect = xla_inputs.env_snapshot() if not started else _ENV_AT_IMPORT
    for src in _in_effect.values():
        if src.error is not None:
            raise ConfigError(error_line(src))
    changed = [n for n in FLAG_ENV_VARS if now[n] != _in_effect[n]]
    if changed and not _warned_changed:
        _warned_changed = True
        log.warning(
            "%s changed after XLA read it at start-up; this process still compiles with %s "
            "(the compile key and manifest say so); start a new process to use the new flags",
            ", ".join(_describe(now[n]) for n in changed),
            ", ".join(_describe(_in_effect[n]) for n in changed),
        )


def _env_snapshot() -> dict[str, str]:
    return _env_in_effect if _env_in_effect is not None else _ENV_AT_IMPORT


def _describe(src: FlagSource) -> str:
    if src.path is None:
        return f"{src.var}={src.raw!r}"
    text = src.text if src.text is not None else src.error or ""
    return f"{src.var}={src.raw!r} (the file: {text[:160]!r})"


def flags_in_effect() -> dict[str, ParsedFlags]:
    """Each flag variable as its reader parsed it in this process."""
    sources = _in_effect if _in_effect is not None else _AT_IMPORT
    return {name: parse(sources[name]) for name in FLAG_ENV_VARS}


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return repr(value)


def jax_config() -> dict[str, Any]:
    """Every JAX config value, as JSON values (enums by value, others by repr)."""
    import jax

    return {name: _json_value(v) for name, v in sorted(jax.config.values.items())}


def key_environment(platform: str) -> dict[str, Any]:
    """What of the process an executable for ``platform`` (a lowering platform: cpu, cuda,
    rocm, tpu) depends on besides the program: each flag variable that platform's compiler
    reads (its flags in effect, and for XLA_FLAGS XLA's own parse), the environment variables
    it reads, the host CPU (cpu), the registered HLO module transformations, and JAX's config
    values. :class:`~jaxaot.errors.Unkeyable` where a transformation cannot be
    identified or a keyed variable changed after the backends started."""
    flags = flags_in_effect()
    keyed: dict[str, Any] = {}
    for name, parsed in flags.items():
        if platform not in READ_BY[name]:
            continue
        keyed[name] = {"effective": parsed.effective}
        if name == XLA_FLAGS:
            keyed[name]["debug_options_sha256"] = debug_options_sha256()
    if _recorded is not None:  # the run's manifest: registrations the program made since
        _recorded["hlo_transformations"] = xla_passes.registered()
    out: dict[str, Any] = {
        "flags": keyed,
        "env": xla_inputs.keyed_env_in_effect(platform, _env_snapshot()),
        "hlo_transformations": xla_passes.key_of(platform),
        "jax_config": {k: v for k, v in jax_config().items() if k not in CONFIG_NOT_IN_KEY},
    }
    if platform == "cpu":
        out["host_cpu"] = host_cpu()
    return out


def environment() -> dict[str, Any]:
    """The manifest's record of the environment: each flag variable (its raw value, the file
    it names, the words its reader sees, the flags in effect, which backends read it), XLA's
    own parse of XLA_FLAGS, the HLO module transformations registered (brought up to date when
    the compile key is made), the host CPU (what XLA:CPU compiles for), and every JAX config
    value, with what the compile key leaves out."""
    flags = flags_in_effect()
    xla = flags[XLA_FLAGS]
    config = jax_config()
    out: dict[str, Any] = {
        "xla_flags": [f"{k}={v}" for k, v in xla.effective.items()],
        "xla_flags_not_in_key": list(xla.output_only),
        "flag_variables": {name: parsed.to_json() for name, parsed in flags.items()},
        "xla_debug_options_sha256": debug_options_sha256(),
        "hlo_transformations": xla_passes.registered(),
        "host_cpu": host_cpu(),
        "jax_config": config,
        "jax_config_not_in_key": sorted(CONFIG_NOT_IN_KEY & set(config)),
    }
    if xla_passes.blind() is not None:
        out["hlo_transformations_unknown"] = xla_passes.blind()
    global _recorded
    _recorded = out
    return out


# The last environment() record (a run's manifest.environment): the program registers HLO
# transformations on import, after the record is made, so key_environment brings it up to date.
_recorded: dict[str, Any] | None = None


def configure(
    *, backend: str, num_devices: int | None, x64: bool, jax_config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Apply process-wide JAX settings for one run (call before any JAX computation), then
    start the backends. Returns the previous values of the JAX options the run changed, for
    :func:`restore_config` after it (a sweep's next job starts from the same settings)."""
    if "jax" not in sys.modules:
        with _without_plugin_noise():
            import jax  # noqa: F401  (jaxlib's GPU modules print at import)
    else:
        _logging_level_as_at_import()
    xla_passes.watch()  # before any program code can register an HLO transformation
    _configure(backend, num_devices)
    previous = run_config(jax_config or {}, needs_x64=x64)
    start_backends(backend)
    return previous


# JAX's logging level as JAX was imported ahead of the run's logging configuration (by the
# jaxaot server, whose runs are forked from it); emptied by the first run that reads it.
_IMPORTED_AHEAD: list[Any] = []


def imported_before_logging() -> None:
    """Note that JAX was imported before any run's logging was configured (the server's
    warm-up): the first :func:`configure` of a run forked from here sets JAX's logging level
    as importing JAX there would have."""
    import jax

    _IMPORTED_AHEAD[:] = [jax.config.values["jax_logging_level"]]


def _logging_level_as_at_import() -> None:
    """JAX takes its logging level (its ``jax`` and ``jaxlib`` loggers' handler, and the C++
    log level) from the ``jax`` logger's level when it is imported, unless JAX_LOGGING_LEVEL
    says otherwise: in a process that imports JAX itself, the level the run's logging config
    gives (Hydra's ``job_logging``). A run forked after an earlier import gets the same, unless
    something set it since."""
    if not _IMPORTED_AHEAD:
        return
    import jax

    ahead = _IMPORTED_AHEAD.pop()
    if "JAX_LOGGING_LEVEL" in os.environ or jax.config.values["jax_logging_level"] != ahead:
        return
    jax.config.update("jax_logging_level", logging.getLevelName(logging.getLogger("jax").level))


# JAX options jaxaot sets from other keys; ``jax.config`` may not set them.
MANAGED_OPTIONS = {
    "jax_num_cpu_devices": "compile.num_devices",
    "jax_platforms": "compile.backend (or JAX_PLATFORMS in the environment)",
    "jax_platform_name": "compile.backend",
}


def run_config(values: Mapping[str, Any], *, needs_x64: bool) -> dict[str, Any]:
    """Set the run's ``jax.config`` options and x64; return what they were.

    x64 is ``jax.config.jax_enable_x64`` when given, else on when an argument is 64-bit, else
    what the process has (JAX's default, or ``JAX_ENABLE_X64`` from the environment).
    """
    import jax
    from jaxaot.config import jax_options
    from jaxaot.errors import ConfigError

    known = jax.config.values
    wanted = dict(values)
    for name in wanted:
        if name in MANAGED_OPTIONS:
            raise ConfigError(
                f"jax.config.{name}: set by jaxaot from {MANAGED_OPTIONS[name]}; expected it there"
            )
        if name not in known:
            close = sorted(k for k in known if k.startswith(name[:10]))[:5]
            raise ConfigError(
                f"jax.config.{name}: not a JAX config option in jax {jax.__version__}"
                + (f" (similar: {', '.join(close)})" if close else "")
            )
        jax_options.check_option(name, wanted[name])  # JAX's type for it (one line)
    # A null boolean leaves the option as the process has it (bool(None) would turn it off).
    wanted = {k: v for k, v in wanted.items() if v is not None or not jax_options.is_boolean(k)}
    x64 = wanted.get("jax_enable_x64")
    if x64 is None and needs_x64:
        wanted["jax_enable_x64"] = True
    elif x64 is not None and not x64 and needs_x64:
        raise ConfigError(
            "jax.config.jax_enable_x64=false, but the program has 64-bit array arguments; "
            "expected jax_enable_x64=true (or null), or 32-bit argument types"
        )
    previous: dict[str, Any] = {}
    try:
        for name, value in wanted.items():
            before = known[name]
            if before == value:
                continue
            try:
                jax.config.update(name, value)
            except Exception as exc:
                raise ConfigError(
                    f"jax.config.{name}: JAX refused {value!r} ({' '.join(str(exc).split())[:200]})"
                ) from None
            previous[name] = before
    except ConfigError:
        restore_config(previous)
        raise
    if previous:
        log.debug("jax.config for this run: %s", {k: wanted[k] for k in previous})
    return previous


def restore_config(previous: Mapping[str, Any]) -> None:
    """Put back the JAX options a run changed (the values :func:`configure` returned)."""
    import jax

    for name, value in previous.items():
        jax.config.update(name, value)


def _jex_backend() -> Any:
    """``jax.extend.backend``, imported only after the HLO module transformation registry is
    watched (importing ``jax.extend`` imports the registration API)."""
    xla_passes.watch()
    from jax.extend import backend

    return backend


def _configure(backend: str, num_devices: int | None) -> None:
    import jax

    jex_backend = _jex_backend()
    compat_jax.check_supported()
    _note_flags()
    _only_needed_platforms(backend)
    from jaxaot.targets.cuda import quiet_plugin_discovery

    quiet_plugin_discovery()  # the CUDA plugin on a host without a GPU (jaxaot[cuda-aot])

    if backend != "cpu" or num_devices is None:
        return
    current = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined]
    if current == num_devices:
        return
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
        # Already initialized with another count (an earlier run in this process).
        jex_backend.clear_backends()
        memo.clear()  # executables of the old client, and lowerings JAX no longer caches
        jax.config.update("jax_num_cpu_devices", num_devices)
    log.debug("using %d virtual CPU devices", num_devices)


def _only_needed_platforms(backend: str) -> None:
    """Start only the backend the run compiles for (and the host CPU), unless the user chose
    platforms (``JAX_PLATFORMS``). JAX otherwise initializes every installed plugin: with the
    ``cuda-aot`` extra on a machine without a GPU, the CUDA plugin prints a traceback at every
    start ("Unable to load CUDA"). Deviceless topology compiles do not need the plugin's
    backend, only its compiler."""
    import jax

    jex_backend = _jex_backend()

    global _platforms_restricted, _started
    if os.environ.get("JAX_PLATFORMS"):
        return
    current = jax.config.jax_platforms  # type: ignore[attr-defined]
    if backend == "cpu":
        if not current:
            jax.config.update("jax_platforms", "cpu")
            _platforms_restricted = True
        return
    if _platforms_restricted and current == "cpu":
        # An earlier CPU run in this process restricted JAX to the CPU; this run needs its own
        # backend (on an accelerator host JAX finds it; an absent one is devices()'s error).
        jax.config.update("jax_platforms", None)
        _platforms_restricted, _started = False, False
        jex_backend.clear_backends()
        memo.clear()


# Whether jaxaot (not the user) set ``jax_platforms`` to "cpu" in this process.
_platforms_restricted = False


# What installed-but-unused PJRT plugins print from C++ on a machine without their hardware,
# when jaxlib imports its GPU modules and when JAX discovers plugins (the CUDA plugin of the
# cuda-aot extra: two absl lines, several times per process).
_PLUGIN_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")
_started = False


class _Caught:
    """What :func:`_without_plugin_noise` caught; ``drop_all`` discards all of it."""

    drop_all = False


@contextlib.contextmanager
def _without_plugin_noise() -> Iterator[_Caught]:
    """Catch what C++ writes to file descriptor 2 meanwhile, drop the plugins' start-up lines
    and pass everything else on (``JAXAOT_DEBUG=1`` passes all of it)."""
    from jaxaot.util.console import capture_fd2

    caught = _Caught()
    if os.environ.get("JAXAOT_DEBUG", "") not in ("", "0"):
        yield caught
        return
    fd2 = None
    try:
        with capture_fd2() as fd2:
            yield caught
    finally:
        lines = fd2.text.splitlines(keepends=True) if fd2 is not None else []
        kept = [ln for ln in lines if not any(n in ln for n in _PLUGIN_NOISE)]
        if kept and not caught.drop_all:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


class _DropPluginErrors(logging.Filter):
    """JAX's "Jax plugin configuration error" records about plugins of platforms this run does
    not use (the CUDA plugin's "Unable to load CUDA" on a machine without a GPU)."""

    def __init__(self, needed: str) -> None:
        super().__init__()
        self.needed = needed

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("plugin configuration error" in text and self.needed not in text)


def start_backends(backend: str = "cpu") -> None:
    """Initialize JAX's backends once per process, without the start-up noise of plugins the
    run does not use (kept for the backend it compiles for)."""
    global _started
    if _started:
        return
    needed = {"cuda": "cuda", "rocm": "rocm"}.get(platform_of(backend), platform_of(backend))
    quiet = _DropPluginErrors(needed)
    jax_log = logging.getLogger("jax._src.xla_bridge")
    jax_log.addFilter(quiet)
    try:
        with _without_plugin_noise() as caught:
            import jax

            present = {d.platform for d in jax.devices()}
            # The backend this run needs is absent: devices() says so in one line, and what
            # its plugin printed while failing to start (libtpu's host-bound and worker-name
            # warnings, on a machine without TPUs) is no help.
            caught.drop_all = platform_of(backend) != "cpu" and not present & {
                platform_of(backend),
                backend,
                "gpu" if platform_of(backend) == "cuda" else "",
            }
    finally:
        jax_log.removeFilter(quiet)
    _started = True


def devices(backend: str) -> list[Any]:
    """The devices of ``backend``, or a BackendError that says how to lower for it instead."""
    import contextlib

    import jax
    from jaxaot.targets.tpu import quiet_libtpu

    # With libtpu installed (jaxaot[tpu]) a host without TPUs gets its start-up noise on
    # stderr when the tpu backend is tried.
    quiet = quiet_libtpu() if backend == "tpu" else contextlib.nullcontext()
    try:
        with quiet:
            return list(jax.devices(backend))
    except RuntimeError as exc:
        present = sorted({d.platform for d in jax.devices()})
        raise BackendError(
            f"compile.backend={backend!r}: no {backend} backend on this machine (present: "
            f"{', '.join(present)}); to prepare a program for it, lower only: "
            f"lower.platforms=[{platform_of(backend)}] stop_after=lower, then resume on the "
            f"target machine with start_at=compile ({str(exc).splitlines()[0]})"
        ) from None


def target_info(topology: str, num_slices: int = 1) -> dict[str, Any]:
    """:func:`backend_info` for ``compile.topology``: libtpu's compile-only devices of that
    topology, with the topology name, slice count and libtpu version."""
    import jax
    from jaxaot.targets.tpu import resolve, topology_info

    info = topology_info(resolve(topology, num_slices))
    return info | {"jax": jax.__version__, "jaxlib": _jaxlib_version()}


def run_backend(comp: Any) -> dict[str, Any]:
    """What the run compiles for (``compile`` options): a target topology's compile-only
    devices (:func:`target_info`) or the backend that is here (:func:`backend_info`)."""
    return (
        target_info(comp.topology, comp.num_slices) if comp.topology else backend_info(comp.backend)
    )


def backend_info(backend: str) -> dict[str, Any]:
    """Platform, version, device kind and count: what a compiled artifact depends on."""
    import jax

    jex_backend = _jex_backend()

    devs = devices(backend)
    client = jex_backend.get_backend(backend)
    return {
        "platform": client.platform,
        "platform_version": client.platform_version,
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "topology": _topology(devs),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
    }


def _topology(devs: list[Any]) -> list[dict[str, Any]] | None:
    """Where each device sits (TPU coordinates, cores, slices), where the backend says; None
    for devices without such attributes (CPU)."""
    fields = ("coords", "core_on_chip", "slice_index", "process_index")
    if not any(hasattr(d, "coords") for d in devs):
        return None
    return [{f: _json_value(getattr(d, f, None)) for f in fields} for d in devs]


def _jaxlib_version() -> str:
    import jaxlib

    return str(getattr(jaxlib, "__version__", "unknown"))


def versions() -> dict[str, str]:
    import platform

    import hydra
    import jax
    import numpy
    import omegaconf

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "numpy": numpy.__version__,
        "hydra": hydra.__version__,
        "omegaconf": omegaconf.__version__,
    }


__all__ = [
    "CONFIG_NOT_IN_KEY",
    "FLAG_ENV_VARS",
    "OUTPUT_ONLY_XLA_FLAGS",
    "backend_info",
    "configure",
    "debug_options_sha256",
    "devices",
    "environment",
    "flags_in_effect",
    "host_cpu",
    "jax_config",
    "key_environment",
    "keyed_env",
    "platform_of",
    "restore_config",
    "run_config",
    "start_backends",
    "target_info",
    "versions",
]
