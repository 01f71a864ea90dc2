"""Deviceless CUDA targets: compile for NVIDIA GPUs on a host that has none.

``compile.topology=h100x8`` (or ``h100``, ``b200x8``, ``h100:2x1x8``: slices x hosts x GPUs per
host) resolves, through :mod:`jaxaot.targets.tpu`, to a GPU :class:`Generation`. This module
does the CUDA-specific part:

- the **target config**: XLA's ``GpuTargetConfigProto`` for the GPU (shipped as package data in
  ``pipeline/targets/gpu_targets/*.txtpb`` (``jaxaot.targets``), from XLA's ``xla/backends/gpu/target_config/specs``, with the
  fields newer than the installed XLA dropped). On a real GPU,
  ``jax._src.lib.xla_client.get_topology_for_devices(jax.devices()).target_config`` prints the
  exact one;
- the **plugin**: ``jax-cuda12-plugin`` + ``jax-cuda12-pjrt`` (``jaxaot[cuda-aot]``), whose
  compile-only devices come from ``jax.experimental.topologies.get_topology_desc(platform=
  "cuda", target_config=..., topology="SxHxG")``. Its CUDA runtime check fails on a host with no
  driver; ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (set by :func:`prepare`) skips it;
- **ptxas and libdevice** from the ``nvidia-cuda-nvcc-cu12`` pip package, passed to this
  compile alone as ``xla_gpu_cuda_data_dir`` (never through ``XLA_FLAGS``). XLA's own search
  also tries ``/usr/local/cuda`` and ``PATH``, where a ptxas of a newer CUDA major (13 on this
  project's machine) would be taken silently; the package's ptxas must be of the plugin's CUDA
  major, and its version is part of the store key.

There is no GPU to autotune on: GEMMs get XLA's default tiles, and the executable says so
(``autotuned: false``). Kernels that only a library absent here provides (cuDNN) fail with one
line naming the op and what to install.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
from importlib import metadata, resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import BackendError
from jaxaot.util.console import quiet_libtpu

if TYPE_CHECKING:
    from jaxaot.targets.tpu import Generation, Target

CUDA_MAJOR = 12  # the plugin's CUDA major version (jax-cuda12-*)
PLUGIN = "jax-cuda12-plugin"
PJRT = "jax-cuda12-pjrt"
NVCC = "nvidia-cuda-nvcc-cu12"
INSTALL_HINT = "pip install 'jaxaot[cuda-aot]'"
CUDNN_HINT = "pip install 'nvidia-cudnn-cu12>=9.8,<10'"
AUTOTUNE_NOTE = (
    "compiled without autotuning (no GPU here: default GEMM tiles, no cuDNN algorithm search); "
    "a compile on the GPU host may be faster"
)
# Measured on an H100 (bench/gpu_results): a 4096^3 bf16 matmul ran 9.05 ms with XLA's default
# Triton tiles vs 0.286 ms compiled on the GPU; through cuBLAS(Lt), which picks its kernel by
# heuristics at run time, the deviceless executable ran 0.295 ms.
CUBLAS_HINT = (
    "for GEMM-heavy programs, compile.compiler_options={xla_gpu_enable_triton_gemm: false} hands "
    "GEMMs to cuBLAS's run-time heuristics (on an H100 a 4096^3 bf16 matmul ran 31x slower on "
    "default Triton tiles than autotuned, and as fast as autotuned through cuBLAS)"
)


def autotune_note(options: dict[str, Any]) -> str:
    """The gap, said where the run is summarized; with the cuBLAS hint unless already taken."""
    if str(options.get("xla_gpu_enable_triton_gemm", "")).lower() == "false":
        return AUTOTUNE_NOTE
    return f"{AUTOTUNE_NOTE}; {CUBLAS_HINT}"


def prepare() -> None:
    """Let the CUDA plugin register on a host without a driver: its CUDA runtime check (which
    fails there) is skipped. Call before JAX starts its backends; harmless on a GPU host."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _plugin_without_driver() -> bool:
    """The CUDA plugin is installed and this host has no NVIDIA driver to run it on."""
    import ctypes
    import importlib.util

    try:
        if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
            return False
    except ImportError:
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


@functools.cache
def quiet_plugin_discovery() -> None:
    """Register JAX's plugins once, with the CUDA plugin's noise on a host without a GPU kept
    off the terminal; call before JAX starts its backends.

    With ``jaxaot[cuda-aot]`` installed on a host without an NVIDIA driver, JAX's plugin
    discovery prints absl lines ("Could not find cuda drivers on your machine") and logs the
    plugin's failed CUDA version check with two tracebacks, on every run. Without a driver that
    check can only fail, so it is skipped (:func:`prepare`: the plugin then registers, and its
    backend fails to start quietly, as any absent backend does); the absl lines go to the DEBUG
    log. On a host with a driver the check runs as JAX intends.
    """
    if not _plugin_without_driver():
        return
    prepare()
    with quiet_libtpu():
        compat_jax.discover_pjrt_plugins()


def target_config(gen: Generation) -> str:
    """The shipped ``GpuTargetConfigProto`` text for ``gen``."""
    return _target_config_file(gen.target_config)


def _target_config_file(name: str) -> str:
    return resources.files("jaxaot.targets").joinpath("gpu_targets", name).read_text()


def target_config_sha256(gen: Generation) -> str:
    return hashlib.sha256(target_config(gen).encode()).hexdigest()


def plugin_versions() -> dict[str, str]:
    """The installed plugin's and PJRT's versions; a BackendError naming the extra without."""
    out = {}
    for name in (PLUGIN, PJRT):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise BackendError(
                f"compile.topology: compiling for an NVIDIA GPU needs {name}, which is not "
                f"installed; install it with {INSTALL_HINT}"
            ) from None
    return out


@functools.cache
def cuda_data_dir() -> Path:
    """The ``nvidia-cuda-nvcc-cu12`` package's root: ``bin/ptxas`` and ``nvvm/libdevice``."""
    try:
        files = metadata.files(NVCC) or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).replace("\\", "/").endswith("cuda_nvcc/bin/ptxas"):
            root = Path(str(f.locate())).parent.parent
            if (root / "nvvm" / "libdevice").is_dir():
                return root
    raise BackendError(
        f"compile.topology: compiling for an NVIDIA GPU needs ptxas and libdevice of CUDA "
        f"{CUDA_MAJOR} ({NVCC}), which is not installed; install it with {INSTALL_HINT}"
    )


@functools.cache
def ptxas_version(data_dir: str) -> str:
    """``ptxas --version`` of ``data_dir/bin/ptxas`` ("12.9.86"); refused unless its major is
    the plugin's (a ptxas of another major makes cubins the plugin's runtime may not load)."""
    ptxas = Path(data_dir) / "bin" / "ptxas"
    try:
        out = subprocess.run(
            [str(ptxas), "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendError(f"compile.topology: {ptxas} --version failed: {exc}") from None
    m = re.search(r"V(\d+)\.(\d+)\.(\d+)", out)
    if m is None:
        raise BackendError(f"compile.topology: cannot read the version of {ptxas}: {out!r}")
    if int(m[1]) != CUDA_MAJOR:
        raise BackendError(
            f"compile.compiler_options.xla_gpu_cuda_data_dir: {ptxas} is CUDA {m[1]}, expected "
            f"CUDA {CUDA_MAJOR} (the plugin's); install {NVCC} ({INSTALL_HINT}) and drop that option"
        )
    return f"{m[1]}.{m[2]}.{m[3]}"


def compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus the nvcc package's directory as ``xla_gpu_cuda_data_dir`` (unless the
    user gave one), its ptxas version checked; for this compile only."""
    data_dir = options.get("xla_gpu_cuda_data_dir") or str(cuda_data_dir())
    ptxas_version(str(data_dir))
    return {**options, "xla_gpu_cuda_data_dir": str(data_dir)}


def topology_name(target: Target) -> str:
    """What the plugin is given: slices x hosts x GPUs per host, e.g. ``1x1x8``."""
    return "x".join(map(str, target.shape))


def cuda_devices(target: Target) -> tuple[Any, ...]:
    """The plugin's compile-only devices for ``target``."""
    return _devices(target.generation.name, target.generation.target_config, topology_name(target))


@functools.cache
def _devices(gen_name: str, config_file: str, topology: str) -> tuple[Any, ...]:
    plugin_versions()
    prepare()
    from jax.experimental import topologies

    text = _target_config_file(config_file)
    where = f"compile.topology={gen_name}:{topology}"
    with quiet_libtpu():  # the plugin's "Could not find cuda drivers" lines, on fd 2
        try:
            try:
                desc = topologies.get_topology_desc(
                    platform="cuda", target_config=text, topology=topology
                )
            except NotImplementedError:
                # JAX started its backends before prepare(): the plugin's check failed then and
                # it never registered. Register it now (the check is skipped this time).
                _register_plugin()
                desc = topologies.get_topology_desc(
                    platform="cuda", target_config=text, topology=topology
                )
        except BackendError:
            raise
        except Exception as exc:
            text_ = " ".join(str(exc).split())
            raise BackendError(f"{where}: the CUDA plugin refused it: {text_[:300]}") from None
    return tuple(desc.devices)


def _register_plugin() -> None:
    import importlib

    try:
        plugin = importlib.import_module("jax_plugins.xla_cuda12")
    except ImportError:
        raise BackendError(
            f"compile.topology: the CUDA plugin (jax_plugins.xla_cuda12) cannot be imported; "
            f"install it with {INSTALL_HINT}"
        ) from None
    plugin.initialize()


def info(target: Target) -> dict[str, Any]:
    """What a deviceless CUDA compile depends on: the store key's ``backend``."""
    devs = cuda_devices(target)
    data_dir = str(cuda_data_dir())
    return {
        "platform": "cuda",
        "platform_version": " ".join(str(devs[0].client.platform_version).split()),
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "topology": target.topology,
        "num_slices": target.shape[0],
        "generation": target.generation.name,
        "target_config_sha256": target_config_sha256(target.generation),
        **plugin_versions(),
        "ptxas": ptxas_version(data_dir),
        "autotuned": False,
    }


def gpu_present(target: Target) -> bool:
    """Whether this host has NVIDIA GPUs JAX can run on (the kind is checked at load)."""
    import jax

    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def refuse_resume(target: Target) -> None:
    """``start_at=execute`` of a deviceless CUDA compile: the host must have the GPUs (kind and
    count) the executable was compiled for; a one-line BackendError otherwise."""
    import jax

    gen, need = target.generation, target.devices
    what = f"{target.topology} ({need} x {gen.device_kind}, compile.topology={target.requested})"
    try:
        devs = list(jax.devices("cuda"))
    except RuntimeError:
        raise BackendError(
            f"start_at=execute: the executable was compiled deviceless for NVIDIA GPU target "
            f"{what}, and this host has no NVIDIA GPU; run this command on a host with those "
            "GPUs (and jaxaot[cuda-aot] installed), or start_at=compile to compile again here"
        ) from None
    kinds = sorted({d.device_kind for d in devs})
    if kinds != [gen.device_kind] or len(devs) < need:
        raise BackendError(
            f"start_at=execute: the executable was compiled for {what}, but this host has "
            f"{len(devs)} x {', '.join(kinds)}; expected {need} x {gen.device_kind}, or "
            "start_at=compile to compile for this host's GPUs"
        )


def explain_missing_library(exc: BaseException) -> str | None:
    """One line for an error that says a GPU library (cuDNN) is missing: the op that needs it
    (from the traceback) and what to install; None for any other error."""
    text = " ".join(str(exc).split())
    if not re.search(r"cu[Dd][Nn][Nn] (not found|is not detected)", text):
        return None
    op = _jax_entry_point(exc) or "a cuDNN kernel"
    return (
        f"{op} needs cuDNN, which this host lacks ({text[:80]}); a cuDNN kernel cannot be "
        f"compiled without it (install it with {CUDNN_HINT}; JAX also checks the GPU while "
        "tracing it, so compile it on the GPU host), or use the XLA implementation "
        "(e.g. jax.nn.dot_product_attention(..., implementation='xla')) for a deviceless compile"
    )


_PUBLIC = {"dot_product_attention": "jax.nn.dot_product_attention(implementation='cudnn')"}


def _jax_entry_point(exc: BaseException) -> str | None:
    """The first JAX function the user's code called on the way to ``exc``."""
    tb = exc.__traceback__
    while tb is not None:
        mod = str(tb.tb_frame.f_globals.get("__name__", ""))
        if mod.startswith("jax.") or mod == "jax":
            name = tb.tb_frame.f_code.co_name
            return _PUBLIC.get(name, f"{mod}.{name}")
        tb = tb.tb_next
    return None


__all__ = [
    "AUTOTUNE_NOTE",
    "CUBLAS_HINT",
    "CUDA_MAJOR",
    "INSTALL_HINT",
    "autotune_note",
    "compile_options",
    "cuda_data_dir",
    "cuda_devices",
    "explain_missing_library",
    "gpu_present",
    "info",
    "plugin_versions",
    "prepare",
    "ptxas_version",
    "quiet_plugin_discovery",
    "refuse_resume",
    "target_config",
    "target_config_sha256",
    "topology_name",
]
