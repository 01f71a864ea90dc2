"""The per-key store lock that makes concurrent sweep jobs compile a shared key once."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from jaxaot.errors import ConfigError
from jaxaot.store.locks import KeyLock, remove_idle_locks

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


def test_with_waits_for_the_holder(tmp_path: Path) -> None:
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
