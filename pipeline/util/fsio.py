"""Atomic, verified file I/O: the only way jaxaot writes an artifact or a manifest.

A write goes to a uniquely named temp file in the destination directory and is then renamed
over the destination, so a reader (this process, another one, or a run after this one was
killed) sees the old file, the new file or nothing, never a torn one. These writes are not
fsynced: the operating system writes them back, so only a kernel crash or a power loss can
cost the last seconds of a run directory, and every checkpoint read checks each file's size
and sha256 (a lost file is an error naming it, never a wrong answer). Fsyncing each file and
its folder would take more than half of a warm run's time (24 files). Store entries, which
other processes and machines take as finished, are fsynced before they become visible
(:mod:`jaxaot.store.cache`). An interrupted write leaves only a ``.tmp-*`` file that
:func:`remove_stale_temps` (called by later runs and by ``jaxaot-store gc``) cleans up.
:func:`flock_file` is the one way jaxaot takes an advisory lock on a file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20
# Files and folders are created with these modes and the process umask applied by the kernel
# (never ``mkstemp``/``mkdtemp``, which make 0600/0700): with umask 002 or 022 a store or run
# directory on a shared file system is readable by the team.
FILE_MODE = 0o666
DIR_MODE = 0o777


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
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


def _new_temp_file(parent: Path, prefix: str) -> tuple[int, str]:
    """A new, uniquely named file opened for writing, mode :data:`FILE_MODE` minus the umask."""
    for _ in range(100):
        tmp = os.path.join(parent, f"{prefix}{uuid.uuid4().hex[:12]}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp file name in {parent}")  # pragma: no cover


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named folder in ``parent``, mode :data:`DIR_MODE` minus the umask (a
    folder created in a setgid folder inherits its group, as a team store needs)."""
    for _ in range(100):
        tmp = Path(parent) / f"{prefix}{uuid.uuid4().hex[:12]}"
        try:
            os.mkdir(tmp, DIR_MODE)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp folder name in {parent}")  # pragma: no cover


def atomic_write_bytes(path: Path, data: bytes | bytearray | memoryview) -> str:
    """Write ``data`` to ``path`` atomically and return its sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp_file(path.parent, TEMP_PREFIX + path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            raise _naming(exc, path) from exc
        raise
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


class FileLock:
    """An advisory ``flock`` taken by :func:`flock_file`; :meth:`close` (or the end of a
    ``with`` block) releases it. ``held``: this process holds it. ``busy``: another process
    held it and :func:`flock_file` did not wait. ``error``: why no lock can be had here (no
    ``fcntl``, a file system without locks); its caller then runs unlocked."""

    __slots__ = ("_fd", "busy", "error", "held", "path")

    def __init__(
        self, path: Path, fd: int, *, busy: bool = False, error: Exception | None = None
    ) -> None:
        self.path, self._fd = path, fd
        self.held = fd >= 0
        self.busy, self.error = busy, error

    def fileno(self) -> int:
        """The lock file's descriptor (-1 when none is open); closing it releases the lock."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            self.held = False
            os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "held" if self.held else "busy" if self.busy else f"unlocked ({self.error})"
        return f"FileLock({str(self.path)!r}, {state})"


def flock_file(
    path: Path,
    *,
    shared: bool = False,
    wait: bool = True,
    create: bool = True,
    waiting: Callable[[], None] | None = None,
) -> FileLock:
    """Open ``path`` and take its ``flock``, exclusive or ``shared``: the one way jaxaot locks a
    file. With ``create``, the file (mode :data:`FILE_MODE` minus the umask) and its folders
    are made when missing. Where another process holds a conflicting lock, ``wait`` blocks
    until it is free (calling ``waiting()`` first, once); otherwise the lock comes back
    ``busy``. The descriptor is close-on-exec, so a program this process starts never holds it.

    OSError when the file cannot be opened (or created); where no lock can be had (no
    ``fcntl``, ENOLCK and the like) the lock comes back not held, with its ``error``.
    """
    path = Path(path)
    try:
        import fcntl
    except ImportError as exc:  # pragma: no cover - not POSIX
        return FileLock(path, -1, error=exc)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), FILE_MODE)
    how = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                os.close(fd)
                return FileLock(path, -1, busy=True)
            if waiting is not None:
                waiting()
            fcntl.flock(fd, how)
    except OSError as exc:  # ENOLCK, a file system that cannot lock
        os.close(fd)
        return FileLock(path, -1, error=exc)
    except BaseException:  # interrupted while waiting
        os.close(fd)
        raise
    return FileLock(path, fd)


ENV_TRUST = "JAXAOT_TRUST_STORE"


def trust_from_env() -> bool:
    """``JAXAOT_TRUST_STORE=1`` (or true/yes): trust stores and checkpoints whatever their modes."""
    return os.environ.get(ENV_TRUST, "").strip().lower() in ("1", "true", "yes", "on")


def _my_groups() -> frozenset[int]:
    return frozenset({os.getegid(), *os.getgroups()})


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        import grp

        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except (ImportError, KeyError):
        return f"gid {gid}"


def loose_permissions(path: Path, st: os.stat_result, owner_matters: bool = True) -> str | None:
    """Why ``path`` (with stat ``st``) could be changed by users other than you and your groups,
    or None. The rule is ssh's for key files, widened to a team: refuse what every user can
    write, what a group you are not in can write, and (``owner_matters``) what belongs to a user
    who is neither you, root, nor in the file's group with you. A sticky world-writable folder
    (``/tmp``) is fine: others cannot rename or delete what is yours in it. A symbolic link's
    own mode (always ``rwxrwxrwx`` on Linux) says nothing and is not judged here: see
    :func:`untrusted_path`, which judges what a link leads to and who may repoint it."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return None
    sticky = stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX)
    mine = _my_groups()
    if mode & stat.S_IWOTH and not sticky:
        return f"{path} is writable by every user (mode {stat.filemode(mode)})"
    if mode & stat.S_IWGRP and st.st_gid not in mine and not sticky:
        return (
            f"{path} is writable by group {_group(st.st_gid)}, which you are not in "
            f"(mode {stat.filemode(mode)})"
        )
    if owner_matters and _stranger(st):
        return f"{path} belongs to {_who(st.st_uid)}, who is not in a group with you"
    return None


def _stranger(st: os.stat_result) -> bool:
    """Owned by a user who is neither you, root, nor in the file's group with you."""
    return st.st_uid not in (os.geteuid(), 0) and st.st_gid not in _my_groups()


def _link_problem(link: Path, st: os.stat_result) -> str | None:
    """Why the symbolic link ``link`` could be repointed by someone you do not trust, or None.

    Only the writers of the folder holding a link can replace it (that folder is judged on its
    own) and, in a sticky folder such as ``/tmp``, the link's owner as well."""
    try:
        parent = link.parent.lstat()
    except OSError:
        return None
    sticky = stat.S_ISDIR(parent.st_mode) and bool(parent.st_mode & stat.S_ISVTX)
    if sticky and _stranger(st):
        return (
            f"{link} is a symbolic link in the sticky folder {link.parent} that belongs to "
            f"{_who(st.st_uid)}, who is not in a group with you and may repoint it"
        )
    return None


def _judge(path: Path, owner_matters: bool) -> str | None:
    try:
        st = path.lstat()
    except OSError:  # not created yet (whoever creates it applies your umask), or unreachable
        return None
    if stat.S_ISLNK(st.st_mode):
        return _link_problem(path, st)
    return loose_permissions(path, st, owner_matters)


def untrusted_path(path: Path, root: Path) -> str | None:
    """Why a file under ``root`` (a store or run directory) could have been written by someone
    you do not trust, or None: ``path``, every folder from it up to ``root``, and ``root``'s
    ancestors (those for writability only) are checked, one ``lstat`` each; missing ones are
    skipped.

    Symbolic links (a ``store.dir`` or ``resume_from`` that is a link, a link above them) are
    followed: the file and folders they lead to are judged under their resolved paths, which the
    reason names; so are the folders that hold each link (their writers could repoint it), and a
    link in a sticky folder owned by a stranger is refused (its owner could repoint it)."""
    path, root = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    real_path, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    checks: dict[Path, bool] = {}  # path -> whether its owner matters (those in the tree)

    def add(p: Path, owner_matters: bool) -> None:
        checks[p] = checks.get(p, False) or owner_matters

    # Resolved paths first, so that a reason names the folder as it is on disk.
    for chain_path, chain_root in ((real_path, real_root), (path, root)):
        add(chain_path, True)
        for p in chain_path.parents:
            add(p, p == chain_root or chain_root in p.parents)
        add(chain_root, True)
        for p in chain_root.parents:
            add(p, False)
    for p, owner_matters in checks.items():
        reason = _judge(p, owner_matters)
        if reason:
            return reason
    return None


_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a folder")


def _can(path: Path, mode: int) -> bool:
    """``os.access`` for this process's effective ids (what a write would be judged by)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def folder_problem(path: Path | str, *, write: bool, create: bool = True) -> str | None:
    """Why ``path`` cannot serve as a folder that this process reads (and, with ``write``,
    writes), or None; a path that does not exist yet is fine where its nearest existing
    ancestor is a folder you may create it in (or, without ``create``, where nothing on the way
    is a file). Symbolic links are followed. The reason names the path at fault: ``/dev/null``
    "is a character device", a link loop, a file on the way. Nothing is created."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    try:
        st = os.stat(path)
    except OSError as exc:
        if not create and exc.errno == errno.ENOENT and not os.path.islink(path):
            return None
        return _missing_folder_problem(path, exc)
    shown = f"{path} (a symbolic link to {os.path.realpath(path)})" if path.is_symlink() else path
    if not stat.S_ISDIR(st.st_mode):
        return f"{shown} is {_kind(st.st_mode)}, not a folder"
    need = os.R_OK | os.X_OK | (os.W_OK if write else 0)
    if not _can(path, need):
        what = "write to" if write and _can(path, os.R_OK | os.X_OK) else "read"
        return f"{shown} is a folder you cannot {what} (mode {stat.filemode(st.st_mode)})"
    return None


def _missing_folder_problem(path: Path, exc: OSError) -> str | None:
    if exc.errno == errno.ELOOP:
        return f"{path} cannot be resolved: its symbolic links form a loop"
    if exc.errno == errno.ENOTDIR:
        for p in reversed(path.parents):  # the first ancestor that is not a folder
            try:
                st = os.stat(p)
            except OSError:
                break
            if not stat.S_ISDIR(st.st_mode):
                return f"{p} is {_kind(st.st_mode)}, not a folder, so {path} cannot be one"
        return f"{path}: {exc.strerror}"
    if exc.errno != errno.ENOENT:
        return f"{path} cannot be reached ({exc.strerror})"
    if os.path.islink(path):
        return (
            f"{path} is a symbolic link to {os.readlink(path)}, which does not exist "
            "(create that folder first)"
        )
    for p in path.parents:  # the nearest existing ancestor must let you create the rest
        try:
            st = os.stat(p)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):  # pragma: no cover - stat said ENOENT, not ENOTDIR
            return f"{p} is {_kind(st.st_mode)}, not a folder, so {path} cannot be one"
        if not _can(p, os.W_OK | os.X_OK):
            return (
                f"{path} does not exist and cannot be created: {p} is not writable by you "
                f"(mode {stat.filemode(st.st_mode)})"
            )
        return None
    return None


def find_temps(root: Path) -> list[tuple[Path, float]]:
    """``(path, age in seconds)`` of every ``.tmp-*`` file or folder under ``root`` (not those
    inside another): what interrupted writes leave."""
    found: list[tuple[Path, float]] = []
    now = time.time()
    if not Path(root).is_dir():
        return found
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *dirnames]:
            if name.startswith(TEMP_PREFIX):
                p = Path(dirpath) / name
                try:
                    found.append((p, max(now - p.lstat().st_mtime, 0.0)))
                except OSError:
                    continue
        dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
    return found


def remove_stale_temps(root: Path, older_than_s: float = 3600.0) -> int:
    """Remove ``.tmp-*`` files and folders under ``root`` left by interrupted writes."""
    import shutil

    removed = 0
    for p, age in find_temps(root):
        if age < older_than_s:
            continue
        try:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink()
            removed += 1
        except FileNotFoundError:
            continue
    return removed


__all__ = [
    "DIR_MODE",
    "ENV_TRUST",
    "FILE_MODE",
    "TEMP_PREFIX",
    "FileLock",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "canonical_json",
    "flock_file",
    "folder_problem",
    "key_of",
    "loose_permissions",
    "make_temp_dir",
    "remove_stale_temps",
    "sha256_bytes",
    "sha256_file",
    "trust_from_env",
    "untrusted_path",
]
