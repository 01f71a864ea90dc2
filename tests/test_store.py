"""Behaviour of the checkpoint store, including damage, crashes, races and read-only media."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import cli_env, read_manifest, run_cli
from jaxaot.errors import ConfigError, StoreError
from jaxaot.store.cache import (
    ENV_STORE_DIR,
    MANIFEST_NAME,
    STORE_FORMAT_VERSION,
    Store,
    StoreEntry,
    check_store_dir,
    parse_size,
    resolve_store_root,
)
from jaxaot.util.fsio import TEMP_PREFIX, key_of, sha256_file

REPO = Path(__file__).resolve().parents[1]
COMPAT = {"jaxlib": "0.10.2", "backend": "cpu 0.10.2"}
KEY = key_of({"test": "store", "n": 1})
KEY2 = key_of({"test": "store", "n": 2})
KEY3 = key_of({"test": "store", "n": 3})


def payload(seed: int, size: int = 4096) -> bytes:
    return (key_of(seed).encode() * (size // 64 + 1))[:size]


def put(store: Store, key: str = KEY, seed: int = 0, stage: str = "compile") -> StoreEntry:
    entry = store.put(
        stage=stage,
        key=key,
        files={"executable.bin": payload(seed), "optimized.hlo.txt": b"HloModule m\n"},
        meta={"seed": seed},
        compute_seconds=1.25,
        compat=COMPAT,
    )
    assert entry is not None
    return entry


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jaxaot.store" and r.levelno >= logging.WARNING
    ]


def temps(root: Path) -> list[Path]:
    return list(root.rglob(f"{TEMP_PREFIX}*")) if root.exists() else []


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(root=tmp_path / "store")


@pytest.fixture(autouse=True)
def _debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="jaxaot.store")


# -- round trip ----------------------------------------------------------------------------


def test_put_get_round_trip_records_sha256_of_every_file(store: Store) -> None:
    put(store, seed=7)
    entry = store.get("compile", KEY, expect=COMPAT)
    assert entry is not None
    assert entry.dir == store.root / f"v{STORE_FORMAT_VERSION}" / "compile" / KEY[:2] / KEY
    assert entry.read_bytes("executable.bin") == payload(7)
    assert entry.read_bytes("optimized.hlo.txt") == b"HloModule m\n"
    doc = json.loads((entry.dir / MANIFEST_NAME).read_text())
    assert doc["format_version"] == STORE_FORMAT_VERSION
    assert (doc["stage"], doc["key"], doc["meta"], doc["compat"]) == (
        "compile",
        KEY,
        {"seed": 7},
        COMPAT,
    )
    assert doc["compute_seconds"] == 1.25
    for name in ("executable.bin", "optimized.hlo.txt"):
        path = entry.path(name)
        assert doc["files"][name] == {"sha256": sha256_file(path), "size": path.stat().st_size}
    assert sorted(p.name for p in entry.dir.iterdir()) == sorted([MANIFEST_NAME, *entry.files])
    assert temps(store.root) == []


def test_get_missing_key_is_a_quiet_miss(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    assert store.get("compile", KEY, expect=COMPAT) is None
    put(store)
    assert store.get("compile", KEY2, expect=COMPAT) is None
    assert store.get("lower", KEY, expect=COMPAT) is None
    assert store_warnings(caplog) == []
    assert any("store miss: compile/" in r.getMessage() for r in caplog.records)


def test_put_copies_a_path_source(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(payload(3, size=3 << 20))
    entry = store.put("compile", KEY, {"executable.bin": src}, compat=COMPAT)
    assert entry is not None
    got = store.get("compile", KEY, expect=COMPAT)
    assert got is not None and got.read_bytes("executable.bin") == src.read_bytes()
    assert got.files["executable.bin"].sha256 == sha256_file(src)


def test_put_of_an_existing_valid_entry_returns_it(store: Store) -> None:
    first = put(store, seed=1)
    second = put(store, seed=2)  # same key, same compat: the stored entry stands
    assert second.created == first.created
    assert second.read_bytes("executable.bin") == payload(1)


def test_disabled_store_neither_reads_nor_writes(tmp_path: Path) -> None:
    put(Store(tmp_path / "s"))
    off = Store(tmp_path / "s", enabled=False)
    assert off.get("compile", KEY, expect=COMPAT) is None
    assert off.put("compile", KEY2, {"a": b"x"}) is None
    off.record("compile", KEY, hit=True)
    assert not (tmp_path / "s" / "v1" / "compile" / KEY2[:2]).exists()
    assert off.stats().total.hits == 0


@pytest.mark.parametrize("bad", ["", "ABC", KEY.upper(), KEY[:63], KEY + "0", "../" + KEY[3:], 123])
def test_bad_key_is_a_value_error(store: Store, bad: object) -> None:
    with pytest.raises(ValueError, match="invalid store key"):
        store.get("compile", bad, expect=COMPAT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid store key"):
        store.put("compile", bad, {"a": b""})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".tmp-x", "v1/../x"])
def test_bad_stage_is_a_value_error(store: Store, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid store stage name"):
        store.get(bad, KEY)


@pytest.mark.parametrize("bad", ["", "../x", "a/b", MANIFEST_NAME, ".tmp-x", ".hidden"])
def test_bad_file_name_is_a_value_error_before_any_io(store: Store, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid store file name"):
        store.put("compile", KEY, {bad: b"x"})
    assert not store.root.exists()


def test_non_json_meta_fails_before_any_io(store: Store) -> None:
    with pytest.raises(TypeError):
        store.put("compile", KEY, {"a": b"x"}, meta={"f": object()})
    assert not store.root.exists()


# -- damaged entries -----------------------------------------------------------------------


def _truncate(n: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        f = d / "executable.bin"
        f.write_bytes(f.read_bytes()[: n(f.stat().st_size)])

    return damage


def _flip_byte(d: Path) -> None:
    f = d / "executable.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x01
    f.write_bytes(bytes(data))


def _edit_manifest(**changes: object) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        doc = json.loads((d / MANIFEST_NAME).read_text())
        doc.update(changes)
        (d / MANIFEST_NAME).write_text(json.dumps(doc))

    return damage


def _traversal(d: Path) -> None:
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["files"]["../../../outside"] = doc["files"].pop("executable.bin")
    (d / MANIFEST_NAME).write_text(json.dumps(doc))


def _symlink_payload(d: Path) -> None:
    outside = d.parent / "outside.bin"
    outside.write_bytes((d / "executable.bin").read_bytes())
    (d / "executable.bin").unlink()
    (d / "executable.bin").symlink_to(outside)


def _empty_folder(d: Path) -> None:
    shutil.rmtree(d)
    d.mkdir()


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated-to-0": (_truncate(lambda n: 0), r"'executable.bin' is 0 bytes, manifest says 4096"),
    "truncated-to-1": (_truncate(lambda n: 1), r"'executable.bin' is 1 bytes, manifest says 4096"),
    "truncated-to-half": (_truncate(lambda n: n // 2), r"is 2048 bytes, manifest says 4096"),
    "flipped-byte": (_flip_byte, r"'executable.bin' sha256 [0-9a-f]{16} does not match manifest"),
    "payload-without-manifest": (
        lambda d: (d / MANIFEST_NAME).unlink(),
        r"entry.json missing \(payload without manifest\)",
    ),
    "manifest-without-payload": (
        lambda d: (d / "executable.bin").unlink(),
        r"'executable.bin' is missing \(manifest without payload\)",
    ),
    "garbage-manifest": (
        lambda d: (d / MANIFEST_NAME).write_bytes(b"\x00\xffnot json{"),
        r"entry.json is not valid JSON",
    ),
    "empty-manifest": (
        lambda d: (d / MANIFEST_NAME).write_bytes(b""),
        r"entry.json is not valid JSON",
    ),
    "manifest-not-an-object": (
        lambda d: (d / MANIFEST_NAME).write_text("[1, 2]"),
        r"not a JSON object",
    ),
    "unknown-format-version": (
        _edit_manifest(format_version=STORE_FORMAT_VERSION + 1),
        rf"incompatible entry: entry format version {STORE_FORMAT_VERSION + 1}, "
        rf"this jaxaot reads version {STORE_FORMAT_VERSION}",
    ),
    "compat-mismatch": (
        _edit_manifest(compat={**COMPAT, "jaxlib": "0.9.0"}),
        r"incompatible entry: compat mismatch: jaxlib: entry has '0.9.0', expected '0.10.2'",
    ),
    "manifest-for-another-key": (_edit_manifest(key=KEY2), r"but sits at compile/"),
    "path-traversal-in-manifest": (_traversal, r"invalid file name '../../../outside'"),
    "payload-is-a-symlink": (_symlink_payload, r"'executable.bin' is not a regular file"),
    "empty-entry-folder": (
        _empty_folder,
        r"entry.json missing \(empty entry folder\)",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_entry_is_a_logged_miss_removed_and_recomputed(
    store: Store, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    damage, reason = DAMAGE[case]
    entry = put(store, seed=1)
    damage(entry.dir)
    caplog.clear()

    assert store.get("compile", KEY, expect=COMPAT) is None

    warnings = store_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"store miss: compile/{KEY[:12]}: ")
    assert warnings[0].endswith("; entry removed")
    assert re.search(reason, warnings[0]), warnings[0]
    assert not entry.dir.exists()
    assert temps(store.root) == []

    fresh = put(store, seed=2)
    got = store.get("compile", KEY, expect=COMPAT)
    assert got is not None and got.created == fresh.created
    assert got.read_bytes("executable.bin") == payload(2)
    assert len(store_warnings(caplog)) == 1


def test_compat_mismatch_with_a_different_jaxlib(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    put(store, seed=1)
    other = {**COMPAT, "jaxlib": "0.10.3"}
    assert store.get("compile", KEY, expect=other) is None
    (line,) = store_warnings(caplog)
    assert "compat mismatch: jaxlib: entry has '0.10.2', expected '0.10.3'" in line
    entry = store.put("compile", KEY, {"executable.bin": b"new"}, compat=other)
    assert entry is not None
    got = store.get("compile", KEY, expect=other)
    assert got is not None and got.read_bytes("executable.bin") == b"new"


def test_put_replaces_a_damaged_entry(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    entry = put(store, seed=1)
    _flip_byte(entry.dir)
    fresh = put(store, seed=2)
    assert fresh.read_bytes("executable.bin") == payload(2)
    (line,) = store_warnings(caplog)
    assert line.startswith(f"store put replaces: compile/{KEY[:12]}: corrupt entry: ")


@pytest.mark.parametrize(
    "damage", [_flip_byte, _truncate(lambda n: n - 1)], ids=["flip", "truncate"]
)
def test_read_bytes_reverifies_the_bytes_it_returns(
    store: Store, damage: Callable[[Path], None]
) -> None:
    put(store, seed=1)
    entry = store.get("compile", KEY, expect=COMPAT)
    assert entry is not None
    damage(entry.dir)
    with pytest.raises(StoreError, match=r"file 'executable.bin' at .* changed after verification"):
        entry.read_bytes("executable.bin")
    assert entry.read_bytes("optimized.hlo.txt") == b"HloModule m\n"
    with pytest.raises(KeyError, match="has no file 'nope'"):
        entry.read_bytes("nope")


# -- crashes and races -----------------------------------------------------------------------

_KILLED_PUT = """
import os, sys, time
from pathlib import Path
import jaxaot.store.cache as st

root, key, where, src = sys.argv[1:5]
if where == "rename":
    def blocked_rename(*args, **kwargs):
        print("blocked", flush=True)
        time.sleep(120)
    st.os.rename = blocked_rename
else:
    print("started", flush=True)
st.Store(Path(root)).put("compile", key, {"executable.bin": Path(src), "b.txt": b"b"})
print("finished", flush=True)
"""


@pytest.mark.parametrize("where", ["mid-file", "rename"])
def test_kill_9_during_put_leaves_only_a_temp_folder(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    if where == "mid-file":
        # The source is a FIFO we feed by hand: the child is provably inside the copy loop,
        # with part of the file written, when it is killed.
        src = tmp_path / "fifo"
        os.mkfifo(src)
    else:
        src = tmp_path / "src.bin"
        src.write_bytes(payload(5, size=1 << 20))
    store.root.mkdir(parents=True)
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUT, str(store.root), KEY, where, str(src)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    try:
        assert child.stdout is not None
        with contextlib.ExitStack() as stack:
            if where == "mid-file":
                assert child.stdout.readline().strip() == "started"
                fifo = stack.enter_context(open(src, "wb"))  # blocks until the child opens it
                fifo.write(payload(5, size=(1 << 20) + 4096))
                fifo.flush()
                deadline = time.monotonic() + 20
                while not any(
                    p.stat().st_size >= 1 << 20
                    for p in store.root.glob(f"{TEMP_PREFIX}*/executable.bin")
                ):
                    assert time.monotonic() < deadline, "child never wrote its first chunk"
                    time.sleep(0.01)
            else:
                assert child.stdout.readline().strip() == "blocked"
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=20) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()

    (tmp,) = temps(store.root)
    assert tmp.is_dir() and tmp.parent == store.root
    assert (tmp / MANIFEST_NAME).exists() == (where == "rename")
    assert store.ls() == []
    assert store.get("compile", KEY, expect=COMPAT) is None
    assert store_warnings(caplog) == []

    assert store.gc().temps_removed == 0  # younger than the default grace period: maybe live
    report = store.gc(temp_grace_s=0)
    assert report.temps_removed == 1
    assert temps(store.root) == []
    assert put(store).read_bytes("executable.bin") == payload(0)


_RACER = """
import json, logging, os, sys, time
from pathlib import Path
from jaxaot.store.cache import Store

logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(message)s")

root, key, ready, go, idx = sys.argv[1:6]
data = (bytes(range(256)) * 4096) * 2  # 2 MiB, identical in every racer
Path(ready, idx).touch()
while not os.path.exists(go):
    time.sleep(0.0005)
e = Store(Path(root)).put("compile", key, {"executable.bin": data, "n.txt": b"n"},
                          compat={"jaxlib": "0.10.2"})
print(json.dumps(None if e is None else [str(e.dir), e.files["executable.bin"].sha256]))
"""


def test_eight_concurrent_puts_of_one_key_leave_one_valid_entry(
    store: Store, tmp_path: Path
) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    store.root.mkdir(parents=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(store.root), KEY, str(ready), str(go), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        for i in range(8)
    ]
    deadline = time.monotonic() + 300  # bounds a hang: 8 loading processes on a loaded machine
    while len(list(ready.iterdir())) < 8:  # a barrier: every racer is loaded and waiting
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.005)
    go.touch()
    results, logs = [], ""
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out))
        logs += err
    assert "WARNING" not in logs and "ERROR" not in logs, logs
    assert logs.count("file(s) stored") == 1, logs  # one rename won; the rest kept its entry

    assert all(r is not None for r in results)
    dirs = {r[0] for r in results}
    expected_dir = str(store.entry_dir("compile", KEY))
    assert dirs == {expected_dir}
    assert {r[1] for r in results} == {sha256_file(Path(expected_dir) / "executable.bin")}
    assert [(i.stage, i.key) for i in store.ls()] == [("compile", KEY)]
    assert store.verify().ok
    assert temps(store.root) == []


_RECORDER = """
import sys
from pathlib import Path
from jaxaot.store.cache import Store
s = Store(Path(sys.argv[1]))
for i in range(100):
    s.record("compile" if i % 2 else "lower", sys.argv[2], hit=i % 4 == 0, seconds_saved=0.5)
"""


def test_record_from_concurrent_processes_keeps_every_line(store: Store) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RECORDER, str(store.root), KEY], env=child_env(), cwd=REPO
        )
        for _ in range(4)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4
    lines = (store.root / "v1" / "stats.jsonl").read_text().splitlines()
    assert len(lines) == 400 and all(json.loads(line)["key"] == KEY for line in lines)
    total = store.stats().total
    assert (total.hits, total.misses, total.seconds_saved) == (100, 300, 50.0)


# -- read-only and full stores ---------------------------------------------------------------


@contextlib.contextmanager
def unprivileged() -> Iterator[Path]:
    """A scratch folder writable by us, entered as a user that permissions apply to.

    Root ignores mode bits, so as root we drop the effective uid to nobody for the block.
    """
    base = Path(tempfile.mkdtemp(prefix="jaxaot-ro-"))
    dropped = False
    try:
        if os.geteuid() == 0:
            os.chmod(base, 0o755)
            os.chown(base, 65534, 65534)
            try:
                os.setegid(65534)
                os.seteuid(65534)
            except OSError as exc:
                pytest.skip(f"running as root and cannot drop privileges ({exc})")
            dropped = True
        yield base
    finally:
        if dropped:
            os.seteuid(0)
            os.setegid(0)
        for d in base.rglob("*"):
            if d.is_dir():
                d.chmod(0o755)
        shutil.rmtree(base)


def test_read_only_store_by_chmod_degrades_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with unprivileged() as base:
        store = Store(base / "store")
        put(store, seed=1)
        store.root.chmod(0o555)
        caplog.clear()
        assert store.put("compile", KEY2, {"a": b"x"}, compat=COMPAT) is None
        assert store.put("compile", KEY3, {"a": b"y"}, compat=COMPAT) is None
        store.record("compile", KEY, hit=True)
        got = store.get("compile", KEY, expect=COMPAT)
        assert got is not None and got.read_bytes("executable.bin") == payload(1)
        assert store.read_only
        (line,) = store_warnings(caplog)
        assert "is not writable" in line and "Permission denied" in line
        assert temps(store.root) == []


@pytest.mark.parametrize(
    ("func", "code"),
    [
        ("mkdir", errno.EROFS),
        ("rename", errno.EROFS),
        ("fsync", errno.ENOSPC),
        ("rename", errno.EDQUOT),
    ],
)
def test_unwritable_store_simulated_degrades_with_one_warning(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    func: str,
    code: int,
) -> None:
    put(store, seed=1)
    caplog.clear()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, func, fail)
    assert store.put("compile", KEY2, {"a": b"x"}, compat=COMPAT) is None
    assert store.put("compile", KEY3, {"a": b"y"}, compat=COMPAT) is None
    store.record("compile", KEY, hit=False)
    got = store.get("compile", KEY, expect=COMPAT)
    assert got is not None and got.read_bytes("executable.bin") == payload(1)
    monkeypatch.undo()

    (line,) = store_warnings(caplog)
    assert "is not writable" in line and os.strerror(code) in line
    assert temps(store.root) == []
    assert [i.key for i in store.ls()] == [KEY]
    assert Store(store.root).put("compile", KEY2, {"a": b"x"}) is not None  # a new instance retries


def _corrupt(store: Store, key: str = KEY) -> Path:
    entry_dir = store.entry_dir("compile", key)
    (entry_dir / MANIFEST_NAME).write_text("{ not json")
    return entry_dir


def _one_bad_entry_is_skipped_alone(
    store: Store, bad: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a store does with ``bad``, a corrupt entry that cannot be removed: one warning
    naming it and why, misses and skipped puts for that key, and every other key cached."""
    caplog.clear()
    assert store.get("compile", KEY, expect=COMPAT) is None
    assert store.put("compile", KEY, {"a": b"x"}, compat=COMPAT) is None
    assert store.get("compile", KEY, expect=COMPAT) is None
    (line,) = store_warnings(caplog)
    assert str(bad) in line and "corrupt entry" in line and "cannot be removed" in line
    assert "not writable" not in line
    assert not store.read_only
    for i, other in enumerate((KEY2, KEY3)):
        assert put(store, key=other, seed=i) is not None
        assert store.get("compile", other, expect=COMPAT) is not None
    store.record("compile", KEY2, hit=True)
    assert len(store_warnings(caplog)) == 1
    assert store.stats().total.hits == 1


def test_an_entry_that_cannot_be_removed_is_skipped_alone(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    put(store, seed=1)
    bad = _corrupt(store)
    real = os.rename

    def refuse(src: object, dst: object, *a: object, **k: object) -> None:
        if bad in (Path(str(src)), Path(str(dst))):  # like an immutable folder: EPERM
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(src), None, str(dst))
        real(src, dst, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", refuse)
    _one_bad_entry_is_skipped_alone(store, bad, caplog)
    assert os.strerror(errno.EPERM) in store_warnings(caplog)[0]


def test_an_entry_in_a_folder_you_cannot_write_is_skipped_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real permissions: the corrupt entry's folder is read-only, so neither removing the entry
    nor putting a new one there can work; the store goes on for every other key."""
    with unprivileged() as base:
        store = Store(base / "store")
        put(store, seed=1)
        bad = _corrupt(store)
        bad.parent.chmod(0o555)
        assert KEY2[:2] != KEY[:2] and KEY3[:2] != KEY[:2]  # their folders are writable
        _one_bad_entry_is_skipped_alone(store, bad, caplog)
        assert os.strerror(errno.EACCES) in store_warnings(caplog)[0]


def test_a_folder_in_the_store_that_refuses_entries_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with unprivileged() as base:
        store = Store(base / "store")
        put(store, seed=1)
        (store.data_dir / "compile").chmod(0o555)  # no new key folders under compile/
        caplog.clear()
        assert store.put("compile", KEY2, {"a": b"x"}, compat=COMPAT) is None
        assert store.put("compile", KEY3, {"a": b"y"}, compat=COMPAT) is None
        (line,) = store_warnings(caplog)
        folder = store.data_dir / "compile"
        assert f"{folder} is not writable" in line and "the rest of the store" in line
        assert not store.read_only and temps(store.root) == []
        assert put(store, key=KEY2, seed=2, stage="lower") is not None  # other folders: cached
        assert store.get("compile", KEY, expect=COMPAT) is not None  # hits still served
        assert len(store_warnings(caplog)) == 1


def test_a_hit_miss_log_that_cannot_be_written_never_stops_caching(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    put(store, seed=1)
    real = os.open

    def refuse(path: object, *a: object, **k: object) -> int:
        if str(path).endswith("stats.jsonl"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    caplog.clear()
    store.record("compile", KEY, hit=True)
    store.record("compile", KEY, hit=False)
    assert put(store, key=KEY2, seed=2) is not None
    (line,) = store_warnings(caplog)
    assert "cannot record hits and misses" in line and "stats.jsonl" in line
    assert "still cached" in line and not store.read_only


# -- maintenance -------------------------------------------------------------------------------


def test_gc_by_size_removes_least_recently_used_first(store: Store) -> None:
    for i, key in enumerate((KEY, KEY2, KEY3)):
        put(store, key=key, seed=i)
    assert store.get("compile", KEY, expect=COMPAT) is not None  # KEY is now the most recent
    sizes = {i.key: i.size_bytes for i in store.ls()}
    total = sum(sizes.values())

    report = store.gc(max_bytes=total - 1)
    assert (report.entries_removed, report.bytes_freed) == (1, sizes[KEY2])
    assert sorted(i.key for i in store.ls()) == sorted([KEY, KEY3])

    report = store.gc(max_bytes=sizes[KEY])
    assert (report.entries_removed, report.bytes_remaining) == (1, sizes[KEY])
    assert [i.key for i in store.ls()] == [KEY]
    assert store.gc(max_bytes=10**9).entries_removed == 0
    assert temps(store.root) == []


def test_gc_older_than_removes_entries_unused_that_long(store: Store) -> None:
    put(store, key=KEY)
    put(store, key=KEY2)
    old = time.time() - 7200
    os.utime(store.entry_dir("compile", KEY) / MANIFEST_NAME, (old, old))
    report = store.gc(older_than_s=3600)
    assert report.entries_removed == 1
    assert [i.key for i in store.ls()] == [KEY2]


def test_stats_counts_entries_bytes_hits_and_misses(store: Store) -> None:
    put(store, key=KEY)
    put(store, key=KEY2)
    put(store, key=KEY3, stage="lower")
    store.record("compile", KEY, hit=True, seconds_saved=2.0)
    store.record("compile", KEY, hit=True, seconds_saved=3.5)
    store.record("compile", KEY2, hit=False)
    store.record("execute", KEY3, hit=False)
    with open(store.root / "v1" / "stats.jsonl", "ab") as f:
        f.write(b'{"torn": tr\n')  # a torn line is skipped
    stats = store.stats()
    by_size = {i.key: i.size_bytes for i in store.ls()}
    assert set(stats.stages) == {"compile", "lower", "execute"}
    c = stats.stages["compile"]
    assert (c.entries, c.bytes, c.hits, c.misses, c.seconds_saved) == (
        2,
        by_size[KEY] + by_size[KEY2],
        2,
        1,
        5.5,
    )
    assert (stats.stages["lower"].entries, stats.stages["execute"].misses) == (1, 1)
    assert (stats.total.entries, stats.total.hits, stats.total.misses) == (3, 2, 2)


def test_gc_folds_the_hit_miss_log_into_the_same_totals(store: Store) -> None:
    put(store, key=KEY)
    for hit, saved in ((True, 2.0), (True, 3.5), (False, 0.0)):
        store.record("compile", KEY, hit=hit, seconds_saved=saved)
    store.record("execute", KEY3, hit=False)
    log = store.root / "v1" / "stats.jsonl"
    with open(log, "ab") as f:
        f.write(b'{"torn": tr\n')
    before = store.stats()

    assert store.gc().log_lines_folded == 5
    assert [json.loads(x)["stage"] for x in log.read_text().splitlines()] == ["compile", "execute"]
    assert store.stats() == before
    store.record("compile", KEY, hit=True, seconds_saved=1.0)
    assert store.gc().log_lines_folded == 1
    assert store.gc().log_lines_folded == 0  # already folded: the file is not rewritten
    c = store.stats().stages["compile"]
    assert (c.hits, c.misses, c.seconds_saved) == (3, 1, 6.5)


def test_records_appended_while_gc_folds_are_never_lost(store: Store) -> None:
    writers, per_writer = 4, 150

    def append() -> None:
        for _ in range(per_writer):
            store.record("compile", KEY, hit=True, seconds_saved=1.0)

    threads = [threading.Thread(target=append) for _ in range(writers)]
    for t in threads:
        t.start()
    folds = 0
    while any(t.is_alive() for t in threads):
        folds += store.gc().log_lines_folded
    for t in threads:
        t.join()
    c = store.stats().stages["compile"]
    assert (c.hits, c.seconds_saved) == (writers * per_writer, writers * per_writer * 1.0)
    assert folds > 0


def test_verify_reports_corrupt_entries_and_removes_on_request(store: Store) -> None:
    put(store, key=KEY)
    bad = put(store, key=KEY2)
    put(store, key=KEY3, stage="lower")
    _flip_byte(bad.dir)

    report = store.verify()
    assert not report.ok and len(report.results) == 3
    (c,) = report.corrupt
    assert (c.stage, c.key, c.removed) == ("compile", KEY2, False)
    assert "sha256" in c.reason and bad.dir.exists()

    report = store.verify(remove=True)
    assert [(r.key, r.removed) for r in report.corrupt] == [(KEY2, True)]
    assert not bad.dir.exists()
    assert store.verify().ok and len(store.verify().results) == 2


def test_ls_lists_entries_with_size_and_times(store: Store) -> None:
    before = time.time()
    put(store, key=KEY)
    put(store, key=KEY2, stage="lower")
    infos = store.ls()
    assert [(i.stage, i.key, i.files) for i in infos] == [("compile", KEY, 2), ("lower", KEY2, 2)]
    for i in infos:
        assert i.size_bytes == sum(p.stat().st_size for p in i.dir.iterdir())
        assert i.created is not None and before - 1 <= i.created <= i.last_used + 1
    assert [i.key for i in store.ls(stage="lower")] == [KEY2]


# -- helpers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("512", 512),
        ("10B", 10),
        ("2GB", 2_000_000_000),
        ("2gb", 2_000_000_000),
        ("1.5 MB", 1_500_000),
        ("3KB", 3000),
        ("1KiB", 1024),
        ("4mib", 4 << 20),
        ("2GiB", 2 << 30),
        (4096, 4096),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "2XB", "-1GB", "2 G B", "1e9", "two", "2GB!"])
def test_parse_size_rejects_bad_values_naming_them(bad: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid size {bad!r}".replace("(", r"\(")):
        parse_size(bad)


def test_resolve_store_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_STORE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_store_root(None) == tmp_path / "xdg" / "jaxaot" / "store"
    monkeypatch.setenv(ENV_STORE_DIR, str(tmp_path / "env"))
    assert resolve_store_root(None) == tmp_path / "env"
    assert resolve_store_root("") == tmp_path / "env"
    assert resolve_store_root(tmp_path / "cfg") == tmp_path / "cfg"


@pytest.mark.parametrize("xdg", [None, "", "relative/cache"])
def test_the_default_store_is_under_the_home_without_an_absolute_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None
) -> None:
    """The XDG specification: an unset, empty or relative $XDG_CACHE_HOME means ~/.cache."""
    monkeypatch.delenv(ENV_STORE_DIR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.chdir(tmp_path)
    assert resolve_store_root(None) == tmp_path / "home" / ".cache" / "jaxaot" / "store"


def test_the_default_store_is_created_private(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV_STORE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o002)  # a team umask: the per-user folders stay private all the same
    try:
        check_store_dir(None)
    finally:
        os.umask(old)
    for folder in ("xdg", "xdg/jaxaot", "xdg/jaxaot/store"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o700, folder
    Store(resolve_store_root(None)).check_trusted()  # a private store passes the trust check


def test_a_default_store_that_cannot_be_created_names_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV_STORE_DIR, raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    want = f"store.dir (unset, so the default {tmp_path / 'file' / 'jaxaot' / 'store'})"
    with pytest.raises(ConfigError, match=re.escape(want) + ".*is a regular file, not a folder"):
        check_store_dir(None)


def test_runs_from_two_folders_share_the_default_store(tmp_path: Path) -> None:
    """The default store is per user: the second run, from another folder, is a cache hit."""
    env = cli_env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop(ENV_STORE_DIR, None)
    statuses = []
    for where in ("a", "b/c"):
        cwd = tmp_path / where
        cwd.mkdir(parents=True)
        run = cwd / "run"
        proc = run_cli(
            ["program=axpy", "stop_after=compile", f"hydra.run.dir={run}"], cwd=cwd, env=env
        )
        assert proc.returncode == 0, proc.stderr
        statuses.append(read_manifest(run)["stages"]["compile"]["status"])
        assert not (cwd / "outputs").exists()
    assert statuses == ["ran", "cached"]
    store = tmp_path / "xdg" / "jaxaot" / "store"
    log = [json.loads(x) for x in (store / "v1" / "stats.jsonl").read_text().splitlines()]
    assert [(e["stage"], e["hit"]) for e in log] == [("compile", False), ("compile", True)]


def test_a_store_root_replaced_by_a_file_mid_run_is_one_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    put(store, seed=1)
    shutil.rmtree(store.root)
    store.root.write_text("not a folder")
    caplog.clear()
    assert store.get("compile", KEY, expect=COMPAT) is None
    store.record("compile", KEY, hit=False)
    assert store.put("compile", KEY, {"a": b"x"}, compat=COMPAT) is None
    store.record("compile", KEY2, hit=False)
    assert store.put("compile", KEY2, {"a": b"y"}, compat=COMPAT) is None
    (line,) = store_warnings(caplog)
    assert f"store at {store.root} is not writable" in line and store.read_only
    assert store.root.read_text() == "not a folder"
