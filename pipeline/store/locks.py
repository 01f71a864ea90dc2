"""One computation per store key across processes: the others wait, then hit the store.

Sweep jobs that share a compile key (an execute-only sweep) may start together under a
parallel launcher; without a lock each would miss and compile. :class:`KeyLock` is an exclusive
``flock`` on ``<store>/locks/<stage>/<key>.lock`` held from the store miss until the put, so the
first job compiles and the rest load its entry. The lock is advisory and per key (jobs with
different keys never wait for each other), the kernel releases it if its holder dies, and where
it cannot be taken (no ``fcntl``, a read-only store, a file system without locks) jobs simply
run unlocked: the store's atomic puts keep that correct, only slower.

A store with a ``claim`` method (a bucket store, :mod:`jaxaot.store.tiered`) reaches further:
once the local lock is held, the key is claimed in the bucket too, so that jobs on other machines
wait for this one (and this one for theirs) the same way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxaot.store.bucket import BUSY
from jaxaot.util.fsio import FileLock, flock_file

log = logging.getLogger("jaxaot")

LOCKS_DIR = "locks"
STATS_LOCK = "stats.lock"  # in LOCKS_DIR: appends to the hit/miss log share it, gc takes it alone


@contextlib.contextmanager
def file_lock(path: Path, exclusive: bool) -> Iterator[bool]:
    """A blocking ``flock`` on ``path`` (created if missing) for the ``with`` block.

    Yields False where no lock can be had (no ``fcntl``, a read-only or lock-less file system):
    the caller then runs unlocked, as :class:`KeyLock` does.
    """
    try:
        lock = flock_file(path, shared=not exclusive)
    except OSError:
        yield False
        return
    with lock:
        yield lock.held


def remove_idle_locks(root: Path, older_than_s: float) -> int:
    """Delete per-key lock files nobody holds that were created over ``older_than_s`` ago.

    Each file is deleted while this process holds its lock, so a running computation never
    loses its lock. A job that opened the file just before and waits on it may then run beside
    a job that creates a fresh one: at worst one key is computed twice, never stored wrongly
    (the store's puts are atomic). Returns how many were removed.
    """
    removed = 0
    now = time.time()
    for path in sorted(Path(root, LOCKS_DIR).glob("*/*.lock")):
        try:
            if now - path.stat().st_mtime <= older_than_s:
                continue
            lock = flock_file(path, wait=False, create=False)
        except OSError:  # already gone, or unreadable
            continue
        with lock:
            if not lock.held:  # held by a running job, or not lockable here
                continue
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
    return removed


class KeyLock:
    """The store-wide lock for ``(stage, key)``; ``with`` waits for it, :meth:`acquire` may not."""

    def __init__(self, store: Any, stage: str, key: str) -> None:
        self.stage, self.key = stage, key
        self.path = Path(store.root) / LOCKS_DIR / stage / f"{key}.lock"
        self._usable = bool(store.enabled and not store.read_only)
        self._lock: FileLock | None = None
        self._claim_of: Any = getattr(store, "claim", None) if self._usable else None
        self._claim: Any = None  # what claim() returned: released with the lock

    @property
    def held(self) -> bool:
        return self._lock is not None or self._claim is not None

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; False only when ``blocking=False`` and another job holds it."""
        if self.held or not self._usable:
            return True
        if not self._acquire_local(blocking):
            return False
        if self._claim_of is not None:
            claim = self._claim_of(self.stage, self.key, blocking)
            if claim == BUSY:
                self.release()
                return False
            self._claim = claim
        return True

    def _acquire_local(self, blocking: bool) -> bool:
        waited_from: list[float] = []

        def waiting() -> None:
            waited_from.append(time.perf_counter())
            log.info(
                "[%s] %s is being computed by another job; waiting for it",
                self.stage,
                self.key[:12],
            )

        try:
            lock = flock_file(self.path, wait=blocking, waiting=waiting)
        except OSError as exc:
            lock = FileLock(self.path, -1, error=exc)
        if lock.busy:
            return False
        if not lock.held:
            log.debug(
                "[%s] no lock for %s (%s); running unlocked", self.stage, self.key[:12], lock.error
            )
            return True
        if waited_from:
            waited = time.perf_counter() - waited_from[0]
            log.info("[%s] waited %.2f s for %s", self.stage, waited, self.key[:12])
        self._lock = lock
        return True

    def release(self) -> None:
        if self._claim is not None:
            claim, self._claim = self._claim, None
            claim.release()
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.close()

    def __enter__(self) -> KeyLock:
        self.acquire(blocking=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["LOCKS_DIR", "STATS_LOCK", "KeyLock", "file_lock", "remove_idle_locks"]
