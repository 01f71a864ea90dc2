"""Atomic, verified file I/O: the only way jaxaot writes an artifact or a manifest.

A write goes to a uniquely named temp file in the destination directory, is fsynced and then
renamed over the destination, so a reader sees the old file, the new file or nothing, never a
torn one. An interrupted write leaves only a ``.tmp-*`` file that :func:`remove_stale_temps`
(called by later runs and by ``jaxaot-store gc``) cleans up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

TEMP_PREFIX = ".tmp-"
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once at import: os.umask can only be read by setting it
_CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the form every cache key is hashed over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def key_of(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj``."""
    return sha256_bytes(canonical_json(obj).encode())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically and return its sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        # mkstemp makes 0600 files; artifacts are ordinary files (shared stores, clusters).
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            raise _naming(exc, path) from exc
        raise
    _fsync_dir(path.parent)
    return sha256_bytes(data)


def _naming(exc: OSError, path: Path) -> OSError:
    """The same error naming the file: a failed write() or fsync() (ENOSPC, EIO) names none."""
    if exc.errno is None:
        return OSError(f"{exc}: {str(path)!r}")
    try:
        return type(exc)(exc.errno, exc.strerror or str(exc), str(path))
    except Exception:
        return OSError(exc.errno, exc.strerror or str(exc), str(path))


def atomic_write_text(path: Path, text: str) -> str:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> str:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def remove_stale_temps(root: Path, older_than_s: float = 3600.0) -> int:
    """Remove ``.tmp-*`` files and folders under ``root`` left by interrupted writes."""
    import shutil

    removed = 0
    now = time.time()
    if not Path(root).is_dir():
        return 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in list(filenames) + list(dirnames):
            if not name.startswith(TEMP_PREFIX):
                continue
            p = Path(dirpath) / name
            try:
                if now - p.lstat().st_mtime < older_than_s:
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()
                removed += 1
            except FileNotFoundError:
                continue
        dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
    return removed


__all__ = [
    "TEMP_PREFIX",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "canonical_json",
    "key_of",
    "remove_stale_temps",
    "sha256_bytes",
    "sha256_file",
]
