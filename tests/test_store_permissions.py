"""Shared and team stores: modes follow the umask, and nothing that users you do not trust can
write is unpickled, from the store or from ``resume_from``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jaxaot
import pytest
from jaxaot.errors import StoreError
from jaxaot.store.cache import Store
from jaxaot.store.locks import KeyLock
from jaxaot.util.fsio import ENV_TRUST, atomic_write_bytes, key_of, untrusted_path

KEY = key_of({"test": "permissions"})
REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534  # a uid and gid that are neither root nor in root's groups
FILES = {"executable.bin": b"\x80pickle" * 100, "compiled.json": b"{}"}
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to act as a second user (setuid/chown)"
)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder another user can reach (pytest's tmp_path sits under a 0700 folder)."""
    d = Path(tempfile.mkdtemp(prefix="jaxaot-shared-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]
    }


# Run as root in a fresh process (no JAX threads to fork), dropping to another user once the
# modules are imported (the interpreter's own files may not be readable by that user).
_SECOND_USER = """
import os, sys
from jaxaot.errors import StoreError
from jaxaot.store.cache import Store
uid, gid, groups, root, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(gid)
os.setuid(uid)
try:
    entry = Store(root).get("compile", key)
except StoreError as exc:
    print(exc)
    sys.exit(2)
sys.exit(0 if entry is not None and entry.read_bytes("executable.bin") == bytes.fromhex(sys.argv[6]) else 1)
"""


def _second_user_hits(root: Path, uid: int, gid: int, groups: list[int]) -> bool:
    """Whether another user (``uid`` in ``groups``) gets a verified hit for KEY in ``root``."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _SECOND_USER,
            str(uid),
            str(gid),
            ",".join(map(str, groups)),
            str(root),
            KEY,
            FILES["executable.bin"].hex(),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    if proc.returncode == 2:
        raise StoreError(proc.stdout.strip())
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode == 0


# -- umask (item 8) ------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o002, 0o022])
def test_store_folders_and_files_follow_the_umask(tmp_path: Path, mask: int) -> None:
    with umask(mask):
        store = Store(tmp_path / "store")
        assert store.put("compile", KEY, FILES) is not None
        store.record("compile", KEY, hit=False)
        with KeyLock(store, "compile", KEY):
            pass
    modes = _modes(store.root)
    for rel, mode in modes.items():
        is_dir = (store.root / rel).is_dir()
        assert mode == (0o777 if is_dir else 0o666) & ~mask, (rel, oct(mode))
    assert any(r.endswith("executable.bin") for r in modes)
    assert any(r.endswith(".lock") for r in modes) and any(r.endswith("stats.jsonl") for r in modes)


@pytest.mark.parametrize("mask", [0o002, 0o022])
def test_run_directory_artifacts_follow_the_umask(tmp_path: Path, mask: int) -> None:
    with umask(mask):
        atomic_write_bytes(tmp_path / "run" / "compile" / "executable.bin", b"x")
    assert stat.S_IMODE((tmp_path / "run" / "compile" / "executable.bin").stat().st_mode) == (
        0o666 & ~mask
    )
    assert stat.S_IMODE((tmp_path / "run" / "compile").stat().st_mode) == 0o777 & ~mask


@as_root
def test_a_teammate_reads_and_trusts_a_group_store(shared_dir: Path) -> None:
    """umask 002 in a team store: a user in the store's group gets a verified hit."""
    with umask(0o002):
        store = Store(shared_dir / "store")
        assert store.put("compile", KEY, FILES) is not None
    gid = store.root.stat().st_gid
    assert _second_user_hits(store.root, NOBODY, NOBODY, [gid])
    # Someone outside the group could have written it (it is group-writable): refused, loudly.
    with pytest.raises(StoreError, match="which you are not in"):
        _second_user_hits(store.root, NOBODY, NOBODY, [])


@as_root
def test_everyone_reads_a_store_written_with_umask_022(shared_dir: Path) -> None:
    with umask(0o022):
        store = Store(shared_dir / "store")
        assert store.put("compile", KEY, FILES) is not None
    assert _second_user_hits(store.root, NOBODY, NOBODY, [])
    assert Store(shared_dir / "store").get("compile", KEY) is not None  # still there


# -- trust (item 9) --------------------------------------------------------------------------


@pytest.fixture
def stored(tmp_path: Path) -> Store:
    with umask(0o022):
        store = Store(tmp_path / "store")
        assert store.put("compile", KEY, FILES) is not None
    return store


def test_a_world_writable_entry_is_a_miss_removed_with_a_warning(
    stored: Store, caplog: pytest.LogCaptureFixture
) -> None:
    entry_dir = stored.entry_dir("compile", KEY)
    (entry_dir / "executable.bin").chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="jaxaot.store"):
        assert stored.get("compile", KEY) is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "untrusted" in warning and "executable.bin is writable by every user" in warning
    assert not entry_dir.exists()  # removed: the next put stores it with the umask's modes
    assert stored.put("compile", KEY, FILES) is not None
    assert stored.get("compile", KEY) is not None


def test_a_world_writable_store_folder_is_a_one_line_error(
    stored: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    (stored.data_dir / "compile").chmod(0o777)
    with pytest.raises(StoreError) as err:
        stored.get("compile", KEY)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"store at {stored.root} is not safe to load executables from" in msg
    assert "compile is writable by every user (mode drwxrwxrwx)" in msg
    assert "store.trust=true" in msg and ENV_TRUST in msg
    assert stored.entry_dir("compile", KEY).exists()  # nothing removed
    # explicitly trusted: served as before
    assert Store(stored.root, trust=True).get("compile", KEY) is not None
    monkeypatch.setenv(ENV_TRUST, "1")
    assert Store(stored.root).get("compile", KEY) is not None


def test_a_sticky_world_writable_parent_is_fine(tmp_path: Path) -> None:
    parent = tmp_path / "scratch"
    parent.mkdir()
    parent.chmod(0o1777)  # like /tmp: others cannot rename or delete what is yours
    with umask(0o022):
        store = Store(parent / "store")
        assert store.put("compile", KEY, FILES) is not None
    assert store.get("compile", KEY) is not None
    parent.chmod(0o777)  # without the sticky bit, anyone may swap the store folder
    with pytest.raises(StoreError, match="scratch is writable by every user"):
        store.get("compile", KEY)


@as_root
def test_entries_of_a_stranger_or_a_foreign_group_are_untrusted(
    stored: Store, caplog: pytest.LogCaptureFixture
) -> None:
    exe = stored.entry_dir("compile", KEY) / "executable.bin"
    os.chown(exe, NOBODY, NOBODY)  # mode 0644, but its owner may rewrite it at will
    assert stored.get("compile", KEY) is None
    assert "belongs to" in caplog.text and f"uid {NOBODY}" in caplog.text
    assert stored.put("compile", KEY, FILES) is not None
    exe.chmod(0o664)
    os.chown(exe, 0, NOBODY)  # group-writable by a group root is not in
    assert stored.get("compile", KEY) is None
    assert "which you are not in" in caplog.text


def test_resume_refuses_an_executable_others_can_write(tmp_path: Path, compose_run) -> None:  # type: ignore[no-untyped-def]
    first = compose_run("program=axpy", "store.enabled=false").run_dir
    (first / "compile").chmod(0o777)
    resume = ["program=axpy", f"resume_from={first}", "start_at=execute", "store.enabled=false"]
    with pytest.raises(StoreError) as err:
        jaxaot.run(jaxaot.compose(resume), run_dir=tmp_path / "r1", overrides=resume)
    msg = str(err.value)
    assert "\n" not in msg and "refusing to unpickle executable.bin" in msg
    assert "compile is writable by every user" in msg and "store.trust=true" in msg
    trusted = [*resume, "store.trust=true"]
    result = jaxaot.run(jaxaot.compose(trusted), run_dir=tmp_path / "r2", overrides=trusted)
    assert result.manifest["stages"]["compile"]["status"] == "resumed"


def test_a_run_refuses_an_untrusted_store_before_any_stage(tmp_path: Path) -> None:
    store = Store(os.environ["JAXAOT_STORE_DIR"])
    store.data_dir.mkdir(parents=True)
    store.data_dir.chmod(0o777)
    overrides = ["program=axpy"]
    with pytest.raises(StoreError, match=r"store at .* is not safe .*v1 is writable by every user"):
        jaxaot.run(jaxaot.compose(overrides), run_dir=tmp_path / "r", overrides=overrides)
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "not safe" in manifest["error"]
    assert manifest["stages"] == {}  # refused before any stage ran
    # a run that does not read the store is not refused
    lower_only = ["program=axpy", "stop_after=lower"]
    jaxaot.run(jaxaot.compose(lower_only), run_dir=tmp_path / "l", overrides=lower_only)


# -- symbolic links: the target and its folders are judged, never the link's own mode ----------


def test_a_symlinked_store_is_judged_by_its_target(tmp_path: Path) -> None:
    with umask(0o022):
        real = Store(tmp_path / "real")
        assert real.put("compile", KEY, FILES) is not None
    (tmp_path / "link").symlink_to(tmp_path / "real")
    linked = Store(tmp_path / "link")
    linked.check_trusted()  # a link's mode (lrwxrwxrwx) is no reason to refuse
    entry = linked.get("compile", KEY)
    assert entry is not None and entry.read_bytes("executable.bin") == FILES["executable.bin"]
    assert linked.put("compile", key_of({"other": 1}), FILES) is not None
    # The target others can write: refused, naming the resolved folder.
    (tmp_path / "real").chmod(0o777)
    with pytest.raises(StoreError) as err:
        linked.get("compile", KEY)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"store at {tmp_path / 'link'} (a symbolic link to {tmp_path / 'real'})" in msg
    assert f"{tmp_path / 'real'} is writable by every user (mode drwxrwxrwx)" in msg
    assert "lrwxrwxrwx" not in msg


def test_a_symlinked_store_whose_target_sits_in_a_folder_others_can_write(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with umask(0o022):
        assert Store(scratch / "store").put("compile", KEY, FILES) is not None
    (tmp_path / "link").symlink_to(scratch / "store")
    scratch.chmod(0o1777)  # sticky, like /tmp: fine
    assert Store(tmp_path / "link").get("compile", KEY) is not None
    scratch.chmod(0o777)  # anyone may swap the store folder behind the link
    with pytest.raises(StoreError, match=f"{scratch} is writable by every user"):
        Store(tmp_path / "link").get("compile", KEY)


def test_a_link_in_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    """Whoever can write the folder holding a link can repoint it, at a store of their own."""
    with umask(0o022):
        assert Store(tmp_path / "real").put("compile", KEY, FILES) is not None
    (tmp_path / "open").mkdir()
    (tmp_path / "open" / "link").symlink_to(tmp_path / "real")
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(StoreError, match=f"{tmp_path / 'open'} is writable by every user"):
        Store(tmp_path / "open" / "link").get("compile", KEY)


def test_a_link_above_the_store_is_followed(tmp_path: Path) -> None:
    (tmp_path / "projects").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "projects")
    with umask(0o022):
        store = Store(tmp_path / "alias" / "team" / "store")
        assert store.put("compile", KEY, FILES) is not None
    assert untrusted_path(store.entry_dir("compile", KEY), store.root) is None
    assert store.get("compile", KEY) is not None


@as_root
def test_a_strangers_link_in_a_sticky_folder_is_refused(tmp_path: Path) -> None:
    """In a sticky folder such as /tmp a link's owner may replace it: a stranger's is refused."""
    with umask(0o022):
        assert Store(tmp_path / "real").put("compile", KEY, FILES) is not None
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    link = sticky / "store"
    link.symlink_to(tmp_path / "real")
    assert Store(link).get("compile", KEY) is not None  # root's own link
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(StoreError, match=f"{link} is a symbolic link .*uid {NOBODY}"):
        Store(link).get("compile", KEY)


def test_resume_from_a_symlinked_run_dir(tmp_path: Path, compose_run) -> None:  # type: ignore[no-untyped-def]
    first = compose_run("program=axpy", "store.enabled=false").run_dir
    link = tmp_path / "latest"
    link.symlink_to(first)
    resume = ["program=axpy", f"resume_from={link}", "start_at=execute", "store.enabled=false"]
    result = jaxaot.run(jaxaot.compose(resume), run_dir=tmp_path / "r1", overrides=resume)
    assert result.manifest["stages"]["compile"]["status"] == "resumed"
    (first / "compile").chmod(0o777)
    with pytest.raises(StoreError) as err:
        jaxaot.run(jaxaot.compose(resume), run_dir=tmp_path / "r2", overrides=resume)
    msg = str(err.value)
    assert "\n" not in msg and f"(a symbolic link to {first})" in msg
    assert f"{first / 'compile'} is writable by every user (mode drwxrwxrwx)" in msg


def test_cli_runs_with_a_symlinked_store_and_refuses_an_open_target(tmp_path: Path) -> None:
    from conftest import run_cli

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    args = ["program=axpy", "stop_after=compile", f"store.dir={tmp_path / 'link'}"]
    for i, status in enumerate(("ran", "cached")):
        proc = run_cli([*args, f"hydra.run.dir={tmp_path / f'run{i}'}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        manifest = json.loads((tmp_path / f"run{i}" / "manifest.json").read_text())
        assert manifest["stages"]["compile"]["status"] == status
    (tmp_path / "real").chmod(0o777)
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"jaxaot: error: store at {tmp_path / 'link'} (a symbolic link")
    assert f"{tmp_path / 'real'} is writable by every user (mode drwxrwxrwx)" in lines[0]
