"""Resume from another run's checkpoint: verified loads, no program code needed from compile on,
options of earlier stages frozen, other hosts and other device counts."""

from __future__ import annotations

import json
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env, read_manifest, run_cli
from jaxaot.errors import BackendError, ConfigError, StoreError

USER_MODULE = (
    "import jax.numpy as jnp\n\ndef model(w, x):\n    return jnp.tanh(x @ w).sum(axis=0)\n"
)
USER_ARGS = "program.args=[f32[16,8],f32[4,16]]"


def _statuses(manifest: dict) -> dict[str, str]:
    return {s: r["status"] for s, r in manifest["stages"].items()}


@pytest.fixture
def user_module(tmp_path: Path) -> Path:
    mods = tmp_path / "usermods"
    mods.mkdir()
    (mods / "resume_user_model.py").write_text(USER_MODULE)
    return mods


def test_resume_in_a_fresh_process_without_the_program_module(tmp_path, user_module):
    with_module = cli_env(PYTHONPATH=f"{cli_env()['PYTHONPATH']}:{user_module}")
    lowered = tmp_path / "lowered"
    proc = run_cli(
        [
            "program.target=resume_user_model:model",
            USER_ARGS,
            "stop_after=lower",
            f"hydra.run.dir={lowered}",
        ],
        cwd=tmp_path,
        env=with_module,
    )
    assert proc.returncode == 0, proc.stderr
    (user_module / "resume_user_model.py").unlink()  # the target machine has no program code

    compiled = tmp_path / "compiled"
    proc = run_cli(
        [f"resume_from={lowered}", "start_at=compile", f"hydra.run.dir={compiled}"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(compiled)
    assert _statuses(manifest) == {
        "stage_out": "resumed",
        "lower": "resumed",
        "compile": "ran",
        "execute": "ran",
    }
    assert manifest["config"]["program"]["target"] == "resume_user_model:model"
    assert manifest["resumed_from"] == str(lowered.resolve())
    # the resumed run is itself a complete checkpoint: its copies carry the same hashes
    assert (
        manifest["stages"]["lower"]["artifacts"]
        == read_manifest(lowered)["stages"]["lower"]["artifacts"]
    )

    executed = tmp_path / "executed"
    proc = run_cli(
        [
            f"resume_from={compiled}",
            "start_at=execute",
            "execute.seed=3",
            f"hydra.run.dir={executed}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert _statuses(read_manifest(executed))["compile"] == "resumed"

    proc = run_cli(
        [
            f"resume_from={compiled}",
            "start_at=execute",
            "execute.check=reference",
            f"hydra.run.dir={tmp_path / 'ref'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "program.target='resume_user_model:model': cannot import module" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_executable_loads_on_a_host_with_another_device_count(tmp_path):
    first = tmp_path / "one_device"
    proc = run_cli(["program=axpy", "stop_after=compile", f"hydra.run.dir={first}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read_manifest(first)["backend"]["device_count"] == 1
    eight = cli_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    second = tmp_path / "eight_devices"
    proc = run_cli(
        [f"resume_from={first}", "start_at=execute", f"hydra.run.dir={second}"],
        cwd=tmp_path,
        env=eight,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(second)
    assert manifest["backend"]["device_count"] == 8
    assert _statuses(manifest)["compile"] == "resumed"
    assert manifest["stages"]["execute"]["metrics"]["median_s"] > 0


def test_corrupt_or_missing_checkpoint_files_are_errors_naming_the_file(compose_run, tmp_path):
    src = compose_run("program=axpy", "stop_after=compile").run_dir
    exported = src / "lower" / "exported.bin"
    data = exported.read_bytes()
    exported.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(StoreError, match=r"checkpoint file .*lower/exported.bin is corrupt"):
        compose_run(f"resume_from={src}", "start_at=compile")
    exported.unlink()
    with pytest.raises(StoreError, match=r"checkpoint file .*lower/exported.bin is missing"):
        compose_run(f"resume_from={src}", "start_at=compile")
    with pytest.raises(StoreError, match="no such run directory"):
        compose_run(f"resume_from={tmp_path / 'nowhere'}", "start_at=compile")


def test_resume_needs_the_stages_it_skips(compose_run):
    src = compose_run("program=axpy", "stop_after=lower").run_dir
    with pytest.raises(StoreError, match="no finished 'compile' stage"):
        compose_run(f"resume_from={src}", "start_at=execute")
    with pytest.raises(ConfigError, match="start_at='compile' needs resume_from"):
        compose_run("start_at=compile")


def test_options_of_resumed_stages_come_from_the_checkpoint(compose_run):
    src = compose_run("program=axpy", "program.args=[f32[4],f32[4]]", "stop_after=lower").run_dir
    resumed = jaxaot.run(
        jaxaot.compose(
            [
                f"resume_from={src}",
                "start_at=compile",
                "execute.seed=5",
                "compile.compiler_options={xla_cpu_enable_fast_math:true}",
            ]
        ),
        run_dir=src.parent / "resumed",
        overrides=["execute.seed=5", "compile.compiler_options={xla_cpu_enable_fast_math:true}"],
    )
    cfg = resumed.manifest["config"]
    assert cfg["program"]["name"] == "axpy" and cfg["program"]["args"][0] == "f32[4]"
    assert cfg["compile"]["compiler_options"] == {"xla_cpu_enable_fast_math": True}
    assert cfg["execute"]["seed"] == 5
    with pytest.raises(
        ConfigError, match=r"program.args: overridden to .* comes? from the checkpoint"
    ):
        jaxaot.run(
            jaxaot.compose(
                [f"resume_from={src}", "start_at=compile", "program.args=[f32[8],f32[8]]"]
            ),
            run_dir=src.parent / "conflict",
            overrides=["program.args=[f32[8],f32[8]]"],
        )
    with pytest.raises(ConfigError, match=r"^program: overridden"):
        jaxaot.run(
            jaxaot.compose([f"resume_from={src}", "start_at=compile", "program=mlp"]),
            run_dir=src.parent / "conflict2",
            overrides=["program=mlp"],
        )


def test_cli_refuses_a_conflicting_override_in_one_line(compose_run, tmp_path):
    src = compose_run("program=axpy", "stop_after=compile").run_dir
    proc = run_cli(
        [
            f"resume_from={src}",
            "start_at=execute",
            "lower.donate_argnums=[0]",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxaot: error: lower.donate_argnums: overridden")


def test_an_executable_from_another_jaxlib_is_recompiled_from_the_export(compose_run):
    src = compose_run("program=axpy", "stop_after=compile").run_dir
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["backend"]["jaxlib"] = "0.0.1"
    (src / "manifest.json").write_text(json.dumps(manifest))
    # Compiled from the export: jax.jit(exported.call) is another executable than the source
    # run's (it keeps every argument), so it has a key of its own: stored once, then hit.
    runs = (
        ("store.enabled=false", "ran"),
        ("store.enabled=true", "ran"),
        ("store.enabled=true", "cached"),
    )
    for store, status in runs:
        resumed = compose_run(f"resume_from={src}", "start_at=execute", store)
        stage = resumed.manifest["stages"]["compile"]
        assert stage["status"] == status
        assert any(
            "not loaded, compiled again from lower/exported.bin" in w for w in stage["warnings"]
        )
        assert int(resumed["execute"].outputs) == 10


def test_start_at_lower_traces_again_and_notices_changed_code(tmp_path, compose_run, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "changing_model.py").write_text("def f(x):\n    return x + 1\n")
    src = compose_run(
        "program.target=changing_model:f", "program.args=[f32[3]]", "stop_after=lower"
    ).run_dir
    same = compose_run(f"resume_from={src}", "start_at=lower")
    assert _statuses(same.manifest)["stage_out"] == "ran"
    assert not same.manifest["stages"]["stage_out"]["warnings"]
    import importlib
    import sys

    (tmp_path / "changing_model.py").write_text("def f(x):\n    return x * 3\n")
    # Python checks a .pyc against its source's mtime (whole seconds) and size: this edit keeps
    # the size, and may fall in the same second, so the bytecode goes as an editor's would age
    import shutil

    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
    sys.modules.pop("changing_model", None)
    importlib.invalidate_caches()
    changed = compose_run(f"resume_from={src}", "start_at=lower")
    assert any("different jaxpr" in w for w in changed.manifest["stages"]["stage_out"]["warnings"])


def test_a_tpu_lowering_is_the_input_for_compile_on_a_tpu_host(compose_run):
    src = compose_run("program=mlp", "lower.platforms=[tpu]", "stop_after=lower").run_dir
    import jax

    exported = jax.export.deserialize(bytearray((src / "lower" / "exported.bin").read_bytes()))
    assert exported.platforms == ("tpu",)
    # Without compile.backend the resumed compile is for the lowering's one platform (here,
    # a CPU machine, that is the error saying there is no TPU; on a TPU host it compiles).
    with pytest.raises(
        BackendError, match=r"^compile.backend='tpu': no tpu backend on this machine"
    ):
        compose_run(f"resume_from={src}", "start_at=compile")
    chosen = [f"resume_from={src}", "start_at=compile", "compile.backend=cpu"]
    with pytest.raises(
        BackendError,
        match=r"needs a lowering for 'cpu', but lower.platforms was "
        r"\['tpu'\]; compile for one of those \(compile.backend=tpu\)",
    ):
        jaxaot.run(jaxaot.compose(chosen), run_dir=src.parent / "chosen", overrides=chosen)


def test_a_resumed_execute_draws_the_inputs_of_the_original_run(compose_run, monkeypatch):
    """Dict arguments listed out of key order: the checkpoint's config comes back sorted, and
    the inputs (one seeded draw per leaf) must still be the original run's, bit for bit."""
    import numpy as np

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # aot_programs
    src = compose_run(
        "program.target=aot_programs:tree_fn",
        "program.args=[{w:f32[2,3],b:f32[2]},f32[3],2]",  # w before b: not sorted
        "program.kwargs={scale:f32[]}",
        "stage_out.static_argnums=[2]",
        "store.enabled=false",
    ).run_dir
    resumed = compose_run(f"resume_from={src}", "start_at=execute", "store.enabled=false")

    def outputs(run_dir: Path) -> dict[str, np.ndarray]:
        with np.load(run_dir / "execute" / "outputs.npz") as z:
            return {k: z[k] for k in z.files}

    want, got = outputs(src), outputs(resumed.run_dir)
    assert want.keys() == got.keys() and len(want) == 2
    for k in want:
        assert want[k].tobytes() == got[k].tobytes(), k


def test_a_run_judged_not_to_fit_keeps_its_executable_for_a_later_try(compose_run, tmp_path):
    """The memory-analysis verdict is an estimate: the compile stage of a program it says does
    not fit is ``does_not_fit`` yet has its executable, and ``start_at=execute`` takes it (here it
    stops at the next check: this host has no TPU), not "no finished compile stage"."""
    from jaxaot.errors import DoesNotFit

    src = tmp_path / "misfit"
    with pytest.raises(DoesNotFit):  # XLA accepts it; 99.99999% of the HBM is held back
        compose_run(
            "program=axpy", "compile.topology=v5e:2x2", "compile.hbm_reserve=0.9999999", run_dir=src
        )
    compile_stage = read_manifest(src)["stages"]["compile"]
    assert (compile_stage["status"], compile_stage["computed"]) == ("does_not_fit", "ran")
    assert (src / "compile" / "executable.bin").exists()
    with pytest.raises(BackendError, match="this host has no TPU"):
        compose_run(f"resume_from={src}", "start_at=execute")


@pytest.mark.parametrize("bad_first", [True, False], ids=["bad-key-first", "resume-dir-first"])
@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ("execute.seed=-1", r"^execute\.seed: expected an int >= 0, found -1$"),
        ("store.dir=/dev/null", r"^store\.dir=/dev/null: expected a folder"),
    ],
)
def test_a_resume_names_the_users_config_error_before_a_missing_checkpoint(
    tmp_path, bad, named, bad_first
):
    """The user's own config is checked before the checkpoint is opened: a bad key, or a store
    folder that cannot be one, is the error, not the resume_from that does not exist."""
    missing = f"resume_from={tmp_path / 'nonexistent'}"
    overrides = ["program=axpy", "start_at=compile"]
    overrides += [bad, missing] if bad_first else [missing, bad]
    with pytest.raises(ConfigError, match=named):
        jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "r", overrides=overrides)
    assert not (tmp_path / "r").exists()


def test_a_resume_from_a_missing_folder_with_a_good_config_names_the_folder(tmp_path):
    overrides = ["program=axpy", "start_at=compile", f"resume_from={tmp_path / 'nonexistent'}"]
    with pytest.raises(StoreError, match=r"resume_from='.*nonexistent': no such run directory"):
        jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "r", overrides=overrides)
