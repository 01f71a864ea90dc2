"""Exporting a run's executable into JAX's own persistent compilation cache
(``jaxaot-store export-jax-cache``, :mod:`jaxaot.store.jax_cache`): a fresh process running plain ``jax.jit`` with that cache
directory loads it (JAX's own hit log and monitoring event), with outputs equal bit for bit to
its own compile's; a job whose key differs misses; what cannot be keyed soundly is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env, run_cli

# One worker builds the module's runs once (make test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("jax_cache_export")

PROGRAM = """
import numpy as np
import jax
import jax.numpy as jnp

TABLE = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64)


def f(x, y):
    # A scan body (closed_call: no argument attributes) and jitted helpers (tril, _where: empty
    # ones) beside main: MLIR's printer leaves the empty lists out of the module text.
    def body(c, w):
        return jnp.tanh(c @ w) * 2.0 + 1.0, None

    z, _ = jax.lax.scan(body, x, jnp.stack([y, y.T]))
    return jnp.where(z > 1.5, jnp.tril(z), z)


def g(x):
    return x @ TABLE.T
"""

# A registered HLO module transformation that turns every multiply into an add: XLA runs it
# inside each compile of the process (x * 3 + 1 compiles to x + 3 + 1); JAX's key has no trace
# of it.
PASS_PROGRAM = """
import jaxlib._hlo as hlo
from jax.extend import xla as jxla


def mul_to_add(proto):
    module = hlo.HloModule.from_serialized_hlo_module_proto(proto)
    text = module.to_string(hlo.HloPrintOptions.short_parsable()).replace("multiply(", "add(")
    return hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()


jxla.register_hlo_module_transformation(mul_to_add, name="mul_to_add", platforms="cpu")


def f(x):
    return x * 3.0 + 1.0
"""

# Plain jax.jit, no jaxaot: the cache hits JAX reports for jit_f, and the output's bytes.
TARGET = """
import json, logging, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax._src import monitoring

hits, events = [], []


class Hits(logging.Handler):
    def emit(self, record):
        if "Persistent compilation cache hit for 'jit_f'" in record.getMessage():
            hits.append(record.getMessage())


log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Hits())
monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
import b2prog

x = (jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) / 64).block_until_ready()
before = sorted(os.listdir(sys.argv[1])) if os.path.isdir(sys.argv[1]) else []
out = np.asarray(jax.jit(b2prog.f)(x, x))
print(json.dumps({
    "hits": len(hits),
    "hit_events": events.count("/jax/compilation_cache/cache_hits"),
    "out": out.tobytes().hex(),
    "dtype": str(out.dtype),
}))
"""


def _env(mods: Path, **extra: str) -> dict[str, str]:
    env = cli_env(JAX_PLATFORMS="cpu", **extra)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{mods}"
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(extra)
    return env


def _export(cache: Path, *run_dirs: Path, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """``jaxaot-store export-jax-cache CACHE RUN_DIR...`` in a process of its own: its lines and
    exit status."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxaot.cli.store_cmd", "export-jax-cache", str(cache)]
        + [str(r) for r in run_dirs],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return {"lines": proc.stdout.strip().splitlines(), "rc": proc.returncode}


def _python(code: str, *args: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """jaxaot runs (stop_after=compile, in this process) of b2prog.f, of f lowered for cpu and
    tpu (compiled through its export), of f with compile.dump, and of b2prog.g (a large
    captured constant, elided in its text); and, in a process of its own, of b2pass.f compiled
    with its HLO module transformation registered."""
    import jaxaot

    tmp = tmp_path_factory.mktemp("jaxcache")
    mods = tmp / "mods"
    mods.mkdir()
    (mods / "b2prog.py").write_text(PROGRAM)
    (mods / "b2pass.py").write_text(PASS_PROGRAM)
    made = {
        "f": ["program.target=b2prog:f", "program.args=[f32[8,8],f32[8,8]]"],
        "two_platforms": [
            "program.target=b2prog:f",
            "program.args=[f32[8,8],f32[8,8]]",
            "lower.platforms=[cpu,tpu]",
        ],
        "constant": ["program.target=b2prog:g", "program.args=[f32[8,64]]"],
        "dumped": [
            "program.target=b2prog:f",
            "program.args=[f32[8,8],f32[8,8]]",
            "compile.dump=true",
        ],
    }
    out = {"mods": mods, "tmp": tmp}
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(mods))
        mp.setenv("JAXAOT_STORE_DIR", str(tmp / "store"))
        for name, overrides in made.items():
            result = jaxaot.run(
                jaxaot.compose([*overrides, "stop_after=compile"]), run_dir=tmp / name
            )
            assert result.run_dir == tmp / name
            out[name] = tmp / name
        sys.modules.pop("b2prog", None)
    args = ["program.target=b2pass:f", "program.args=[f32[8]]", "stop_after=compile"]
    proc = run_cli(
        [*args, f"hydra.run.dir={tmp / 'with_pass'}"],
        cwd=tmp,
        env=_env(mods, JAXAOT_STORE_DIR=str(tmp / "store")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["with_pass"] = tmp / "with_pass"
    yield out


@pytest.fixture(scope="module")
def exported(runs: dict[str, Path]) -> dict[str, Any]:
    """``jaxaot-store export-jax-cache`` of f's run into ``jax-cache``, in a process with the
    jobs' environment (one CPU device, no XLA_FLAGS)."""
    tmp = runs["tmp"]
    cache = tmp / "jax-cache"
    result = _export(cache, runs["f"], env=_env(runs["mods"]), cwd=tmp)
    return result | {"cache": cache}


def _jax_cache_read(entry: bytes) -> tuple[bytes, int]:
    """(the serialized executable, the compile seconds) of a JAX cache entry, read as jax 0.10.2's
    ``compilation_cache`` writes one: compressed with zstd (Python 3.14's ``compression.zstd``,
    else the zstandard package) where there is one, else zlib, around the compile seconds in 4
    big-endian bytes and the executable."""
    try:
        from compression import zstd  # type: ignore[import-not-found]

        raw = zstd.decompress(entry)
    except ImportError:
        try:
            import zstandard
        except ImportError:
            raw = zlib.decompress(entry)
        else:
            raw = zstandard.ZstdDecompressor().decompress(entry)
    return raw[4:], int.from_bytes(raw[:4], "big")


def test_plain_jit_hits_the_exported_executable_bit_for_bit(
    runs: dict[str, Path], exported: dict[str, Any]
) -> None:
    from jaxaot.store import jax_cache

    tmp, mods, cache = runs["tmp"], runs["mods"], exported["cache"]
    env = _env(mods)
    text = (runs["f"] / "lower" / "module.stablehlo.mlir").read_text()
    assert "func.func private @closed_call(" in text and "func.func private @tril(" in text
    assert exported["rc"] == 0, exported
    [line] = exported["lines"]
    assert line.startswith("written jit_f-"), line
    key = line.split()[1]
    files = sorted(p.name for p in cache.iterdir())
    assert files == [f"{key}-atime", f"{key}-cache"]
    umask = os.umask(0)
    os.umask(umask)
    assert (cache / f"{key}-cache").stat().st_mode & 0o777 == 0o666 & ~umask  # as JAX writes
    # The entry is JAX's format around the very executable the run compiled.
    stored, _ = _jax_cache_read((cache / f"{key}-cache").read_bytes())
    blob = (runs["f"] / "compile" / "executable.bin").read_bytes()
    assert stored == jax_cache.xla_executable(blob)

    hit = _python(TARGET, str(cache), env=env, cwd=tmp)
    assert (hit["hits"], hit["hit_events"]) == (1, 1), hit
    assert sorted(p.name for p in cache.iterdir()) == files  # JAX compiled and wrote nothing
    # The cache path as the job spells it is in JAX's key: the same folder named relatively
    # is another key, where nothing hits and JAX compiles f itself.
    own = _python(TARGET, cache.name, env=env, cwd=tmp)
    assert (own["hits"], own["hit_events"]) == (0, 0), own
    assert (hit["out"], hit["dtype"]) == (own["out"], own["dtype"])  # JAX's own compile's bits


def test_a_job_on_another_device_count_misses_until_exported_for_it(
    runs: dict[str, Path], exported: dict[str, Any]
) -> None:
    tmp, mods, cache = runs["tmp"], runs["mods"], exported["cache"]
    assert exported["rc"] == 0, exported
    # JAX's key hashes the CPU client's topology: its device count.
    two = _env(mods, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    # The miss compiles; on a loaded machine that can take over JAX's 1 s threshold for
    # writing its own entry, which the export would then find present.
    never_writes = dict(two, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1e9")
    missed = _python(TARGET, str(cache), env=never_writes, cwd=tmp)
    assert (missed["hits"], missed["hit_events"]) == (0, 0), missed
    again = _export(cache, runs["f"], env=two, cwd=tmp)
    assert again["lines"][0].startswith("written jit_f-"), again
    assert again["lines"][0].split()[1] != exported["lines"][0].split()[1]
    hit = _python(TARGET, str(cache), env=two, cwd=tmp)
    assert (hit["hits"], hit["hit_events"], hit["out"]) == (1, 1, missed["out"]), hit
    # Exporting for one device again keeps the entry there, as JAX keeps one.
    kept = _export(cache, runs["f"], env=_env(mods), cwd=tmp)
    assert kept["lines"] == [exported["lines"][0].replace("written", "present", 1)]


def test_what_cannot_be_keyed_soundly_is_refused_in_one_line(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxaot.store import jax_cache

    tmp = runs["tmp"]
    cache = tmp / "jax-cache-refused"
    tampered = tmp / "tampered"
    shutil.copytree(runs["f"], tampered)
    blob = bytearray((tampered / "compile" / "executable.bin").read_bytes())
    blob[-1] ^= 1
    (tampered / "compile" / "executable.bin").write_bytes(bytes(blob))
    runs_in: list[str | Path] = [
        runs["two_platforms"],
        runs["constant"],
        tampered,
        tmp / "absent",
        runs["dumped"],
    ]
    results = jax_cache.export_runs(runs_in, str(cache))
    lines, rc = jax_cache.report(results)
    assert rc == 1
    assert [r.state for r in results] == ["refused"] * 5
    assert all("\n" not in line for line in lines)
    assert "lowered for ['cpu', 'tpu']: compiled through its jax.export" in lines[0]
    assert "elides large constants" in lines[1] and "elide_constants_over=null" in lines[1]
    assert "executable.bin differs from its manifest" in lines[2]
    assert lines[3] == f"refused {tmp / 'absent'}: no absent/manifest.json"
    assert "own dump/trace options (compile.dump)" in lines[4]
    # XLA reads every flag of the compile's: other XLA_FLAGS (than the dump and device-count
    # flags JAX's key leaves out) than the compile's are refused.
    compiled_with = runs["f"] / "manifest.json"
    words = json.loads(compiled_with.read_text())["environment"]["flag_variables"]["XLA_FLAGS"]
    monkeypatch.setenv("XLA_FLAGS", " ".join([*words["words"], "--xla_cpu_enable_fast_math=true"]))
    [flags] = jax_cache.export_runs([runs["f"]], str(cache))
    assert flags.state == "refused"
    assert "this process has" in flags.reason and "--xla_cpu_enable_fast_math=true" in flags.reason
    assert flags.reason.endswith("(export with the job's XLA_FLAGS)")
    assert not cache.exists()


def _edited(runs: dict[str, Path], name: str, edit: Any) -> Path:
    """A copy of f's run whose manifest's environment ``edit`` changed (the manifest is not
    hashed: its artifacts are, and they stay as they were)."""
    copy = runs["tmp"] / name
    shutil.copytree(runs["f"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest["environment"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_what_jaxs_key_leaves_out_of_a_compile_is_refused(runs: dict[str, Path]) -> None:
    """XLA ran a registered HLO module transformation inside the compile, or compiled for
    another host CPU, or the manifest cannot say: JAX's key covers neither, so a plain-jit job
    without them would load another program's executable."""
    from jaxaot.stages import xla_inputs
    from jaxaot.store import jax_cache
    from jaxaot.util.host_cpu import host_cpu

    # The manifest records the host CPU the compile key has.
    recorded = json.loads((runs["f"] / "manifest.json").read_text())["environment"]
    assert recorded["host_cpu"] == xla_inputs.host_cpu() == host_cpu()
    passes = json.loads((runs["with_pass"] / "manifest.json").read_text())["environment"]
    assert [p["name"] for p in passes["hlo_transformations"]] == ["mul_to_add"]

    def other_cpu(env: dict[str, Any]) -> None:
        env["host_cpu"] = dict(env["host_cpu"], model="9999", flags="fpu sse2")

    runs_in: list[str | Path] = [
        runs["with_pass"],
        _edited(runs, "other_cpu", other_cpu),
        _edited(runs, "no_cpu", lambda env: env.pop("host_cpu")),
        _edited(runs, "no_passes", lambda env: env.pop("hlo_transformations")),
        _edited(runs, "blind", lambda env: env.update(hlo_transformations_unknown="imported")),
    ]
    cache = runs["tmp"] / "jax-cache-unkeyed"
    results = jax_cache.export_runs(runs_in, str(cache))
    assert [r.state for r in results] == ["refused"] * 5, [r.line() for r in results]
    reasons = [r.reason for r in results]
    assert reasons[0].startswith(
        "compiled with HLO module transformations registered for cpu (mul_to_add): "
    ), reasons[0]
    assert reasons[1].startswith("compiled for another host CPU (flags; model '9999', here ")
    assert reasons[1].endswith("export on the host the jobs run on, from a run compiled there")
    assert reasons[2].startswith("its manifest records no environment.host_cpu")
    assert reasons[3].startswith("its manifest records no environment.hlo_transformations")
    assert reasons[4].startswith("HLO module transformations may have run in its compile")
    assert all("\n" not in r.line() for r in results)
    assert not cache.exists()


def test_a_module_with_a_python_callback_is_refused() -> None:
    """A host callback's or custom partitioning's custom call names a Python callback of the
    compiling process: JAX never files such an executable, and a loaded one gets none."""
    from jaxaot.store import jax_cache

    for target in ("xla_ffi_python_cpu_callback", "CustomSPMDPartitioning"):
        text = (
            "module @jit_f {\n  func.func public @main(%arg0: tensor<3xf32>) -> tensor<3xf32> {\n"
            f"    %0 = stablehlo.custom_call @{target}(%arg0) : (tensor<3xf32>) -> tensor<3xf32>\n"
            "    return %0 : tensor<3xf32>\n  }\n}\n"
        )
        with pytest.raises(jax_cache.Refused, match=f"its module calls {target}, a Python"):
            jax_cache.compiled_module(text, "0" * 64)


def test_a_platform_this_process_has_no_client_for_is_refused_naming_the_fix() -> None:
    """JAX_PLATFORMS without the run's platform: one line naming the variable, no traceback."""
    from jaxaot.store import jax_cache

    with pytest.raises(jax_cache.Refused, match=r"no nosuchplatform client .* JAX_PLATFORMS="):
        jax_cache._client_and_devices({"platform": "nosuchplatform"}, [0])


def _executable(header: bytes, body: bytes) -> bytes:
    from jaxaot.util import protowire as pw

    return pw.encode_varint(len(header)) + header + body


def test_the_serialized_executable_is_read_field_by_field() -> None:
    """The IFRT header's format and name, and PjRt's compile options, of a serialized
    executable; what is not such a message is refused in one line."""
    from jaxaot.store import jax_cache
    from jaxaot.util import protowire as pw

    header = pw.length_delimited(2, b"pjrt_ifrt") + pw.length_delimited(7, b"jit_f")
    options = pw.length_delimited(3, pw.length_delimited(2, b"layout")) + b"\x48\x01"
    body = pw.length_delimited(1, b"executable") + pw.length_delimited(2, options)
    assert jax_cache.recorded(_executable(header, body)) == ("jit_f", options)
    cases = [
        (b"\xff" * 11, "has no header .*varint longer than 10 bytes"),
        (_executable(b"\x12" + b"\xff" * 10 + b"\x01", b""), "varint longer than 10 bytes"),
        (_executable(header, b"\x12\x05abc"), "5 bytes past the end"),
        (_executable(header, b"\x13"), "wire type 3"),
        (_executable(pw.length_delimited(2, b"pjrt"), body), "not jaxlib 0.10.2's pjrt_ifrt"),
        (_executable(header, pw.length_delimited(1, b"executable")), "no compile options"),
    ]
    for data, match in cases:
        with pytest.raises(jax_cache.Refused, match=match):
            jax_cache.recorded(data)
