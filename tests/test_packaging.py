"""The project installs as one import name, ``jaxaot``, and runs from a wheel: the configs are a
package resource, the entry points work, and a user's own ``pipeline`` package does not matter."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel built from a copy of the tree (setuptools leaves build/ and *.egg-info/ in the
    tree it builds) and installed into a folder of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheels, site, src = tmp / "wheels", tmp / "site", tmp / "src"
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "outputs", "__pycache__", ".*_cache"
    )
    shutil.copytree(REPO, src, ignore=ignore)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    (wheel,) = wheels.glob("jaxaot-*.whl")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    return wheel, site


def _env(site: Path, tmp_path: Path, *extra: Path) -> dict[str, str]:
    path = ":".join(str(p) for p in (*extra, site))
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "JAXAOT_STORE_DIR": str(tmp_path / "s")}


def test_the_wheel_installs_jaxaot_and_hydra_plugins_only(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == {"jaxaot", "hydra_plugins"}, top
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")] or [None]
    if top_level:
        listed = set(zipfile.ZipFile(wheel).read(top_level).decode().split())
        assert listed <= {"jaxaot", "hydra_plugins"}, listed
    # every shipped YAML, the GPU target configs and the examples are in the package
    shipped = {
        "jaxaot/conf/" + str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").rglob("*.yaml")
    }
    assert shipped and shipped <= names
    targets = {
        "jaxaot/targets/gpu_targets/" + p.name
        for p in (REPO / "pipeline" / "targets" / "gpu_targets").glob("*.txtpb")
    }
    assert "jaxaot/targets/gpu_targets/h100.txtpb" in targets and targets <= names
    assert {
        "jaxaot/cli/main.py",
        "jaxaot/stages/compile.py",
        "jaxaot/examples/transformer.py",
        "jaxaot/py.typed",
    } <= names


def test_the_installed_wheel_runs_and_ignores_a_user_pipeline_package(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    """A user project with its own ``pipeline`` package, in the current directory: jaxaot still
    starts (it once failed with ``No module named 'pipeline.cli'``), and the user's
    ``pipeline.model:f`` is the program it runs."""
    _, site = installed
    user = tmp_path / "project"
    (user / "pipeline").mkdir(parents=True)
    (user / "pipeline" / "__init__.py").write_text("")
    (user / "pipeline" / "model.py").write_text(
        textwrap.dedent("""\
        import jax.numpy as jnp

        def f(x):
            return jnp.sum(x) * 3
        """)
    )
    env = _env(site, tmp_path, user)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import jaxaot, jaxaot.conf, pipeline; "
            "print(jaxaot.__file__); print(pipeline.__file__)",
        ],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr
    jaxaot_file, user_file = probe.stdout.split()
    assert jaxaot_file.startswith(str(site)) and user_file.startswith(str(user))
    for name in ("stages", "conf", "jaxaot_examples"):
        gone = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert gone.returncode != 0 and "No module named" in gone.stderr, name
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxaot",
            "program=axpy",
            "program.target=pipeline.model:f",
            "program.args=[f32[4]]",
            "program.kwargs={}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "pipeline.model:f" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    assert (tmp_path / "run" / "execute" / "outputs.npz").is_file()
    version = subprocess.run(
        [sys.executable, "-m", "jaxaot", "--version"],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
    )
    assert version.returncode == 0 and version.stdout.startswith("jaxaot "), version.stderr


def test_the_source_folder_refuses_a_second_name() -> None:
    """The repository root on sys.path makes ``pipeline/`` importable as ``pipeline``: that would
    be a second copy of every module (two ``JaxaotError`` classes, two config registrations), so
    it is refused with a message that says what to import instead."""
    proc = subprocess.run(
        [sys.executable, "-c", "import pipeline"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "import it as 'jaxaot'" in proc.stderr.strip().splitlines()[-1]


def test_the_editable_install_serves_this_checkout() -> None:
    import jaxaot
    import jaxaot.conf
    import jaxaot.stages

    assert Path(jaxaot.__file__).parent == REPO / "pipeline"
    assert Path(jaxaot.stages.__file__).parent == REPO / "stages"
    assert Path(jaxaot.conf.__file__).parent == REPO / "conf"
