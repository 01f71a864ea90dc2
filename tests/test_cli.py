"""The ``jaxaot`` command in a subprocess: Hydra's introspection, a user module through every
stage option, user config directories, and errors as one line with a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import jaxaot
import numpy as np
import pytest
import yaml
from conftest import REPO, SuiteServer, cli_env, read_manifest, run_cli, served_env

# A test of the process itself (its exit status and lines on an error, --help, --version, a
# closed stdout, JAX as the target is imported) starts a plain `jaxaot`; a test of what a run
# does (its manifest, artifacts and folders) runs through the suite's server, a child forked
# per run with the client's exit status and pipes.
plain_process = pytest.mark.plain_process

MODEL = textwrap.dedent(
    """
    import jax.numpy as jnp

    def loss(x, b, n):
        # n is a Python int (static): it unrolls n tanh layers.
        y = x * b.astype(x.dtype)
        for _ in range(n):
            y = jnp.tanh(y)
        return y
    """
)


def _env_with(path: Path) -> dict[str, str]:
    return cli_env(PYTHONPATH=os.pathsep.join([str(REPO), str(path)]))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# --- Hydra's own introspection ---------------------------------------------------------------


def _run_alone(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None, *args: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot <args>``, started as a plain_process test starts it, in an empty folder of its
    own (its own store and config folders beside it): the finished process and that folder."""
    home = tmp_path_factory.mktemp("alone")
    cwd = home / "cwd"
    cwd.mkdir()
    own = {"JAXAOT_STORE_DIR": str(home / "store"), "XDG_CONFIG_HOME": str(home / "config")}
    # a plain process, as a plain_process test's own runs; through the suite's server only under
    # JAXAOT_TEST_SERVER=1 (make test-server), which sends those through it too
    every_run_served = os.environ.get("JAXAOT_TEST_SERVER") == "1"
    env = served_env(suite_server, **own) if every_run_served else cli_env(**own)
    return run_cli(list(args), cwd=cwd, env=env), cwd


@pytest.fixture(scope="module")
def help_run(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot --help``, run once for the module's tests of its screen."""
    return _run_alone(tmp_path_factory, suite_server, "--help")


@pytest.fixture(scope="module")
def version_run(
    tmp_path_factory: pytest.TempPathFactory, suite_server: SuiteServer | None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``jaxaot --version`` (as ``python -m jaxaot --version``), run once for the module."""
    return _run_alone(tmp_path_factory, suite_server, "--version")


@plain_process
def test_help_is_one_screen_with_groups_options_and_no_schemas(
    help_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, _ = help_run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) <= 60 and max(len(line) for line in lines) <= 100
    assert "base_" not in proc.stdout  # schemas are not choices
    assert "layers:" not in proc.stdout and "== Config ==" not in proc.stdout  # no config dump
    groups = proc.stdout.split("== Config groups", 1)[1].split("\n\n", 1)[0]
    # every group of conf/config.yaml's defaults list, each with its one-line description
    for group, words in (
        ("program", "what to compile"),
        ("lower", "lowering options"),
        ("mesh", "device mesh"),
        ("store", "checkpoint store"),
        ("experiment", "whole-run preset"),
    ):
        assert any(ln.startswith(group + " ") and words in ln for ln in groups.splitlines())
    assert "transformer*" in groups and "none*" in groups  # defaults marked
    assert "stop_after=execute" in proc.stdout and "jaxaot --version" in proc.stdout
    assert "$" not in proc.stdout  # no unexpanded Hydra template variable


@plain_process
def test_version_names_jaxaot_jax_jaxlib_and_the_backend(
    version_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    import jax
    import jaxlib

    proc, cwd = version_run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:3] == [
        f"jaxaot {jaxaot.__version__}",
        f"jax {jax.__version__}",
        f"jaxlib {jaxlib.__version__}",
    ]
    assert lines[3].startswith("backend cpu (compile.backend default): ")
    assert "Hydra" not in proc.stdout and not list(cwd.iterdir())
    assert "Traceback" not in proc.stderr and "CUDA" not in proc.stderr  # no plugin probing


@plain_process
def test_python_dash_m_jaxaot_is_the_command(
    version_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, _ = version_run  # run_cli starts `python -m jaxaot`
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("jaxaot ")


def test_python_and_the_cli_write_one_run_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    monkeypatch.chdir(tmp_path)  # jaxaot.run from Python in this folder, as `python -c` would
    py = jaxaot.run(jaxaot.compose(["program=axpy", "stop_after=stage_out"]))
    assert py.ok
    cli_run = run_cli(["program=axpy", "stop_after=stage_out"], cwd=tmp_path)
    assert cli_run.returncode == 0, cli_run.stderr
    runs = sorted(p.parent.relative_to(tmp_path) for p in tmp_path.rglob("manifest.json"))
    assert len(runs) == 2
    for run in runs:  # outputs/<date>/<time>[-n], both
        assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d(-\d+)?", str(run)), run
    assert str(py.run_dir) in {str(r) for r in runs}


def _closed_stdout(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose reader is already gone (``| head`` after its lines)."""
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, *args],
            cwd=cwd,
            env=cli_env(),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)


@plain_process
def test_a_closed_stdout_ends_quietly_with_the_runs_own_status(tmp_path: Path) -> None:
    ok = _closed_stdout(
        ["-m", "jaxaot", "program=axpy", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert "BrokenPipe" not in ok.stderr and "Traceback" not in ok.stderr
    assert read_manifest(tmp_path / "a")["status"] == "ok"  # the run went on to the end
    bad = _closed_stdout(
        [
            "-m",
            "jaxaot",
            "program=axpy",
            "program.args=[f32[3],f32[4]]",
            f"hydra.run.dir={tmp_path / 'b'}",
        ],
        tmp_path,
    )
    assert bad.returncode == 1
    assert bad.stderr.count("incompatible shapes for broadcasting") == 1  # printed once
    assert "jaxaot: error: stage 'stage_out' failed: TypeError: add got" in bad.stderr
    diff = _closed_stdout(
        ["-m", "jaxaot.cli.diff_cmd", str(tmp_path / "a"), str(tmp_path / "b")], tmp_path
    )
    assert diff.returncode == 1, diff.stderr  # "different", as documented, though unread
    assert diff.stderr == ""


@plain_process
def test_help_lists_the_config_groups_and_programs(
    help_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, cwd = help_run
    assert proc.returncode == 0, proc.stderr
    assert "== Config groups (group=option; * = default) ==" in proc.stdout
    start = next(i for i, ln in enumerate(proc.stdout.splitlines()) if ln.startswith("program "))
    lines = proc.stdout.splitlines()
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    programs = " ".join(lines[start:end])  # wrapped onto as many lines as it takes
    for name in ("attention", "axpy", "collectives", "mlp", "transformer*", "transformer_train"):
        assert name in programs
    assert "\ncompile " in proc.stdout and "\nexecute " in proc.stdout
    assert proc.stdout.startswith("jaxaot: JAX's four AOT stages")
    usage = proc.stdout.split("== Usage ==\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [u.split()[0] for u in usage] == ["jaxaot"] * 9
    assert any(u.startswith("jaxaot -v ") for u in usage)
    commands = proc.stdout.split("== Commands", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [" ".join(c.split()[:2]) for c in commands] == [
        "jaxaot server",
        "jaxaot-store stats",
        "jaxaot-diff <run",
        "jaxaot-graph <run",
        "jaxaot-report <sweep",
    ]
    assert "--hydra-help" in proc.stdout.splitlines()[-1]
    assert not list(cwd.iterdir())  # nothing ran


@plain_process
def test_info_shows_the_shipped_config_dir(tmp_path: Path) -> None:
    proc = run_cli(["--info"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Config search path" in proc.stdout
    assert "pkg://jaxaot.conf" in proc.stdout


@plain_process
def test_cfg_job_prints_the_composed_config_without_running(tmp_path: Path) -> None:
    proc = run_cli(
        [
            "--cfg",
            "job",
            "program=axpy",
            "program.args=[f32[2],3]",
            "stop_after=lower",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load(proc.stdout)
    assert job["program"]["name"] == "axpy"
    assert job["program"]["args"] == ["f32[2]", 3]
    assert job["stop_after"] == "lower"
    assert not (tmp_path / "run").exists()


# --- a user module through every stage option ------------------------------------------------


def test_the_issues_example_with_a_user_module(tmp_path: Path) -> None:
    pkg = tmp_path / "user" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(MODEL)
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "program.target=mypkg.model:loss",
            "program.args=[f32[128,512],{shape:[512],dtype:bf16,init:normal},3]",
            "stage_out.static_argnums=[2]",
            "lower.donate_argnums=[0]",
            "compile.backend=cpu",
            "compile.compiler_options={xla_cpu_enable_fast_math:true}",
            "stop_after=compile",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path / "user",  # ./mypkg importable as under `python -m`: no PYTHONPATH=.
    )
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "ok"
    assert manifest["config"]["compile"]["compiler_options"] == {"xla_cpu_enable_fast_math": True}
    assert [manifest["stages"][s]["status"] for s in ("stage_out", "lower")] == ["ran", "ran"]
    assert manifest["stages"]["compile"]["status"] in ("ran", "cached")
    assert (run_dir / "compile" / "executable.bin").is_file()
    assert not (run_dir / "execute").exists()

    sig = json.loads((run_dir / "stage_out" / "signature.json").read_text())
    assert [(i["path"], i["type"], i["donated"]) for i in sig["inputs"]] == [
        ("args[0]", "f32[128,512]", True),
        ("args[1]", "bf16[512]", False),
    ]
    assert sig["static"] == [{"path": "args[2]", "value": 3}]
    assert sig["outputs"][0]["type"] == "f32[128,512]"
    assert (run_dir / "stage_out" / "jaxpr.txt").read_text().count("tanh") == 3
    assert "tf.aliasing_output = 0" in (run_dir / "lower" / "module.stablehlo.mlir").read_text()
    assert "compile" in proc.stdout and "FLOP" in proc.stdout  # the summary table
    # Not named after the default program whose other fields it kept: after its function.
    assert manifest["config"]["program"]["name"] == "loss"
    assert proc.stdout.startswith("jaxaot · loss (mypkg.model:loss) · cpu")  # the summary only


# --- user config directories -----------------------------------------------------------------

MINE = textwrap.dedent(
    """
    defaults:
      - base_program
      - _self_

    name: mine
    description: a user's own program config
    target: jax.numpy:multiply
    args: ["f32[3]", 2.0]
    kwargs: {}
    """
)


def _user_conf(tmp_path: Path) -> Path:
    conf = tmp_path / "myconf"
    (conf / "program").mkdir(parents=True)
    (conf / "program" / "mine.yaml").write_text(MINE)
    return conf


def test_config_dir_adds_a_users_programs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "--config-dir",
            str(_user_conf(tmp_path)),
            "program=mine",
            "execute.repeats=1",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(run_dir)
    assert manifest["config"]["program"]["name"] == "mine"
    with np.load(run_dir / "execute" / "outputs.npz") as z:
        assert z["out0"].shape == (3,) and z["out0"].dtype == np.float32


def test_hydra_searchpath_adds_a_users_programs(tmp_path: Path) -> None:
    # In-process (jaxaot.compose takes the same overrides as the command line).

    cfg = jaxaot.compose([f"hydra.searchpath=[file://{_user_conf(tmp_path)}]", "program=mine"])
    typed = jaxaot.validate(cfg)
    assert (typed.program.name, typed.program.target) == ("mine", "jax.numpy:multiply")
    assert typed.program.args == ["f32[3]", 2.0]


# --- errors: one line, non-zero exit, traceback only with debug ------------------------------


@plain_process
def test_an_unknown_key_is_rejected_naming_it(tmp_path: Path) -> None:
    proc = run_cli(
        ["program=axpy", "compile.bogus=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path
    )
    assert proc.returncode == 1
    (line,) = _error_lines(proc.stderr)
    assert line.startswith("jaxaot: error: unknown key 'compile.bogus' (compile has backend, ")
    assert "HYDRA_FULL_ERROR" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "manifest.json").exists()


@plain_process
def test_a_wrong_type_is_one_line_naming_the_key(tmp_path: Path) -> None:
    proc = run_cli(["execute.repeats=lots", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = _error_lines(proc.stderr)
    assert "execute.repeats" in line and "lots" in line


@plain_process
def test_an_arg_spec_error_is_one_line(cli) -> None:
    proc, run_dir = cli("program=axpy", "program.args=[x32[3],f32[3]]", expect_ok=False)
    assert proc.returncode == 1
    assert _error_lines(proc.stderr) == [
        "jaxaot: error: program.args[0]: unknown dtype 'x32'; expected one of "
        + proc.stderr.split("expected one of ", 1)[1].strip()
    ]
    assert not (run_dir / "manifest.json").exists()  # rejected before any stage


@plain_process
def test_a_target_error_is_one_line_and_debug_adds_the_traceback(cli) -> None:
    proc, run_dir = cli("program=axpy", "program.target=no_such_module_xyz:f", expect_ok=False)
    assert proc.returncode == 1
    assert _error_lines(proc.stderr) == [
        "jaxaot: error: program.target='no_such_module_xyz:f': cannot import module "
        "'no_such_module_xyz' (No module named 'no_such_module_xyz'); is its package installed, "
        "on PYTHONPATH or in the current directory?"
    ]
    assert proc.stdout == "" and not run_dir.exists()  # refused before the run began

    debug, _ = cli(
        "program=axpy", "program.target=no_such_module_xyz:f", "debug=true", expect_ok=False
    )
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert "TargetError" in debug.stderr
    assert _error_lines(debug.stderr)[-1].startswith("jaxaot: error: program.target=")


@plain_process
def test_an_absent_backend_is_one_line_saying_how_to_lower(cli) -> None:
    proc, _ = cli("program=axpy", "compile.backend=tpu", expect_ok=False)
    assert proc.returncode == 1
    [line] = _error_lines(proc.stderr)
    assert line.startswith("jaxaot: error: compile.backend='tpu': no tpu backend on this machine")
    assert "lower.platforms=[tpu] stop_after=lower" in line


@plain_process
def test_a_failed_reference_check_exits_non_zero(cli, tmp_path: Path) -> None:
    nan = tmp_path / "nan.npy"
    np.save(nan, np.array([1, np.nan, 3], np.float32))
    proc, run_dir = cli(
        "program.target=jax.numpy:max",
        "program.args=[f32[3]]",
        f"execute.inputs=[{nan}]",
        "compile.compiler_options={xla_cpu_enable_fast_min_max:true}",
        "execute.check=reference",
        expect_ok=False,
    )
    assert proc.returncode == 1
    [line] = _error_lines(proc.stderr)
    assert line.startswith(
        "jaxaot: error: execute.check=reference: outputs differ from plain jax.jit"
    )
    assert read_manifest(run_dir)["stages"]["execute"]["metrics"]["check"] == "failed"


@plain_process
@pytest.mark.parametrize("sweeper", ["jaxaot_fit", "jaxaot_optuna"])
def test_a_search_sweeper_without_multirun_is_refused(cli, tmp_path: Path, sweeper: str) -> None:
    """Without -m Hydra would run the job once and search nothing: refused, nothing left."""
    proc, run_dir = cli(f"hydra/sweeper={sweeper}", "program=axpy", expect_ok=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"jaxaot: error: hydra/sweeper={sweeper}: a search runs only as a sweep, and this command "
        f"line has no -m; expected jaxaot -m hydra/sweeper={sweeper} ... (without -m, Hydra runs "
        "the job once and searches nothing)"
    )
    assert not run_dir.exists()


@plain_process
def test_a_target_that_cannot_be_imported_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """The target is imported before the run has a folder: no summary, no outputs/."""
    proc = run_cli(["program=axpy", "program.target=nosuch.mod:fn"], cwd=tmp_path)
    assert proc.returncode == 1
    [line] = _error_lines(proc.stderr)
    assert line.startswith(
        "jaxaot: error: program.target='nosuch.mod:fn': cannot import module 'nosuch.mod'"
    )
    assert proc.stdout == ""  # no summary table
    assert not (tmp_path / "outputs").exists()


@plain_process
def test_a_target_that_exits_while_imported_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "ends_on_import.py").write_text("import sys\nsys.exit(3)\ndef f(x): return x\n")
    proc = run_cli(
        ["program.target=ends_on_import:f", "program.args=[f32[2]]"],
        cwd=tmp_path,
        env=_env_with(tmp_path),
    )
    assert proc.returncode == 1
    assert _error_lines(proc.stderr) == [
        "jaxaot: error: program.target='ends_on_import:f': importing 'ends_on_import' called "
        "sys.exit(3); expected the module to import without ending the process"
    ]
    assert not (tmp_path / "outputs").exists()


@plain_process
def test_the_target_is_imported_under_the_runs_jax_settings(tmp_path: Path) -> None:
    """What a module sees of JAX when it is imported (before the run's folder exists) is what
    the run configured: the platform, the device count and x64."""
    probe = tmp_path / "probe.txt"
    (tmp_path / "probe_mod.py").write_text(
        textwrap.dedent(
            f"""
            import jax

            with open({str(probe)!r}, "w") as f:
                f.write(f"{{jax.config.jax_platforms}} {{jax.config.jax_num_cpu_devices}} "
                        f"{{jax.config.jax_enable_x64}}")

            def f(x):
                return x * 2
            """
        )
    )
    proc = run_cli(
        [
            "program.target=probe_mod:f",
            "program.args=[f64[4]]",
            "compile.num_devices=2",
            "stop_after=stage_out",
        ],
        cwd=tmp_path,
        env=_env_with(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert probe.read_text() == "cpu 2 True"
    [run_dir] = (tmp_path / "outputs").glob("2*/*")
    assert read_manifest(run_dir)["stages"]["stage_out"]["status"] == "ran"
