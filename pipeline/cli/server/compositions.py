"""Hydra compositions remembered by the ``jaxaot`` server, for the runs it forks.

Composing jaxaot's config costs ~0.2 s, a fifth of a warm run through the server. A run's
composition is a pure function of what it reads: the config name and overrides, the working
directory, the job name, and the config files on Hydra's search path. So a served run that
composes (Hydra's RUN mode) reports the result to the server under a key over all of that, and
a later run with the same key starts from a copy instead of composing.

The key covers every file and folder under every ``file://`` and ``pkg://`` source Hydra reads
(the primary config's own ``hydra.searchpath`` included, symlinks followed) by path, target,
size, inode, and modification and change times (any write to a file changes its ctime, which no
user can set back). Not remembered: a composition whose defaults list calls an OmegaConf
resolver (``- experiment: ${oc.env:PICK}``), one that copies environment variables
(``hydra.job.env_copy``), one with a source it cannot fingerprint or over 5000 files, and one
whose files changed in the last 2 s (a change within the same clock tick would look the same,
as Git's "racily clean" files). Structured configs (Hydra's ConfigStore) are registered by
jaxaot's own modules, which the server watches: it restarts when one changes. OmegaConf's
resolver cache is cleared, so no resolved value (the ``${now:...}`` of a run dir, resolved
while composing) travels from one run to another: each run resolves its own.
``tests/test_server.py`` checks a remembered composition equals Hydra's own, and that edited
files, a primary config's search path, a symlinked folder and an environment variable in a
defaults list are read again.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections import OrderedDict

from jaxaot.sweeps.remembered import KEEP, composition_key, remember

_RECORD = struct.Struct("!II")  # key length, payload length (0: a hit)


def install(memo: OrderedDict[str, bytes], report_fd: int) -> None:
    """In a served run: Hydra's RUN-mode compositions come from ``memo`` (the server's, as
    forked) when their key is there; each one is reported to the server on ``report_fd``.
    Not on a Hydra this was not tested on (jaxaot.compat.hydra.HYDRA_KNOWN): each run composes."""

    def report(key: str, payload: bytes) -> None:
        data = _RECORD.pack(len(key), len(payload)) + key.encode() + payload
        with contextlib.suppress(OSError):  # the server went away: nothing to remember
            _write_all(report_fd, data)

    remember(memo, report)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_reports(data: bytes) -> list[tuple[str, bytes]]:
    """The (key, payload) records a run reported; payload b"" for a composition it reused."""
    out: list[tuple[str, bytes]] = []
    at = 0
    while at + _RECORD.size <= len(data):
        klen, plen = _RECORD.unpack_from(data, at)
        at += _RECORD.size
        if at + klen + plen > len(data):
            break  # cut short (the run was killed while reporting): dropped
        key = data[at : at + klen].decode()
        out.append((key, data[at + klen : at + klen + plen]))
        at += klen + plen
    return out


__all__ = ["KEEP", "composition_key", "install", "read_reports"]
