"""``jaxaot-store`` run as a user runs it: in a subprocess, reading real store folders."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PAIRS_MODULE, write_pairs_module
from jaxaot.cli.store_cmd import main
from jaxaot.store.cache import ENV_STORE_DIR, MANIFEST_NAME, Store
from jaxaot.util.fsio import key_of

REPO = Path(__file__).resolve().parents[1]
KEYS = [key_of({"cli": i}) for i in range(3)]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jaxaot.cli.store_cmd", *args],
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


# -- verify --deep, temp folders, read-only stores ---------------------------------------------


def test_verify_deep_reports_and_removes_an_entry_that_cannot_be_loaded(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    compose_run,  # type: ignore[no-untyped-def]
) -> None:
    """An entry whose pickle names a NamedTuple class that was renamed since verifies (its bytes
    are intact) but is unusable; a LAPACK executable beside it loads and runs cold."""
    mods = write_pairs_module(tmp_path / "mods", "deep_pairs").parent
    monkeypatch.syspath_prepend(str(mods))
    compose_run("program.target=deep_pairs:pair", "program.args=[f32[3]]")
    compose_run("program.target=jax.numpy.linalg:inv", "program.args=[f32[4,4]]")
    root = Path(os.environ[ENV_STORE_DIR])
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(mods)])}
    proc = cli("verify", "--deep", "--store", str(root), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "2 entries: 2 ok, 0 corrupt, 0 unusable"

    (mods / "deep_pairs.py").write_text(PAIRS_MODULE.replace("Pair", "Renamed"))
    assert cli("verify", "--store", str(root), env=env).returncode == 0  # the bytes are fine
    proc = cli("verify", "--deep", "--store", str(root), env=env)
    assert proc.returncode == 1
    [bad] = [line for line in proc.stdout.splitlines() if line.startswith("UNUSABLE")]
    assert "cannot unpickle executable.bin: AttributeError: Can't get attribute 'Pair'" in bad
    assert "2 entries: 1 ok, 0 corrupt, 1 unusable" in proc.stdout
    assert "verify --remove --deep" in proc.stdout

    proc = cli("verify", "--deep", "--remove", "--store", str(root), env=env)
    assert proc.returncode == 1 and "[removed]" in proc.stdout and "1 removed" in proc.stdout
    assert [i.stage for i in Store(root).ls()] == ["compile"]
    proc = cli("verify", "--deep", "--store", str(root), env=env)
    assert proc.returncode == 0 and "1 entries: 1 ok, 0 corrupt, 0 unusable" in proc.stdout


def test_verify_deep_survives_a_loader_that_crashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe process killed by a signal marks the entry it was on, and the rest go on."""
    from jaxaot.store import probe as store_probe

    dirs = [tmp_path / f"e{i}" for i in range(3)]
    fake = tmp_path / "fake_python"
    # Reports the first entry it is given as usable, then dies of SIGSEGV on the next one.
    fake.write_text(
        '#!/bin/sh\nshift 2\necho "{\\"dir\\": \\"$1\\", \\"reason\\": \\"\\"}"\nkill -SEGV $$\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(store_probe.sys, "executable", str(fake))
    results = store_probe.probe_entries(dirs, trust=False)
    assert [(r.dir, r.usable) for r in results] == [
        (dirs[0], True),
        (dirs[1], False),
        (dirs[2], True),
    ]
    assert results[1].reason == "loading it killed the process (SIGSEGV)"


def test_verify_deep_blames_a_timeout_only_on_the_entry_that_hangs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's timeout says nothing about the entry it was on: that one is probed alone
    before it is called unusable (--remove would delete it)."""
    from jaxaot.store import probe as store_probe

    dirs = [tmp_path / f"e{i}" for i in range(3)]
    fake = tmp_path / "fake_python"
    # A batch reports its first entry, then hangs; alone, e1 is fine and e2 hangs.
    fake.write_text(
        "#!/bin/sh\nshift 2\n"
        'if [ $# -eq 1 ]; then case "$1" in *e2) exec sleep 30;; esac; fi\n'
        'echo "{\\"dir\\": \\"$1\\", \\"reason\\": \\"\\"}"\n'
        "[ $# -eq 1 ] || exec sleep 30\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(store_probe.sys, "executable", str(fake))
    monkeypatch.setattr(store_probe, "_PROBE_TIMEOUT_S", 1.0)
    results = store_probe.probe_entries(dirs, trust=False)
    assert [(r.dir, r.usable) for r in results] == [
        (dirs[0], True),
        (dirs[1], True),
        (dirs[2], False),
    ]
    assert results[2].reason.startswith("loading it did not finish (timed out after 1 s")


def test_verify_and_stats_report_orphan_temp_folders(store: Store) -> None:
    dead = store.root / ".tmp-put-compile-0123456789ab-dead"
    dead.mkdir()
    (dead / "executable.bin").write_bytes(b"partial")
    old = time.time() - 3 * 3600
    os.utime(dead, (old, old))
    for command in ("verify", "stats"):
        proc = cli(command, "--store", str(store.root))
        assert proc.returncode == 0, proc.stderr
        assert "1 temp folder(s)" in proc.stdout, command
        assert "  .tmp-put-compile-0123456789ab-dead  age 3.0 h" in proc.stdout, command
    shutil.rmtree(dead)
    assert "temp folder" not in cli("stats", "--store", str(store.root)).stdout


def test_verify_remove_on_a_read_only_store_claims_no_removal(
    store: Store, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = store.entry_dir("compile", KEYS[1])
    (bad / "executable.bin").write_bytes(b"\x00" * 10)

    def read_only(src: object, dst: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(src))

    monkeypatch.setattr(os, "rename", read_only)
    assert main(["verify", "--remove", "--store", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert "[removed]" not in out
    assert f"CORRUPT  compile/{KEYS[1]}: 'executable.bin' is 10 bytes" in out
    assert "[NOT removed: [Errno 30] Read-only file system" in out
    assert "3 entries: 2 ok, 1 corrupt; 0 removed, 1 could not be removed (read-only store?)" in out
    assert bad.exists()


def test_verify_names_entries_another_jax_made_and_deep_leaves_them_alone(tmp_path: Path) -> None:
    """A team store shared across jax versions: an entry another jaxlib made verifies (its bytes
    are intact), says which jax made it, and ``--deep --remove`` neither probes nor deletes it
    (this jaxlib would fail to load what that jaxlib serves)."""
    import importlib.metadata

    store = Store(tmp_path / "store")
    mine = {d: importlib.metadata.version(d) for d in ("jax", "jaxlib")}
    theirs = {"jax": "0.6.2", "jaxlib": "0.6.2", "platform": "cpu", "platform_version": "cpu"}
    assert store.put("compile", KEYS[0], {"executable.bin": b"not a pickle"}, compat=theirs)
    proc = cli("verify", "--store", str(store.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        f"ok       compile/{KEYS[0]} (made by jax 0.6.2, jaxlib 0.6.2: never served to this "
        f"jax {mine['jax']}, jaxlib {mine['jaxlib']})"
    ) in proc.stdout
    proc = cli("verify", "--deep", "--remove", "--store", str(store.root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 entries: 1 ok, 0 corrupt, 0 unusable" in proc.stdout
    assert store.entry_dir("compile", KEYS[0]).is_dir()
