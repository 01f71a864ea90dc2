"""Executables loaded in a process that lowered nothing: LAPACK custom calls, NamedTuple
outputs, and a custom call no one here can vouch for.

Each scenario runs the program once to fill the store and a run directory, then loads the
executable in fresh subprocesses; every output must equal the first run's bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    PAIRS_MODULE,
    SuiteServer,
    cli_env,
    read_manifest,
    run_cli,
    served_env,
    write_pairs_module,
)
from jaxaot.util.fsio import sha256_bytes

# jax.numpy.linalg functions with LAPACK custom calls on CPU, and arguments they accept: each
# one a set of LAPACK targets of its own (solve makes inv's two, det the first of them).
OPS = {
    "inv": "[f32[6,6]]",
    "eigh": "[f32[6,6]]",  # EighResult: a NamedTuple output
    "svd": "[f32[6,6]]",  # SVDResult
    "qr": "[f32[6,6]]",  # QRResult
    "cholesky": "[f32[6,6]]",
}
LAPACK = {  # jax 0.10.2, f32 on CPU
    "inv": {"lapack_sgetrf_ffi", "lapack_strsm_ffi"},
    "eigh": {"lapack_ssyevd_ffi"},
    "svd": {"lapack_sgesdd_ffi"},
    "qr": {"lapack_sgeqrf_ffi", "lapack_sorgqr_ffi"},
    "cholesky": {"lapack_spotrf_ffi"},
}


def _outputs(run_dir: Path) -> dict[str, bytes]:
    """Every output leaf as (dtype, shape, raw bytes): equal means bit for bit."""
    with np.load(run_dir / "execute" / "outputs.npz") as z:
        return {k: (str(z[k].dtype), z[k].shape, z[k].tobytes()) for k in z.files}  # type: ignore[misc]


def _statuses(run_dir: Path) -> dict[str, str]:
    return {s: r["status"] for s, r in read_manifest(run_dir)["stages"].items()}


def _run(tmp_path: Path, name: str, *overrides: str, env: dict[str, str] | None = None) -> Path:
    run_dir = tmp_path / name
    proc = run_cli([*overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return run_dir


@pytest.mark.parametrize("op", sorted(OPS))
def test_linalg_executable_loads_cold_from_the_store(tmp_path: Path, op: str, compose_run) -> None:  # type: ignore[no-untyped-def]
    """Run once (here), then resume the lowering in a fresh process that lowers nothing and
    hits the store: the route that segfaulted."""
    from jaxaot.stages import custom_calls

    program = [f"program.target=jax.numpy.linalg:{op}", f"program.args={OPS[op]}"]
    first = compose_run(*program).run_dir
    hlo = (first / "compile" / "optimized.hlo.txt").read_bytes()
    assert {t for t in custom_calls.targets_of(hlo) if t.startswith("lapack_")} == LAPACK[op]
    lowered = json.loads((first / "lower" / "lowered.json").read_text())
    assert (first / "lower" / "exported.bin").is_file(), "every linalg op must be resumable"
    results = {"eigh": "EighResult", "svd": "SVDResult", "qr": "QRResult"}
    if op in results:
        assert lowered["namedtuples"] == [f"jax._src.numpy.linalg:{results[op]}"]
    # A resumed compile is keyed by its export's bytes: the first resume here stores the
    # executable it compiles from exported.bin, the cold process below is served that entry.
    # (in a fresh process too: this test process may run more devices, which the key covers)
    warm = _run(tmp_path, "warm", f"resume_from={first}", "start_at=compile")
    assert _statuses(warm)["compile"] == "ran"
    cold = _run(tmp_path, "cold", f"resume_from={first}", "start_at=compile")
    assert _statuses(cold)["compile"] == "cached"
    assert _outputs(cold) == _outputs(first)


@pytest.mark.parametrize("op, args", [("solve", "[f32[6,6], f32[6]]"), ("det", "[f32[6,6]]")])
def test_solve_and_det_make_no_lapack_call_inv_does_not(op: str, args: str, compose_run) -> None:  # type: ignore[no-untyped-def]
    """Why OPS leaves them out: their cold loads are inv's (the same LAPACK targets, fewer)."""
    from jaxaot.stages import custom_calls

    run = compose_run(
        f"program.target=jax.numpy.linalg:{op}", f"program.args={args}", "stop_after=compile"
    )
    hlo = (run.run_dir / "compile" / "optimized.hlo.txt").read_bytes()
    lapack = {t for t in custom_calls.targets_of(hlo) if t.startswith("lapack_")}
    assert lapack and lapack <= LAPACK["inv"], lapack


@pytest.mark.parametrize("op", ["inv", "eigh"])
def test_every_load_route_gives_the_first_runs_outputs(tmp_path: Path, op: str) -> None:
    program = [f"program.target=jax.numpy.linalg:{op}", f"program.args={OPS[op]}"]
    first = _run(tmp_path, "first", *program)
    hit = _run(tmp_path, "hit", *program)  # a fresh process, a store hit
    assert _statuses(hit)["compile"] == "cached"
    resumed = _run(tmp_path, "resumed", f"resume_from={first}", "start_at=execute")
    assert _statuses(resumed)["compile"] == "resumed"
    off = _run(tmp_path, "off", f"resume_from={first}", "start_at=compile", "store.enabled=false")
    assert _statuses(off)["compile"] == "ran"  # compiled from exported.bin alone
    for run in (hit, resumed, off):
        assert _outputs(run) == _outputs(first), run.name


def _pairs_env(mods: Path) -> dict[str, str]:
    """The environment of a `jaxaot` run that finds ``cold_pairs`` in ``mods``."""
    return cli_env(PYTHONPATH=f"{cli_env()['PYTHONPATH']}:{mods}")


@pytest.fixture(scope="module")
def pairs_run(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[Path, Path]:
    """A whole `jaxaot` run of ``cold_pairs:pair`` (a NamedTuple output), its module in a folder
    of its own and the run with a store of its own: (that folder, the run dir). The tests
    resume from it in fresh processes, each with its own store."""
    tmp = tmp_path_factory.mktemp("pairs")
    mods = write_pairs_module(tmp / "usermods", "cold_pairs").parent
    env = served_env(
        suite_server,
        PYTHONPATH=f"{cli_env()['PYTHONPATH']}:{mods}",
        JAXAOT_STORE_DIR=str(tmp / "store"),
        XDG_CONFIG_HOME=str(tmp / "config"),
    )
    first = _run(tmp, "first", "program.target=cold_pairs:pair", "program.args=[f32[5]]", env=env)
    return mods, first


def test_user_namedtuple_outputs_are_resumable(
    tmp_path: Path, pairs_run: tuple[Path, Path]
) -> None:
    mods, first = pairs_run
    env = _pairs_env(mods)
    assert json.loads((first / "lower" / "lowered.json").read_text())["namedtuples"] == [
        "cold_pairs:Pair"
    ]
    paths = [o["path"] for o in json.loads((first / "execute" / "outputs.json").read_text())]
    assert paths == [".total", ".scaled"]
    for start_at in ("execute", "compile"):
        resumed = _run(
            tmp_path, f"from_{start_at}", f"resume_from={first}", f"start_at={start_at}", env=env
        )
        assert _outputs(resumed) == _outputs(first)
        assert [
            o["path"] for o in json.loads((resumed / "execute" / "outputs.json").read_text())
        ] == paths


def test_user_namedtuple_that_is_gone_is_a_one_line_error(
    tmp_path: Path, pairs_run: tuple[Path, Path]
) -> None:
    _, first = pairs_run
    # cold_pairs as the resuming process finds it: its Pair class renamed since the run
    mods = write_pairs_module(tmp_path / "usermods", "cold_pairs").parent
    (mods / "cold_pairs.py").write_text(PAIRS_MODULE.replace("class Pair", "class Renamed"))
    proc = run_cli(
        [f"resume_from={first}", "start_at=compile", f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path,
        env=_pairs_env(mods),
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxaot: error: ") and "cold_pairs:Pair" in last
    # one line, no traceback through jaxaot's code (jax plugins may print their own)
    assert "/stages/" not in proc.stderr and "/pipeline/" not in proc.stderr


def _rewrite_artifact(run_dir: Path, rel: str, data: bytes) -> None:
    """Replace a checkpoint file and its manifest record (a checkpoint that verifies)."""
    (run_dir / rel).write_bytes(data)
    manifest = read_manifest(run_dir)
    stage = rel.split("/")[0]
    manifest["stages"][stage]["artifacts"][rel].update(sha256=sha256_bytes(data), size=len(data))
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


def test_unvouched_custom_call_is_compiled_from_the_export_not_called(tmp_path: Path) -> None:
    """An executable naming a custom call this process never registered is not loaded cold: the
    run compiles from exported.bin instead, with a warning, and gives the same outputs."""
    program = ["program.target=jax.numpy.linalg:inv", f"program.args={OPS['inv']}"]
    first = _run(tmp_path, "first", *program, "store.enabled=false")
    hlo = (first / "compile" / "optimized.hlo.txt").read_bytes()
    _rewrite_artifact(
        first,
        "compile/optimized.hlo.txt",
        hlo + b'\n// custom_call_target="my_private_ffi_kernel"\n',
    )
    run_dir = tmp_path / "resumed"
    proc = run_cli(
        [
            f"resume_from={first}",
            "start_at=execute",
            "store.enabled=false",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    compile_rec = read_manifest(run_dir)["stages"]["compile"]
    assert compile_rec["status"] == "ran"
    assert any(
        "my_private_ffi_kernel" in w and "exported.bin" in w for w in compile_rec["warnings"]
    )
    assert _outputs(run_dir) == _outputs(first)


def test_prepare_vouches_for_jaxlib_and_xla_targets_only_when_cold() -> None:
    from types import SimpleNamespace

    from jaxaot.errors import ColdLoadError
    from jaxaot.stages import custom_calls

    hlo = (
        b'%a = custom-call(), custom_call_target="lapack_sgetrf_ffi"\n'
        b'%b = custom-call(), custom_call_target="__onednn$matmul"\n'
        b'%c = custom-call(), custom_call_target="Sharding"\n'
    )
    assert custom_calls.targets_of(hlo) == {"lapack_sgetrf_ffi", "__onednn$matmul", "Sharding"}
    assert custom_calls.targets_of(b"HloModule m\n") == frozenset()
    cold, warm = SimpleNamespace(state="loaded"), SimpleNamespace(state="live")
    custom_calls.prepare(hlo, "cpu", cold, "here")  # all vouched for
    odd = hlo + b'%d = custom-call(), custom_call_target="my_ffi"\n'
    with pytest.raises(ColdLoadError, match=r"here: .*\['my_ffi'\].*not loading it"):
        custom_calls.prepare(odd, "cpu", cold, "here")
    custom_calls.prepare(odd, "cpu", warm, "here")  # lowered here: its code registered my_ffi


def test_a_checkpoints_pytree_classes_go_through_the_import_policy(
    tmp_path: Path, pairs_run: tuple[Path, Path]
) -> None:
    """lowered.json names classes a resume imports: the resuming run's trust.* rules decide."""
    mods, first = pairs_run
    proc = run_cli(
        [
            f"resume_from={first}",
            "start_at=compile",
            "trust.deny_imports=[cold_pairs.Pair]",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
        env=_pairs_env(mods),
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "jaxaot: error: resume_from: lowered.json pytree class='cold_pairs:Pair'"
    )
    assert "trust.deny_imports refuses (rule 'cold_pairs.Pair')" in last
