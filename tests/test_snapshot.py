"""Golden snapshots (pipeline/snapshots/snapshot.py): write, verify, update, determinism, sweeps, pytest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jaxaot.examples
import pytest
from conftest import cli_env, read_manifest
from jaxaot.api import verify_snapshot
from jaxaot.errors import ConfigError, SnapshotError, SnapshotMismatch
from jaxaot.snapshots.snapshot import DIFF_NAME, INDEX_NAME, load_snapshot

AXPY8 = ("program=axpy", "program.args=[f32[8],f32[8]]", "stop_after=compile")
AXPY16 = ("program=axpy", "program.args=[f32[16],f32[16]]", "stop_after=compile")


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_golden_round_trip(compose_run, tmp_path: Path) -> None:
    golden = tmp_path / "golden" / "axpy"
    first = compose_run(*AXPY8, f"snapshot.write={golden}")
    assert first.manifest["snapshot"]["status"] == "written"
    index = json.loads((golden / INDEX_NAME).read_text())
    assert index["stages"] == ["stage_out", "lower", "compile"]
    assert set(index["files"]) >= {
        "stage_out/jaxpr.txt",
        "lower/module.stablehlo.mlir",
        "lower/module.hlo.txt",
        "compile/optimized.hlo.txt",
        "stage_out/signature.json",
        "config.json",
        "versions.json",
    }
    # no timestamps or paths in what is hashed
    for rel in index["files"]:
        text = (golden / rel).read_text()
        assert str(tmp_path) not in text and "2026-" not in text and "stack_frame" not in text
    # the run keeps its own copy, identical to the golden one
    assert _files(first.run_dir / "snapshot") == _files(golden)

    ok = compose_run(*AXPY8, f"snapshot.verify={golden}")
    assert ok.ok and ok.manifest["snapshot"]["status"] == "match"

    with pytest.raises(SnapshotMismatch, match=r"stage_out \(jaxpr\) differs; also") as err:
        compose_run(*AXPY16, f"snapshot.verify={golden}", "snapshot.diff_lines=6")
    exc = err.value
    assert "same versions as the golden (jax " in str(exc) and "snapshot.update=true" in str(exc)
    assert exc.diff_path is not None and exc.diff_path.endswith(DIFF_NAME)
    run_dir = Path(exc.diff_path).parent
    assert exc.diff.splitlines()[:2] == [
        f"--- {golden}/stage_out/jaxpr.txt",
        f"+++ {run_dir}/snapshot/stage_out/jaxpr.txt",
    ]
    assert len(exc.diff.splitlines()) == 7  # snapshot.diff_lines=6, then how many more
    assert f"more diff lines; full diff: {exc.diff_path}" in exc.diff.splitlines()[-1]
    full = Path(exc.diff_path).read_text()
    assert (
        "-{ lambda ; a:f32[8] b:f32[8]. let" in full
        and "+{ lambda ; a:f32[16] b:f32[16]. let" in full
    )
    assert '# config: program.args: ["f32[8]", "f32[8]"] -> ["f32[16]", "f32[16]"]' in full
    assert "+++ " in full.split("compile/optimized.hlo.txt", 1)[1]  # every stage's diff is there
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["snapshot"]["status"] == "mismatch"
    assert manifest["snapshot"]["first_difference"] == "stage_out/jaxpr.txt"


# zeros_like uses only its argument's shape: keep_unused changes the lowering, not the trace.
ZEROS = (
    "program=axpy",
    "program.target=jax.numpy:zeros_like",
    "program.args=[f32[8]]",
    "stop_after=compile",
)


@pytest.mark.parametrize(
    ("change", "stage"),
    [
        ("lower.keep_unused=true", "lower (StableHLO)"),
        ("+compile.compiler_options.xla_disable_hlo_passes=fusion", "compile (optimized HLO)"),
    ],
)
def test_verify_names_the_first_differing_stage(
    compose_run, tmp_path: Path, change: str, stage: str
) -> None:
    program = ZEROS if change.startswith("lower") else AXPY8
    golden = tmp_path / "golden"
    compose_run(*program, f"snapshot.write={golden}")
    with pytest.raises(SnapshotMismatch, match=re.escape(f"verify={golden}: {stage} differs")):
        compose_run(*program, change, f"snapshot.verify={golden}")


def test_update_rewrites_on_purpose(compose_run, tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    compose_run(*AXPY8, f"snapshot.write={golden}")
    with pytest.raises(
        SnapshotError, match=r"a different snapshot is there already .*snapshot\.update=true"
    ):
        compose_run(*AXPY16, f"snapshot.write={golden}")  # write never replaces a golden
    updated = compose_run(*AXPY16, f"snapshot.verify={golden}", "snapshot.update=true")
    assert updated.manifest["snapshot"]["status"] == "updated"
    assert "a:f32[16] b:f32[16]" in (golden / "stage_out/jaxpr.txt").read_text()
    assert (
        compose_run(*AXPY16, f"snapshot.verify={golden}").manifest["snapshot"]["status"] == "match"
    )
    with pytest.raises(SnapshotMismatch):
        compose_run(*AXPY8, f"snapshot.verify={golden}")
    # a run that stops earlier drops the later stages' files from the golden on update
    compose_run(*AXPY16, "stop_after=lower", f"snapshot.verify={golden}", "snapshot.update=true")
    assert load_snapshot(golden).stages == ["stage_out", "lower"]
    assert not (golden / "compile").exists()


def test_golden_problems_are_clear_errors(compose_run, tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    with pytest.raises(
        SnapshotError, match=r"no snapshot\.json there; write the golden snapshot first"
    ):
        compose_run(*AXPY8, "stop_after=lower", f"snapshot.verify={golden}")
    created = compose_run(
        *AXPY8, "stop_after=lower", f"snapshot.verify={golden}", "snapshot.update=true"
    )
    assert created.manifest["snapshot"]["status"] == "created"
    jaxpr = golden / "stage_out/jaxpr.txt"
    jaxpr.write_text(jaxpr.read_text().replace("f32[8]", "f32[9]"))
    with pytest.raises(SnapshotError, match=r"jaxpr\.txt: sha256 .* edited by hand; regenerate"):
        compose_run(*AXPY8, "stop_after=lower", f"snapshot.verify={golden}")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SnapshotError, match=r"not empty and holds no snapshot\.json"):
        compose_run(*AXPY8, "stop_after=lower", f"snapshot.write={tmp_path / 'other'}")


GOOD_ENTRY = {"sha256": "0" * 64, "size": 0}


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{not json", r"not valid JSON: expected the JSON object jaxaot writes, found Expecting"),
        ("[1, 2]", r"expected the JSON object jaxaot writes, found a JSON list"),
        ('{"files": {}}', r"format_version: expected the integer 1, found none"),
        ('{"format_version": "1"}', r"format_version: expected the integer 1, found '1'"),
        ('{"format_version": true}', r"format_version: expected the integer 1, found True"),
        ('{"format_version": 2}', r"snapshot format version 2; this jaxaot reads version 1"),
        ('{"format_version": 1, "files": []}', r"files: expected an object .* found a JSON list"),
        (
            json.dumps({"format_version": 1, "files": {"../x.txt": GOOD_ENTRY}}),
            r"file entry '\.\./x\.txt': expected a path inside the folder, found one that leaves",
        ),
        (
            json.dumps({"format_version": 1, "files": {"a.txt": {"sha256": "ab"}}}),
            r"file entry 'a\.txt': expected \{\"sha256\": str, \"size\": int\}, found \{'sha256'",
        ),
    ],
    ids=[
        "bad-json",
        "not-object",
        "no-version",
        "string-version",
        "bool-version",
        "other-version",
        "files-list",
        "entry-leaves",
        "entry-record",
    ],
)
def test_unusable_index_says_what_expected_found_and_the_fix(
    tmp_path: Path, index: str, message: str
) -> None:
    (tmp_path / INDEX_NAME).write_text(index)
    with pytest.raises(SnapshotError) as err:
        load_snapshot(tmp_path)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"{tmp_path / INDEX_NAME}: ")
    assert re.search(message, text), text
    assert text.endswith(f"; rewrite it with snapshot.verify={tmp_path} snapshot.update=true")
    # an update reads it as an empty snapshot, so the fix it names works
    assert load_snapshot(tmp_path, check=False).files == {}


def test_unreadable_index_says_the_fix(tmp_path: Path) -> None:
    index = tmp_path / INDEX_NAME
    index.mkdir()  # unreadable as a file, for root too
    with pytest.raises(SnapshotError) as err:
        load_snapshot(tmp_path)
    assert str(err.value) == (
        f"{index}: unreadable (Is a directory); make it readable or rewrite it with "
        f"snapshot.verify={tmp_path} snapshot.update=true"
    )


def test_update_rewrites_an_unusable_index(compose_run, tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / INDEX_NAME).write_text('{"format_version": 99}')
    with pytest.raises(SnapshotError, match=r"format version 99; this jaxaot reads version 1; "):
        compose_run(*AXPY8, "stop_after=lower", f"snapshot.verify={golden}")
    compose_run(*AXPY8, "stop_after=lower", f"snapshot.verify={golden}", "snapshot.update=true")
    assert load_snapshot(golden).stages == ["stage_out", "lower"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["snapshot.write=a", "snapshot.verify=b"], r"expected one of them"),
        (["snapshot.update=true"], r"snapshot\.update=true: expected snapshot\.verify"),
        (["snapshot.diff_lines=-1"], r"snapshot\.diff_lines: expected >= 0"),
        (["snapshot.graph_format=gif"], r"snapshot\.graph_format: expected one of svg, png"),
    ],
)
def test_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        jaxaot.validate(jaxaot.compose(["program=axpy", *overrides]))


def test_no_snapshot_options_write_nothing(compose_run) -> None:
    result = compose_run("program=axpy", "stop_after=lower")
    assert "snapshot" not in result.manifest
    assert not (result.run_dir / "snapshot").exists() and not (result.run_dir / "graph").exists()


def test_two_fresh_processes_give_byte_identical_snapshots(tmp_path: Path) -> None:
    """The shipped mlp config in two processes at once, from different working directories
    and hash seeds, with the program's source file at different paths and line numbers: the
    snapshot folders must hold the same bytes."""
    source = (Path(jaxaot.examples.__file__).parent / "mlp.py").read_text()
    jobs = []
    for i in (1, 2):
        cwd, src = tmp_path / f"cwd{i}", tmp_path / f"src{i}" / ("nested" * i)
        cwd.mkdir()
        src.mkdir(parents=True)
        (src / "snapmod.py").write_text("\n" * (7 * i) + source)
        # a store each: both processes must compile (a shared one would serve the second)
        env = cli_env(PYTHONHASHSEED=str(i), JAXAOT_STORE_DIR=str(tmp_path / f"store{i}"))
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(src)])
        cmd = [
            sys.executable,
            "-m",
            "jaxaot",
            "program=mlp",
            "program.target=snapmod:mlp",
            "stop_after=compile",
            f"snapshot.write={tmp_path / 'golden' / str(i)}",
            f"hydra.run.dir={tmp_path / 'runs' / str(i)}",
        ]
        jobs.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    for job in jobs:
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out
    a, b = _files(tmp_path / "golden" / "1"), _files(tmp_path / "golden" / "2")
    assert "compile/optimized.hlo.txt" in a and INDEX_NAME in a
    assert a == b, [k for k in a if a[k] != b.get(k)]
    # the raw artifacts did differ: the optimized HLO's debug tables name each source path
    raw = [(tmp_path / "runs" / i / "compile/optimized.hlo.txt").read_text() for i in "12"]
    assert str(tmp_path / "src1") in raw[0] and str(tmp_path / "src1") not in raw[1]


def test_multirun_suite_with_interpolated_golden_dirs(compose_run, tmp_path: Path) -> None:
    for name in ("axpy", "mlp"):
        compose_run(
            f"program={name}",
            "stop_after=lower",
            f"snapshot.write={tmp_path}/golden/{name}",
            run_dir=tmp_path / f"w{name}",
        )
    # mlp's golden replaced by axpy's: the mlp job must fail, the axpy job pass, the sweep exit 1
    mlp = tmp_path / "golden/mlp"
    for rel, data in _files(tmp_path / "golden/axpy").items():
        (mlp / rel).write_bytes(data)
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxaot",
            "-m",
            "program=axpy,mlp",
            "stop_after=lower",
            "snapshot.verify=golden/${program.name}",
            "hydra.callbacks.sweep.plots=false",  # the report's plots: not what is checked
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "snapshot: 1 sweep job(s) failed" in checked.stderr
    assert "snapshot.verify=golden/mlp: stage_out (jaxpr) differs" in checked.stderr
    assert "--- golden/mlp/stage_out/jaxpr.txt" in checked.stdout
    verdicts = {
        m["config"]["program"]["name"]: (m["snapshot"]["dir"], m["snapshot"]["status"])
        for m in (read_manifest(p.parent) for p in (tmp_path / "sweep").glob("*/manifest.json"))
    }
    assert verdicts == {"axpy": ("golden/axpy", "match"), "mlp": ("golden/mlp", "mismatch")}


def test_verify_snapshot_helper(tmp_path: Path) -> None:
    golden = tmp_path / "tests" / "golden" / "axpy"
    created = verify_snapshot(golden, AXPY8, update=True, run_dir=tmp_path / "r0")
    assert created.manifest["snapshot"]["status"] == "created"
    assert verify_snapshot(golden, AXPY8, run_dir=tmp_path / "r1").ok
    with pytest.raises(AssertionError, match=r"stage_out \(jaxpr\) differs") as err:
        verify_snapshot(golden, AXPY16, run_dir=tmp_path / "r2")
    assert "+{ lambda ; a:f32[16] b:f32[16]. let" in str(err.value)  # the diff rides along


# A user's own test suite using the pytest11 plugin's fixture (golden folders relative to the
# test file): test_first alone, then, once --jaxaot-update wrote its golden, with test_changed.
USER_FIRST = f"""
def test_first(jaxaot_snapshot):
    assert jaxaot_snapshot("golden/axpy", {list(AXPY8)!r}).ok
"""
USER_CHANGED = f"""
import pytest

def test_changed(jaxaot_snapshot):
    with pytest.raises(AssertionError, match="stage_out \\\\(jaxpr\\\\) differs"):
        jaxaot_snapshot("golden/axpy", {list(AXPY16)!r})
"""


def _user_pytest(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *extra: str,
) -> tuple[int, str]:
    """``pytest -q -p jaxaot -p no:cacheprovider tests/test_user.py <extra>`` as the user runs it
    in ``tmp_path`` (plugin autoload off: the plugin is named), in this process: its exit status
    and what it printed. Its session's temp folders go under ``tmp_path/pytest``."""
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        m.chdir(tmp_path)
        m.setattr(sys, "path", list(sys.path))  # the session puts tests/ first
        m.delitem(sys.modules, "test_user", raising=False)  # each session imports the file anew
        args = ["-q", "-p", "jaxaot", "-p", "no:cacheprovider"]
        code = pytest.main(
            [*args, f"--basetemp={tmp_path / 'pytest'}", "tests/test_user.py", *extra]
        )
        m.delitem(sys.modules, "test_user", raising=False)
    return int(code), capsys.readouterr().out


def test_pytest_fixture_without_a_golden_says_how_to_write_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_user.py").write_text(USER_FIRST)
    code, out = _user_pytest(tmp_path, monkeypatch, capsys)
    assert code == 1
    golden = tmp_path / "tests" / "golden" / "axpy"
    line = f"no golden yet: run `pytest --jaxaot-update` to write {golden}"
    assert line in out
    assert "Traceback" not in out and "snapshot.py" not in out  # one line
    assert not golden.exists()
    code, out = _user_pytest(tmp_path, monkeypatch, capsys, "--jaxaot-update")
    assert code == 0, out
    assert (golden / "snapshot.json").is_file()
    # the golden the fixture wrote: the same program matches it, a changed one differs
    (tmp_path / "tests" / "test_user.py").write_text(USER_FIRST + USER_CHANGED)
    code, out = _user_pytest(tmp_path, monkeypatch, capsys)
    assert code == 0, out
    assert "2 passed" in out


def test_jaxaot_graph_never_writes_into_a_golden_snapshot(
    compose_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxaot.cli.graph_cmd import main as graph_main

    golden = tmp_path / "golden" / "axpy"
    compose_run(*AXPY8, f"snapshot.write={golden}")
    before = _files(golden)
    listing = sorted(p.relative_to(golden) for p in golden.rglob("*"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert graph_main([str(golden)]) == 0
    assert graph_main([str(golden / "compile" / "optimized.hlo.txt")]) == 0
    assert sorted(p.relative_to(golden) for p in golden.rglob("*")) == listing
    assert _files(golden) == before
    assert (work / "axpy.graph" / "optimized.hlo.dot").read_text().startswith("digraph")
    assert (work / "optimized.hlo.dot").is_file()
