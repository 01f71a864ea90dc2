"""The four stages through the runner, in-process: files, manifest, records and every error.

Most runs use ``program=axpy`` (``2 * x + y``) with tiny shapes: a run costs a few tenths of a
second. The CLI-only behaviour is in ``test_cli.py`` and ``test_walkthrough.py``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import platform
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest
from conftest import read_manifest
from jaxaot.config.order import STAGES
from jaxaot.engine.summary import render
from jaxaot.errors import (
    ArgSpecError,
    BackendError,
    CheckError,
    ConfigError,
    StageError,
    StoreError,
    TargetError,
)
from jaxaot.stages import Compiled, Executed, Lowered, StagedOut
from jaxaot.stages.execute import _compare
from jaxaot.stages.inputs import spec_inputs

# The file names the issue fixes, per stage folder (stages may write more).
ISSUE_FILES = {
    "stage_out": {"jaxpr.txt", "signature.json"},
    "lower": {"module.stablehlo.mlir", "module.hlo.txt", "exported.bin"},
    "compile": {
        "optimized.hlo.txt",
        "cost_analysis.json",
        "memory_analysis.json",
        "executable.bin",
    },
    "execute": {"outputs.npz", "timings.json"},
}
AXPY = "program=axpy"


@pytest.fixture(autouse=True)
def _programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # aot_programs


def outputs(run_dir: Path) -> list[np.ndarray]:
    with np.load(run_dir / "execute" / "outputs.npz") as z:
        return [z[f"out{i}"] for i in range(len(z.files))]


def load_json(run_dir: Path, name: str) -> Any:
    return json.loads((run_dir / name).read_text())


def save(path: Path, array: Any) -> str:
    np.save(path, np.asarray(array))
    return str(path)


# --- files, manifest, records -----------------------------------------------------------------


def test_a_full_run_writes_the_issue_files_and_a_manifest_that_matches_them(compose_run) -> None:
    result = compose_run(AXPY)
    run_dir = result.run_dir
    for stage, names in ISSUE_FILES.items():
        assert names <= {p.name for p in (run_dir / stage).iterdir()}, stage

    manifest = read_manifest(run_dir)
    assert manifest == json.loads(json.dumps(result.manifest))
    assert manifest["status"] == "ok" and manifest["error"] is None
    assert manifest["format_version"] == 1
    assert manifest["versions"]["python"] == platform.python_version()
    assert manifest["versions"]["jax"] == jax.__version__
    assert manifest["versions"]["jaxlib"]
    backend = manifest["backend"]
    assert backend["platform"] == "cpu"
    assert backend["device_count"] >= 1
    assert backend["device_kind"] and backend["platform_version"]
    assert manifest["config"]["program"]["name"] == "axpy"
    assert manifest["config"]["stage_out"]["static_argnums"] == []  # interpolation resolved

    listed: dict[str, dict[str, Any]] = {}
    for stage in STAGES:
        record = manifest["stages"][stage]
        assert record["status"] in ("ran", "cached")
        assert isinstance(record["seconds"], float) and record["seconds"] >= 0
        listed |= record["artifacts"]
    on_disk = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()} - {
        "manifest.json"
    }
    assert set(listed) == on_disk
    for name, art in listed.items():
        data = (run_dir / name).read_bytes()
        assert art == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, name

    assert isinstance(result["stage_out"], StagedOut)
    assert isinstance(result["lower"], Lowered)
    assert isinstance(result["compile"], Compiled)
    assert isinstance(result["execute"], Executed)
    assert result["compile"].cost["flops"] == 2.0
    assert int(result["execute"].outputs) == 10


@pytest.mark.parametrize("stop", ["stage_out", "lower", "compile"])
def test_stop_after_ends_the_run_after_that_stage(compose_run, stop: str) -> None:
    result = compose_run(AXPY, f"stop_after={stop}")
    assert result.ok
    done = STAGES[: STAGES.index(stop) + 1]
    assert list(result.records) == list(done)
    for stage in STAGES:
        if stage in done:
            assert ISSUE_FILES[stage] <= {p.name for p in (result.run_dir / stage).iterdir()}
        else:
            assert not (result.run_dir / stage).exists(), stage
            assert (
                result.manifest["stages"].get(stage, {"status": "skipped"})["status"] == "skipped"
            )


def test_signature_json_has_paths_types_and_static_values(compose_run) -> None:
    result = compose_run(
        "program.target=aot_programs:tree_fn",
        "program.args=[{w:f32[2,3],b:{shape:[2],init:zeros}},f32[3],2]",
        "program.kwargs={scale:0.5}",
        "stage_out.static_argnums=[2]",
        "execute.check=reference",
    )
    sig = load_json(result.run_dir, "stage_out/signature.json")
    assert [(i["path"], i["type"], i["weak_type"], i["donated"]) for i in sig["inputs"]] == [
        ("args[0]['b']", "f32[2]", False, False),
        ("args[0]['w']", "f32[2,3]", False, False),
        ("args[1]", "f32[3]", False, False),
        ("kwargs['scale']", "f32[]", True, False),
    ]
    assert sig["inputs"][1]["shape"] == [2, 3] and sig["inputs"][1]["dtype"] == "float32"
    assert [(o["path"], o["type"]) for o in sig["outputs"]] == [
        ("['total']", "f32[]"),
        ("['y']", "f32[2]"),
    ]
    assert sig["static"] == [{"path": "args[2]", "value": 2}]
    assert "dot_general" in (result.run_dir / "stage_out/jaxpr.txt").read_text()
    assert result["execute"].check["ok"]


def test_exported_bin_and_executable_bin_load_and_compute_the_same(compose_run) -> None:
    result = compose_run(
        AXPY, "program.args=[{shape:[8],init:arange},{shape:[8],init:ones}]", "execute.warmup=0"
    )
    run_dir = result.run_dir
    x, y = np.arange(8, dtype=np.float32), np.ones(8, np.float32)
    want = 2 * x + y
    np.testing.assert_array_equal(outputs(run_dir)[0], want)

    exported = jax.export.deserialize(bytearray((run_dir / "lower/exported.bin").read_bytes()))
    assert exported.platforms == ("cpu",)
    assert [str(a) for a in exported.in_avals] == ["float32[8]", "float32[8]"]
    np.testing.assert_array_equal(exported.call(x, y), want)

    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = pickle.loads((run_dir / "compile/executable.bin").read_bytes())
    # On the devices it was compiled for (compiled.json): an earlier test in this process may
    # have started more virtual CPU devices, and the default would be all of them.
    by_id = {d.id: d for d in jax.devices("cpu")}
    device_ids = load_json(run_dir, "compile/compiled.json")["device_ids"]
    executable = deserialize_and_load(
        payload, in_tree, out_tree, backend="cpu", execution_devices=[by_id[i] for i in device_ids]
    )
    np.testing.assert_array_equal(executable(x, y), want)


class _FullDisk:
    """``os`` for jaxaot.util.fsio alone: writing a file whose name contains ``victim`` fails
    with ENOSPC, as write() does on a full disk (naming no file)."""

    def __init__(self, module: Any, victim: str, paths: dict[int, str]) -> None:
        self._module, self._victim, self._paths = module, victim, paths

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd: int = self._module.open(path, flags, *args, **kwargs)
        self._paths[fd] = str(path)
        return fd

    def fdopen(self, fd: int, *args: Any, **kwargs: Any) -> Any:
        real = self._module.fdopen(fd, *args, **kwargs)
        if self._victim not in self._paths.get(fd, ""):
            return real

        class Full:
            def __enter__(self) -> Full:
                return self

            def __exit__(self, *exc: object) -> None:
                real.close()

            def write(self, data: bytes) -> int:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return Full()


@pytest.mark.parametrize("victim", ["module.stablehlo.mlir", "module.hlo.txt", "exported.bin"])
def test_a_full_disk_names_the_file_it_could_not_write(
    compose_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, victim: str
) -> None:
    from jaxaot.util import fsio as fsutil

    paths: dict[int, str] = {}
    monkeypatch.setattr(fsutil, "os", _FullDisk(os, victim, paths))
    run_dir = tmp_path / "full"
    with pytest.raises(StageError) as info:
        compose_run(AXPY, run_dir=run_dir)
    target = run_dir / "lower" / victim
    assert str(info.value) == (
        f"stage 'lower' failed: OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: "
        f"{str(target)!r}"
    )
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["error"]) == ("failed", str(info.value))
    assert manifest["stages"]["lower"]["status"] == "failed"
    assert not target.exists()
    assert [p.name for p in (run_dir / "lower").iterdir() if p.name.startswith(".tmp-")] == []


def test_every_atomic_write_names_its_file_on_enospc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from jaxaot.util import fsio as fsutil

    paths: dict[int, str] = {}
    monkeypatch.setattr(fsutil, "os", _FullDisk(os, "manifest.json", paths))
    with pytest.raises(OSError) as info:
        fsutil.atomic_write_json(tmp_path / "manifest.json", {"status": "ok"})
    assert (info.value.errno, info.value.filename) == (
        errno.ENOSPC,
        str(tmp_path / "manifest.json"),
    )
    assert list(tmp_path.iterdir()) == []  # the temp file is gone, nothing half-written


# --- compile options --------------------------------------------------------------------------


def test_compiler_options_reach_this_compile_and_nothing_else(compose_run, tmp_path: Path) -> None:
    # XLA:CPU's fast min/max ignores NaN: max([1, nan, 3, 4]) is 4 with it and nan without.
    nan = save(tmp_path / "nan.npy", np.array([1, np.nan, 3, 4], np.float32))
    base = ("program.target=jax.numpy:max", "program.args=[f32[4]]", f"execute.inputs=[{nan}]")
    plain = compose_run(*base)
    assert np.isnan(outputs(plain.run_dir)[0])

    opts = (
        "compile.compiler_options={xla_cpu_enable_fast_min_max:true,xla_cpu_enable_fast_math:true}"
    )
    fast = compose_run(*base, opts)
    assert outputs(fast.run_dir)[0] == 4.0
    assert fast.manifest["config"]["compile"]["compiler_options"] == {
        "xla_cpu_enable_fast_min_max": True,
        "xla_cpu_enable_fast_math": True,
    }

    # The reference (plain jax.jit in the same process) must not see the option: no global leak.
    with pytest.raises(
        CheckError,
        match=r"execute\.check=reference: outputs differ from plain jax\.jit beyond tolerance: output 0: max abs err inf",
    ):
        compose_run(*base, opts, "execute.check=reference", run_dir=tmp_path / "checked")
    manifest = read_manifest(tmp_path / "checked")
    assert manifest["status"] == "failed"
    assert manifest["stages"]["execute"]["status"] == "failed"
    assert manifest["stages"]["execute"]["metrics"]["check"] == "failed"
    assert "outputs differ" in manifest["error"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            "{xla_no_such_option:true}",
            r"compile\.compiler_options: XLA rejected \['xla_no_such_option'\]: .*No such compile option",
        ),
        (
            "{xla_cpu_enable_fast_math:sometimes}",
            r"compile\.compiler_options: XLA rejected \['xla_cpu_enable_fast_math'\]: .*not a valid bool",
        ),
    ],
)
def test_rejected_compiler_options_name_the_key(compose_run, options: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        compose_run(AXPY, f"compile.compiler_options={options}")


# --- execute: timings, donation, check ----------------------------------------------------------


def test_timings_json_statistics(compose_run) -> None:
    result = compose_run(
        AXPY, "program.args=[f32[64],f32[64]]", "execute.repeats=4", "execute.warmup=2"
    )
    timings = load_json(result.run_dir, "execute/timings.json")
    cost = load_json(result.run_dir, "compile/cost_analysis.json")
    assert timings["calls"] == 4 and timings["warmup"] == 2
    assert len(timings["samples_s"]) == 4
    assert timings["min_s"] <= timings["median_s"] <= timings["max_s"]
    assert timings["min_s"] <= timings["mean_s"] <= timings["max_s"]
    assert timings["min_s"] == min(timings["samples_s"]) and timings["stddev_s"] >= 0
    assert timings["flops_per_s"] == pytest.approx(cost["flops"] / timings["median_s"])
    assert timings["bytes_per_s"] == pytest.approx(cost["bytes accessed"] / timings["median_s"])
    assert timings["donated_inputs_consumed"] is None  # nothing donated
    metrics = result.manifest["stages"]["execute"]["metrics"]
    assert metrics["median_s"] == timings["median_s"]
    assert metrics["flops_per_s"] == timings["flops_per_s"]


def test_donated_inputs_are_consumed(compose_run) -> None:
    result = compose_run(
        AXPY, "program.args=[f32[16],f32[16]]", "lower.donate_argnums=[0]", "execute.repeats=3"
    )
    assert load_json(result.run_dir, "execute/timings.json")["donated_inputs_consumed"] is True
    assert "tf.aliasing_output" in (result.run_dir / "lower/module.stablehlo.mlir").read_text()
    assert result["lower"].donate_argnums == (0,)
    donated = [
        i["donated"] for i in load_json(result.run_dir, "stage_out/signature.json")["inputs"]
    ]
    assert donated == [True, False]


def test_donated_keyword_arguments_are_consumed_on_every_call(compose_run) -> None:
    result = compose_run(
        "program.target=aot_programs:scaled",
        "program.args=[f32[4]]",
        "program.kwargs={z:{shape:[4],init:ones}}",
        "lower.donate_argnames=[z]",
        "execute.warmup=1",
        "execute.repeats=2",
        "execute.check=reference",
    )
    assert load_json(result.run_dir, "execute/timings.json")["donated_inputs_consumed"] is True
    sig = load_json(result.run_dir, "stage_out/signature.json")
    assert [(i["path"], i["donated"]) for i in sig["inputs"]] == [
        ("args[0]", False),
        ("kwargs['z']", True),
    ]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ("program.args=[f32[4],f32[4]]", "lower.donate_argnames=[nonexistent]"),
            r"^lower\.donate_argnames: 'nonexistent' names no argument passed to the target "
            r"\(positional parameters: x, y; program\.args passes 2 positionally; program\.kwargs "
            r"keys: none\); expected one of x, y, or remove it$",
        ),
        (
            (
                "program.target=aot_programs:scaled",
                "program.args=[f32[4]]",
                "program.kwargs={z:f32[4]}",
                "lower.donate_argnames=[w]",
            ),
            r"^lower\.donate_argnames: 'w' names no argument passed to the target "
            r"\(positional parameters: x; program\.args passes 1 positionally; program\.kwargs "
            r"keys: z\); expected one of x, z, or remove it$",
        ),
        (
            (
                "program.target=jax.numpy:sum",
                "program.args=[f32[4]]",
                "program.kwargs={}",
                "lower.donate_argnames=[where]",
            ),  # a parameter, but not passed
            r"^lower\.donate_argnames: 'where' names no argument passed to the target \(positional "
            r"parameters: a, axis, dtype, out, keepdims, initial, where, promote_integers; "
            r"program\.args passes 1 positionally",
        ),
    ],
)
def test_donate_argnames_naming_no_argument_is_an_error(compose_run, overrides, match) -> None:
    # jax.jit maps argnames through the signature and donates nothing for an unknown name.
    with pytest.raises(ConfigError, match=match):
        compose_run(AXPY, *overrides, "stop_after=stage_out")


def test_donate_argnames_may_name_a_positional_parameter_or_a_var_keyword(compose_run) -> None:
    by_name = compose_run(
        AXPY, "program.args=[f32[4],f32[4]]", "lower.donate_argnames=[y]", "stop_after=lower"
    )
    assert by_name["lower"].donate_argnums == (1,)
    # A name that reaches **kwargs is passed, so it can be donated.
    result = compose_run(
        "program.target=aot_programs:var_keywords",
        "program.args=[f32[4]]",
        "program.kwargs={extra:f32[4]}",
        "lower.donate_argnames=[extra]",
        "execute.repeats=2",
    )
    assert load_json(result.run_dir, "execute/timings.json")["donated_inputs_consumed"] is True
    sig = load_json(result.run_dir, "stage_out/signature.json")
    assert [(i["path"], i["donated"]) for i in sig["inputs"]] == [
        ("args[0]", False),
        ("kwargs['extra']", True),
    ]


def test_a_multi_platform_lowering_compiles_for_the_backend(compose_run) -> None:
    result = compose_run(
        AXPY, "program.args=[f32[4],f32[4]]", "lower.platforms=[cpu,tpu]", "execute.check=reference"
    )
    assert result.ok
    exported = jax.export.deserialize(
        bytearray((result.run_dir / "lower/exported.bin").read_bytes())
    )
    assert exported.platforms == ("cpu", "tpu")


def test_check_reference_passes_and_is_recorded(compose_run) -> None:
    result = compose_run(AXPY, "program.args=[f32[8],bf16[8]]", "execute.check=reference")
    check = load_json(result.run_dir, "execute/check.json")
    assert check["ok"] and check["failures"] == []
    assert check["max_abs_err"] == 0.0
    assert result.manifest["stages"]["execute"]["metrics"]["check"] == "ok"


def _ctx(rtol: float | None = None, atol: float | None = None) -> Any:
    return SimpleNamespace(opts=SimpleNamespace(rtol=rtol, atol=atol))


@pytest.mark.parametrize(
    ("got", "want", "ok"),
    [
        (np.float32([1, np.nan, np.inf, -np.inf]), np.float32([1, np.nan, np.inf, -np.inf]), True),
        (np.float32([1.0, 2.0]), np.float32([1.0, 2.0 + 1e-6]), True),  # inside f32's tolerance
        (np.float32([1, 2]), np.float32([1, np.nan]), False),
        (np.float32([4.0]), np.float32([np.inf]), False),  # rtol * inf must not excuse it
        (np.float32([np.inf]), np.float32([-np.inf]), False),
        (np.complex64([1 + 1j]), np.complex64([1 + 2j]), False),  # the imaginary part counts
        (np.complex64([1 + 1j]), np.complex64([1 + 1j]), True),
        (np.int32([3]), np.int32([4]), False),  # integers are exact by default
        (np.bool_([True]), np.bool_([True]), True),
    ],
)
def test_compare(got: np.ndarray, want: np.ndarray, ok: bool) -> None:
    result = _compare(_ctx(), {"a": got}, {"a": want})
    assert result["ok"] is ok
    assert len(result["failures"]) == (0 if ok else 1)
    if ok:
        assert result["max_abs_err"] < 1e-5


def test_compare_tolerances_from_config() -> None:
    assert _compare(_ctx(atol=1.0), [np.int32(3)], [np.int32(4)])["ok"]
    strict = _compare(_ctx(rtol=0.0, atol=0.0), [np.float32(1.0)], [np.float32(1.0 + 2**-20)])
    assert not strict["ok"]
    assert strict["failures"] == [
        f"output 0: max abs err {2**-20:.3g}, max rel err {strict['max_rel_err']:.3g} (rtol=0, atol=0)"
    ]


def test_non_finite_outputs_warn_in_manifest_and_summary(compose_run) -> None:
    result = compose_run(
        "program.target=jax.numpy:log",
        "program.args=[{shape:[4],dtype:f32,init:zeros}]",
        "execute.check=reference",  # -inf == -inf: the reference check still passes
    )
    assert result.ok
    np.testing.assert_array_equal(outputs(result.run_dir)[0], np.full(4, -np.inf, np.float32))
    warning = "execute: non-finite values (nan/inf) in output(s) <root>"
    assert result.manifest["warnings"] == [warning]
    assert read_manifest(result.run_dir)["stages"]["execute"]["warnings"] == [warning[9:]]
    assert load_json(result.run_dir, "execute/outputs.json")[0]["finite"] is False
    assert f"warning: {warning}" in render(result.manifest).splitlines()


def test_a_program_with_a_host_callback_compiles(compose_run) -> None:
    # jax.export cannot serialize host callbacks: lower warns and skips exported.bin, the
    # program still compiles and runs from the live lowering, and resuming from it says why not.
    result = compose_run("program.target=aot_programs:noisy", "program.args=[f32[2]]")
    assert result.ok
    assert any("no exported.bin" in w for w in result.manifest["warnings"])
    assert not (result.run_dir / "lower" / "exported.bin").exists()
    with pytest.raises(StoreError, match=r"has no exported\.bin"):
        compose_run(f"resume_from={result.run_dir}", "start_at=compile")


# --- program.target errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (
            "no_such_module_xyz:f",
            r"program\.target='no_such_module_xyz:f': cannot import module 'no_such_module_xyz' .*PYTHONPATH",
        ),
        (
            "jax.numpy:no_such_fn",
            r"program\.target='jax\.numpy:no_such_fn': 'jax\.numpy' has no attribute 'no_such_fn' \(it has: ",
        ),
        ("jax.numpy:linalg.no_such", r"'jax\.numpy\.linalg' has no attribute 'no_such'"),
        (
            "aot_programs:NOT_A_FUNCTION",
            r"program\.target='aot_programs:NOT_A_FUNCTION': 'NOT_A_FUNCTION' is a int, not a callable",
        ),
    ],
)
def test_target_errors(compose_run, tmp_path: Path, target: str, match: str) -> None:
    with pytest.raises(TargetError, match=match):
        compose_run(AXPY, f"program.target={target}", run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()  # refused before the run claimed its folder


def test_errors_while_tracing_are_wrapped_naming_the_stage(compose_run) -> None:
    with pytest.raises(
        StageError,
        match=r"^stage 'stage_out' failed: ValueError: boom while tracing "
        r"\(while tracing aot_programs:boom\(args\[0\]=f32\[2\]\)\)$",
    ) as info:
        compose_run("program.target=aot_programs:boom", "program.args=[f32[2]]")
    assert isinstance(info.value.__cause__, ValueError)


def test_a_manifest_that_cannot_be_written_at_the_end_keeps_the_runs_own_error(
    compose_run, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk at the last manifest write must not hide why the run failed."""
    from jaxaot.rundir.manifest import Manifest

    real, calls = Manifest.write, []

    def write(self: Manifest) -> None:
        calls.append(self.status)
        if self.status == "failed":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        real(self)

    monkeypatch.setattr(Manifest, "write", write)
    with pytest.raises(StageError, match="boom while tracing"):
        compose_run("program.target=aot_programs:boom", "program.args=[f32[2]]")
    assert "failed" in calls
    assert any("No space left" in r.getMessage() for r in caplog.records)


def test_a_manifest_that_cannot_be_written_fails_a_run_that_went_well(
    compose_run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a run's own error may take precedence: an ok run with no manifest is an error."""
    from jaxaot.rundir.manifest import Manifest

    real = Manifest.write

    def write(self: Manifest) -> None:
        if self.status == "ok":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        real(self)

    monkeypatch.setattr(Manifest, "write", write)
    with pytest.raises(OSError, match="No space left"):
        compose_run(AXPY, "stop_after=stage_out")


def test_a_failed_trace_says_which_argument_went_where(compose_run) -> None:
    """The issue's sweep example puts a batch where the mlp takes its parameters."""
    with pytest.raises(StageError) as info:
        compose_run("program=mlp", "program.args.0=f32[256,1024]")
    assert str(info.value).endswith(
        "(while tracing jaxaot.examples.mlp:mlp(args[0]=f32[256,1024], args[1]=f32[64,256]))"
    )
    with pytest.raises(
        StageError,
        match=r"forward\(args\[0\]=\{embed, layers, ln_f, unembed\}, "
        r"args\[1\]=f32\[4,64\]\)\)$",
    ):
        compose_run("program=transformer", "program.args.1=f32[4,64]")


def test_a_string_at_a_traced_position_is_an_error(compose_run) -> None:
    with pytest.raises(ArgSpecError, match=r"add it to stage_out\.static_argnums"):
        compose_run(
            "program.target=jax.numpy:einsum", "program.args=['ij,jk->ik',f32[4,8],f32[8,2]]"
        )


# --- backends -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "platform_"), [("tpu", "tpu"), ("gpu", "cuda")])
def test_an_absent_backend_says_how_to_lower_for_it(
    compose_run, backend: str, platform_: str
) -> None:
    with pytest.raises(
        BackendError,
        match=rf"^compile\.backend='{backend}': no {backend} backend on this machine \(present: cpu\); "
        rf"to prepare a program for it, lower only: lower\.platforms=\[{platform_}\] stop_after=lower",
    ):
        compose_run(AXPY, f"compile.backend={backend}")


def test_lowering_for_an_absent_platform_works_as_advised(compose_run) -> None:
    result = compose_run(AXPY, "compile.backend=tpu", "lower.platforms=[tpu]", "stop_after=lower")
    assert result.ok
    exported = jax.export.deserialize(
        bytearray((result.run_dir / "lower/exported.bin").read_bytes())
    )
    assert exported.platforms == ("tpu",)
    assert "stablehlo.multiply" in (result.run_dir / "lower/module.stablehlo.mlir").read_text()


# --- execute.inputs -------------------------------------------------------------------------------


def test_execute_inputs_from_npy_files_and_literals(compose_run, tmp_path: Path) -> None:
    five = save(tmp_path / "five.npy", np.int32(5))
    result = compose_run(AXPY, "program.args=[i32[],i32[]]", f"execute.inputs=[{five},3]")
    assert outputs(result.run_dir)[0] == 13
    assert outputs(result.run_dir)[0].dtype == np.int32


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        (
            "[1]",
            r"execute\.inputs: expected 2 entries \(the non-static positional arguments\), found 1",
        ),
        ("5", r"execute\.inputs: expected a list \(one entry per non-static positional argument\)"),
        (
            "[[1,2],3]",
            r"execute\.inputs\[0\]: expected one array \(\.npy path\) or literal, found \[1, 2\]",
        ),
        (
            "{args:[1,2],kwargs:{z:1}}",
            r"execute\.inputs\.kwargs: expected a dict with keys \[\], found \['z'\]",
        ),
    ],
)
def test_execute_inputs_with_the_wrong_structure(compose_run, inputs: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        compose_run(AXPY, "program.args=[i32[],i32[]]", f"execute.inputs={inputs}")


def test_execute_inputs_of_other_types_are_refused_before_jax_sees_them(
    compose_run, tmp_path: Path
) -> None:
    a = save(tmp_path / "a.npy", np.arange(3, dtype=np.int32))
    with pytest.raises(
        ConfigError,
        match=r"^execute\.inputs: 2 inputs differ from the types declared for them: "
        r"execute\.inputs\[0\]: '[^']*a\.npy' holds i32\[3\], expected i32\[\] \(as "
        r"program\.args\[0\] declares; inputs are never converted\): save it as i32\[\], or "
        r"change program\.args\[0\]; execute\.inputs\[1\]: '[^']*a\.npy' holds i32\[3\], "
        r"expected i32\[\] \(as program\.args\[1\] declares; .* change program\.args\[1\]$",
    ):
        compose_run(AXPY, "program.args=[i32[],i32[]]", f"execute.inputs=[{a},{a}]")


def test_execute_inputs_of_other_types_are_refused_naming_the_input(compose_run) -> None:
    # A number is no i32[3]: refused before JAX's "Argument types differ" check.
    with pytest.raises(
        ConfigError,
        match=r"^execute\.inputs\[0\]: expected i32\[3\] \(as program\.args\[0\] declares\), "
        r"found a float scalar 1\.5; give a \.npy file holding i32\[3\]",
    ):
        compose_run(AXPY, "program.args=[i32[3],i32[3]]", "execute.inputs=[1.5,2]")


# --- arguments: literals, statics, kwargs, library targets ---------------------------------------


def test_literal_args_are_traced_and_executed_with_their_values(compose_run) -> None:
    result = compose_run(AXPY, "program.args=[3,4]")
    assert int(outputs(result.run_dir)[0]) == 10
    sig = load_json(result.run_dir, "stage_out/signature.json")
    assert [(i["type"], i["weak_type"]) for i in sig["inputs"]] == [("i32[]", True)] * 2
    assert sig["static"] == []


def test_static_argnames_can_name_a_positional_parameter(compose_run) -> None:
    result = compose_run(AXPY, "program.args=[7,5]", "stage_out.static_argnames=[x]")
    assert int(outputs(result.run_dir)[0]) == 19
    assert "dense<14>" in (result.run_dir / "lower/module.stablehlo.mlir").read_text()
    assert result["stage_out"].bound.static_argnums == (0,)


def test_static_literal_lists_become_tuples(compose_run) -> None:
    result = compose_run(
        "program.target=jax.numpy:reshape",
        "program.args=[f32[2,6],[3,4]]",
        "stage_out.static_argnums=[1]",
    )
    assert result["stage_out"].args[1] == (3, 4)
    assert isinstance(result["stage_out"].args[1], tuple)
    assert outputs(result.run_dir)[0].shape == (3, 4)
    assert load_json(result.run_dir, "stage_out/signature.json")["static"] == [
        {"path": "args[1]", "value": [3, 4]}
    ]


def test_kwargs(compose_run) -> None:
    result = compose_run(
        AXPY, "program.args=[]", "program.kwargs={x:{shape:[3],init:arange},y:2.0}"
    )
    np.testing.assert_array_equal(outputs(result.run_dir)[0], np.float32([2, 4, 6]))
    sig = load_json(result.run_dir, "stage_out/signature.json")
    assert [i["path"] for i in sig["inputs"]] == ["kwargs['x']", "kwargs['y']"]


def test_einsum_as_a_direct_library_target_with_static_subscripts(compose_run) -> None:
    result = compose_run(
        "program.target=jax.numpy:einsum",
        "program.args=['ij,jk->ik', f32[4,8], f32[8,2]]",
        "stage_out.static_argnums=[0]",
        "execute.check=reference",
    )
    a, b = spec_inputs(result["stage_out"].bound, seed=0)[0]
    got = outputs(result.run_dir)[0]
    assert got.shape == (4, 2)
    np.testing.assert_allclose(got, np.einsum("ij,jk->ik", a, b), rtol=1e-5, atol=1e-5)
    assert load_json(result.run_dir, "stage_out/signature.json")["static"] == [
        {"path": "args[0]", "value": "ij,jk->ik"}
    ]


# --- dtypes ----------------------------------------------------------------------------------------


def test_64_bit_types_turn_x64_on_for_that_run_only(compose_run) -> None:
    wide = compose_run(AXPY, "program.args=[f64[3],i64[3]]")
    assert outputs(wide.run_dir)[0].dtype == np.float64
    narrow = compose_run(AXPY, "program.args=[f32[3],f32[3]]")
    assert outputs(narrow.run_dir)[0].dtype == np.float32
    assert not jax.config.jax_enable_x64


@pytest.mark.parametrize(
    ("arg", "dtype", "stored"),
    [
        ("bf16[3]", "bfloat16", "float32"),
        ("f8_e4m3fn[3]", "float8_e4m3fn", "float32"),
        ("i4[3]", "int4", "float32"),
        ("c64[3]", "complex64", "complex64"),
        ("u8[3]", "uint8", "uint8"),
    ],
)
def test_outputs_of_every_kind_of_dtype(compose_run, arg: str, dtype: str, stored: str) -> None:
    result = compose_run(
        AXPY, f"program.args=[{arg},{arg}]", "execute.check=reference", "execute.repeats=1"
    )
    described = load_json(result.run_dir, "execute/outputs.json")[0]
    assert (described["dtype"], described["stored_dtype"], described["finite"]) == (
        dtype,
        stored,
        True,
    )
    got = outputs(result.run_dir)[0]
    assert got.dtype == np.dtype(stored)  # .npz holds numbers, not raw ml_dtypes bytes
    assert all(math.isfinite(abs(v)) for v in got.tolist())


def test_a_cpu_run_does_not_keep_jax_to_the_cpu_for_a_later_run(
    compose_run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU run restricts JAX to the CPU platform (quiet plugins); a later run in the same
    process (a sweep over backends, a notebook) that needs another backend gets it back."""
    import jax
    from jaxaot.stages import jaxenv

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    compose_run(AXPY, "stop_after=stage_out")
    if not jaxenv._platforms_restricted:
        pytest.skip("this process's JAX platforms were set by someone else")
    assert jax.config.jax_platforms == "cpu"
    try:
        jaxenv._only_needed_platforms("tpu")
        assert jax.config.jax_platforms is None and not jaxenv._platforms_restricted
    finally:
        jaxenv._only_needed_platforms("cpu")
    assert jax.config.jax_platforms == "cpu"
