"""What the import policy allows by default, and how a name is judged (no Hydra, no JAX).

A name is judged by its dotted path (``pkg.mod:attr`` is ``pkg.mod.attr``) against rules:
dotted prefixes that match whole components (``jax`` matches ``jax.numpy.sum``, not
``jaxtyping``). The longest matching rule decides; at equal length a user's rule beats a
built-in one. A name no rule matches is refused: the default is an allow list.

Besides the table below, the user's own code is allowed: a top-level module or package found
directly in a folder on ``sys.path`` that is not part of the Python installation (the current
directory, ``PYTHONPATH`` entries, folders a ``.pth`` file adds), never one in the standard
library or in site-packages. That is judged with :func:`importlib.util.find_spec` on the
top-level name, which imports nothing; a module already imported is judged by where it was
loaded from, so a project's ``code.py`` is user code while the standard library's ``code``,
once imported, is not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ALL = "*"
BUILTIN = "the import policy"

# Where a name is used: the rules of the scope "any" hold everywhere, the others only there.
TARGET = "target"  # program.target, _pytree_ classes, scoped metadata, lowered.json classes
HYDRA = "hydra"  # Hydra's callbacks, sweeper, launcher (_target_ at any depth), search path
LOGGING = "logging"  # hydra.job_logging / hydra.hydra_logging: class, (), ext://


@dataclass(frozen=True)
class Rule:
    prefix: str  # dotted; "*" matches every name
    allow: bool
    source: str = BUILTIN  # or the user's: trust.allow_imports, JAXAOT_ALLOW_IMPORTS, a file
    why: str = ""
    scope: str = "any"
    user: bool = False  # given by the user (command line, environment, user file)

    def matches(self, name: str) -> bool:
        return self.prefix == ALL or name == self.prefix or name.startswith(self.prefix + ".")

    def rank(self) -> tuple[int, bool, bool]:
        return (0 if self.prefix == ALL else len(self.prefix), self.user, not self.allow)


def _rules(prefixes: str, allow: bool, why: str, scope: str = "any") -> list[Rule]:
    return [Rule(p, allow, BUILTIN, why, scope) for p in prefixes.split()]


_FILES = "reads or writes files"
BUILTIN_RULES: tuple[Rule, ...] = tuple(
    # Allowed: the JAX ecosystem (programs, transforms, pytree classes) and jaxaot's examples.
    _rules("jax", True, "JAX: programs, transformations and pytree classes")
    + _rules("ml_dtypes", True, "JAX's extra dtypes (bfloat16, float8): scalar types")
    + _rules("flax optax equinox chex", True, "the JAX ecosystem: layers, optimizers, pytrees")
    + _rules("jaxaot.examples", True, "jaxaot's example programs")
    + _rules("jaxaot.models", True, "jaxaot's adapters for Flax, Equinox, optax and orbax")
    # Refused inside those: files, processes, the network, pickle, native libraries.
    + _rules(
        "jax.numpy.load jax.numpy.save jax.numpy.savez jax.numpy.fromfile "
        "jax._src.numpy.lax_numpy.load",
        False,
        "reads or writes .npy files (numpy.load can unpickle)",
    )
    + _rules(
        "jax.profiler jax._src.profiler jax.collect_profile jax.experimental.profiler",
        False,
        "writes trace files and opens a profiler server port",
    )
    + _rules(
        "jax.distributed jax._src.distributed jax._src.clusters jax._src.cloud_tpu_init "
        "jax.experimental.multihost_utils jax.experimental.transfer",
        False,
        "connects to other hosts (coordinator, cloud metadata, transfer servers)",
    )
    + _rules(
        "jax.experimental.serialize_executable jax._src.pickle_util "
        "jax.experimental.colocated_python",
        False,
        "pickles: loading one runs code",
    )
    + _rules(
        "jax.experimental.array_serialization jax.experimental.compilation_cache "
        "jax._src.compilation_cache jax._src.compilation_cache_interface jax._src.lru_cache "
        "jax._src.path jax._src.jaxpr_util jax.tools jax.experimental.jax2tf",
        False,
        _FILES,
    )
    + _rules(
        "jax.config jax._src.config flax.configurations",
        False,
        "changes global options (dump and cache folders among them)",
    )
    + _rules(
        "jax.lib jax._src.lib jax._src.xla_bridge jax.extend.backend jax.extend.ffi jax.ffi "
        "jax._src.ffi jax.experimental.mosaic jax._src.lazy_loader",
        False,
        "loads native libraries or modules by name (PJRT plugins, FFI targets)",
    )
    + _rules("jax.print_environment_info jax._src.environment_info", False, "runs nvidia-smi")
    + _rules(
        "jax.debug.breakpoint jax._src.debugger equinox.debug.breakpoint_if "
        "equinox.debug._breakpoint_if",
        False,
        "an interactive debugger reading the terminal",
    )
    + _rules(
        "jax._src.test_util jax._src.internal_test_util jax._src.test_multiprocess "
        "jax._src.test_loader",
        False,
        "test harnesses that start processes and write files",
    )
    + _rules(
        "flax.io flax.training.checkpoints flax.training.orbax_utils flax.metrics "
        "flax.serialization equinox.tree_serialise_leaves equinox.tree_deserialise_leaves "
        "equinox._serialisation",
        False,
        _FILES + " (checkpoints, logs)",
    )
    + _rules("chex._src.fake", False, "changes XLA_FLAGS and replaces jax.jit/pmap")
    # Hydra's own slots: callbacks, sweeper, launcher (_target_ at any depth), the search path.
    + _rules("hydra._internal.core_plugins", True, "Hydra's own sweeper, launcher, sources", HYDRA)
    + _rules("hydra_plugins", True, "installed Hydra plugins (sweepers, launchers)", HYDRA)
    + _rules("hydra.conf jaxaot.conf", True, "Hydra's and jaxaot's shipped configs", HYDRA)
    + _rules(
        "jaxaot.sweeps.callbacks.SweepCallback jaxaot.sweeps.snapshot_check.SnapshotSweepCheck "
        "jaxaot.sweeps.tracking.MlflowTracking",
        True,
        "jaxaot's Hydra callbacks (conf/config.yaml, conf/tracking/)",
        HYDRA,
    )
    # Logging configs: the handlers and formatters Hydra's own job_logging uses.
    + _rules(
        "logging.StreamHandler logging.FileHandler logging.NullHandler logging.Formatter "
        "logging.Filter colorlog.ColoredFormatter colorlog.formatter.ColoredFormatter",
        True,
        "the handlers and formatters of Hydra's logging configs",
        LOGGING,
    )
    + _rules(
        "sys.stdout sys.stderr", True, "ext://sys.stdout: where a StreamHandler writes", LOGGING
    )
)


# --- the user's own code ----------------------------------------------------------------------


def _installation_dirs() -> list[Path]:
    """The Python installation's folders: the standard library and every site-packages."""
    found: set[str] = set()
    schemes = [sysconfig.get_paths()]
    schemes.append(
        sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    )
    for paths in schemes:
        found.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    found.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    user_site = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user_site, str):
        found.add(user_site)
    return [Path(p).resolve() for p in found if p]


_INSTALLATION: list[Path] | None = None


def _in_installation(folder: Path) -> bool:
    global _INSTALLATION
    if _INSTALLATION is None:
        _INSTALLATION = _installation_dirs()
    if {"site-packages", "dist-packages"} & set(folder.parts):
        return True
    return any(folder == d or d in folder.parents for d in _INSTALLATION)


def _search_path() -> list[str]:
    """``sys.path`` as a target is imported with: the current directory first, as under
    ``python -m`` (jaxaot.util.console.cwd_importable adds it before importing a target)."""
    cwd = os.getcwd()
    return sys.path if cwd in sys.path or "" in sys.path else [cwd, *sys.path]


@contextlib.contextmanager
def _importing_path() -> Iterator[None]:
    path = _search_path()
    if path is sys.path:
        yield
        return
    saved = list(sys.path)
    sys.path[:] = path
    try:
        yield
    finally:
        sys.path[:] = saved


_FOLDERS: dict[tuple[str, ...], frozenset[Path]] = {}


def _user_folders() -> frozenset[Path]:
    """Folders of the import path outside the installation."""
    path = tuple(_search_path())
    key = (os.getcwd(), *path)
    if key not in _FOLDERS:
        _FOLDERS.clear()  # the latest import path only
        _FOLDERS[key] = frozenset(_folders(path))
    return _FOLDERS[key]


def _folders(path: tuple[str, ...]) -> set[Path]:
    out: set[Path] = set()
    for entry in path:
        folder = Path(entry or os.getcwd())
        if folder.is_dir():
            resolved = folder.resolve()
            if not _in_installation(resolved):
                out.add(resolved)
    return out


@dataclass(frozen=True)
class Location:
    """Where a top-level module was (or would be) imported from."""

    found: bool
    user: bool  # found directly in a user folder (see module docstring)
    where: str  # a path, "built-in", or "" when not found

    def kind(self) -> str:
        """What it is, for a refusal: "the standard library's (/usr/lib/python3.11/code.py)"."""
        if not self.found:
            return "not found"
        if self.where == "built-in":
            return "built into Python"
        if self.where == "frozen":
            return "the standard library's (frozen into Python)"
        path = Path(self.where)
        if {"site-packages", "dist-packages"} & set(path.parts):
            return f"an installed package ({self.where})"
        if _in_installation(path.parent):
            return f"the standard library's ({self.where})"
        return f"imported from {self.where}, not from a folder on sys.path (an import hook?)"


def locate(top: str) -> Location:
    """Where ``import top`` would load from (or did), without importing anything."""
    try:
        with _importing_path():
            spec = importlib.util.find_spec(top)
    except (ImportError, ValueError, AttributeError):
        spec = None
    if spec is None:
        return Location(False, False, "")
    if spec.origin in ("built-in", "frozen"):
        return Location(True, False, spec.origin)
    folders: list[Path] = []
    shown = ""
    if spec.origin and spec.has_location:
        origin = Path(spec.origin).resolve()
        package = spec.submodule_search_locations is not None
        where = origin.parent.parent if package else origin.parent
        named = origin.parent.name == top if package else origin.name.split(".")[0] == top
        if not named:
            return Location(True, False, str(origin))
        folders.append(where)
        shown = str(origin)
    elif spec.submodule_search_locations:  # a namespace package: every portion counts
        for portion in spec.submodule_search_locations:
            path = Path(portion)
            if not path.is_dir():
                return Location(True, False, str(portion))
            folders.append(path.resolve().parent)
        shown = str(spec.submodule_search_locations[0])
    if not folders:
        return Location(True, False, str(spec.origin))
    user = _user_folders()
    return Location(True, all(f in user for f in folders), shown)


def user_code_rule(top: str, location: Location) -> Rule:
    """The allow rule for a top-level package that :func:`locate` found to be the user's."""
    return Rule(top, True, f"this project ({location.where})", "your own code")


__all__ = [
    "ALL",
    "BUILTIN",
    "BUILTIN_RULES",
    "HYDRA",
    "LOGGING",
    "TARGET",
    "Location",
    "Rule",
    "locate",
    "user_code_rule",
]
