"""``jaxaot-store`` run as a user runs it: in a subprocess, reading real store folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.fsutil import key_of
from pipeline.store import ENV_STORE_DIR, MANIFEST_NAME, Store
from pipeline.store_cli import main

REPO = Path(__file__).resolve().parents[1]
KEYS = [key_of({"cli": i}) for i in range(3)]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.store_cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=60,
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "store")
    for i, key in enumerate(KEYS):
        stage = "lower" if i == 2 else "compile"
        assert s.put(stage, key, {"executable.bin": bytes([i]) * 1000, "x.txt": b"x"}) is not None
    s.record("compile", KEYS[0], hit=True, seconds_saved=4.0)
    s.record("compile", KEYS[1], hit=False)
    return s


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jaxaot-store: error: ")
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_stats_prints_a_table_per_stage(store: Store) -> None:
    proc = cli("stats", "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"store {store.root} (format v1)"
    assert lines[1].split() == [
        "stage",
        "entries",
        "size",
        "hits",
        "misses",
        "hit",
        "rate",
        "time",
        "saved",
    ]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["compile"][1] == "2" and rows["compile"][4:7] == ["1", "1", "50%"]
    assert rows["compile"][7:] == ["4.0", "s"]
    assert rows["lower"][1] == "1" and rows["lower"][6] == "-"
    assert rows["total"][1] == "3"


def test_ls_lists_every_entry_and_filters_by_stage(store: Store) -> None:
    proc = cli("ls", "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    assert sorted(k for k in KEYS if k in proc.stdout) == sorted(KEYS)
    assert proc.stdout.splitlines()[-1] == "3 entries"
    proc = cli("ls", "--stage", "lower", "--store", str(store.root))
    assert proc.returncode == 0
    assert KEYS[2] in proc.stdout and KEYS[0] not in proc.stdout
    assert proc.stdout.splitlines()[-1] == "1 entries"


def test_store_defaults_to_the_environment_variable(store: Store) -> None:
    proc = cli("ls", env={ENV_STORE_DIR: str(store.root)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "3 entries"


def test_store_option_before_the_subcommand(store: Store, tmp_path: Path) -> None:
    proc = cli("--store", str(store.root), "ls", env={ENV_STORE_DIR: str(tmp_path / "nope")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "3 entries"


def test_verify_exits_1_on_corruption_and_removes_on_request(store: Store) -> None:
    proc = cli("verify", "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "3 entries: 3 ok, 0 corrupt"

    bad = store.entry_dir("compile", KEYS[1])
    (bad / "executable.bin").write_bytes(b"\x00" * 10)
    proc = cli("verify", "--store", str(store.root))
    assert proc.returncode == 1
    assert f"CORRUPT  compile/{KEYS[1]}: 'executable.bin' is 10 bytes" in proc.stdout
    assert "3 entries: 2 ok, 1 corrupt" in proc.stdout
    assert bad.exists()

    proc = cli("verify", "--remove", "--store", str(store.root))
    assert proc.returncode == 1 and "[removed]" in proc.stdout
    assert not bad.exists()
    assert cli("verify", "--store", str(store.root)).returncode == 0


def test_gc_max_size_evicts_least_recently_used(store: Store) -> None:
    assert store.get("compile", KEYS[0]) is not None  # most recently used now
    keep = next(i for i in store.ls() if i.key == KEYS[0]).size_bytes
    proc = cli("gc", "--max-size", f"{keep}B", "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("removed 0 temp folder(s), 0 idle lock(s) and 2 entries")
    assert "hit/miss log: 2 lines folded into per-stage totals" in proc.stdout
    assert [i.key for i in store.ls()] == [KEYS[0]]


def test_gc_removes_temp_folders_past_the_grace_period(store: Store) -> None:
    (store.root / ".tmp-put-compile-dead").mkdir()
    (store.root / ".tmp-put-compile-dead" / "executable.bin").write_bytes(b"partial")
    proc = cli("gc", "--store", str(store.root))
    assert proc.stdout.startswith("removed 0 temp folder(s)")
    proc = cli("gc", "--temp-grace-hours", "0", "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("removed 1 temp folder(s), 0 idle lock(s) and 0 entries")
    assert not (store.root / ".tmp-put-compile-dead").exists()


def test_bad_max_size_is_a_one_line_error(store: Store) -> None:
    assert_one_line_error(cli("gc", "--max-size", "2XB", "--store", str(store.root)), "'2XB'")
    assert len(store.ls()) == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gc", "--max-size=lots"], "invalid size 'lots'"),
        (["gc", "--max-size=-5MB"], "invalid size '-5MB'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: COMMAND"),
        (["gc", "--older-than-hours", "soon"], "invalid float value: 'soon'"),
        (["gc", "--older-than-hours", "-1"], "--older-than-hours must be >= 0"),
        (["ls", "--stage", "../x"], "invalid store stage name '../x'"),
        (["verify", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_a_one_line_error(
    store: Store, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    rc = main(["--store", str(store.root), *args])
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(args, rc, out, err), needle)
    assert len(store.ls()) == 3


def test_missing_store_is_a_one_line_error(tmp_path: Path) -> None:
    assert_one_line_error(
        cli("stats", "--store", str(tmp_path / "nope")), "no store at", ENV_STORE_DIR
    )


def test_main_returns_exit_codes_in_process(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", "--store", str(store.root)]) == 0
    assert main(["gc", "--max-size", "1QB", "--store", str(store.root)]) == 2
    (store.entry_dir("lower", KEYS[2]) / MANIFEST_NAME).write_text("{")
    assert main(["verify", "--store", str(store.root)]) == 1
    assert main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert "invalid size '1QB'" in err and "entry.json is not valid JSON" in out
