"""What XLA and libtpu read besides the program and the flags' words, for the compile key: XLA's
own parse of ``XLA_FLAGS``, the environment variables a backend's compiler (or the libraries it
calls) reads, and the host CPU XLA:CPU compiles for."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
from collections.abc import Mapping

from jaxaot.compat import jax as compat_jax
from jaxaot.errors import Unkeyable
from jaxaot.stages.xla_flags import OUTPUT_ONLY_XLA_FLAGS
from jaxaot.util.host_cpu import host_cpu


def debug_options_sha256() -> str | None:
    """The sha256 of XLA's own parse of ``XLA_FLAGS`` in this process: the options a compile
    starts from (``CompileOptions()``, which jaxlib fills from the flags XLA read), output-only
    fields reset as JAX's cache key resets them. It holds what XLA applied, whatever the
    variable says now, and every flag form and repeat as XLA read it. None where this jaxlib
    does not expose them."""
    try:
        options = compat_jax.compile_options()
        debug = options.executable_build_options.debug_options
    except Exception:  # another jaxlib
        return None
    for flag in OUTPUT_ONLY_XLA_FLAGS:
        name = flag[2:]
        if not hasattr(debug, name):
            continue  # not exposed: when set, it changes the digest (a miss, never a wrong hit)
        with contextlib.suppress(Exception):
            value = getattr(debug, name)
            setattr(debug, name, 0 if isinstance(value, enum.Enum) else type(value)())
    return hashlib.sha256(options.SerializeAsString()).hexdigest()


# Environment variables a backend's compiler or the libraries it calls read, which change the
# executable or its numerics, by lowering platform: NVIDIA's TF32 override (cuBLAS, cuDNN) and
# the cuDNN knobs whose names the CUDA plugin holds (jax-cuda12-plugin 0.10.2); libtpu's
# megacore mode. For tpu every set XLA_* variable is keyed too (libtpu 0.0.42 holds dozens of
# XLA_TPU_*/XLA_MSA_* names that may be read as overrides; unset ones key nothing).
KEYED_ENV_VARS: Mapping[str, tuple[str, ...]] = {
    "cuda": (
        "NVIDIA_TF32_OVERRIDE",
        "TF_ENABLE_WINOGRAD_NONFUSED",
        "TF_FP16_CONV_USE_FP32_COMPUTE",
        "TF_FP16_RNN_USE_FP32_COMPUTE",
        "TF_USE_CUDNN_BATCHNORM_SPATIAL_PERSISTENT",
    ),
    "rocm": ("TF_USE_ROCM_NHWC", "TF_FP16_CONV_USE_FP32_COMPUTE"),
    "tpu": ("TPU_MEGACORE",),
}
_NOT_XLA_OPTIONS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_")  # keyed apart; the host allocator's


_ALL_KEYED = frozenset(n for names in KEYED_ENV_VARS.values() for n in names)


def _keyable(name: str) -> bool:
    return name in _ALL_KEYED or (name.startswith("XLA_") and not name.startswith(_NOT_XLA_OPTIONS))


def env_snapshot() -> dict[str, str]:
    """The set variables :func:`keyed_env` may key for any platform, as they are now: the GPU
    plugin, cuBLAS, cuDNN and libtpu read them once per process, as the backends start, like
    XLA_FLAGS."""
    return {n: v for n, v in sorted(os.environ.items()) if _keyable(n)}


def keyed_env(platform: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The set environment variables of :data:`KEYED_ENV_VARS` for ``platform``, in
    ``environ`` (default: the process's environment now)."""
    env = os.environ if environ is None else environ
    names = set(KEYED_ENV_VARS.get(platform, ()))
    if platform == "tpu":
        names |= {n for n in env if n.startswith("XLA_") and not n.startswith(_NOT_XLA_OPTIONS)}
    return {n: env[n] for n in sorted(names) if n in env}


def env_changes(snapshot: Mapping[str, str], platform: str) -> list[str]:
    """``NAME='now' (was 'then')`` for each variable keyed for ``platform`` that differs now
    from ``snapshot``."""
    then, now = keyed_env(platform, snapshot), keyed_env(platform)
    return [
        f"{n}={now.get(n)!r} (was {then.get(n)!r})"
        for n in sorted(set(then) | set(now))
        if then.get(n) != now.get(n)
    ]


def keyed_env_in_effect(platform: str, snapshot: Mapping[str, str]) -> dict[str, str]:
    """:func:`keyed_env` of the snapshot taken as the backends started;
    :class:`~jaxaot.errors.Unkeyable` when the environment says otherwise now
    (which value a library compiles with is then not known for certain)."""
    changed = env_changes(snapshot, platform)
    if changed:
        raise Unkeyable(
            f"compiled without the store: {', '.join(changed)} changed after the backends "
            "started, and their libraries read it once per process; start a new process to "
            "use the new value"
        )
    return keyed_env(platform, snapshot)


__all__ = [
    "KEYED_ENV_VARS",
    "debug_options_sha256",
    "env_changes",
    "env_snapshot",
    "host_cpu",
    "keyed_env",
    "keyed_env_in_effect",
]
