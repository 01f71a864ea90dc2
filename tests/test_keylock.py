"""The per-key store lock that makes concurrent sweep jobs compile a shared key once."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from jaxaot.errors import ConfigError
from jaxaot.store.locks import KeyLock, file_lock, remove_idle_locks
from jaxaot.util.fsio import FILE_MODE, flock_file

KEY = "ab" * 32


def _store(root: Path, enabled: bool = True, read_only: bool = False) -> SimpleNamespace:
    return SimpleNamespace(root=root, enabled=enabled, read_only=read_only)


def test_a_held_key_is_refused_without_waiting_and_free_after_release(tmp_path: Path) -> None:
    first, second = (
        KeyLock(_store(tmp_path), "compile", KEY),
        KeyLock(_store(tmp_path), "compile", KEY),
    )
    assert first.acquire(blocking=False) and first.held
    assert not second.acquire(blocking=False) and not second.held
    assert KeyLock(_store(tmp_path), "compile", "cd" * 32).acquire(blocking=False)  # other keys
    first.release()
    assert second.acquire(blocking=False)
    second.release()
    assert (tmp_path / "locks" / "compile" / f"{KEY}.lock").is_file()


def test_with_waits_for_the_holder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="jaxaot")
    holder = KeyLock(_store(tmp_path), "compile", KEY)
    assert holder.acquire()

    def release_later() -> None:
        time.sleep(0.3)
        holder.release()

    threading.Thread(target=release_later).start()
    t0 = time.perf_counter()
    with KeyLock(_store(tmp_path), "compile", KEY) as waiter:
        assert waiter.held
        assert time.perf_counter() - t0 >= 0.25
    assert not waiter.held
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"[compile] {KEY[:12]} is being computed by another job; waiting for it"
    assert said[1].startswith("[compile] waited ") and said[1].endswith(f" s for {KEY[:12]}")


def test_disabled_or_read_only_store_runs_unlocked(tmp_path: Path) -> None:
    for store in (_store(tmp_path, enabled=False), _store(tmp_path, read_only=True)):
        lock = KeyLock(store, "compile", KEY)
        assert lock.acquire(blocking=False) and not lock.held
    assert not (tmp_path / "locks").exists()


def test_gc_removes_only_old_locks_nobody_holds(tmp_path: Path) -> None:
    held, idle, young = (
        KeyLock(_store(tmp_path), "compile", KEY),
        KeyLock(_store(tmp_path), "compile", "cd" * 32),
        KeyLock(_store(tmp_path), "lower", "ef" * 32),
    )
    for lock in (held, idle, young):
        assert lock.acquire(blocking=False)
    idle.release()
    young.release()
    old = time.time() - 7200
    for lock in (held, idle):
        os.utime(lock.path, (old, old))
    assert remove_idle_locks(tmp_path, older_than_s=3600) == 1
    assert held.path.exists() and not idle.path.exists() and young.path.exists()
    assert not KeyLock(_store(tmp_path), "compile", KEY).acquire(blocking=False)  # still held
    held.release()
    again = KeyLock(_store(tmp_path), "compile", "cd" * 32)
    assert again.acquire(blocking=False) and again.path.exists()
    again.release()


def test_a_failed_compile_leaves_its_key_unlocked(compose_run) -> None:  # type: ignore[no-untyped-def]
    """In one process (the basic launcher) a leaked lock would make the next job wait forever."""
    bad = ["program=axpy", "compile.compiler_options.xla_backend_optimization_level=banana"]
    errors: list[str] = []

    def attempt() -> None:
        try:
            compose_run(*bad)
        except ConfigError as exc:
            errors.append(str(exc))

    for _ in range(2):
        worker = threading.Thread(target=attempt, daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "the second run waited on a lock the first one kept"
    assert len(errors) == 2 and "xla_backend_optimization_level" in errors[1]


def test_flock_file_shared_exclusive_busy_and_waiting(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b.lock"
    with flock_file(path, shared=True) as first, flock_file(path, shared=True) as second:
        assert first.held and second.held and path.is_file()  # folders and file created
        assert (path.stat().st_mode & 0o777) == FILE_MODE & ~_umask()
        busy = flock_file(path, wait=False)
        assert busy.busy and not busy.held and busy.fileno() == -1
    assert not first.held and first.fileno() == -1
    holder = flock_file(path)
    assert not os.get_inheritable(holder.fileno())  # a started program never holds it
    waited: list[float] = []
    threading.Timer(0.3, holder.close).start()
    t0 = time.perf_counter()
    with flock_file(path, waiting=lambda: waited.append(time.perf_counter() - t0)) as waiter:
        assert waiter.held and len(waited) == 1 and time.perf_counter() - t0 >= 0.25
    with pytest.raises(FileNotFoundError):
        flock_file(tmp_path / "missing.lock", create=False)
    assert not (tmp_path / "missing.lock").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_no_lock_here_runs_unlocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without locks (ENOLCK): KeyLock, file_lock and gc run unlocked."""
    import errno
    import fcntl

    def no_locks(fd: int, how: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = flock_file(tmp_path / "x.lock")
    assert not lock.held and not lock.busy and isinstance(lock.error, OSError)
    key = KeyLock(_store(tmp_path), "compile", KEY)
    assert key.acquire(blocking=False) and not key.held
    with file_lock(tmp_path / "stats.lock", exclusive=True) as locked:
        assert locked is False
    old = time.time() - 7200
    os.utime(key.path, (old, old))
    assert remove_idle_locks(tmp_path, older_than_s=3600) == 0 and key.path.exists()


def test_an_unopenable_lock_runs_unlocked(tmp_path: Path) -> None:
    (tmp_path / "locks").write_text("a file where the locks folder goes")
    key = KeyLock(_store(tmp_path), "compile", KEY)
    assert key.acquire() and not key.held
    with file_lock(tmp_path / "locks" / "stats.lock", exclusive=False) as locked:
        assert locked is False


def test_a_peak_dump_folder_is_one_compiles_at_a_time(tmp_path: Path) -> None:
    from jaxaot.stages import peak_dump

    folder = tmp_path / "peak" / "ab12"
    folder.mkdir(parents=True)
    (folder / "stale.txt").write_text("a previous compile's dump")
    with peak_dump.locked(folder):
        assert not folder.exists()  # emptied for this compile
        assert flock_file(tmp_path / "peak" / "locks" / "ab.lock", wait=False).busy
    assert not folder.exists()
    with flock_file(tmp_path / "peak" / "locks" / "ab.lock", wait=False) as free:
        assert free.held
