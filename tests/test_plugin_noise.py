"""jaxaot's own commands stay quiet in a venv with the GPU/TPU extras on a host without GPUs
or TPUs: none of what the CUDA plugin and libtpu print when JAX starts every installed plugin
(absl start-up lines, the CUDA version check's tracebacks, libtpu's host-bounds errors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, extra_reason, missing_extra_modules

pytestmark = pytest.mark.plain_process  # what a started process prints

NOISE = (
    "cudart_stub",
    "Could not find cuda drivers",
    "absl::InitializeLog",
    "Jax plugin configuration error",
    "Traceback",
    "TPU_ACCELERATOR_TYPE",
    "TPU_WORKER_HOSTNAMES",
    "Source Location Trace",
)
EXTRAS = [extra for extra in ("cuda-aot", "tpu") if not missing_extra_modules(extra)]

COMMANDS = {
    "version": ["jaxaot.cli.main", "--version"],
    "run": ["jaxaot", "program=axpy", "execute.repeats=1"],
    "store stats": ["jaxaot.cli.store_cmd", "stats"],
    "topology compile": [
        "jaxaot",
        "program=axpy",
        "compile.topology=v5e:2x2",
        "stop_after=compile",
    ],
}


@pytest.mark.slow
@pytest.mark.skipif(not EXTRAS, reason=f"{extra_reason('cuda-aot')}, or the [tpu] extra")
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.extra("tpu")) if "topology" in n else n for n in COMMANDS],
)
def test_jaxaots_own_commands_print_no_plugin_noise(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env["JAXAOT_STORE_DIR"] = str(tmp_path / "store")
    (tmp_path / "store").mkdir()  # an empty store: what jaxaot-store stats reads
    module, *args = COMMANDS[name]
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path / 'run'}"]
        if module == "jaxaot"
        else [sys.executable, "-m", module, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for needle in NOISE:
        assert needle not in proc.stdout + proc.stderr, proc.stderr
