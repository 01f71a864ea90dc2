"""Accelerators jaxaot can compile for without having them: one table, and names resolved to it.

``compile.topology`` takes either the topology names libtpu accepts (``v5e:4x4``, ``v4:2x2x1``,
``v5p:2x2x2``, ``v6e:16x16``) or the accelerator names users book (``v5e-256``, ``v5p-128``,
``v6e-64``, ``v4-32``). Both resolve to a :class:`Target`: a generation from :data:`GENERATIONS`,
a libtpu topology name and the number of slices. Resolving names imports no JAX;
:func:`topology_devices` (libtpu's compile-only devices) does, when it is called.

The figures are the public per-chip numbers from Google Cloud's TPU documentation, written
from the published pages (named per entry; this project's machines cannot browse, so they were
not re-checked against the live pages when this table was written). "usable HBM" is different:
it is what XLA itself allows a program per device, read from libtpu's own rejection message
(``... exceeds available HBM (15.75G)``) with ``libtpu==0.0.42.1`` on this project's CPU
machine; the fit verdict compares against it.

Accelerator names count TensorCores for v4 and v5p (2 per chip: ``v4-32`` is 16 chips, a
``2x2x4`` topology) and chips for v5e and v6e (1 TensorCore per chip: ``v5e-256`` is 256
chips, ``16x16``); see "TPU versions" / "v4 and v5p accelerator types" in the Cloud TPU docs.
v4 and v5p compile in megacore mode (the two TensorCores of a chip are one JAX device), as on
the real hardware, so every per-device figure below is a per-chip figure.

Entries are per platform: a later issue adds NVIDIA GPUs (``platform="cuda"``, ``h100``,
``b200``, ...) as more :class:`Generation` rows with their own name parser.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from jaxaot.errors import BackendError, ConfigError
from jaxaot.util.console import quiet_libtpu

log = logging.getLogger("jaxaot")

GiB = 1024**3
_T = 1e12
_GB_S = 1e9
_GB = 10**9  # the host-memory figures' "GB", taken as 10^9 bytes (the smaller reading)


@dataclass(frozen=True)
class Generation:
    """One accelerator generation: what a fit verdict and a roofline estimate need."""

    name: str  # the name users and libtpu write: "v5e"
    platform: str  # JAX lowering platform: "tpu" (later "cuda")
    device_kind: str  # jax Device.device_kind of a compile-only device, e.g. "TPU v5 lite"
    cores_per_chip: int  # TensorCores per chip
    name_counts: str  # what N in "<name>-N" counts: "cores" or "chips"
    dims: int  # topology dimensions: 2 (v5e, v6e: 2D torus) or 3 (v4, v5p: 3D torus)
    chips_per_host: int  # chips per host VM in multi-host slices
    chip_config: str  # libtpu's chip_config_name: "megacore" (1 device per chip) or "default"
    hbm_bytes: int  # HBM per chip, published
    hbm_usable_bytes: int  # per device, XLA's limit (libtpu 0.0.42.1's message, see above)
    peak_bf16_flops: float  # per chip, FLOP/s
    peak_int8_ops: float  # per chip, OP/s
    hbm_bandwidth: float  # per chip, bytes/s
    source: str  # the public page the published figures are from
    # NVIDIA GPUs (platform "cuda", compiled deviceless): XLA's target config file, peak dense FP8.
    target_config: str = ""  # pipeline/targets/gpu_targets/<file>
    peak_fp8_flops: float | None = None
    # Host RAM of one host (TPU VM, GPU server), published: host-memory buffers (pinned_host
    # arguments, offloaded activations) are checked against it over chips_per_host devices.
    host_memory_bytes: int = 0

    @property
    def hbm_usable_gib(self) -> float:
        return self.hbm_usable_bytes / GiB


# Sources (Google Cloud TPU documentation, cloud.google.com/tpu/docs/...):
#   v4:  "TPU v4" page (system architecture): 275 TFLOP/s bf16 and int8, 32 GiB HBM2,
#        1200 GB/s, 2 TensorCores per chip, 4 chips per host; v4-N counts TensorCores.
#   v5e: "TPU v5e" page: 197 TFLOP/s bf16, 394 TOP/s int8, 16 GB HBM2, 819 GB/s, 1 TensorCore
#        per chip; multi-host slices have 4 chips per host (libtpu's default host bounds 2x2x1);
#        v5litepod-N / v5e-N counts chips.
#   v5p: "TPU v5p" page: 459 TFLOP/s bf16, 918 TOP/s int8, 95 GB HBM2e, 2765 GB/s, 2 TensorCores
#        per chip, 4 chips per host; v5p-N counts TensorCores.
#   v6e: "TPU v6e" (Trillium) page: 918 TFLOP/s bf16, 1836 TOP/s int8, 32 GB HBM, 1640 GB/s,
#        1 TensorCore per chip, 4 chips per host in multi-host slices; v6e-N counts chips.
# Host memory per host: the 4-chip TPU VM machine types of each page's "system architecture" /
# "VM types" tables: v4 ct4p-hightpu-4t 407 GB, v5e ct5lp-hightpu-4t 192 GB, v5p
# ct5p-hightpu-4t 448 GB, v6e ct6e-standard-4t 720 GB (the 1- and 8-chip v5e/v6e machine types
# have the same memory per chip).
GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation(
            name="v4",
            device_kind="TPU v4",
            cores_per_chip=2,
            name_counts="cores",
            dims=3,
            chip_config="megacore",
            hbm_bytes=32 * GiB,
            hbm_usable_bytes=int(30.75 * GiB),
            peak_bf16_flops=275 * _T,
            peak_int8_ops=275 * _T,
            hbm_bandwidth=1200 * _GB_S,
            source="cloud.google.com/tpu/docs: TPU v4",
            platform="tpu",
            chips_per_host=4,
            host_memory_bytes=407 * _GB,
        ),
        Generation(
            name="v5e",
            device_kind="TPU v5 lite",
            cores_per_chip=1,
            name_counts="chips",
            dims=2,
            chip_config="default",
            hbm_bytes=16 * GiB,
            hbm_usable_bytes=int(15.75 * GiB),
            peak_bf16_flops=197 * _T,
            peak_int8_ops=394 * _T,
            hbm_bandwidth=819 * _GB_S,
            source="cloud.google.com/tpu/docs: TPU v5e",
            platform="tpu",
            chips_per_host=4,
            host_memory_bytes=192 * _GB,
        ),
        # The docs' "95 GB" is rounded: XLA allows 95.74 GiB per device.
        Generation(
            name="v5p",
            device_kind="TPU v5",
            cores_per_chip=2,
            name_counts="cores",
            dims=3,
            chip_config="megacore",
            hbm_bytes=95 * GiB,
            hbm_usable_bytes=int(95.74 * GiB),
            peak_bf16_flops=459 * _T,
            peak_int8_ops=918 * _T,
            hbm_bandwidth=2765 * _GB_S,
            source="cloud.google.com/tpu/docs: TPU v5p",
            platform="tpu",
            chips_per_host=4,
            host_memory_bytes=448 * _GB,
        ),
        Generation(
            name="v6e",
            device_kind="TPU v6 lite",
            cores_per_chip=1,
            name_counts="chips",
            dims=2,
            chip_config="default",
            hbm_bytes=32 * GiB,
            hbm_usable_bytes=int(31.25 * GiB),
            peak_bf16_flops=918 * _T,
            peak_int8_ops=1836 * _T,
            hbm_bandwidth=1640 * _GB_S,
            source="cloud.google.com/tpu/docs: TPU v6e",
            platform="tpu",
            chips_per_host=4,
            host_memory_bytes=720 * _GB,
        ),
    )
}
# NVIDIA GPUs (platform "cuda"): compiled deviceless through the CUDA plugin
# (pipeline/targets/cuda.py). Published per-GPU figures, dense (no sparsity), from NVIDIA's
# datasheets, written from the published documents (not re-checked against live pages: this
# project's machines cannot browse): "NVIDIA A100 Tensor Core GPU" datasheet (SXM 80GB:
# 312 TFLOP/s bf16, 624 TOP/s int8, no FP8, 2039 GB/s); "NVIDIA H100 Tensor Core GPU" datasheet
# (H100 SXM: 989 TFLOP/s bf16, 1979 TFLOP/s FP8, 1979 TOP/s int8, 3.35 TB/s; the datasheet's
# headline numbers are with sparsity, twice these); "NVIDIA H200 Tensor Core GPU" datasheet
# (H200 SXM: 141 GB HBM3e, 4.8 TB/s, compute as H100 SXM); "NVIDIA DGX B200" / "HGX B200"
# datasheets (per GPU: 180 GB HBM3e, 8 TB/s, 2.25 PFLOP/s bf16, 4.5 PFLOP/s FP8 and int8 dense).
# hbm_bytes is the memory XLA's target config gives (device_memory_size, what the driver reports);
# hbm_usable_bytes is 75% of it: what JAX's GPU client takes by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION=0.75), so the fit verdict is JAX's default, not the card's:
# the other 25% is the GPUs' default compile.hbm_reserve (stages/fit_verdict.py).
# Host memory: the DGX systems' datasheets (DGX A100 640GB, DGX H100, DGX H200, DGX B200: 2 TB
# of system memory for 8 GPUs; other HGX servers vary: set compile.host_memory_bytes).
_GPU_HOST = 8  # GPUs per host in "h100x8" (HGX/DGX boards)
GENERATIONS.update(
    {
        g.name: g
        for g in (
            Generation(
                name="a100",
                platform="cuda",
                device_kind="NVIDIA A100-SXM4-80GB",
                cores_per_chip=1,
                name_counts="chips",
                dims=3,
                chips_per_host=_GPU_HOST,
                chip_config="",
                hbm_bytes=85100068864,
                hbm_usable_bytes=int(85100068864 * 0.75),
                peak_bf16_flops=312 * _T,
                peak_int8_ops=624 * _T,
                hbm_bandwidth=2039 * _GB_S,
                source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB)",
                target_config="a100.txtpb",
                peak_fp8_flops=None,
                host_memory_bytes=2000 * _GB,
            ),
            Generation(
                name="h100",
                platform="cuda",
                device_kind="NVIDIA H100 80GB HBM3",
                cores_per_chip=1,
                name_counts="chips",
                dims=3,
                chips_per_host=_GPU_HOST,
                chip_config="",
                hbm_bytes=84942979072,
                hbm_usable_bytes=int(84942979072 * 0.75),
                peak_bf16_flops=989 * _T,
                peak_int8_ops=1979 * _T,
                hbm_bandwidth=3350 * _GB_S,
                source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
                target_config="h100.txtpb",
                peak_fp8_flops=1979 * _T,
                host_memory_bytes=2000 * _GB,
            ),
            Generation(
                name="h200",
                platform="cuda",
                device_kind="NVIDIA H200 141GB HBM3e",
                cores_per_chip=1,
                name_counts="chips",
                dims=3,
                chips_per_host=_GPU_HOST,
                chip_config="",
                hbm_bytes=151397597184,
                hbm_usable_bytes=int(151397597184 * 0.75),
                peak_bf16_flops=989 * _T,
                peak_int8_ops=1979 * _T,
                hbm_bandwidth=4800 * _GB_S,
                source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
                target_config="h200.txtpb",
                peak_fp8_flops=1979 * _T,
                host_memory_bytes=2000 * _GB,
            ),
            Generation(
                name="b200",
                platform="cuda",
                device_kind="NVIDIA B200",
                cores_per_chip=1,
                name_counts="chips",
                dims=3,
                chips_per_host=_GPU_HOST,
                chip_config="",
                hbm_bytes=191514411008,
                hbm_usable_bytes=int(191514411008 * 0.75),
                peak_bf16_flops=2250 * _T,
                peak_int8_ops=4500 * _T,
                hbm_bandwidth=8000 * _GB_S,
                source="NVIDIA DGX B200 / HGX B200 datasheets (per GPU)",
                target_config="b200.txtpb",
                peak_fp8_flops=4500 * _T,
                host_memory_bytes=2000 * _GB,
            ),
        )
    }
)
# Other spellings of a generation in accelerator names ("v5litepod-16" is v5e-16).
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e"}

_LIBTPU_NAME = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+)*)$")
_ACCELERATOR_NAME = re.compile(r"^([a-z0-9]+)-(\d+)$")


@dataclass(frozen=True)
class Target:
    """A described topology to compile for: generation, libtpu name, slices."""

    generation: Generation
    topology: str  # what libtpu is given: "v5e:4x4"
    shape: tuple[int, ...]  # chips per dimension
    num_slices: int = 1
    requested: str = ""  # what the user wrote (compile.topology)

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices(self) -> int:
        """JAX devices over all slices (one per chip: megacore on v4/v5p)."""
        return self.chips * self.num_slices

    def describe(self) -> str:
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        alias = f" ({self.requested})" if self.requested and self.requested != self.topology else ""
        return f"{self.topology}{alias}{slices}: {self.devices} devices"

    def to_json(self) -> dict[str, object]:
        return {
            "generation": self.generation.name,
            "topology": self.topology,
            "shape": list(self.shape),
            "num_slices": self.num_slices,
            "devices": self.devices,
            "requested": self.requested,
        }


def _known() -> str:
    return ", ".join(sorted(g for g in GENERATIONS if GENERATIONS[g].platform == "tpu"))


_GPU_NAME = re.compile(r"^([a-z]\d+)(?:x(\d+))?$")  # h100, h100x8
_GPU_TOPOLOGY = re.compile(r"^([a-z]\d+):(\d+)x(\d+)x(\d+)$")  # h100:2x1x8


def _resolve_gpu(text: str, value: str, num_slices: int, key: str) -> Target | None:
    """A deviceless GPU target: ``h100`` (1 GPU), ``h100x8`` (one host of 8), ``h100:2x1x8``
    (slices x hosts x GPUs per host); None when ``text`` names no GPU generation."""
    m = _GPU_TOPOLOGY.match(text) or _GPU_NAME.match(text)
    gen = GENERATIONS.get(m[1]) if m else None
    if m is None or gen is None or gen.platform != "cuda":
        return None
    topo = m.re is _GPU_TOPOLOGY
    shape = (int(m[2]), int(m[3]), int(m[4])) if topo else (1, 1, int(m[2] or 1))
    if min(shape) < 1:
        raise ConfigError(f"{key}: {value!r}: expected counts >= 1, e.g. {gen.name}:2x1x8")
    if num_slices != 1:
        raise ConfigError(
            f"compile.num_slices={num_slices}: GPU targets count slices in compile.topology; "
            f"expected e.g. compile.topology={gen.name}:{num_slices}x1x{shape[2]} and "
            "compile.num_slices=1"
        )
    return Target(gen, f"{gen.name}:{'x'.join(map(str, shape))}", shape, 1, value)


def default_shape(chips: int, dims: int) -> tuple[int, ...]:
    """Google Cloud's default topology for a chip count: near-square (2D) or near-cube (3D),
    ascending (``v5e-32`` is 4x8, ``v4-32``'s 16 chips are 2x2x4), with 2x2x1 for 4 chips."""
    shape = [1] * dims
    for _ in range(int(math.log2(chips))):
        shape[shape.index(min(shape))] *= 2
    return tuple(shape) if dims == 3 and chips == 4 else tuple(sorted(shape))


def _generation(name: str, value: str, key: str) -> Generation:
    gen = GENERATIONS.get(_ALIASES.get(name, name))
    if gen is not None and gen.platform == "cuda":
        raise ConfigError(
            f"{key}: {value!r}: expected an NVIDIA GPU target as {name}, {name}x8 (GPUs on one "
            f"host) or {name}:2x1x8 (slices x hosts x GPUs per host)"
        )
    if gen is None:
        raise ConfigError(
            f"{key}: unknown TPU generation {name!r} in {value!r}; expected one of {_known()} "
            "(e.g. v5e:4x4 or v5e-16)"
        )
    return gen


def resolve(value: str, num_slices: int = 1, key: str = "compile.topology") -> Target:
    """A :class:`Target` from a libtpu topology name or an accelerator name; ConfigError
    naming ``key`` for anything else."""
    text = value.strip().lower()
    if num_slices < 1:
        raise ConfigError(f"compile.num_slices: expected >= 1, found {num_slices}")
    gpu = _resolve_gpu(text, value, num_slices, key)
    if gpu is not None:
        return gpu
    m = _LIBTPU_NAME.match(text)
    if m:
        gen = _generation(m[1], value, key)
        shape = tuple(int(n) for n in m[2].split("x"))
        if len(shape) != gen.dims or min(shape) < 1:
            example = "x".join(["2"] * gen.dims)
            raise ConfigError(
                f"{key}: {gen.name} topologies have {gen.dims} dimensions, found {value!r}; "
                f"expected e.g. {gen.name}:{example}"
            )
        return Target(gen, f"{gen.name}:{m[2]}", shape, num_slices, value)
    m = _ACCELERATOR_NAME.match(text)
    if m:
        gen = _generation(m[1], value, key)
        n = int(m[2])
        chips, rem = divmod(n, gen.cores_per_chip) if gen.name_counts == "cores" else (n, 0)
        if rem or chips < 4 or chips & (chips - 1):
            counts = "TensorCores (2 per chip)" if gen.name_counts == "cores" else "chips"
            raise ConfigError(
                f"{key}: {value!r}: {gen.name}-N counts {counts}; expected N for a power-of-two "
                f"number of chips >= 4 (e.g. {gen.name}-{4 * gen.cores_per_chip}), or a libtpu "
                f"topology name such as {gen.name}:{'x'.join(['2'] * gen.dims)}"
            )
        shape = default_shape(chips, gen.dims)
        return Target(gen, f"{gen.name}:{'x'.join(map(str, shape))}", shape, num_slices, value)
    raise ConfigError(
        f"{key}: expected a TPU topology such as v5e:4x4 or v4:2x2x1, or an accelerator name "
        f"such as v5e-256 or v4-32 (generations: {_known()}), or an NVIDIA GPU target such as "
        f"h100, h100x8 or h100:2x1x8 (GPUs: {_known_gpus()}), found {value!r}"
    )


def _known_gpus() -> str:
    return ", ".join(sorted(g for g in GENERATIONS if GENERATIONS[g].platform == "cuda"))


INSTALL_HINT = "pip install 'jaxaot[tpu]'"


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None without one (no import: libtpu loads lazily)."""
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def topology_devices(target: Target) -> list[Any]:
    """libtpu's compile-only devices for ``target``: what meshes and compiles are laid over."""
    if target.generation.platform == "cuda":  # the CUDA plugin's compile-only devices
        from jaxaot.targets.cuda import cuda_devices

        return list(cuda_devices(target))
    return list(_topology(target.topology, target.num_slices, target.generation.chip_config))


@functools.cache
def _topology(name: str, num_slices: int, chip_config: str) -> tuple[Any, ...]:
    if libtpu_version() is None:
        raise BackendError(
            f"compile.topology={name}: compiling for a TPU topology needs libtpu, which is not "
            f"installed; install it with {INSTALL_HINT}"
        )
    from jax.experimental import topologies

    kwargs: dict[str, Any] = {"chip_config_name": chip_config}
    if num_slices > 1:
        kwargs["num_slices"] = num_slices
    try:
        with quiet_libtpu():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs)
    except Exception as exc:
        text = " ".join(str(exc).split())
        raise BackendError(f"compile.topology={name}: libtpu refused it: {text[:300]}") from None
    return tuple(desc.devices)


def topology_info(target: Target) -> dict[str, Any]:
    """What a compile for ``target`` depends on, like ``jaxenv.backend_info`` for a backend that
    is present: platform + version, device kind + count, and the topology itself."""
    if target.generation.platform == "cuda":  # target config, plugin, ptxas
        from jaxaot.targets.cuda import info

        return info(target)
    devs = topology_devices(target)
    client = devs[0].client
    return {
        "platform": "tpu",
        "platform_version": str(client.platform_version),
        "device_kind": devs[0].device_kind,
        "device_count": len(devs),
        "topology": target.topology,
        "num_slices": target.num_slices,
        "generation": target.generation.name,
        "libtpu": libtpu_version(),
    }


__all__ = [
    "GENERATIONS",
    "INSTALL_HINT",
    "Generation",
    "GiB",
    "Target",
    "default_shape",
    "libtpu_version",
    "quiet_libtpu",
    "resolve",
    "topology_devices",
    "topology_info",
]
