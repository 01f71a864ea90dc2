"""Paths a run is pointed at that cannot serve: ``store.dir``, ``snapshot.write``/``verify``,
``resume_from`` and the run dir itself. Each ends in one line naming the key and the path (a
config error before any JAX work, where it can be known then), never an internal error, a
traceback, or a torn file; a store that fills up during a run costs one warning, not the run."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jaxaot
import pytest
from conftest import cli_env, run_cli
from jaxaot.errors import ConfigError, RunDirError, SnapshotError, StoreError
from jaxaot.rundir.dirs import claim
from jaxaot.rundir.manifest import Manifest
from jaxaot.store.cache import Store
from jaxaot.util.fsio import TEMP_PREFIX, folder_problem


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "internal error" not in lines[0] and "Traceback" not in proc.stderr
    assert lines[0].startswith("jaxaot: error: ")
    return lines[0]


@pytest.fixture
def bad_dirs(tmp_path: Path) -> dict[str, Path]:
    """Paths that cannot be folders, by what is wrong with them."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    return {
        "a character device": Path("/dev/null"),
        "a regular file": tmp_path / "file",
        "a loop": tmp_path / "loop1",
        "under a file": tmp_path / "file" / "store",
        "a dangling link": tmp_path / "dangling",
    }


REASONS = {
    "a character device": "/dev/null is a character device, not a folder",
    "a regular file": "file is a regular file, not a folder",
    "a loop": "loop1 cannot be resolved: its symbolic links form a loop",
    "under a file": "file is a regular file, not a folder, so ",
    "a dangling link": "dangling is a symbolic link to ",
}


# -- folder_problem ------------------------------------------------------------------------------


def test_folder_problem_names_what_is_wrong(bad_dirs: dict[str, Path], tmp_path: Path) -> None:
    for what, path in bad_dirs.items():
        problem = folder_problem(path, write=False)
        assert problem is not None and REASONS[what] in problem, (what, problem)
    assert folder_problem(tmp_path, write=True) is None
    assert folder_problem(tmp_path / "new" / "deeper", write=True) is None  # can be created
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert folder_problem(tmp_path / "link", write=True) is None
    (tmp_path / "flink").symlink_to(tmp_path / "file")
    problem = folder_problem(tmp_path / "flink", write=False)
    assert problem == (
        f"{tmp_path / 'flink'} (a symbolic link to {tmp_path / 'file'}) is a regular file, "
        "not a folder"
    )
    # without create, a path that is not there yet is fine; a file in the way is not
    assert folder_problem(tmp_path / "absent", write=False, create=False) is None
    assert folder_problem(tmp_path / "file" / "x", write=False, create=False) is not None


# -- store.dir: a config error before any JAX work ------------------------------------------------


def test_an_unusable_store_dir_is_a_config_error_naming_the_key(
    bad_dirs: dict[str, Path],
) -> None:
    for what, path in bad_dirs.items():
        with pytest.raises(ConfigError) as err:
            jaxaot.validate(jaxaot.compose(["program=axpy", f"store.dir={path}"]))
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith(f"store.dir={path}: expected a folder for the checkpoint store")
        assert REASONS[what] in msg and "store.enabled=false" in msg, (what, msg)
        # a disabled store is not looked at
        jaxaot.validate(
            jaxaot.compose(["program=axpy", f"store.dir={path}", "store.enabled=false"])
        )


def test_store_dir_from_the_environment_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("JAXAOT_STORE_DIR", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"^store\.dir \(unset, so \$JAXAOT_STORE_DIR=.*file\)"):
        jaxaot.validate(jaxaot.compose(["program=axpy"]))


def test_a_read_only_store_folder_is_not_a_config_error(tmp_path: Path) -> None:
    """An existing folder you may read serves hits; puts are skipped with one warning."""
    (tmp_path / "store").mkdir()
    jaxaot.validate(jaxaot.compose(["program=axpy", f"store.dir={tmp_path / 'store'}"]))


@pytest.mark.parametrize(
    "what", ["a character device", "a regular file", "a loop", "under a file", "a dangling link"]
)
def test_cli_unusable_store_dir_is_one_line_before_any_work(
    bad_dirs: dict[str, Path], tmp_path: Path, what: str
) -> None:
    path = bad_dirs[what]
    run_dir = tmp_path / "run"
    work = tmp_path / "work"  # a working folder without the symlink loop (which no server takes)
    work.mkdir()
    proc = run_cli(["program=axpy", f"store.dir={path}", f"hydra.run.dir={run_dir}"], cwd=work)
    assert proc.returncode == 1
    line = _one_error_line(proc)
    assert line.startswith(f"jaxaot: error: store.dir={path}: ") and REASONS[what] in line
    assert not (run_dir / "manifest.json").exists()  # refused at validation: nothing ran
    assert (tmp_path / "file").read_text() == "mine"


# -- snapshot.write / snapshot.verify ------------------------------------------------------------


def test_snapshot_paths_that_are_not_folders_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("mine")
    for key, extra in (("snapshot.write", []), ("snapshot.verify", ["snapshot.update=true"])):
        for path in (tmp_path / "file", Path("/dev/null")):
            with pytest.raises(ConfigError) as err:
                jaxaot.validate(jaxaot.compose(["program=axpy", f"{key}={path}", *extra]))
            assert str(err.value).startswith(f"{key}={path}: expected a folder")
            assert f"{path} is a " in str(err.value)
    with pytest.raises(ConfigError, match=r"^snapshot\.verify=.*file: expected a folder"):
        jaxaot.validate(jaxaot.compose(["program=axpy", f"snapshot.verify={tmp_path / 'file'}"]))
    # a golden not written yet is reported after the run, with how to write it
    jaxaot.validate(jaxaot.compose(["program=axpy", f"snapshot.verify={tmp_path / 'golden'}"]))


def test_cli_snapshot_write_to_a_regular_file_is_one_line_before_any_work(
    tmp_path: Path,
) -> None:
    target = tmp_path / "golden.txt"
    target.write_text("mine")
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["program=axpy", f"snapshot.write={target}", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    assert proc.returncode == 1
    line = _one_error_line(proc)
    assert line.startswith(f"jaxaot: error: snapshot.write={target}: expected a folder")
    assert f"{target} is a regular file, not a folder" in line
    assert target.read_text() == "mine" and not (run_dir / "manifest.json").exists()


def test_a_golden_that_cannot_be_written_is_one_snapshot_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compose_run
) -> None:  # type: ignore[no-untyped-def]
    import jaxaot.snapshots.snapshot as snapshot

    golden = tmp_path / "golden"
    real = snapshot.atomic_write_text

    def full(path: Path, text: str) -> str:
        if golden in Path(path).parents:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, text)

    monkeypatch.setattr(snapshot, "atomic_write_text", full)
    with pytest.raises(SnapshotError) as err:
        compose_run("program=axpy", "stop_after=lower", f"snapshot.write={golden}")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"snapshot.write={golden}: cannot write {golden}/")
    assert os.strerror(errno.ENOSPC) in msg
    assert not golden.exists() or not (golden / "snapshot.json").exists()  # no index: no golden


# -- resume_from ---------------------------------------------------------------------------------


def test_resume_from_a_regular_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    overrides = ["program=axpy", f"resume_from={tmp_path / 'file'}", "start_at=execute"]
    with pytest.raises(StoreError) as err:
        jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "r", overrides=overrides)
    msg = str(err.value)
    assert msg.startswith(f"resume_from='{tmp_path / 'file'}': no such run directory")
    assert "is a regular file, not a folder" in msg


# -- the run dir ---------------------------------------------------------------------------------


def test_a_manifest_that_cannot_be_written_keeps_the_last_complete_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jaxaot.rundir.manifest as manifest_module

    manifest = Manifest(run_dir=tmp_path, config={"a": 1})
    manifest.write()
    before = (tmp_path / "manifest.json").read_text()
    real = manifest_module.atomic_write_json
    calls: list[Path] = []

    def full(path: Path, obj: object) -> str:
        calls.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(manifest_module, "atomic_write_json", full)
    manifest.status = "ok"
    with pytest.raises(RunDirError) as err:
        manifest.write()
    msg = str(err.value)
    assert msg.startswith(f"run dir {tmp_path}: cannot write manifest.json (No space left")
    assert "\n" not in msg
    assert (tmp_path / "manifest.json").read_text() == before
    # The run then ends with this error: writing its record fails again, quietly.
    manifest.status, manifest.error = "failed", msg
    manifest.write()
    assert len(calls) == 2
    monkeypatch.setattr(manifest_module, "atomic_write_json", real)
    manifest.write()  # space again: written
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "failed"


def test_claim_on_a_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = Path.write_bytes

    def full(self: Path, data: bytes) -> int:
        if self.name.startswith(f"{TEMP_PREFIX}manifest.json"):
            real_write(self, data[:10])  # a torn temp file, as a full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    run_dir = tmp_path / "run"
    with pytest.raises(RunDirError) as err:
        claim(run_dir, {"status": "running"}, key="hydra.run.dir")
    msg = str(err.value)
    assert msg.startswith(f"hydra.run.dir='{run_dir}': cannot write manifest.json (No space")
    assert list(run_dir.iterdir()) == []  # neither a manifest nor a temp file


def test_claim_of_a_run_dir_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match=r"^run_dir='.*file': expected a folder for the run"):
        claim(tmp_path / "file", {}, key="run_dir")
    assert (tmp_path / "file").read_text() == "mine"


# The CLI in a fresh process whose run dir fills up once the first stage is recorded.
_FULL_RUN_DIR = """
import errno, os, sys
import jaxaot.rundir.manifest as m
real = m.atomic_write_json
def full(path, obj):
    if obj.get("stages"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(path, obj)
m.atomic_write_json = full
from jaxaot.cli.main import main
sys.argv = ["jaxaot", *sys.argv[1:]]
main()
"""


def test_cli_a_run_dir_too_full_for_its_manifest_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_RUN_DIR, "program=axpy", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=cli_env(JAXAOT_SERVER="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    line = _one_error_line(proc)
    assert line == (
        f"jaxaot: error: run dir {run_dir}: cannot write manifest.json (No space left on "
        "device); the last complete one is kept there; free space on that file system (or run "
        "with hydra.run.dir on another one) and run again"
    )
    kept = json.loads((run_dir / "manifest.json").read_text())  # whole, as the claim wrote it
    assert kept["status"] == "running" and kept["stages"] == {}


# -- a store that fills up during a run: one warning, the run goes on uncached --------------------


@contextlib.contextmanager
def tiny_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A ``size`` tmpfs mounted at ``where``: a real file system that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (this test fills a real file system)")
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here, although root: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_cli_a_store_that_fills_up_costs_one_warning(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "small", "16k") as small:
        run_dir = tmp_path / "run"
        proc = run_cli(
            ["program=axpy", f"store.dir={small / 'store'}", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        warnings = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "WARNING" in ln]
        assert len(warnings) == 1, proc.stderr
        assert f"store at {small / 'store'} is not writable" in warnings[0]
        assert "No space left on device" in warnings[0]
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["status"] == "ok" and manifest["stages"]["compile"]["status"] == "ran"
        assert not list((small / "store").rglob(f"{TEMP_PREFIX}*"))  # no half-written entry


# -- one corrupt entry that cannot be removed: skipped alone -------------------------------------


@contextlib.contextmanager
def unremovable(entry_dir: Path) -> Iterator[None]:
    """Make ``entry_dir`` impossible to move away: immutable as root (``chattr +i``; mode bits
    do not stop root), its folder read-only otherwise."""
    if os.geteuid() == 0:
        proc = subprocess.run(["chattr", "+i", str(entry_dir)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"chattr +i is not supported here: {proc.stderr.strip()}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(entry_dir)], check=True)
    else:
        entry_dir.parent.chmod(0o555)
        try:
            yield
        finally:
            entry_dir.parent.chmod(0o755)


def test_cli_an_entry_that_cannot_be_removed_is_one_warning_and_the_run_goes_on(
    tmp_path: Path, isolated_store: Path
) -> None:
    first = run_cli(["program=axpy", f"hydra.run.dir={tmp_path / 'run0'}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (entry,) = [i.dir for i in Store(isolated_store).ls("compile")]
    (entry / "entry.json").write_text("{ not json")
    with unremovable(entry):
        proc = run_cli(["program=axpy", f"hydra.run.dir={tmp_path / 'run1'}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        warnings = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "WARNING" in ln]
        assert len(warnings) == 1, proc.stderr
        assert f"corrupt entry at {entry}" in warnings[0] and "cannot be removed" in warnings[0]
        assert "not writable" not in proc.stdout + proc.stderr
        manifest = json.loads((tmp_path / "run1" / "manifest.json").read_text())
        assert manifest["status"] == "ok" and manifest["stages"]["compile"]["status"] == "ran"
        # another program's result is cached as usual
        args = [
            "program=axpy",
            "program.args=[f32[8],f32[8]]",
            f"hydra.run.dir={tmp_path / 'run2'}",
        ]
        proc = run_cli(args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        key = json.loads((tmp_path / "run2" / "manifest.json").read_text())["stages"]["compile"][
            "key"
        ]
        assert Store(isolated_store).get("compile", key) is not None
