"""Where the ``jaxaot server``'s socket lives, and whether its folder is the user's alone.

A client hands its server its whole environment (tokens included), argv, cwd and terminal
descriptors, so it must reach its own user's server and nobody else's. Two checks, both
before the first byte is sent (the second is :func:`jaxaot.cli.server.client.connect`'s):

- **The folder.** The socket's folder is the user's alone: owned by them, mode 0700, and
  every folder on its path is a real folder (no symbolic link) that no one else can write to,
  unless it is sticky (``/tmp``: others cannot rename or remove what is not theirs there). A
  folder that someone else made first (``/tmp/jaxaot-<uid>`` is a name anyone can take) is
  refused with one line; it is created with :func:`os.mkdir`, which fails if anything is
  there already, and checked through descriptors opened with ``O_NOFOLLOW``.
- **The peer.** After ``connect``, ``SO_PEERCRED`` gives the uid of the process listening on
  the socket; one that is not the client's own euid gets nothing
  (:func:`jaxaot.cli.server.protocol.peer_problem`).

The standard library and jaxaot.errors only: the client side must cost milliseconds.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

from jaxaot.errors import UnsafeSocketError

OVERRIDE = "JAXAOT_SERVER_SOCKET"
FIX = f"set {OVERRIDE} to a path in a folder of your own (e.g. ~/.jaxaot/server.sock)"
_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def runtime_dir() -> Path | None:
    """``$XDG_RUNTIME_DIR`` when it is what systemd makes it: a directory (not a symbolic
    link) owned by this user with mode 0700; else None."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if not os.path.isabs(runtime):
        return None
    try:
        st = os.lstat(runtime)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return Path(runtime)


def default_folder() -> Path:
    """``$XDG_RUNTIME_DIR/jaxaot`` (see :func:`runtime_dir`), else ``jaxaot-<uid>`` in the
    temp dir (``$TMPDIR``, else ``/tmp``)."""
    runtime = runtime_dir()
    if runtime is not None:
        return runtime / "jaxaot"
    tmp = os.environ.get("TMPDIR", "")
    if not (os.path.isabs(tmp) and os.path.isdir(tmp)):
        tmp = "/tmp"
    return Path(tmp) / f"jaxaot-{os.geteuid()}"


def socket_path() -> Path:
    """``JAXAOT_SERVER_SOCKET`` (made absolute), else ``server-<env>.sock`` in
    :func:`default_folder`: one server per user and Python environment."""
    override = os.environ.get(OVERRIDE)
    if override:
        return Path(os.path.abspath(os.path.expanduser(override)))
    env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    return default_folder() / f"server-{env}.sock"


def _mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}"


def _ancestor_problem(where: str, st: os.stat_result) -> str | None:
    """Why a folder on the way to the socket's folder lets someone else swap what is in it."""
    if st.st_uid not in (0, os.geteuid()):
        return f"{where} is owned by uid {st.st_uid}, neither you nor root"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{where} is writable by others and not sticky ({_mode(st)})"
    return None


def folder_problem(st: os.stat_result) -> str | None:
    """Why a folder (stat'ed without following a symbolic link) is not this user's alone."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    me = os.geteuid()
    if st.st_uid != me:
        return f"is owned by uid {st.st_uid}, not by you (uid {me}): someone else made it"
    if st.st_mode & 0o077:
        return f"has {_mode(st)}, not 0700: others have access"
    return None


def _refuse(folder: Path, problem: str, fix: str = FIX) -> UnsafeSocketError:
    return UnsafeSocketError(f"server socket folder {folder} {problem}; {fix}")


def _open_dir(folder: Path, here: Path, dir_fd: int) -> int:
    """An ``O_PATH`` descriptor of ``here`` (a name in the folder ``dir_fd``), not following a
    symbolic link; UnsafeSocketError for a link or a file, FileNotFoundError when absent."""
    try:
        return os.open(here.name, _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP or ENOTDIR: a symbolic link or not a folder
        try:
            st = os.lstat(here.name, dir_fd=dir_fd)
        except OSError:
            raise _refuse(folder, f"cannot be opened: {here}: {exc.strerror}") from None
        what = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a folder"
        raise _refuse(folder, what if here == folder else f"is unsafe: {here} {what}") from None


def check_folder(folder: Path, *, create: bool) -> None:
    """Raise UnsafeSocketError (one line naming the folder, what is wrong and the fix) unless
    ``folder`` is this user's alone; FileNotFoundError when it is missing and not ``create``
    (missing folders are made 0700 when ``create``). Walked component by component through
    ``O_PATH|O_NOFOLLOW`` descriptors: what is checked is what the next step opens."""
    folder = Path(os.path.abspath(folder))
    fds = [os.open("/", _OPEN)]
    try:
        names = folder.parts[1:]
        if not names and (problem := folder_problem(os.fstat(fds[0]))):
            raise _refuse(folder, problem)
        for i in range(len(names)):
            here = Path("/", *names[: i + 1])
            try:
                fd = _open_dir(folder, here, fds[-1])
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(here.name, 0o700, dir_fd=fds[-1])
                    # What this process just made, in a folder no one else can swap it out
                    # of (checked on the way here): 0700 whatever the umask.
                    os.chmod(here.name, 0o700, dir_fd=fds[-1])
                except FileExistsError:  # made meanwhile: checked below as any other
                    pass
                except OSError as exc:
                    raise _refuse(folder, f"cannot be made: {here}: {exc.strerror}") from None
                fd = _open_dir(folder, here, fds[-1])
            fds.append(fd)
            st = os.fstat(fd)
            if here == folder:
                if problem := folder_problem(st):
                    own = st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode)
                    fix = f"chmod 700 {folder}, or {FIX}" if own else FIX
                    raise _refuse(folder, problem, fix)
            elif problem := _ancestor_problem(str(here), st):
                raise _refuse(folder, f"is unsafe: {problem}")
    finally:
        for fd in fds:
            os.close(fd)


__all__ = [
    "FIX",
    "OVERRIDE",
    "check_folder",
    "default_folder",
    "folder_problem",
    "runtime_dir",
    "socket_path",
]
