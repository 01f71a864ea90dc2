"""The project installs as a wheel and runs from it: configs are found outside the source tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO


def test_wheel_carries_the_configs_and_runs_from_an_install(tmp_path: Path) -> None:
    wheels, site, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    # Built from a copy: setuptools leaves build/ and *.egg-info/ in the tree it builds.
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "outputs", "__pycache__", ".*_cache"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(src)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("jaxaot-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped and shipped <= names
    assert {"pipeline/cli.py", "stages/compile.py", "jaxaot_examples/transformer.py"} <= names
    # XLA's GPU target configs (compile.topology=h100..., issue 16) are package data.
    targets = {str(p.relative_to(REPO)) for p in (REPO / "pipeline" / "gpu_targets").glob("*")}
    assert "pipeline/gpu_targets/h100.txtpb" in targets and targets <= names
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)  # fmt: skip
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(site),
        "JAXAOT_STORE_DIR": str(tmp_path / "s"),
    }
    where = subprocess.run([sys.executable, "-c", "import pipeline, conf; print(pipeline.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    assert where.stdout.strip().startswith(str(site)), where.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "program=axpy", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "axpy" in run.stdout and (tmp_path / "run" / "execute" / "outputs.npz").is_file()
