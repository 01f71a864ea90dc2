"""The version matrix: jaxaot's core tests on the oldest and the newest jax it supports, on
Python 3.11 and 3.13 (``make test-matrix``; ``nox -l`` lists the sessions).

Each session is a venv of its own under ``.nox/``, made by nox with the registry's jax and
jaxlib wheels of one version and this checkout installed editable with the dev extra only (a
test that needs another extra is skipped, naming it; one that needs a newer jax is skipped,
naming the version: tests/conftest.py). nox finds ``python3.11`` and ``python3.13`` on PATH (the
Makefile makes pyenv's visible); a missing one fails the session.

- ``core``: the fast tier (``-m "not slow"``: every test that starts no process, runs no
  pipeline and compiles nothing) and the slow tests of :data:`CORE_FILES`.
- ``smoke``: the oldest jax's quick check that ``.ci/run`` runs beside ``make test``: a few
  pipeline runs (a program, a mesh, a snapshot written and verified, jaxaot-diff) and
  :data:`SMOKE_TESTS`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import tomllib

import nox
import nox.command

OLDEST_JAX = "0.6.2"
NEWEST_JAX = "0.10.2"
PYTHONS = ["3.11", "3.13"]

# The pipeline tests beside the fast tier: the code that meets JAX's version-dependent surface
# end to end. The stages themselves (trace, lower, compile, execute; layouts and donation), the
# on-disk artifacts that must agree across versions (snapshots, their diff, the store's
# serialized exports), and meshes and shardings (abstract meshes, the mesh context).
CORE_FILES = [
    "tests/test_stages.py",
    "tests/test_layouts.py",
    "tests/test_snapshot.py",
    "tests/test_diff.py",
    "tests/test_store.py",
    "tests/test_aot_mesh.py",
    "tests/test_shardings.py",
]
# The smoke's tests: the compat layer's (every private name it reads resolves on this jax, each
# version gate takes its branch) and the stages' (trace, lower, compile, execute of every kind of
# argument and output). Not tests/test_layers.py: its type check reads the default jax's stubs.
SMOKE_TESTS = ["tests/test_compat.py", "tests/test_stages.py"]

nox.options.sessions = ["core"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


def _workers() -> str:
    """pytest-xdist workers: one a core, at most 4 (the Makefile's TEST_WORKERS rule)."""
    return os.environ.get("TEST_WORKERS") or str(min(os.cpu_count() or 2, 4))


def _install(session: nox.Session, jax: str, *also: str) -> None:
    session.install("-e", ".[dev]" if not also else ".", f"jax=={jax}", f"jaxlib=={jax}", *also)


def _dev(*names: str) -> list[str]:
    """The dev extra's requirements (pyproject.toml) of the distributions ``names``."""
    with open("pyproject.toml", "rb") as f:
        dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    return [r for r in dev if re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] in names]


def _pytest(session: nox.Session, *args: str) -> None:
    session.run(
        "python", "-m", "pytest", "-q", "-n", _workers(), "--dist", "loadgroup", *args,
        *session.posargs,
    )  # fmt: skip


@nox.session(python=PYTHONS)
@nox.parametrize("jax", [OLDEST_JAX, NEWEST_JAX])
def core(session: nox.Session, jax: str) -> None:
    """The fast tier and the slow tests of CORE_FILES on one jax and one Python."""
    _install(session, jax)
    failed = []
    for part, args in (
        ("fast tier", ["-m", "not slow"]),
        ("core files", ["-m", "slow", *CORE_FILES]),
    ):
        try:  # both parts run; the session fails after them, naming each that failed
            _pytest(session, *args)
        except nox.command.CommandFailed:
            failed.append(part)
    if failed:
        session.error(f"failed: {', '.join(failed)} (jax {jax}, Python {session.python})")


@nox.session(python=PYTHONS[0])
def smoke(session: nox.Session) -> None:
    """The oldest jax: a program, a mesh, a snapshot written and verified, jaxaot-diff between
    them, then SMOKE_TESTS. The runs go to a temp dir with their own store and caches. Of the dev
    extra it installs pytest and pytest-xdist only (the linters and nox: a minute more)."""
    _install(session, OLDEST_JAX, *_dev("pytest", "pytest-xdist"))
    work = tempfile.mkdtemp(prefix="jaxaot-smoke-")
    env = {
        "JAXAOT_SERVER": "0",
        "JAXAOT_STORE_DIR": os.path.join(work, "store"),
        "XDG_CACHE_HOME": os.path.join(work, "cache"),
    }
    golden = os.path.join(work, "golden")
    try:
        with session.chdir(work):
            session.run("jaxaot", "program=mlp", env=env)
            session.run("jaxaot", "program=mlp", "mesh=data2_model4", env=env)
            base = ["jaxaot", "program=mlp", "stop_after=compile"]
            session.run(*base, f"snapshot.write={golden}", env=env)
            session.run(*base, f"snapshot.verify={golden}", "hydra.run.dir=verified", env=env)
            session.run("jaxaot-diff", golden, "verified", env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _pytest(session, *SMOKE_TESTS)
