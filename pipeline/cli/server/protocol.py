"""The wire protocol between a ``jaxaot`` client and its server, over a Unix stream socket.

Framing: each message is a 4-byte big-endian length, then that many bytes of UTF-8 JSON (an
object). The client's request carries its stdin/stdout/stderr and any other inheritable
descriptors as SCM_RIGHTS ancillary data on the same ``sendmsg``.

Messages, in order on one connection:

- client -> server: a **request**, ``{"v": PROTOCOL, "argv", "argv0", "orig_argv", "cwd", "env", "path",
  "origins", "process"}`` (:mod:`jaxaot.cli.server.facts` says what ``origins``
  and ``process`` hold), with descriptors ``[0, 1, 2, *process["inherited_fds"]]``; or an
  **operation**, ``{"v": PROTOCOL, "op": "status" | "stop"}``, without descriptors.
- server -> client: ``{"declined": reason}`` (nothing ran; the client runs in-process), or
  ``{"pid": pid}`` (the run's process, leader of its own process group), then when it ends
  ``{"exit": status}`` or ``{"exit": 128 + sig, "signal": sig}``. To ``status``: the
  server's figures; to ``stop``: ``{"stopping": pid}``.

Versioning: ``v`` is :data:`PROTOCOL`; a server declines a request with another one (the run
goes on in-process), so a client and a server from different checkouts never misread each
other.

Peers: each end learns who is at the other end from the kernel (``SO_PEERCRED``), never
from the messages; a peer running as another user gets nothing (:func:`peer_problem`).

The standard library only: the client side must cost milliseconds.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from typing import Any

# The request format's version. 3: "process" (interpreter, limits, identity, cgroup and
# namespaces, umask, affinity, ignored signals, how each stdio stream was opened: encoding,
# error handler, line buffering, write-through; inherited descriptors).
PROTOCOL = 3
MAX_FDS = 200  # descriptors above 2 passed to a run (one SCM_RIGHTS message holds 253)

_HEADER = struct.Struct("!I")
_PEERCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one message (and ``fds`` with its first bytes)."""
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)) + data)


def recv(
    sock: socket.socket, maxfds: int = 0, deadline: float | None = None
) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (and the descriptors sent with it, close-on-exec): exactly its bytes, never a
    byte of the next one (the reply with the pid and the one with the exit status may arrive
    together). None when the peer closed before a whole message; ValueError for bytes that are
    not JSON; TimeoutError past ``deadline`` (``time.monotonic()``), however the bytes come."""
    fds: list[int] = []
    try:
        _until(sock, deadline)
        first = _recv_fds(sock, _HEADER.size, maxfds, fds) if maxfds else sock.recv(_HEADER.size)
        header = _recv_exact(sock, first, _HEADER.size, deadline)
        if header is None:
            return None, fds
        (size,) = _HEADER.unpack(header)
        data = _recv_exact(sock, b"", size, deadline)
        return (json.loads(data) if data is not None else None), fds
    except BaseException:  # the caller never sees them: close them here
        for fd in fds:
            os.close(fd)
        raise


def _recv_fds(sock: socket.socket, size: int, maxfds: int, fds: list[int]) -> bytes:
    """socket.recv_fds with MSG_CMSG_CLOEXEC (its own ``flags`` are not passed on): the
    descriptors never outlive an exec unless moved there on purpose."""
    item = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(
        size, socket.CMSG_SPACE(maxfds * item.itemsize), getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            item.frombytes(payload[: len(payload) - (len(payload) % item.itemsize)])
    fds.extend(item)
    return data


def _until(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("past the deadline")
    sock.settimeout(left)


def _recv_exact(
    sock: socket.socket, data: bytes, size: int, deadline: float | None
) -> bytes | None:
    if not data and size:
        _until(sock, deadline)
        data = sock.recv(size)
        if not data:
            return None
    while len(data) < size:
        _until(sock, deadline)
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def operation(op: str) -> dict[str, Any]:
    """An operation message (``status``, ``stop``)."""
    return {"v": PROTOCOL, "op": op}


def exit_message(waitstatus: int) -> dict[str, Any]:
    """The message that ends a run, from its ``waitpid`` status: 128 + the signal that
    killed it (and the signal, so the client can end the same way), else its exit status."""
    code = os.waitstatus_to_exitcode(waitstatus)
    return {"exit": 128 - code, "signal": -code} if code < 0 else {"exit": code}


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket: for a
    client, the one that listened (as it was at ``listen``); for a server, the one that
    connected."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def peer_problem(pid: int, uid: int, gid: int) -> str | None:
    """Why a process with these credentials (``SO_PEERCRED``) is not to be trusted with a
    request: it runs as another user. (gid is not judged: a user's server may run with any
    of their groups.)"""
    me = os.geteuid()
    if uid != me:
        return f"runs as uid {uid} (pid {pid}), not as you (uid {me})"
    return None


__all__ = [
    "MAX_FDS",
    "PROTOCOL",
    "exit_message",
    "operation",
    "peer_credentials",
    "peer_problem",
    "recv",
    "send",
]
