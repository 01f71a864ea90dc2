"""What a client process is, that a child forked by the server must be too.

A served run is a child of the server, not of the client, so whatever the child would have
taken from the client's process (rather than from the request's argv, cwd and environment) is
sent in the request and either given to the child or compared:

- given to the child: the umask, the CPU affinity, the signals the client ignores (``nohup``),
  stdio's error handler (strict, or surrogateescape in a C locale), descriptors above 2;
- compared (a run with other values is declined and runs in-process): the interpreter and its
  options, resource limits, priority, user and groups, cgroup and namespaces, the origin of
  every pre-imported package (:data:`PREIMPORT`), and every environment variable read at
  import time (:data:`IMPORT_ENV`), less those read only when a backend starts
  (:data:`BACKEND_START_ENV`): the server starts none, so the child reads the client's.

The standard library only: a client computes these facts before every served run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

# Packages imported in the server, whose origin a client must agree with.
PREIMPORT = ("jax", "jaxlib", "numpy", "hydra", "omegaconf", "jaxaot")
# Variables read at import time (JAX's config defaults, XLA/TF logging, BLAS threads, Python's
# own): a run whose values differ cannot use the server's imports.
IMPORT_ENV = re.compile(
    r"^(JAX_|XLA_|TF_|TPU_|LIBTPU|PJRT_|CUDA_|NVIDIA_|PYTHON|LD_|MALLOC|OMP_|OPENBLAS_|MKL_|GOTO"
    r"|LANG$|LC_)"  # the locale: stdio's encoding is decided at start-up
)
# Variables of IMPORT_ENV's families that JAX reads only as it starts its backends, which a
# served run does in the child, after it took on the client's environment: a client may set
# them otherwise than the server. JAX's CUDA plugin reads JAX_SKIP_CUDA_CONSTRAINTS_CHECK in
# its initialize(), at plugin discovery (jaxaot.targets.cuda.prepare sets it in a process
# that compiles for a GPU).
BACKEND_START_ENV = frozenset({"JAX_SKIP_CUDA_CONSTRAINTS_CHECK"})
# Signals a client forwards to its run; those it ignores, its run ignores.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_LIMITS = (
    "RLIMIT_AS",
    "RLIMIT_DATA",
    "RLIMIT_NOFILE",
    "RLIMIT_STACK",
    "RLIMIT_CORE",
    "RLIMIT_CPU",
    "RLIMIT_FSIZE",
    "RLIMIT_NPROC",
    "RLIMIT_MEMLOCK",
)
# The process facts compared, and the reason a request is declined when one differs.
COMPARED = {
    "python": "interpreter or its options",
    "limits": "resource limits",
    "nice": "priority",
    "identity": "user or groups",
    "place": "cgroup or namespaces",
}


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that JAX, XLA or Python read at import."""
    return {k: v for k, v in env.items() if IMPORT_ENV.match(k) and k not in BACKEND_START_ENV}


def origins() -> dict[str, str | None]:
    """Where this process imports (or imported) each pre-imported package from."""
    import importlib.util

    out: dict[str, str | None] = {}
    for name in PREIMPORT:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        out[name] = spec.origin if spec is not None else None
    return out


def process() -> dict[str, Any]:
    """What a process has that a forked child does not take from its request's environment:
    the interpreter and its options, resource limits and priority (compared: a run with other
    values is declined), umask and CPU affinity (given to the child)."""
    import resource

    umask = os.umask(0)
    os.umask(umask)
    return {
        "python": [sys.executable, sys.version, repr(sys.flags), sys.warnoptions, sys._xoptions],
        "limits": {n: list(resource.getrlimit(getattr(resource, n))) for n in _LIMITS},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "identity": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
        "place": _place(),  # cgroup (a batch job's limits) and namespaces (a container's view)
        "umask": umask,
        "affinity": sorted(os.sched_getaffinity(0)),
        "ignored": [int(sig) for sig in FORWARDED if signal.getsignal(sig) == signal.SIG_IGN],
        "stdio": [getattr(f, "errors", None) for f in (sys.stdin, sys.stdout, sys.stderr)],
        "inherited_fds": inherited_fds(),
    }


def _place() -> list[Any]:
    out: list[Any] = []
    with contextlib.suppress(OSError):
        out.append(Path("/proc/self/cgroup").read_text())
    for ns in ("mnt", "pid", "user", "net", "ipc", "uts"):
        with contextlib.suppress(OSError):
            out.append(os.stat(f"/proc/self/ns/{ns}").st_ino)
    return out


def inherited_fds() -> list[int]:
    """Descriptors above 2 that a child process would inherit (``3<file``, ``/dev/fd/63``, a
    make jobserver): passed to the run at the same numbers."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return []
    out = []
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    out.append(fd)
    return out


def process_mismatch(theirs: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """The reason a client's :func:`process` facts cannot be served by a process with
    ``mine``, or None."""
    for what, reason in COMPARED.items():
        if theirs.get(what) != mine[what]:
            return reason
    return None


def env_mismatch(theirs: dict[str, str], mine: dict[str, str], added: dict[str, str]) -> str | None:
    """The reason a client's environment cannot use imports made under ``mine``, or None:
    a variable the imports set (``added``) that the client sets otherwise, or any import-time
    variable that differs. A variable the imports added (absent from ``mine``) that the client
    has with the very value they set is no difference: the client's own imports would find
    it set as the server's left it (a client started from a Python process that imported JAX
    has JAX's ``TF_CPP_MIN_LOG_LEVEL``)."""
    for key, value in added.items():
        if key in theirs and theirs[key] != value:
            return f"environment ({key})"
    same = {k for k, v in added.items() if k not in mine and theirs.get(k) == v}
    t = {k: v for k, v in import_env(theirs).items() if k not in same}
    m = import_env(mine)
    if t != m:
        keys = sorted(k for k in t.keys() | m.keys() if t.get(k) != m.get(k))
        return f"environment ({', '.join(keys)})"
    return None


__all__ = [
    "BACKEND_START_ENV",
    "COMPARED",
    "FORWARDED",
    "IMPORT_ENV",
    "PREIMPORT",
    "env_mismatch",
    "import_env",
    "inherited_fds",
    "origins",
    "process",
    "process_mismatch",
]
