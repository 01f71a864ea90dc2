"""What a client process is, that a child forked by the server must be too.

A served run is a child of the server, not of the client, so whatever the child would have
taken from the client's process (rather than from the request's argv, cwd and environment) is
sent in the request and either given to the child or compared:

- given to the child: the umask, the CPU affinity, the signals the client ignores (``nohup``),
  how its stdio streams were opened (encoding and error handler, line buffering,
  write-through: the locale, ``PYTHONIOENCODING``, a terminal, ``python -u``), descriptors
  above 2;
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
from typing import Any, NamedTuple

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


# Names on a client's sys.path entry that its child would not look up again, besides every
# module the server looked up (:func:`looked_up_names`): Python's start-up hooks (imported as
# an interpreter starts, never in a forked child) and the plugin namespaces Hydra and JAX scan.
PRESTART = frozenset({"sitecustomize", "usercustomize", "hydra_plugins", "jax_plugins"})
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


class _Lookups:
    """A finder ahead of every other one on ``sys.meta_path``: it records the top-level name
    of every module the process looks for, found or not, imported or failed, and finds
    nothing itself (the next finder does)."""

    names: set[str] = set()

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> None:
        cls.names.add(name.partition(".")[0])


def record_lookups() -> None:
    """From now on, remember every module name this process looks for (the server calls it
    before its imports: an optional dependency a library found missing, or failing, stays so
    in every child, whatever a client's path adds)."""
    if _Lookups not in sys.meta_path:
        sys.meta_path.insert(0, _Lookups)


def stop_recording() -> None:
    """Take the recorder off ``sys.meta_path`` (a forked run's imports are its own)."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_Lookups)


def looked_up_names() -> set[str]:
    """The top-level names of every module this process imported, and of those it looked
    for since :func:`record_lookups`."""
    return {name.partition(".")[0] for name in list(sys.modules)} | _Lookups.names


def own_setup() -> str | None:
    """What this process did that a run started by a server would not have, or None for a
    ``jaxaot`` process as it starts (``python -m jaxaot``, the ``jaxaot`` script).

    A script that imported JAX, Hydra, NumPy, OmegaConf or jaxaot (to patch or configure
    them), replaced stdio (``contextlib.redirect_stdout``), runs under a tracer or profiler, or
    is itself ``__main__`` (``program.target=__main__:f``), then called the ``jaxaot`` entry:
    its run is this process's, as it set it up; a server's child has its own copies of all
    that."""
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top == "jaxaot":
            if name not in ENTRY_MODULES and not (
                name == "jaxaot.cli.server" or name.startswith("jaxaot.cli.server.")
            ):
                return f"imported {name}"
        elif top in PREIMPORT:
            return f"imported {name}"
    streams = ("stdin", "stdout", "stderr")
    if any(getattr(sys, s) is not getattr(sys, f"__{s}__") for s in streams):
        return "replaced stdio"
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return "a tracer or profiler"
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "jaxaot.__main__":  # python -m jaxaot
        return None
    from jaxaot.cli.server import entry

    if spec is None and getattr(main, "entry", None) is entry:  # the installed script
        return None
    return "called from another program"


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


def module_names(folder: str) -> set[str]:
    """The top-level names ``import`` finds in ``folder``: modules (any suffix Python
    imports) and folders (packages, namespace portions); an entry that cannot be looked at (a
    symbolic link loop) is none, as for ``import``. OSError when it is no readable folder."""
    import importlib.machinery

    suffixes = tuple(importlib.machinery.all_suffixes())
    names = set()
    with os.scandir(folder) as found:
        for entry in found:
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            if is_dir:
                names.add(entry.name)
            elif entry.name.endswith(suffixes):
                names.add(entry.name.partition(".")[0])
    return names


class ImportPath(NamedTuple):
    """A process's ``sys.path`` as its imports saw it: the entries (absolute, each at its
    first place), those its imported modules came from, and what each readable one held."""

    entries: list[str]
    used: set[str]
    names: dict[str, set[str]]

    @classmethod
    def of_this_process(cls) -> ImportPath:
        cwd = os.getcwd()  # what relative entries meant
        entries = list(dict.fromkeys(_absolute(p, cwd) for p in sys.path))
        names = {}
        for folder in entries:
            with contextlib.suppress(OSError):
                names[folder] = module_names(folder)
        return cls(entries, entries_used(sys.path, cwd), names)


def path_mismatch(theirs: list[str], their_cwd: str, mine: ImportPath) -> str | None:
    """The reason a client with ``sys.path`` ``theirs`` (``PYTHONPATH`` in it; relative
    entries read against ``their_cwd``) cannot be served by imports made under ``mine``, or
    None.

    The child takes the client's ``sys.path``: what the run imports later is found where the
    client would find it, but what the server looked up is not looked up again. So the entries
    both have keep their order, an entry the server imported from is on the client's path too,
    and no entry holds a module or package named as one the server looked up (imported, or
    failed to: the client would import its own), a start-up hook or a plugin namespace
    (:data:`PRESTART`) that it did not hold when the server started (an entry of the client's
    own: at all). An entry that is not there holds nothing; one of the client's own that is no
    readable folder (a zip) is not served."""
    # An entry's first place is where imports look in it: later repeats change nothing.
    t = list(dict.fromkeys(_absolute(p, their_cwd) for p in theirs))
    t_set, m_set = set(t), set(mine.entries)
    if [p for p in t if p in m_set] != [p for p in mine.entries if p in t_set]:
        return "import path (order)"
    if missing := sorted(mine.used - t_set):
        return f"import path ({missing[0]} missing)"
    watched = looked_up_names() | PRESTART
    for folder in t:
        try:
            names = module_names(folder)
        except FileNotFoundError:
            continue
        except OSError:
            if folder in m_set:
                continue  # the server's own zip or path hook entry
            return f"import path ({folder} is not a folder)"
        if clash := sorted((names - mine.names.get(folder, set())) & watched):
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
        "stdio": [_stream(f) for f in (sys.stdin, sys.stdout, sys.stderr)],
        "inherited_fds": inherited_fds(),
    }


def _stream(f: Any) -> list[Any]:
    """How the interpreter opened a stdio stream: its encoding and error handler (the locale's,
    or ``PYTHONIOENCODING``'s), line buffering (a terminal; stderr always) and write-through
    (``python -u``, ``PYTHONUNBUFFERED``)."""
    return [
        getattr(f, "encoding", None),
        getattr(f, "errors", None),
        bool(getattr(f, "line_buffering", False)),
        bool(getattr(f, "write_through", False)),
    ]


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
    "PREIMPORT",
    "PRESTART",
    "ImportPath",
    "entries_used",
    "env_mismatch",
    "import_env",
    "inherited_fds",
    "looked_up_names",
    "module_names",
    "origins",
    "own_setup",
    "path_mismatch",
    "process",
    "process_mismatch",
    "record_lookups",
    "stop_recording",
]
