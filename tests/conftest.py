"""Shared fixtures: an isolated store per test, the CLI in a subprocess, configs composed in-process.

Every test gets its own ``JAXAOT_STORE_DIR`` so runs never share cache entries by accident.
CLI tests run ``python -m jaxaot`` with this checkout first on PYTHONPATH, so they test
the code in the tree (also from a git worktree), not whatever is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jaxaot
import pytest

REPO = Path(__file__).resolve().parent.parent
# Hypothesis keeps its caches in ./.hypothesis by default: the tests leave nothing where pytest
# runs (issue 14), so they go to the temp dir.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "jaxaot-tests-hypothesis")
)
# jaxaot's per-user caches (the default store, the roofline's calibration) live under
# $XDG_CACHE_HOME: the session gets its own, set before any test imports or starts jaxaot, so
# that no in-process run and no subprocess (cli_env copies os.environ) touches ~/.cache.
SESSION_CACHE_HOME = Path(tempfile.mkdtemp(prefix="jaxaot-tests-cache-"))
os.environ["XDG_CACHE_HOME"] = str(SESSION_CACHE_HOME)

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


@pytest.fixture(autouse=True, scope="session")
def test_server() -> Iterator[str | None]:
    """``JAXAOT_TEST_SERVER=1`` (``make test-server``): the suite's ``jaxaot`` runs go through
    one resident server (jaxaot.cli.server) on a private socket; otherwise every run is
    in-process. Yields that socket's path, or None."""
    if os.environ.get("JAXAOT_TEST_SERVER", "") in ("", "0"):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="jaxaot-test-server-") as tmp:
        env = cli_env(JAXAOT_SERVER_SOCKET=str(Path(tmp) / "server.sock"))
        env.pop("JAXAOT_SERVER", None)
        cmd = [sys.executable, "-m", "jaxaot", "server"]
        started = subprocess.run([*cmd, "start"], env=env, capture_output=True, text=True)
        assert started.returncode == 0, started.stderr
        try:
            yield env["JAXAOT_SERVER_SOCKET"]
        finally:
            subprocess.run([*cmd, "stop"], env=env, capture_output=True, text=True)


@pytest.fixture(autouse=True)
def isolated_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_server: str | None
) -> Path:
    store = tmp_path / "store"
    monkeypatch.setenv("JAXAOT_STORE_DIR", str(store))
    # The import policy is the user's: a developer's own trust file or variables never reach
    # the suite (a test that needs them sets them).
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    for name in ("JAXAOT_ALLOW_IMPORTS", "JAXAOT_TRUST_STORE", "JAXAOT_TRUST_COMMAND_LINE"):
        monkeypatch.delenv(name, raising=False)
    # No test's `jaxaot` reaches a developer's server; with JAXAOT_TEST_SERVER=1 every one
    # reaches the suite's own (tests/test_server.py starts its own per test).
    if test_server is None:
        monkeypatch.setenv("JAXAOT_SERVER", "0")
        monkeypatch.setenv("JAXAOT_SERVER_SOCKET", str(tmp_path / "no-server" / "server.sock"))
    else:
        monkeypatch.delenv("JAXAOT_SERVER", raising=False)
        monkeypatch.setenv("JAXAOT_SERVER_SOCKET", test_server)
    return store


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HYDRA_FULL_ERROR", "0")
    env.update(extra)
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


# The fast tier (`make test-fast`, `pytest -m "not slow"`): the unit tests of the modules below,
# less any that starts a process (the `cli` fixture, a cluster) or runs a whole pipeline
# (`compose_run`), and the lint and type check. Every other test is marked `slow`.
FAST_MODULES = frozenset(
    {
        "test_argspec",
        "test_canonical",
        "test_config",
        "test_inputs",
        "test_jax_options",
        "test_keylock",
        "test_layers",
        "test_memo",
        "test_report",
        "test_summary",
    }
)
SLOW_FIXTURES = frozenset({"cli", "compose_run", "slurm"})
SLOW_TESTS = frozenset({"test_lint_and_types"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: left out of the fast tier (make test-fast)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        fast = (
            module in FAST_MODULES
            and getattr(item, "originalname", item.name) not in SLOW_TESTS
            and not SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
        )
        if not fast:
            item.add_marker(pytest.mark.slow)
