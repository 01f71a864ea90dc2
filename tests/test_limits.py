"""Limits checked before any work: device counts, array sizes, input memory, seeds.

Unchecked, each case starts work it cannot finish: a million virtual CPU devices, an XLA abort
(SIGABRT) on an array size that overflows int64, a MemoryError after compiling, a seed that
fails in the execute stage. Each is one line on stderr, exit 1, before the run starts.
The 2048-device case is XLA:CPU's real limit, measured: it compiles, 2049 do not.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import cli_env, read_manifest, run_cli
from jaxaot.config.argspec import memory_bytes


def _jaxaot(tmp_path: Path, *overrides: str, cpu: bool = True):  # type: ignore[no-untyped-def]
    """``jaxaot <overrides>`` into ``tmp_path/run``: with JAX's CPU backend alone
    (JAX_PLATFORMS=cpu), or, for a run refused before JAX starts (``cpu=False``), in the
    environment as it is."""
    env = cli_env(JAX_PLATFORMS="cpu") if cpu else cli_env()
    return run_cli(
        [*overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, timeout=120
    )


def _one_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("jaxaot: error: ")
    return lines[0].removeprefix("jaxaot: error: ")


def test_a_million_devices_are_refused_before_jax(tmp_path: Path) -> None:
    proc = _jaxaot(
        tmp_path, "program=collectives", "stage_out.axis_env=[[i,1000],[j,1000]]", cpu=False
    )
    assert proc.returncode == 1
    assert _one_error(proc.stderr).startswith(
        "stage_out.axis_env=[[i,1000],[j,1000]] needs 1000000 virtual CPU devices"
    )
    assert not (tmp_path / "run" / "manifest.json").exists()  # refused before the run began


def test_xla_cpus_real_limit_2048_devices_compiles(tmp_path: Path) -> None:
    # The largest count XLA:CPU runs in one process; jaxaot.config.mesh.XLA_CPU_MAX_DEVICES.
    proc = _jaxaot(
        tmp_path,
        "program=collectives_psum",
        "stage_out.axis_env=[[i,2048]]",
        "compile.max_devices=2048",
        "stop_after=compile",
    )
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(tmp_path / "run")
    assert manifest["backend"]["device_count"] == 2048
    assert manifest["stages"]["compile"]["status"] == "ran"


def test_an_overflowing_shape_is_one_line_not_sigabrt(tmp_path: Path) -> None:
    proc = _jaxaot(
        tmp_path,
        "program.target=jax.numpy:sin",
        "program.args=[f32[99999999999,99999999999]]",
        cpu=False,
    )
    assert proc.returncode == 1, proc.stderr  # was -6 (SIGABRT) in the compile stage
    assert _one_error(proc.stderr).startswith(
        "program.args[0]: f32[99999999999,99999999999] has 1e+22 elements"
    )


def test_inputs_larger_than_memory_are_refused_before_compiling(tmp_path: Path) -> None:
    memory = memory_bytes()
    assert memory is not None
    rows = memory // (4 * 1024) + 1  # one f32[rows,1024] argument just over this machine's memory
    proc = _jaxaot(
        tmp_path, "program.target=jax.numpy:sin", f"program.args=[f32[{rows},1024]]", cpu=False
    )
    assert proc.returncode == 1, proc.stderr
    assert "program.args[0] alone is" in _one_error(proc.stderr)
    assert not (tmp_path / "run" / "manifest.json").exists()
    # Compiling alone allocates no inputs: the same program compiles.
    ok = run_cli(
        [
            "program.target=jax.numpy:sin",
            f"program.args=[f32[{rows},1024]]",
            "stop_after=compile",
            f"hydra.run.dir={tmp_path / 'compiled'}",
        ],
        cwd=tmp_path,
        env=cli_env(JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr


def test_a_negative_seed_names_the_key(tmp_path: Path) -> None:
    proc = _jaxaot(tmp_path, "program=axpy", "execute.seed=-1", cpu=False)
    assert proc.returncode == 1
    assert _one_error(proc.stderr) == "execute.seed: expected an int >= 0, found -1"


def test_memory_bytes_is_at_most_the_machines() -> None:
    memory = memory_bytes()
    assert memory is not None
    assert 0 < memory <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_XLA_PROBE = """
import sys, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
n = int(sys.argv[1])
jax.config.update("jax_num_cpu_devices", n)
mesh = jax.make_mesh((n,), ("i",), devices=jax.devices())
arg = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=NamedSharding(mesh, P("i")))
try:
    jax.jit(lambda x: jnp.sum(x)).trace(arg).lower().compile()
except Exception as exc:
    print(str(exc).splitlines()[0])
else:
    print("compiled")
"""


def test_xla_cpu_itself_stops_at_2048_devices(tmp_path: Path) -> None:
    """The fact XLA_CPU_MAX_DEVICES states, checked on the installed jaxlib (2049: XLA's
    misleading multiprocess error, which jaxaot now replaces with its own before starting)."""
    import subprocess
    import sys

    from jaxaot.config.mesh import XLA_CPU_MAX_DEVICES

    env = cli_env(JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _XLA_PROBE, str(XLA_CPU_MAX_DEVICES + 1)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "Multiprocess computations aren't implemented on the CPU backend" in out
