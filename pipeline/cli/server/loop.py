"""The serve loop: accept requests on the socket, decline or fork, and report each end.

One selector over the listening socket, each run's client connection, each run's pidfd and
each run's composition-report pipe. A request is declined (``{"declined": reason}``, nothing
forked, the client runs in-process) when the server could get it wrong (:meth:`Server.declines`,
:meth:`Server.stale`, :meth:`Server.fd_clash`); otherwise a child is forked
(jaxaot.cli.server.child) and its pid sent, and when it ends its status. A client that goes
away takes its run with it: SIGTERM to the run's process group, SIGKILL 10 s later.

The loop stops on a ``stop`` request, on KeyboardInterrupt (the server process turns SIGTERM
and SIGHUP into one), after ``idle`` seconds with no request and no run, or when a file of an
imported module changed (:attr:`Server.restart_requested`: the caller re-executes). Leaving,
it first refuses new connections, then answers the clients still waiting to be accepted
(:meth:`Server._decline_waiting`), so that none is dropped unsure whether its run started.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import socket
import stat
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxaot.cli.server import CHILD_MARK, facts
from jaxaot.cli.server.child import exit_now, run_child, run_jaxaot
from jaxaot.cli.server.protocol import (
    MAX_FDS,
    PROTOCOL,
    exit_message,
    peer_credentials,
    peer_problem,
    recv,
    send,
)

MAX_RUNS = 32  # runs in flight at once; more run in-process
IDLE_SECONDS = 3 * 3600
KILL_AFTER = 10.0  # seconds from a client's going away to SIGKILL of its run
DRAIN_S = 2.0  # seconds, in all, to answer the clients still waiting when the loop ends

# What a forked child runs: given the server's remembered compositions and the write end of
# its report pipe (jaxaot.cli.server.compositions).
Job = Callable[["OrderedDict[str, bytes]", int], None]


def _stat(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _signature(path: str) -> tuple[Any, ...] | None:
    """What a watched path's change is judged by, or None when it is absent. A file: its size,
    inode, mtime and ctime. A folder: the names of its entries other than ``__pycache__`` (a
    package installed or removed, a plugin added), with each ``.pth`` file's stat; Python
    writing ``__pycache__`` into it on a first import changes its mtime, not its code."""
    try:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        names = sorted(n for n in os.listdir(path) if n != "__pycache__")
        pth = [_stat(os.path.join(path, n)) for n in names if n.endswith(".pth")]
    except OSError:
        return None
    return (*names, *pth)


class _Run:
    """A served run: the child's pid and pidfd, its client's connection, when it was told to
    stop (a client that went away)."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.conn = conn
        self.killed_at: float | None = None


class Server:
    """The loop's state. ``env_before``: the environment before the server's imports (what
    its clients must agree with); ``warned``: warnings the imports raised; ``lock``: the
    one-server-per-socket flock (a child must not hold it), or None; ``job``: what a forked
    child runs (:func:`jaxaot.cli.server.child.run_jaxaot`)."""

    def __init__(
        self,
        path: Path,
        env_before: dict[str, str],
        warned: list[Any],
        lock: Any,
        job: Job = run_jaxaot,
    ) -> None:
        self.path = path
        self.lock = lock
        self.warned = warned
        self.job = job
        self.env_before = env_before
        # What the imports themselves set (JAX and jaxaot quiet C++ logging this way): an
        # in-process run has them too, so every child gets them on top of its client's.
        self.added = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        self.origins = facts.origins()
        self.import_path = facts.ImportPath.of_this_process()
        self.files = self._module_files()
        self.started = time.time()
        self.last_request = time.monotonic()
        self.idle = float(os.environ.get("JAXAOT_SERVER_IDLE", IDLE_SECONDS))
        self.served = 0
        self.declined = 0
        self.restart_requested = False
        self.restart_reason = ""  # the watched path whose change asked for the restart
        self.sel = selectors.DefaultSelector()
        self.runs: dict[int, _Run] = {}  # by pidfd
        # Hydra compositions the runs reported (jaxaot.cli.server.compositions), and the
        # reports being read (by pipe fd).
        self.composed: OrderedDict[str, bytes] = OrderedDict()
        self.reports: dict[int, bytearray] = {}
        self.compositions_reused = 0
        self.listener: socket.socket | None = None

    @staticmethod
    def _module_files() -> dict[str, tuple[Any, ...] | None]:
        """By :func:`_signature`: every imported module's file, the site-packages folders (a
        package installed or removed, a new or edited .pth file), and each sys.path entry's
        hydra_plugins folder, there or not (Hydra's plugins were looked up at start)."""
        import site

        names = [getattr(mod, "__file__", None) for mod in list(sys.modules.values())]
        names += [*site.getsitepackages(), site.getusersitepackages()]
        names += [os.path.join(p, "hydra_plugins") for p in sys.path if p]
        # An absent path's appearing counts as a change (None, then a signature).
        return {f: _signature(f) for f in dict.fromkeys(names) if f}

    def stale(self) -> str | None:
        """The first watched path that changed since the server started, or None."""
        for f, seen in self.files.items():
            if _signature(f) != seen:
                return f
        return None

    def fd_clash(self, targets: list[int], passing: list[int], conn: socket.socket) -> str | None:
        """A number the run's descriptors need that a child keeps open (one the server's
        libraries opened): such a run is not served, rather than a library's file clobbered."""
        mine = {run.pidfd for run in self.runs.values()} | set(self.reports) | set(passing)
        mine.add(conn.fileno())
        mine |= {run.conn.fileno() for run in self.runs.values()}
        mine |= {self.sel.fileno(), self.listener.fileno() if self.listener else -1}
        if self.lock is not None:
            mine.add(self.lock.fileno())
        try:
            open_now = {int(n) for n in os.listdir("/proc/self/fd")}
        except OSError:
            return None
        kept = open_now - mine  # what a child still has after closing the server's own
        clash = sorted(t for t in targets[3:] if t in kept)
        return f"descriptor {clash[0]} is taken in the server" if clash else None

    def declines(self, req: dict[str, Any]) -> str | None:
        """Why this request cannot be served by this server's imports, or None."""
        if req.get("v") != PROTOCOL:
            return "protocol"
        if req["env"].get(CHILD_MARK):
            return "a run of this server"
        if len(self.runs) >= MAX_RUNS:
            return f"{len(self.runs)} runs in flight"
        proc = req.get("process") or {}
        if reason := facts.process_mismatch(proc, facts.process()):
            return reason
        if len(proc.get("inherited_fds", [])) > MAX_FDS:
            return f"more than {MAX_FDS} open descriptors"
        if reason := facts.env_mismatch(req["env"], self.env_before, self.added):
            return reason
        for name, origin in self.origins.items():
            if req.get("origins", {}).get(name) != origin:
                return f"import path ({name})"
        return facts.path_mismatch(req["path"], req["cwd"], self.import_path)

    def open(self) -> None:
        """Listen on :attr:`path`: a 0600 socket bound under a temporary name, then renamed
        over the path clients connect to; the server's pid beside it (``.pid``)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        old = os.umask(0o177)
        try:
            listener.bind(str(tmp))
        finally:
            os.umask(old)
        os.chmod(tmp, 0o600)
        listener.listen(64)
        os.replace(tmp, self.path)  # atomically the socket clients connect to
        self.path.with_suffix(".pid").write_text(f"{os.getpid()}\n")
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.listener = listener

    def loop(self) -> bool:
        """Serve until stopped (see the module's docstring); True when the server is to
        re-execute itself (:attr:`restart_requested`). Runs still in flight are waited for
        and their clients told how they ended."""
        listener = self.listener
        assert listener is not None, "open() first"
        try:
            while not self.restart_requested:
                if not self.runs and time.monotonic() - self.last_request > self.idle:
                    break
                for key, _ in self.sel.select(timeout=self._timeout()):
                    if key.data == "listen":
                        conn, _ = listener.accept()
                        self.accept(conn)
                    elif key.data == "client":
                        self.client_event(key.fileobj)  # type: ignore[arg-type]
                    elif key.data == "report":
                        self.read_report(key.fd)
                    else:
                        self.finish(key.fd)
                self.escalate()
        except KeyboardInterrupt:  # SIGTERM/SIGHUP or a stop: leave, restart or not
            self.restart_requested = False
        finally:
            self._unlink_if_mine()  # no new client reaches this listener
            self._decline_waiting(listener)
            listener.close()
            for fd in list(self.reports):  # a run still reporting gets EPIPE, never blocks
                os.close(fd)
            self.reports.clear()
            if not self.restart_requested and self.lock is not None:
                self.lock.close()  # a new server may start while these runs end
            for pidfd in list(self.runs):  # runs in flight end as they would have
                try:
                    self.finish(pidfd)
                except KeyboardInterrupt:  # a signal while waiting: the other runs still end
                    self.restart_requested = False
        return self.restart_requested

    def _decline_waiting(self, listener: socket.socket) -> None:
        """Answer the clients that connected but were not accepted yet, which closing the
        listener would drop with no word whether their run started. New connections are
        refused first (the client then finds no server and runs in-process); for up to
        :data:`DRAIN_S` seconds in all, each waiting run request is declined (its client runs
        in-process: nothing was forked) and a stop answered (it ends a restart); a status is
        answered last, and only when the server is restarting (the same process comes back).
        Clients still waiting after that are dropped."""
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RD)  # connect() now gets ECONNREFUSED
        listener.setblocking(False)
        deadline = time.monotonic() + DRAIN_S
        accepted: list[socket.socket] = []  # closed when the drain ends
        asking: list[socket.socket] = []  # status requests, answered once the rest are
        try:
            while time.monotonic() < deadline:
                try:
                    conn, _ = listener.accept()
                except OSError:  # none left
                    break
                accepted.append(conn)
                try:
                    if self._answer_waiting(conn, deadline) == "status":
                        asking.append(conn)
                except KeyboardInterrupt:  # SIGTERM while leaving: leave, restart or not
                    self.restart_requested = False
                    break
                except Exception:  # one client's trouble never stops the shutdown
                    pass
            if self.restart_requested:
                for conn in asking:
                    with contextlib.suppress(OSError):
                        send(conn, self.status())
        finally:
            for conn in accepted:
                conn.close()

    def _answer_waiting(self, conn: socket.socket, deadline: float) -> str | None:
        """Answer one waiting client (see :meth:`_decline_waiting`); its operation."""
        if peer_problem(*peer_credentials(conn)):
            return None
        req: dict[str, Any] | None = None
        with contextlib.suppress(OSError, ValueError):
            req, fds = recv(conn, maxfds=3 + MAX_FDS, deadline=deadline)
            for fd in fds:
                os.close(fd)
        op = (req or {}).get("op")
        if op == "status":
            return op
        if op == "stop":
            self.restart_requested = False
            reply: dict[str, Any] = {"stopping": os.getpid()}
        else:
            reply = {"declined": "stopping"}
            self.declined += 1
        with contextlib.suppress(OSError):
            send(conn, reply)
        return op

    def _timeout(self) -> float:
        if any(r.killed_at is not None for r in self.runs.values()):
            return 1.0
        return max(1.0, min(60.0, self.idle))

    def finish(self, pidfd: int) -> None:
        """Reap a child and send its exit status (128 + signal when killed) to its client."""
        run = self.runs.pop(pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(run.conn)
        os.close(pidfd)
        _, status = os.waitpid(run.pid, 0)
        with contextlib.suppress(OSError), run.conn:
            send(run.conn, exit_message(status))
        self.last_request = time.monotonic()

    def read_report(self, fd: int) -> None:
        """What a run reports about its Hydra compositions: kept (up to
        ``compositions.KEEP``, least recently used dropped) for the runs forked after."""
        try:
            data = os.read(fd, 1 << 20)
        except OSError:
            data = b""
        if data:
            self.reports[fd] += data
            return
        self.sel.unregister(fd)
        os.close(fd)
        from jaxaot.cli.server.compositions import KEEP, read_reports

        for key, payload in read_reports(bytes(self.reports.pop(fd))):
            if payload:
                self.composed[key] = payload
            elif key in self.composed:
                self.compositions_reused += 1
            if key in self.composed:
                self.composed.move_to_end(key)
        while len(self.composed) > KEEP:
            self.composed.popitem(last=False)

    def client_event(self, conn: socket.socket) -> None:
        """A client's connection became readable while its run goes on: it went away (killed,
        say). Its run is ended as an in-process run would be with it: SIGTERM to the run's
        process group, SIGKILL :data:`KILL_AFTER` seconds later if it is still there."""
        try:
            data = conn.recv(4096)  # a client sends nothing after its request: dropped
        except OSError:
            data = b""
        if data:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        for run in self.runs.values():
            if run.conn is conn and run.killed_at is None:
                run.killed_at = time.monotonic()
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(run.pid, signal.SIGTERM)

    def escalate(self) -> None:
        now = time.monotonic()
        for run in self.runs.values():
            if run.killed_at is not None and now - run.killed_at > KILL_AFTER:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(run.pid, signal.SIGKILL)

    def _unlink_if_mine(self) -> None:
        with contextlib.suppress(OSError):
            pid_file = self.path.with_suffix(".pid")
            if pid_file.read_text().strip() == str(os.getpid()):  # not a newer server's
                self.path.unlink()
                pid_file.unlink()

    def status(self) -> dict[str, Any]:
        """The reply to a ``status`` request."""
        return {
            "pid": os.getpid(),
            "started": self.started,
            "served": self.served,
            "declined": self.declined,
            "running": len(self.runs),
            "compositions": [len(self.composed), self.compositions_reused],
            "python": sys.executable,
        }

    def accept(self, conn: socket.socket) -> None:
        """One connection: an operation answered, a request declined, or a run forked."""
        if peer_problem(*peer_credentials(conn)):  # the socket is 0600; and yet
            conn.close()
            return
        conn.settimeout(2)  # a client sends its request at once; never hold the server up
        try:
            req, fds = recv(conn, maxfds=3 + MAX_FDS)
        except (OSError, ValueError):
            req, fds = None, []
        conn.settimeout(None)
        if req is None:  # nothing forked: the client may run in-process
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError), conn:
                send(conn, {"declined": "incomplete request"})
            return
        if req.get("op") == "status":
            with conn:
                send(conn, self.status())
            return
        if req.get("op") == "stop":
            with conn:
                send(conn, {"stopping": os.getpid()})
            raise KeyboardInterrupt
        self.last_request = time.monotonic()
        changed = self.stale()
        reason = f"changed: {changed}" if changed else self.declines(req)
        targets = [0, 1, 2, *req.get("process", {}).get("inherited_fds", [])]
        if not reason and len(fds) != len(targets):
            reason = "descriptors not received"
        if not reason:
            reason = self.fd_clash(targets, fds, conn)
        if reason:
            for fd in fds:
                os.close(fd)
            with conn:
                send(conn, {"declined": reason or "no descriptors"})
            self.declined += 1
            if changed:
                self.restart_requested = True
                self.restart_reason = changed
            return
        self.fork(req, fds, conn, targets)

    def fork(
        self, req: dict[str, Any], fds: list[int], conn: socket.socket, targets: list[int]
    ) -> None:
        """Fork the run's child, tell the client its pid, and watch both."""
        report, report_w = os.pipe()
        if report_w in targets or report in targets:  # pipe() took a number the run needs
            high = max(targets) + 1
            moved = (
                fcntl.fcntl(report, fcntl.F_DUPFD_CLOEXEC, high),
                fcntl.fcntl(report_w, fcntl.F_DUPFD_CLOEXEC, high),
            )
            os.close(report)
            os.close(report_w)
            report, report_w = moved

        def close_servers_own() -> None:
            os.close(report)
            if self.listener is not None:
                self.listener.close()
            conn.close()  # the server's end: if the server dies, its client hears it at once
            if self.lock is not None:
                self.lock.close()
            self.sel.close()
            for run in self.runs.values():  # other runs' descriptors: not this child's
                os.close(run.pidfd)
                run.conn.close()
            for fd in self.reports:
                os.close(fd)

        pid = os.fork()
        if pid == 0:
            try:
                run_child(
                    req,
                    fds,
                    close=close_servers_own,
                    added=self.added,
                    warned=self.warned,
                    job=lambda: self.job(self.composed, report_w),
                )
            finally:
                exit_now(70)  # run_child always exits; this is the line it cannot get past
        os.close(report_w)
        self.reports[report] = bytearray()
        self.sel.register(report, selectors.EVENT_READ, "report")
        with contextlib.suppress(OSError):  # EACCES if the child got there first (and did it)
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        self.served += 1
        run = _Run(pid, conn)
        self.runs[run.pidfd] = run
        self.sel.register(run.pidfd, selectors.EVENT_READ, "child")
        try:
            send(conn, {"pid": pid})
        except OSError:  # the client is gone already
            run.killed_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            return
        self.sel.register(conn, selectors.EVENT_READ, "client")


__all__ = ["IDLE_SECONDS", "KILL_AFTER", "MAX_RUNS", "Job", "Server"]
