"""What a client process is, that a child forked by the server must be too.

A served run is a child of the server, not of the client, so whatever the child would have
taken from the client's process (rather than from the request's argv, cwd and environment) is
sent in the request and either given to the child or compared:

- given to the child: the umask, the CPU affinity, the signals the client ignores (``nohup``),
  stdio's error handler (strict, or surrogateescape in a C locale), descriptors above 2;
- compared (a run with other values is declined and runs in-process): the interpreter and its
  options, resource limits, priority, user and groups, cgroup and namespaces, the origin of
  every pre-imported package (:data:`PREIMPORT`), ``sys.path`` (:func:`path_mismatch`: the
  client's may add entries that hold nothing the server imported), and every environment
  variable read at import time (:data:`IMPORT_ENV`), less those read only when a backend starts
  (:data:`BACKEND_START_ENV`: the server starts none, so the child reads the client's) and
  ``PYTHONPATH`` (what it does, the client's ``sys.path``, is compared).

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


# Names on a client's own sys.path entry that its child would not look up again, besides
# every module the server imported or looked for (:func:`looked_up_names`): Python's start-up
# hooks (imported as an interpreter starts) and the plugin namespaces Hydra and JAX scan.
PRESTART = frozenset({"sitecustomize", "usercustomize", "hydra_plugins", "jax_plugins"})
# What a folder holds that the server's process may have read without importing it by name:
# package metadata (importlib.metadata: versions, entry points) and .pth files.
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".pth")
# The modules the `jaxaot` entry itself imports before it asks a server.
ENTRY_MODULES = frozenset(
    {"jaxaot", "jaxaot.__main__", "jaxaot.cli", "jaxaot.errors", "jaxaot.version"}
)


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that JAX, XLA or Python read at import, less those compared
    otherwise (``PYTHONPATH``: :func:`path_mismatch`) or read later (:data:`BACKEND_START_ENV`)."""
    return {
        k: v
        for k, v in env.items()
        if IMPORT_ENV.match(k) and k not in BACKEND_START_ENV and k != "PYTHONPATH"
    }


class _Misses:
    """A finder after every other one on ``sys.meta_path``: it is asked only for names no
    other finder found (a library's optional import that failed), records their top-level
    names and finds nothing."""

    names: set[str] = set()

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> None:
        cls.names.add(name.partition(".")[0])


def record_misses() -> None:
    """From now on, remember the names this process looks for and does not find (the server
    calls it before its imports: an optional dependency a library found missing stays
    missing in every child, whatever a client's path adds)."""
    if _Misses not in sys.meta_path:
        sys.meta_path.append(_Misses)


def looked_up_names() -> set[str]:
    """The top-level names of every module this process imported, and of those it looked
    for and did not find since :func:`record_misses`."""
    return {name.partition(".")[0] for name in list(sys.modules)} | _Misses.names


def imported_for_a_run() -> str | None:
    """A module this process imported that a run imports too, beyond what the ``jaxaot``
    entry imports: a script that set up JAX, Hydra or jaxaot (patched them, configured them)
    and then called the entry. Its run is this process's, as it wrote it; a server's child
    has copies of its own. None for a ``jaxaot`` process as it starts."""
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top == "jaxaot":
            if name not in ENTRY_MODULES and not (
                name == "jaxaot.cli.server" or name.startswith("jaxaot.cli.server.")
            ):
                return name
        elif top in PREIMPORT:
            return name
    return None


def entries_used(path: list[str], cwd: str) -> set[str]:
    """The entries of ``path`` (made absolute against ``cwd``) that this process's imported
    top-level modules and packages were found in (a package's submodules come with it)."""
    entries = {_absolute(p, cwd) for p in path}
    used: set[str] = set()
    for name, mod in list(sys.modules.items()):
        if "." in name:
            continue
        file = getattr(mod, "__file__", None)
        if isinstance(file, str):
            found = os.path.dirname(os.path.abspath(file))
            if os.path.basename(file).startswith("__init__."):
                found = os.path.dirname(found)
            folders = [found]
        else:  # a namespace package: a portion in each folder that has one (a finder's
            # own entries, such as an editable install's path hook, are no folder)
            portions = [p for p in getattr(mod, "__path__", ()) if os.path.isabs(p)]
            folders = [os.path.dirname(p) for p in portions]
        used.update(f for f in folders if f in entries)
    return used


def module_names(folder: str) -> tuple[set[str], list[str]]:
    """The top-level names ``import`` finds in ``folder`` (modules with any suffix Python
    imports, folders: packages, namespace portions), and what else in it the server's process
    may have read (:data:`METADATA_SUFFIXES`). OSError when it is no readable folder."""
    import importlib.machinery

    suffixes = tuple(importlib.machinery.all_suffixes())
    names, metadata = set(), []
    with os.scandir(folder) as found:
        for entry in found:
            if entry.name.endswith(METADATA_SUFFIXES):
                metadata.append(entry.name)
            elif entry.is_dir():
                names.add(entry.name)
            elif entry.name.endswith(suffixes):
                names.add(entry.name.partition(".")[0])
    return names, sorted(metadata)


def path_mismatch(
    theirs: list[str], their_cwd: str, mine: list[str], my_cwd: str, used: set[str]
) -> str | None:
    """The reason a client with ``sys.path`` ``theirs`` (``PYTHONPATH`` in it) cannot be served
    by imports made under ``mine`` (``used``: the entries they came from, :func:`entries_used`),
    or None. Relative entries are read against each side's cwd.

    The child takes the client's ``sys.path``: what the run imports later is found where the
    client would find it, but what the server imported is not looked up again. So the entries
    both have keep their order, an entry the server imported from is on the client's path too,
    and an entry of the client's own holds no module or package named as one the server
    imported or looked for and did not find (the client would import its own), no start-up
    hook or plugin namespace (:data:`PRESTART`) and no package metadata or .pth file. An entry
    that is not there holds nothing; one that is no readable folder (a zip) is not served."""
    # An entry's first place is where imports look in it: later repeats change nothing.
    t = list(dict.fromkeys(_absolute(p, their_cwd) for p in theirs))
    m = list(dict.fromkeys(_absolute(p, my_cwd) for p in mine))
    t_set, m_set = set(t), set(m)
    if [p for p in t if p in m_set] != [p for p in m if p in t_set]:
        return "import path (order)"
    if missing := sorted(used - t_set):
        return f"import path ({missing[0]} missing)"
    watched = looked_up_names() | PRESTART
    for folder in dict.fromkeys(p for p in t if p not in m_set):
        try:
            names, metadata = module_names(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return f"import path ({folder} is not a folder)"
        if clash := sorted(names & watched) or metadata:
            return f"import path ({clash[0]} in {folder})"
    return None


def _absolute(entry: str, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, entry))


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
    "ENTRY_MODULES",
    "FORWARDED",
    "IMPORT_ENV",
    "METADATA_SUFFIXES",
    "PREIMPORT",
    "PRESTART",
    "entries_used",
    "env_mismatch",
    "import_env",
    "imported_for_a_run",
    "inherited_fds",
    "looked_up_names",
    "module_names",
    "origins",
    "path_mismatch",
    "process",
    "process_mismatch",
    "record_misses",
]
