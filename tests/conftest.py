"""Shared fixtures: an isolated store per test, the CLI in a subprocess, configs composed in-process.

Every test gets its own ``JAXAOT_STORE_DIR`` so runs never share cache entries by accident.
CLI tests run ``python -m jaxaot`` with this checkout first on PYTHONPATH, so they test
the code in the tree (also from a git worktree), not whatever is installed.
"""

from __future__ import annotations

import ast
import atexit
import functools
import gc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jaxaot
import pytest
from jaxaot.errors import BackendError, MissingDependencyError

REPO = Path(__file__).resolve().parent.parent
# Hypothesis keeps its caches in ./.hypothesis by default: the tests leave nothing where pytest
# runs, so they go to the temp dir.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "jaxaot-tests-hypothesis")
)
# jaxaot's per-user caches (the default store, the roofline's calibration) live under
# $XDG_CACHE_HOME: the session gets its own, set before any test imports or starts jaxaot, so
# that no in-process run and no subprocess (cli_env copies os.environ) touches ~/.cache.
# Removed as the process that made it exits: also pytest-xdist's controller, which runs no
# session fixture, and a spawned child that imports this module.
SESSION_CACHE_HOME = Path(tempfile.mkdtemp(prefix="jaxaot-tests-cache-"))
atexit.register(shutil.rmtree, SESSION_CACHE_HOME, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = str(SESSION_CACHE_HOME)

# Outside a test (a module- or session-scoped fixture, before any test's isolated_store) a
# `jaxaot` the suite starts runs in its own process: it never reaches a developer's server.
os.environ["JAXAOT_SERVER"] = "0"
os.environ["JAXAOT_SERVER_SOCKET"] = str(SESSION_CACHE_HOME / "no-server" / "server.sock")

# Ctrl-C as a terminal delivers it: a suite started in the background (`make test &`, `nohup`)
# inherits SIGINT ignored, and every jaxaot the tests start would then ignore it too (a process
# keeps an ignored signal ignored across exec), so the Ctrl-C tests would test nothing. A
# Python handler here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _listing(where: Path) -> set[str]:
    names = {p.name for p in where.iterdir()} if where.is_dir() else set()
    out = where / "outputs"
    return names | ({f"outputs/{p.name}" for p in out.iterdir()} if out.is_dir() else set())


@pytest.fixture(autouse=True, scope="session")
def nothing_left_where_pytest_runs() -> Iterator[None]:
    """Fail the session's last test if the tests left files in the directory pytest runs from
    (a run dir, a golden, a graph, a cache): every test writes under its own tmp_path."""
    cwd = Path.cwd()
    before = _listing(cwd)
    yield
    left = sorted(_listing(cwd) - before - {".pytest_cache"})
    assert not left, f"the tests left {left} in {cwd}"


@pytest.fixture(autouse=True, scope="session")
def session_cache_home() -> Iterator[Path]:
    """The session's ``$XDG_CACHE_HOME`` (:data:`SESSION_CACHE_HOME`), removed at its end."""
    yield SESSION_CACHE_HOME
    shutil.rmtree(SESSION_CACHE_HOME, ignore_errors=True)


# Where the suite's `jaxaot` runs go (JAXAOT_TEST_SERVER): by default through one resident
# `jaxaot server` per pytest process, which forks a child per run with the imports done (a
# run costs ~0.5 s instead of ~2 s of Python, JAX and Hydra start-up), except the tests marked
# `plain_process` (exit statuses, signals, what a process prints, the walkthrough), which start
# a plain `jaxaot` process. "1" sends those through the server too (`make test-server`); "0"
# starts no server: every run is a plain process (`make test-plain`).
TEST_SERVER_MODES = {"": "default", "1": "all", "0": "none"}


def _test_server_mode() -> str:
    value = os.environ.get("JAXAOT_TEST_SERVER", "")
    if value not in TEST_SERVER_MODES:
        raise pytest.UsageError(
            f"JAXAOT_TEST_SERVER: expected unset, 1 (every run through the server) or 0 (none), "
            f"found {value!r}"
        )
    return TEST_SERVER_MODES[value]


class SuiteServer:
    """The session's resident ``jaxaot server`` (jaxaot.cli.server) on a private socket,
    started by the first test that may run ``jaxaot`` (one not in the fast tier)."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.socket = str(folder / "server.sock")
        self.started = False
        # The server's own store and config folders (a served run gets the test's own from
        # its request's environment); it exits by itself 10 minutes after its last request
        # should the session die before stopping it.
        self.env = cli_env(
            JAXAOT_SERVER_SOCKET=self.socket,
            JAXAOT_STORE_DIR=str(folder / "store"),
            XDG_CONFIG_HOME=str(folder / "config"),
            JAXAOT_SERVER_IDLE="600",
        )
        self.env.update(env or {})
        self.env["JAXAOT_SERVER_SOCKET"] = self.socket  # its own, whatever ``env`` had
        self.env.pop("JAXAOT_SERVER", None)

    def _command(self, action: str) -> subprocess.CompletedProcess[str]:
        env = self.env
        cmd = [sys.executable, "-m", "jaxaot", "server", action]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    def start(self) -> str:
        if not self.started:
            started = self._command("start")
            assert started.returncode == 0, started.stderr
            # the runs given this socket reach this server (not one elsewhere, nor in-process)
            assert Path(self.socket).is_socket(), (self.socket, started.stdout)
            self.started = True
        return self.socket

    def stop(self) -> None:
        if self.started:
            self._command("stop")


@pytest.fixture(autouse=True, scope="session")
def suite_server() -> Iterator[SuiteServer | None]:
    """The session's :class:`SuiteServer`; None with ``JAXAOT_TEST_SERVER=0``."""
    if _test_server_mode() == "none":
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="jaxaot-test-server-") as tmp:
        server = SuiteServer(Path(tmp))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(autouse=True)
def isolated_store(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    suite_server: SuiteServer | None,
) -> Path:
    store = tmp_path / "store"
    monkeypatch.setenv("JAXAOT_STORE_DIR", str(store))
    # The import policy is the user's: a developer's own trust file or variables never reach
    # the suite (a test that needs them sets them).
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    for name in ("JAXAOT_ALLOW_IMPORTS", "JAXAOT_TRUST_STORE", "JAXAOT_TRUST_COMMAND_LINE"):
        monkeypatch.delenv(name, raising=False)
    # No test's `jaxaot` reaches a developer's server: it reaches the suite's own, or none
    # (tests/test_server.py starts its own per test). A served run takes its store, config
    # folders and variables from the test's environment, as a plain process would.
    node = request.node
    plain = node.get_closest_marker("plain_process") and _test_server_mode() != "all"
    if suite_server is None or plain or not node.get_closest_marker("slow"):
        monkeypatch.setenv("JAXAOT_SERVER", "0")
        monkeypatch.setenv("JAXAOT_SERVER_SOCKET", str(tmp_path / "no-server" / "server.sock"))
    else:
        monkeypatch.delenv("JAXAOT_SERVER", raising=False)
        monkeypatch.setenv("JAXAOT_SERVER_SOCKET", suite_server.start())
    return store


@pytest.fixture
def loader() -> Iterator[Any]:
    """Hydra's config loader over jaxaot's config folder, with the sweep compose cache empty
    before and after."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from jaxaot.api import conf_dir
    from jaxaot.schema import register_configs
    from jaxaot.sweeps import compose_cache

    register_configs()
    compose_cache.clear()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()
    compose_cache.clear()


# XLA:CPU's backend (LLVM) optimization level 0, as a compiler option: the optimized HLO, and so
# every cost and memory figure, is the default level's (the level changes the machine code
# alone), and a compile takes about half the time. For tests whose subject is what a program
# computes or compiles to, used alike on both sides of a comparison.
FAST_CPU_CODEGEN: dict[str, str | bool] = {"xla_backend_optimization_level": "0"}


# The environment this session began with.
START_ENV = dict(os.environ)


# What JAX and libtpu put in a process's environment as they start (jax's import, libtpu's
# import, a backend without TPU chips): a worker that ran JAX in-process has them, a `jaxaot`
# started from a shell does not. The runs a worker starts leave them out, so they are
# what a user's runs are.
def _jax_start_values() -> dict[str, str]:
    values = {"TF_CPP_MIN_LOG_LEVEL": "1", "TPU_SKIP_MDS_QUERY": "1"}
    spec = importlib.util.find_spec("libtpu")
    if spec is not None and spec.origin:
        values["TPU_LIBRARY_PATH"] = str(Path(spec.origin).parent / "libtpu.so")
    return values


JAX_START_VALUES = _jax_start_values()


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a `jaxaot` it starts, less what JAX's start set in it
    (:data:`JAX_START_VALUES`, unless the session began with it), plus ``extra``."""
    env = dict(os.environ)
    for key, value in JAX_START_VALUES.items():
        if env.get(key) == value and START_ENV.get(key) != value:
            del env[key]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HYDRA_FULL_ERROR", "0")
    env.update(extra)
    return env


def served_env(suite_server: SuiteServer | None, **extra: str) -> dict[str, str]:
    """:func:`cli_env` for a module- or session-scoped fixture, which runs before any test's
    :func:`isolated_store`: its `jaxaot` runs reach the suite's server, as a test's do (in their
    own process under ``JAXAOT_TEST_SERVER=0``)."""
    env = cli_env(**extra)
    if suite_server is not None:
        env.pop("JAXAOT_SERVER", None)
        env["JAXAOT_SERVER_SOCKET"] = suite_server.start()
    return env


def run_cli(
    args: Sequence[str],
    *,
    cwd: Path,
    module: str = "jaxaot",
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``jaxaot <args>`` (as ``python -m jaxaot``: through the suite's server under
    ``make test-server``) in ``cwd``; never raises on rc."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(
    args: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``jaxaot <args>`` as :func:`run_cli` runs it, without waiting: stdout and stderr
    piped, as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "jaxaot", *args],
        cwd=cwd,
        env=env or cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "manifest.json").read_text())


# A user module whose program returns a NamedTuple (resume, cold loads, verify --deep).
PAIRS_MODULE = """
from typing import NamedTuple

import jax.numpy as jnp


class Pair(NamedTuple):
    total: object
    scaled: object


def pair(x):
    return Pair(total=jnp.sum(x), scaled=x * 3)
"""


def write_pairs_module(folder: Path, name: str) -> Path:
    """:data:`PAIRS_MODULE` as ``folder/<name>.py`` (the folder made); the file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(PAIRS_MODULE)
    return path


def read_json(run_dir: Path, name: str) -> Any:
    return json.loads((run_dir / name).read_text())


def run_sweep(tmp: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot -m <overrides>`` in ``tmp`` with a store of its own, into ``tmp/sweep``; asserts
    it exits 0 and returns (the finished process, the sweep dir)."""
    sweep_dir = tmp / "sweep"
    env = cli_env(JAXAOT_STORE_DIR=str(tmp / "store"))
    proc = run_cli(["-m", *overrides, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, sweep_dir


def run_numbered(tmp_path: Path, *overrides: str, name: str = "run") -> Any:
    """``jaxaot.run`` in-process into a fresh ``tmp_path/<name><n>``; the RunResult."""

    rd = tmp_path / f"{name}{len(list(tmp_path.glob(name + '*')))}"
    return jaxaot.run(jaxaot.compose(list(overrides)), run_dir=rd)


@pytest.fixture
def cli(tmp_path: Path):  # type: ignore[no-untyped-def]
    """``cli(*overrides, run_dir=None)`` -> (CompletedProcess, run_dir) with hydra.run.dir set."""

    def call(*overrides: str, run_dir: Path | None = None, expect_ok: bool = True):  # type: ignore[no-untyped-def]
        rd = run_dir or tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        proc = run_cli([*overrides, f"hydra.run.dir={rd}"], cwd=tmp_path)
        if expect_ok:
            assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc, rd

    return call


@pytest.fixture
def compose_run(tmp_path: Path):  # type: ignore[no-untyped-def]
    """``compose_run(*overrides)`` -> RunResult, run in-process in a fresh run dir."""

    def call(*overrides: str, run_dir: Path | None = None):  # type: ignore[no-untyped-def]
        rd = run_dir or tmp_path / f"api{len(list(tmp_path.glob('api*')))}"
        return jaxaot.run(jaxaot.compose(list(overrides)), run_dir=rd)

    return call


# The fast tier (`make test-fast`, `pytest -m "not slow"`): every test that starts no process,
# runs no pipeline, composes no config with Hydra and compiles nothing with XLA. Whether a test
# does is read from the source (ast): a test is slow when it uses a fixture of SLOW_FIXTURES,
# or when its body, a fixture it uses or a function or class it calls (in its own module, in
# tests/ or here, followed through) calls one of SLOW_CALLS or SLOW_METHODS. So a new unit test
# is in the fast tier with no list to edit; a test that is slow for another reason (a sleep, a
# Hydra config loader of its own) says so with ``@pytest.mark.slow``.
SLOW_CALLS = frozenset(
    {
        # a process
        "subprocess.run",
        "subprocess.Popen",
        "subprocess.call",
        "subprocess.check_call",
        "subprocess.check_output",
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.posix_spawn",
        "os.posix_spawnp",
        "multiprocessing.Process",
        "multiprocessing.Pool",
        "conftest.run_cli",
        "conftest.run_sweep",
        # a whole pipeline in this process
        "jaxaot.run",
        "jaxaot.engine.runner.run",
        "jaxaot.cli.main.main",
        "conftest.run_numbered",
        # a pytest session in this process (whose tests run the pipeline)
        "pytest.main",
        # Graphviz's `dot`
        "jaxaot.cli.graph_cmd.main",
        # a Hydra composition of the whole config (~0.4 s each)
        "jaxaot.compose",
        "jaxaot.api.compose",
        # an XLA compile: jit (compiles when called), `lowered.compile()`
        "jax.jit",
        "jax.pmap",
        # a fixture chosen at run time: not known to be fast
        "getfixturevalue",
    }
)
# Method calls slow whatever their receiver: `.compile()` of a lowering (not re.compile), and
# `.lower(...)` with arguments (a jitted function's; str.lower takes none).
SLOW_METHODS = frozenset({"compile", "lower"})
SLOW_FIXTURES = frozenset({"cli", "compose_run", "slurm"})
TESTS = Path(__file__).resolve().parent


class _Module:
    """One test-side module's top-level functions and classes, and what its names import."""

    def __init__(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), str(path))
        self.name = path.stem
        self.defs: dict[str, ast.AST] = {}
        self.imports: dict[str, str] = {}  # local name -> dotted name it stands for
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defs[node.name] = node
        # imports at the top and inside functions (`from conftest import run_cli` in a test)
        top = {id(n) for n in tree.body}
        for node in [*tree.body, *(n for n in ast.walk(tree) if id(n) not in top)]:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
                    else:
                        root = alias.name.partition(".")[0]
                        self.imports[root] = root
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif id(node) in top and isinstance(node, ast.Assign) and len(node.targets) == 1:
                # `_run = run_numbered`, `_go = functools.partial(run_cli, ...)`: an alias
                value = node.value
                if (
                    isinstance(value, ast.Call)
                    and value.args
                    and "partial" in ast.unparse(value.func)
                ):
                    value = value.args[0]
                target = node.targets[0]
                if isinstance(target, ast.Name) and isinstance(value, ast.Name | ast.Attribute):
                    dotted = self.dotted(value)
                    if dotted is not None:
                        self.imports[target.id] = dotted

    def dotted(self, func: ast.expr) -> str | None:
        """The dotted name a call's function stands for (``sp.run`` -> ``subprocess.run``)."""
        parts: list[str] = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            return None
        head = self.imports.get(func.id, f"{self.name}.{func.id}")
        return ".".join([head, *reversed(parts)])


@functools.cache
def _module(name: str) -> _Module | None:
    path = TESTS / f"{name}.py"
    return _Module(path) if path.is_file() else None


def _slow(dotted: str, seen: set[str]) -> bool:
    """Whether calling ``dotted`` starts a process or runs a pipeline, as far as the source in
    tests/ tells: a name of SLOW_CALLS is; a function or class defined in tests/ is read and
    followed; anything else is not."""
    if dotted in SLOW_CALLS or dotted.rpartition(".")[2] in SLOW_CALLS:
        return True
    if dotted in seen:
        return False
    seen.add(dotted)
    module_name, _, rest = dotted.partition(".")
    module = _module(module_name)
    node = module.defs.get(rest.partition(".")[0]) if module else None
    return module is not None and node is not None and _calls_slow(module, node, None, seen)


def _calls_slow(module: _Module, node: ast.AST, cls: ast.ClassDef | None, seen: set[str]) -> bool:
    """Whether ``node`` (a function, or a class's methods) calls anything slow; ``self.f()``
    in a method of ``cls`` follows ``cls.f``."""
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        if (
            cls is not None
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in ("self", "cls")
        ):
            method = next((n for n in cls.body if getattr(n, "name", None) == func.attr), None)
            key = f"{module.name}.{cls.name}.{func.attr}"
            if method is not None and key not in seen:
                seen.add(key)
                if _calls_slow(module, method, cls, seen):
                    return True
            continue
        if (
            isinstance(func, ast.Attribute)
            and func.attr in SLOW_METHODS
            and (func.attr != "lower" or call.args or call.keywords)
            and module.dotted(func) not in ("re.compile", "regex.compile")
        ):
            return True
        target = module.dotted(func)
        if target is not None and _slow(target, seen):
            return True
    return False


def _is_slow(item: pytest.Item) -> bool:
    owner = getattr(item, "cls", None)
    return _is_slow_function(
        item.path,
        getattr(item, "originalname", item.name),
        owner.__name__ if owner else None,
        frozenset(getattr(item, "fixturenames", ())),
    )


@functools.cache
def _is_slow_function(path: Path, function: str, owner: str | None, names: frozenset[str]) -> bool:
    """:func:`_is_slow` of a test function, read once for all its parametrized items."""
    if names & SLOW_FIXTURES:
        return True
    module = _module(path.stem) if path.parent == TESTS else None
    node = module.defs.get(owner or function) if module else None
    if module is None or node is None:
        return True  # source not found: not known to be fast
    seen: set[str] = set()
    if isinstance(node, ast.ClassDef):
        cls = node
        method = next((n for n in cls.body if getattr(n, "name", None) == function), None)
        if method is None or _calls_slow(module, method, cls, seen):
            return True
        fixtures = [n for n in cls.body if getattr(n, "name", None) in names]
        if any(_calls_slow(module, f, cls, seen) for f in fixtures):
            return True
    elif _calls_slow(module, node, None, seen):
        return True
    # the fixtures it uses that its module defines or imports (`from mlflow_server import
    # mlflow_server`: a server process); conftest's slow ones are SLOW_FIXTURES
    return any(
        _slow(f"{module.name}.{name}" if name in module.defs else module.imports[name], seen)
        for name in names
        if name in module.defs or name in module.imports
    )


def _shares_a_slow_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture of its own module that outlives one test (module or class
    scope) and is slow (starts a process, runs a pipeline: as :func:`_is_slow` reads it)."""
    module = _module(item.path.stem) if item.path.parent == TESTS else None
    info = getattr(item, "_fixtureinfo", None)
    if module is None or info is None:
        return False
    own = getattr(getattr(item, "module", None), "__name__", None)
    for name, defs in info.name2fixturedefs.items():
        fixture = defs[-1]
        if (
            fixture.scope != "function"
            and getattr(fixture.func, "__module__", None) == own
            and _slow(f"{module.name}.{name}", set())
        ):
            return True
    return False


# The optional extras the tests use (pyproject's [project.optional-dependencies]) and the modules
# that show each is installed. An extra is missing where one of its modules is not on this
# venv's path; that is decided once, as the session starts (:data:`MISSING_EXTRAS`), so a test
# that hides a module (``sys.modules["optuna"] = None``) changes nothing. Where an extra is
# missing, a test that fails by raising ImportError for one of its missing modules, or jaxaot's
# own error for it (MissingDependencyError, or the BackendError of a topology compile) naming
# ``jaxaot[<extra>]``, and a test module whose import does, are reported as skipped, naming it;
# the decision is made from the exception, never from what the test printed. A test whose
# failure without the extra is something else (an assertion on a `jaxaot` subprocess's output)
# is marked ``@pytest.mark.extra("sweep")``. With every extra installed (`make test`) nothing
# is skipped this way.
EXTRAS = {
    "tpu": ("libtpu",),
    "cuda-aot": ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc"),
    "profile": ("xprof",),
    "models": ("flax", "equinox", "optax", "orbax.checkpoint"),
    "sweep": (
        "hydra_plugins.hydra_joblib_launcher",
        "hydra_plugins.hydra_submitit_launcher",
        "optuna",
        "matplotlib",
    ),
    "tracking": ("mlflow",),
    "s3": ("s3fs",),
    "gcs": ("gcsfs",),
    # the full mlflow's server (its SQL store), moto's S3 server and Playwright, which the
    # tests start or drive
    "testing": (
        "mlflow.server",
        "sqlalchemy",
        "alembic",
        "moto.server",
        "gcp_storage_emulator",
        "playwright",
    ),
}


# The jax a test needs (`@pytest.mark.requires_jax("0.7.2")`): a test of behaviour that older
# JAX releases lack (jaxaot supports jax 0.6 to 0.10) is skipped below that version, naming it.
# The installed version is read from the package metadata, without importing jax.
def _version_tuple(text: str) -> tuple[int, ...]:
    """``"0.10.2"`` (or ``"0.6.2.dev1"``, ``"0.7"``) as ``(0, 10, 2)``: its leading numbers."""
    found = re.match(r"\d+(\.\d+){0,2}", text)
    return tuple(int(n) for n in found.group().split(".")) if found else ()


JAX_VERSION = importlib.metadata.version("jax")


def requires_jax_reason(item: pytest.Item, needed: object) -> str | None:
    """The skip reason of ``item`` marked ``requires_jax(needed)`` on this venv's jax, or None
    where that jax is new enough; a ``needed`` that is no "X.Y[.Z]" string is a usage error."""
    if not isinstance(needed, str) or not re.fullmatch(r"\d+\.\d+(\.\d+)?", needed):
        raise pytest.UsageError(
            f'{item.nodeid}: @pytest.mark.requires_jax: expected a version like "0.7.2", '
            f"found {needed!r}"
        )
    if _version_tuple(JAX_VERSION) >= _version_tuple(needed):
        return None
    return f"needs jax>={needed} (installed: jax {JAX_VERSION}): pip install 'jax>={needed}'"


def _on_path(name: str) -> bool:
    """Whether module ``name`` is on this venv's path, found without running any package's
    code: ``importlib.util.find_spec("a.b")`` imports ``a`` (mlflow's ``__init__`` takes ~2 s
    of CPU), so a dotted name's submodule is looked for in its top package's folders."""
    head, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(head)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return False
    if spec is None or not rest:
        return spec is not None
    *folders, last = rest.split(".")
    suffixes = importlib.machinery.all_suffixes()
    for root in spec.submodule_search_locations or ():  # none: the top is no package
        where = Path(root, *folders)
        if (where / last).is_dir() or any((where / f"{last}{s}").is_file() for s in suffixes):
            return True
    return False


def find_missing_extras(
    extras: dict[str, tuple[str, ...]], on_path: Callable[[str], bool] = _on_path
) -> dict[str, tuple[str, ...]]:
    """Each extra of ``extras`` with its modules that ``on_path`` does not find."""
    return {extra: tuple(m for m in mods if not on_path(m)) for extra, mods in extras.items()}


MISSING_EXTRAS = find_missing_extras(EXTRAS)


def missing_extra_modules(extra: str) -> tuple[str, ...]:
    """The modules of ``extra`` (a key of :data:`EXTRAS`) that this venv does not have."""
    return MISSING_EXTRAS[extra]


def extra_reason(extra: str) -> str:
    """The skip reason of a test that needs ``extra`` (a key of :data:`EXTRAS`), naming it:
    for ``@pytest.mark.extra``, and at a module's top for its imports,
    ``pytest.importorskip("optuna", reason=extra_reason("sweep"))``."""
    missing = MISSING_EXTRAS.get(extra) or EXTRAS[extra]
    return f"needs the [{extra}] extra ({', '.join(missing)} not installed): pip install -e '.[{extra}]'"


def missing_extra_of(exc: BaseException | None) -> str | None:
    """The missing extra that ``exc`` is the failure for: an ImportError naming one of its
    missing modules (or a module inside one, or a package above one), or jaxaot's own error
    for it (MissingDependencyError; the BackendError of a topology compile without libtpu or
    the CUDA plugin), whose message names ``jaxaot[<extra>]``; None for any other exception,
    or an extra that is installed."""
    name = (exc.name or "") if isinstance(exc, ImportError) else ""
    for extra, missing in MISSING_EXTRAS.items():
        if not missing:
            continue
        if name and any(
            name == m or name.startswith(m + ".") or m.startswith(name + ".") for m in missing
        ):
            return extra
        if isinstance(exc, (MissingDependencyError, BackendError)) and (
            f"'jaxaot[{extra}]'" in str(exc)
        ):
            return extra
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed and report.when in ("setup", "call") and call.excinfo is not None:
        extra = missing_extra_of(call.excinfo.value)
        if extra is not None:
            report.outcome = "skipped"
            report.longrepr = (
                str(item.path),
                item.location[1] or 0,
                f"Skipped: {extra_reason(extra)}",
            )
    return report


class _ExtrasModule(pytest.Module):
    """A test module whose import failing for a missing extra skips it, naming the extra."""

    def _getobj(self) -> Any:
        try:
            return super()._getobj()
        except pytest.Collector.CollectError as exc:
            extra = missing_extra_of(exc.__cause__)
            if extra is None:
                raise
            raise pytest.skip.Exception(extra_reason(extra), allow_module_level=True) from None


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
    return _ExtrasModule.from_parent(parent, path=module_path)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """What is alive once the tests are collected (the imported modules, Hydra's and JAX's
    tables) lives for the session: frozen out of the collector's way, each full collection
    scans only what the tests made."""
    gc.collect()
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: left out of the fast tier (make test-fast)")
    config.addinivalue_line(
        "markers",
        "plain_process: its `jaxaot` runs start a plain process, never the suite's server "
        "(the process itself is tested)",
    )
    config.addinivalue_line(
        "markers",
        f"extra(*names): needs these optional extras ({', '.join(EXTRAS)}); skipped, naming "
        "them, where they are not installed",
    )
    config.addinivalue_line(
        "markers",
        'requires_jax(version): needs jax >= version ("0.7.2"); skipped, naming it, on an older jax',
    )
    # pytest-xdist's, registered here too for runs without it (-p no:xdist)
    config.addinivalue_line("markers", "xdist_group(name): run in one xdist worker")
    config.pluginmanager.register(_XdistGroupNodeIds(), "jaxaot-xdist-group-node-ids")


class _XdistGroupNodeIds:
    """An xdist worker (--dist loadgroup) tells the controller each test's group by naming it
    ``<nodeid>@<group>``, which xdist 3.8 writes to ``item._nodeid``; pytest 9.2 reads a node's
    id from ``item._id``, so without this every test is a group of its own."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            named = item.__dict__.get("_nodeid")
            if not isinstance(named, str) or named == item.nodeid:
                continue  # no group, or a pytest that reads the id xdist wrote
            from _pytest.nodeid import NodeId  # pytest 9.2's node ids

            item._id = NodeId.parse(named)
            if item.nodeid != named:  # another pytest: groups would silently stop working
                raise pytest.UsageError(
                    f"{item.nodeid}: xdist names this test {named!r} (its group) and pytest "
                    f"{pytest.__version__} does not take that id; update "
                    "tests/conftest.py's _XdistGroupNodeIds for this pytest/xdist"
                )


# First: an xdist worker names each test by the xdist_group marks it has when its hook runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
        for mark in item.iter_markers("extra"):
            for extra in mark.args:
                if extra not in EXTRAS:
                    raise pytest.UsageError(
                        f"{item.nodeid}: @pytest.mark.extra: expected one of {', '.join(EXTRAS)}, "
                        f"found {extra!r}"
                    )
                if missing_extra_modules(extra):
                    item.add_marker(pytest.mark.skip(reason=extra_reason(extra)))
        for mark in item.iter_markers("requires_jax"):
            reason = requires_jax_reason(item, mark.args[0] if len(mark.args) == 1 else mark.args)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        if "slurm" in getattr(item, "fixturenames", ()):
            # one throw-away SLURM cluster at a time: its tests run in one xdist worker
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif not item.get_closest_marker("xdist_group") and _shares_a_slow_fixture(item):
            # a worker makes a module-scoped fixture for the tests it runs: the tests that share
            # a slow one run in one worker (--dist loadgroup), which makes it once
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
