"""One copy of a big file on disk: run directories hard-link the store's entries (a store hit
costs no copy).

A compiled executable embeds every constant the program captured, so a run that closes over a
51 MB weight writes a 51 MB ``compile/executable.bin``, and the store holds the same bytes
again. On one file system the run directory's file and the store's are made one inode (a hard
link) instead: a store miss links the run's new file into the entry it puts, a store hit links
the entry's file into the run directory. Across file systems, or where links are refused
(``EXDEV``, ``EPERM``, ``EMLINK``), the file is copied.

Sharing an inode is sound because nothing writes these files in place: jaxaot writes a file
only to a new temp name that is then renamed over the old one (:mod:`jaxaot.util.fsio`), the
store puts and removes whole entry folders by rename and deletes them by unlinking, and a link
is made read-only so that nobody else writes it by accident, and only where a copy would have
had the same owner and group (a team store's setgid group), so that a link changes
nobody's trust in a file. Every reader checks sha256 against
its own manifest anyway (the run's ``manifest.json`` or the entry's ``entry.json``), so a file
changed behind jaxaot's back is refused, never served; removing an entry (``jaxaot-store gc``,
``verify --remove``) only drops the store's name, and the run directory keeps its file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import uuid
from pathlib import Path

from jaxaot.util.fsio import TEMP_PREFIX

# Files smaller than this are copied: sharing them saves nothing worth a read-only file.
LINK_MIN_BYTES = 1 << 16
_CHUNK = 1 << 20


def make_read_only(path: Path | str, st: os.stat_result | None = None) -> None:
    """Drop every write bit of ``path`` (a file two names share must not be written in place)."""
    mode = stat.S_IMODE((st or os.lstat(path)).st_mode)
    if mode & 0o222:
        os.chmod(path, mode & ~0o222, follow_symlinks=False)


def _group_of_new_file(folder: Path) -> int:
    """The group a file created in ``folder`` gets: the folder's when it is setgid (a team
    store) or on BSD-like systems, else this process's."""
    st = os.stat(folder)
    if st.st_mode & stat.S_ISGID or not sys.platform.startswith("linux"):
        return st.st_gid
    return os.getegid()


def _as_if_created_in(st: os.stat_result, folder: Path) -> bool:
    """True when a file with stat ``st`` has the owner and group a copy made in ``folder``
    would have: a link must not hand a team store a file of a private group (its members
    could not vouch for it), nor a run directory another user's file."""
    return st.st_uid == os.geteuid() and st.st_gid == _group_of_new_file(folder)


def _same_bytes(path: Path, data: bytes | bytearray | memoryview) -> bool:
    view = memoryview(data)
    at = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            if view[at : at + len(chunk)] != chunk:
                return False
            at += len(chunk)
    return at == len(view)


def link_same(src: Path, dest: Path, data: bytes | bytearray | memoryview) -> bool:
    """Make ``dest`` a read-only hard link to ``src`` when ``src`` is a regular file holding
    exactly ``data`` (read back through the new link, so what was compared is what the name
    now holds); True when done. False leaves ``dest`` as it was: another file system, links
    refused, the bytes differ, ``src`` is gone or belongs to another owner or group."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{TEMP_PREFIX}{dest.name}.{uuid.uuid4().hex[:12]}"
    try:
        if not _as_if_created_in(os.lstat(src), dest.parent):
            return False
        os.link(src, tmp, follow_symlinks=False)
    except OSError:
        return False
    try:
        st = os.lstat(tmp)
        same = stat.S_ISREG(st.st_mode) and st.st_size == len(data) and _same_bytes(tmp, data)
        if same:
            make_read_only(tmp, st)
            os.replace(tmp, dest)
    except OSError:
        same = False
    if not same:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True


def link_into(src: Path, dest: Path) -> bool:
    """Hard-link ``src`` (a regular file of at least :data:`LINK_MIN_BYTES`) as the new name
    ``dest`` and make it read-only; False (nothing created) when that is not possible. The
    caller hashes ``dest`` afterwards: what it records is what the shared inode holds."""
    try:
        st = os.lstat(src)
        big = stat.S_ISREG(st.st_mode) and st.st_size >= LINK_MIN_BYTES
        if not big or not _as_if_created_in(st, dest.parent):
            return False
        os.link(src, dest, follow_symlinks=False)
    except OSError:
        return False
    try:
        make_read_only(dest)
    except OSError:  # not ours to change (another user's file): copy instead
        with contextlib.suppress(OSError):
            os.unlink(dest)
        return False
    return True


def shares_inode(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` are one file (hard links of one inode)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


__all__ = ["LINK_MIN_BYTES", "link_into", "link_same", "make_read_only", "shares_inode"]
