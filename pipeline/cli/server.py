"""A resident ``jaxaot`` server: Python, JAX and Hydra imported once, a fresh child per run.

A warm ``jaxaot`` run spends most of its time starting up: importing JAX, Hydra and jaxaot
costs more than loading the executable and running it (issue 19). ``jaxaot server start``
keeps one process with those imports done and one config composed (no JAX backend started:
that happens per run). Every later ``jaxaot ...`` sends its argv, cwd, environment, and its
stdin/stdout/stderr (the file descriptors themselves, SCM_RIGHTS) over a per-user Unix socket
(jaxaot.cli.server_socket: it sends nothing unless the socket's folder is the user's alone and
the process listening runs as the user; else one warning line and the run goes on in-process);
the server forks a child that runs exactly what ``jaxaot`` would have run in-process. Each run
gets its own backend, device count and JAX config; output goes straight to the client's
terminal or pipes; Ctrl-C and SIGTERM are forwarded to the child's process group; the client
exits with the child's status; a client that dies takes its run with it. (Prior art: Bazel's
client/server, mypy's dmypy, Nailgun.)

The server never serves a run it could get wrong. It declines, and the client runs
in-process as if there were no server, when:
- an environment variable that JAX, XLA or Python read at import differs from the server's;
- the client would import another copy of a pre-imported package (another checkout or venv);
- a file of any module the server imported changed since it started (the server then
  re-executes itself, so the next run is served by fresh code);
- the request comes from a run the server itself forked (``jaxaot`` called from a run):
  a served run never waits on another served run, so runs cannot multiply through the
  server; and at most :data:`MAX_RUNS` runs are in flight.

This module imports only the standard library (and jaxaot.cli.server_socket, which does too)
at its top: the client side must cost milliseconds. One server per user and Python
environment; it exits after ``JAXAOT_SERVER_IDLE`` seconds (default 3 hours) without a
request.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from jaxaot.cli.server_socket import (
    OVERRIDE,
    UnsafeSocketError,
    check_folder,
    connect,
    peer_credentials,
    peer_problem,
    socket_path,
)

# The real os._exit, taken before anything can wrap it (a run guards os._exit while user code
# runs, jaxaot.util.exits): a forked child must end here, whatever happened, and never return
# into the server's accept loop.
_exit_now = os._exit

PROTOCOL = 2
MAX_RUNS = 32  # runs in flight at once; more run in-process
IDLE_SECONDS = 3 * 3600
# Set in a served run's environment (so also in everything it starts): its own `jaxaot`
# calls run in-process, and the server refuses requests that carry it.
CHILD_MARK = "JAXAOT_SERVED_BY"
# Packages imported in the server, whose origin a client must agree with.
_PREIMPORT = ("jax", "jaxlib", "numpy", "hydra", "omegaconf", "jaxaot")
# Variables read at import time (JAX's config defaults, XLA/TF logging, BLAS threads, Python's
# own): a run whose values differ cannot use the server's imports.
_IMPORT_ENV = re.compile(
    r"^(JAX_|XLA_|TF_|TPU_|LIBTPU|PJRT_|CUDA_|NVIDIA_|PYTHON|LD_|MALLOC|OMP_|OPENBLAS_|MKL_|GOTO"
    r"|LANG$|LC_)"  # the locale: stdio's encoding is decided at start-up
)
_LIMITS = (
    "RLIMIT_AS",
    "RLIMIT_DATA",
    "RLIMIT_NOFILE",
    "RLIMIT_STACK",
    "RLIMIT_CORE",
    "RLIMIT_CPU",
    "RLIMIT_FSIZE",
    "RLIMIT_NPROC",
    "RLIMIT_MEMLOCK",
)
_HEADER = struct.Struct("!I")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_SERVE = "from jaxaot.cli.server import serve_forever; serve_forever()"


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if _IMPORT_ENV.match(k)}


def _origins() -> dict[str, str | None]:
    """Where this process imports (or imported) each pre-imported package from."""
    import importlib.util

    out: dict[str, str | None] = {}
    for name in _PREIMPORT:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        out[name] = spec.origin if spec is not None else None
    return out


def _stat(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _process() -> dict[str, Any]:
    """What a process has that a forked child does not take from its request's environment:
    the interpreter and its options, resource limits and priority (compared: a run with other
    values is declined), umask and CPU affinity (given to the child)."""
    import resource

    umask = os.umask(0)
    os.umask(umask)
    return {
        "python": [sys.executable, sys.version, repr(sys.flags), sys.warnoptions, sys._xoptions],
        "limits": {n: list(resource.getrlimit(getattr(resource, n))) for n in _LIMITS},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "identity": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
        "place": _place(),  # cgroup (a batch job's limits) and namespaces (a container's view)
        "umask": umask,
        "affinity": sorted(os.sched_getaffinity(0)),
        "ignored": [int(sig) for sig in _FORWARDED if signal.getsignal(sig) == signal.SIG_IGN],
        "stdio": [getattr(f, "errors", None) for f in (sys.stdin, sys.stdout, sys.stderr)],
        "inherited_fds": _inherited_fds(),
    }


def _place() -> list[Any]:
    out: list[Any] = []
    with contextlib.suppress(OSError):
        out.append(Path("/proc/self/cgroup").read_text())
    for ns in ("mnt", "pid", "user", "net", "ipc", "uts"):
        with contextlib.suppress(OSError):
            out.append(os.stat(f"/proc/self/ns/{ns}").st_ino)
    return out


MAX_FDS = 200  # descriptors above 2 passed to a run (one SCM_RIGHTS message holds 253)


def _inherited_fds() -> list[int]:
    """Descriptors above 2 that a child process would inherit (``3<file``, ``/dev/fd/63``, a
    make jobserver): passed to the run at the same numbers."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return []
    out = []
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    out.append(fd)
    return out


def _send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (and the descriptors sent with it): exactly its bytes, never a byte of the
    next one (the reply with the pid and the one with the exit status may arrive together)."""
    if maxfds:
        first, fds, _, _ = socket.recv_fds(sock, _HEADER.size, maxfds)
    else:
        first, fds = sock.recv(_HEADER.size), []
    header = _recv_exact(sock, first, _HEADER.size)
    if header is None:
        return None, fds
    (size,) = _HEADER.unpack(header)
    data = _recv_exact(sock, b"", size)
    return (json.loads(data) if data is not None else None), fds


def _recv_exact(sock: socket.socket, data: bytes, size: int) -> bytes | None:
    if not data and size:
        data = sock.recv(size)
        if not data:
            return None
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# ---------------------------------------------------------------------------------- client


def _connect(quiet: bool = False) -> socket.socket | None:
    """A connection to this user's own server, nothing sent yet (server_socket.connect checks
    the socket's folder and the listening process's uid first); None when there is none, or
    when it is someone else's: then one warning line (unless ``quiet``), nothing sent."""
    try:
        return connect(socket_path())
    except UnsafeSocketError as exc:
        if not quiet:
            print(
                f"jaxaot: warning: jaxaot server not used, running in this process: {exc}",
                file=sys.stderr,
            )
        return None


def wanted() -> bool:
    """Whether this ``jaxaot`` may use a server: not inside a served run, and not
    ``JAXAOT_SERVER=0``. (``JAXAOT_SERVER=1`` also starts one for the runs after this one.)"""
    if os.environ.get(CHILD_MARK):
        return False
    return os.environ.get("JAXAOT_SERVER", "").lower() not in ("0", "false", "no", "off")


def run_via_server(argv: list[str]) -> int | None:
    """Run ``jaxaot argv`` in a child of the server; its exit status, or None when there is
    no server or it declined (then the caller runs in-process, nothing having happened)."""
    sock = _connect()
    if sock is None:
        return None
    group: int | None = None  # the child leads its own process group
    pending: list[int] = []  # signals that came before the child existed

    def forward(signum: int, _frame: Any) -> None:
        # As a terminal's Ctrl-C reaches every process of an in-process run.
        if group is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)

    # Installed before asking, so that no Ctrl-C falls between the fork and the handler; not
    # for a signal this process ignores (`nohup`, `cmd &`): the run ignores it too.
    previous = {
        sig: signal.signal(sig, forward)
        for sig in _FORWARDED
        if signal.getsignal(sig) != signal.SIG_IGN
    }
    try:
        with sock:
            process = _process()
            request = {
                "v": PROTOCOL,
                "argv": argv,
                "argv0": sys.argv[0],
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "path": sys.path,
                "origins": _origins(),
                "isatty": [os.isatty(fd) for fd in (0, 1, 2)],
                "process": process,
            }
            try:
                _send(sock, request, [0, 1, 2, *process["inherited_fds"]])
            except OSError:
                reply: dict[str, Any] | None = {"declined": "not sent"}  # nothing can have run
            else:
                try:
                    reply, _ = _recv(sock)
                except (OSError, ValueError):
                    reply = None
            if reply is None:  # the server went away: it may have started the run, so not again
                print(
                    "jaxaot: error: the jaxaot server went away before the run started or while "
                    "it started (it may have run); run again (JAXAOT_SERVER=0 runs in this process)",
                    file=sys.stderr,
                )
                return 1
            if "pid" not in reply:  # declined (stale code, another environment)
                if pending:  # interrupted before anything ran
                    print("jaxaot: interrupted before the run started", file=sys.stderr)
                    return 128 + pending[0]
                return None  # the caller runs in-process, nothing having happened
            group = int(reply["pid"])
            for signum in pending:
                forward(signum, None)
            try:
                done, _ = _recv(sock)
            except (OSError, ValueError):
                done = None
            if done is None or "exit" not in done:
                forward(signal.SIGTERM, None)  # no run goes on writing to a terminal given back
                print("jaxaot: error: the jaxaot server went away during the run", file=sys.stderr)
                return 1
            if done.get("signal"):  # killed by a signal: this process ends the same way
                sig = signal.Signals(int(done["signal"]))
                sys.stdout.flush()
                previous[sig] = signal.SIG_DFL
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            return int(done["exit"])
    finally:  # this process's own handlers back (run_via_server is also called in tests)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------- server


class _Run:
    """A served run: the child's pid and pidfd, its client's connection, when it was told to
    stop (a client that went away)."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.conn = conn
        self.killed_at: float | None = None


class _Server:
    def __init__(
        self, path: Path, env_before: dict[str, str], warned: list[Any], lock: Any
    ) -> None:
        self.path = path
        self.lock = lock  # the one-server-per-socket flock: a child must not hold it
        self.warned = warned  # warnings the warm-up raised: an in-process run prints them too
        self.env_before = env_before
        self.env = _import_env(env_before)
        # What the imports themselves set (JAX and jaxaot quiet C++ logging this way): an
        # in-process run has them too, so every child gets them on top of its client's.
        self.added = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        self.origins = _origins()
        self.sys_path = list(sys.path)
        self.files = self._module_files()
        self.started = time.time()
        self.last_request = time.monotonic()
        self.idle = float(os.environ.get("JAXAOT_SERVER_IDLE", IDLE_SECONDS))
        self.served = 0
        self.declined = 0
        self.restart_requested = False
        self.sel = selectors.DefaultSelector()
        self.runs: dict[int, _Run] = {}  # by pidfd
        # Hydra compositions the runs reported (jaxaot.cli.served_compose), and the reports
        # being read (by pipe fd).
        self.composed: OrderedDict[str, bytes] = OrderedDict()
        self.reports: dict[int, bytearray] = {}
        self.compositions_reused = 0
        self.listener_fd = -1

    @staticmethod
    def _module_files() -> dict[str, tuple[int, ...] | None]:
        """By size, inode, mtime and ctime: every imported module's file, the site-packages
        folders (a package installed or removed, a new .pth file), and each sys.path entry's
        hydra_plugins folder, there or not (Hydra's plugins were looked up at start)."""
        import site

        names = [getattr(mod, "__file__", None) for mod in list(sys.modules.values())]
        names += [*site.getsitepackages(), site.getusersitepackages()]
        names += [os.path.join(p, "hydra_plugins") for p in sys.path if p]
        out: dict[str, tuple[int, ...] | None] = {}
        for f in names:
            if f and f not in out:
                try:
                    out[f] = _stat(f)
                except OSError:
                    out[f] = None  # absent: its appearing counts as a change
        return out

    def stale(self) -> str | None:
        for f, seen in self.files.items():
            try:
                now: tuple[int, ...] | None = _stat(f)
            except OSError:
                now = None
            if now != seen:
                return f
        return None

    def fd_clash(self, targets: list[int], passing: list[int], conn: socket.socket) -> str | None:
        """A number the run's descriptors need that a child keeps open (one the server's
        libraries opened): such a run is not served, rather than a library's file clobbered."""
        mine = {run.pidfd for run in self.runs.values()} | set(self.reports) | set(passing)
        mine.add(conn.fileno())
        mine |= {run.conn.fileno() for run in self.runs.values()}
        mine |= {self.sel.fileno(), self.listener_fd}
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
        mine, proc = _process(), req.get("process") or {}
        reasons = {
            "python": "interpreter or its options",
            "limits": "resource limits",
            "nice": "priority",
            "identity": "user or groups",
            "place": "cgroup or namespaces",
        }
        for what, reason in reasons.items():
            if proc.get(what) != mine[what]:
                return reason
        if len(proc.get("inherited_fds", [])) > MAX_FDS:
            return f"more than {MAX_FDS} open descriptors"
        for key, value in self.added.items():  # set by the imports: a client's own must agree
            if key in req["env"] and req["env"][key] != value:
                return f"environment ({key})"
        theirs = _import_env(req["env"])
        if theirs != self.env:
            keys = sorted(
                k for k in theirs.keys() | self.env.keys() if theirs.get(k) != self.env.get(k)
            )
            return f"environment ({', '.join(keys)})"
        for name, origin in self.origins.items():
            if req.get("origins", {}).get(name) != origin:
                return f"import path ({name})"
        # Hydra's plugins were found on the server's sys.path: a client path entry the server
        # lacks with plugins of its own (a project's hydra_plugins/) is not served.
        for entry in req["path"]:
            if entry not in self.sys_path and os.path.isdir(
                os.path.join(entry or req["cwd"], "hydra_plugins")
            ):
                return f"import path (hydra_plugins in {entry or req['cwd']})"
        return None

    def child(
        self,
        req: dict[str, Any],
        fds: list[int],
        listener: socket.socket,
        conn: socket.socket,
        report: int,
    ) -> None:
        """In the forked child: become the client's ``jaxaot`` process and run it; never
        returns."""
        code: Any = 1
        try:
            listener.close()
            conn.close()  # the server's end: if the server dies, its client hears it at once
            self.lock.close()
            self.sel.close()
            for run in self.runs.values():  # other runs' descriptors: not this child's
                os.close(run.pidfd)
                run.conn.close()
            for fd in self.reports:
                os.close(fd)
            # Its own process group (the server sets it too, before telling the client: no race),
            # so a client's signals reach the run and whatever the run started, nothing else.
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)
            targets = [0, 1, 2, *req["process"]["inherited_fds"]]
            high = max(targets) + 1  # first out of every target's way, then into place
            moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in fds]
            for fd in fds:
                os.close(fd)
            for target, fd in zip(targets, moved, strict=True):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(req["cwd"])
            os.umask(req["process"]["umask"])
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, req["process"]["affinity"])
            os.environ.clear()
            os.environ.update({**req["env"], **self.added, CHILD_MARK: str(os.getppid())})
            time.tzset()  # TZ as the client has it (${now:...}, run dir names, manifests)
            sys.path[:] = req["path"]
            sys.argv = [req.get("argv0") or "jaxaot", *req["argv"]]
            tty = req.get("isatty", [False] * 3)
            errors = req["process"]["stdio"]  # strict, or surrogateescape in a C locale
            sys.stdin = open(0, errors=errors[0], closefd=False)  # noqa: SIM115
            sys.stdout = open(  # noqa: SIM115
                1, "w", buffering=1 if tty[1] else -1, errors=errors[1], closefd=False
            )
            sys.stderr = open(2, "w", buffering=1, errors=errors[2], closefd=False)  # noqa: SIM115
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in req["process"]["ignored"]:  # `nohup jaxaot ...`: ignored as the client did
                signal.signal(sig, signal.SIG_IGN)
            import warnings

            for w in self.warned:  # e.g. Hydra's "Error importing plugin ...", as in-process
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            try:
                from jaxaot.cli.main import main
                from jaxaot.cli.served_compose import install

                install(self.composed, report)
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code
            code = _finish_like_python(code)
        except BaseException:
            import traceback

            with contextlib.suppress(BaseException):
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
            code = 1  # as Python exits on an uncaught exception
        finally:
            _exit_now(code if isinstance(code, int) else 1)

    def serve(self) -> None:
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
        self.listener_fd = listener.fileno()
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGHUP, _interrupt)
        try:
            while not self.restart_requested:
                if not self.runs and time.monotonic() - self.last_request > self.idle:
                    break
                for key, _ in self.sel.select(timeout=self._timeout()):
                    if key.data == "listen":
                        conn, _ = listener.accept()
                        self.accept(conn, listener)
                    elif key.data == "client":
                        self.client_event(key.fileobj)  # type: ignore[arg-type]
                    elif key.data == "report":
                        self.read_report(key.fd)
                    else:
                        self.finish(key.fd)
                self.escalate()
        except KeyboardInterrupt:
            pass
        finally:
            listener.close()
            self._unlink_if_mine()
            for fd in list(self.reports):  # a run still reporting gets EPIPE, never blocks
                os.close(fd)
            self.reports.clear()
            if not self.restart_requested:  # a new server may start while these runs end
                self.lock.close()
            for pidfd in list(self.runs):  # runs in flight end as they would have
                self.finish(pidfd)
        if self.restart_requested:  # an imported file changed: start again from fresh code
            # With the environment it started with, not the one its imports added to.
            os.execve(sys.executable, [sys.executable, "-c", _SERVE], self.env_before)

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
        code = os.waitstatus_to_exitcode(status)
        done = {"exit": 128 - code, "signal": -code} if code < 0 else {"exit": code}
        with contextlib.suppress(OSError), run.conn:
            _send(run.conn, done)
        self.last_request = time.monotonic()

    def read_report(self, fd: int) -> None:
        """What a run reports about its Hydra compositions: kept (up to
        ``served_compose.KEEP``, least recently used dropped) for the runs forked after."""
        try:
            data = os.read(fd, 1 << 20)
        except OSError:
            data = b""
        if data:
            self.reports[fd] += data
            return
        self.sel.unregister(fd)
        os.close(fd)
        from jaxaot.cli.served_compose import KEEP, read_reports

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
        process group, SIGKILL 10 s later if it is still there."""
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
            if run.killed_at is not None and now - run.killed_at > 10:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(run.pid, signal.SIGKILL)

    def _unlink_if_mine(self) -> None:
        with contextlib.suppress(OSError):
            pid_file = self.path.with_suffix(".pid")
            if pid_file.read_text().strip() == str(os.getpid()):  # not a newer server's
                self.path.unlink()
                pid_file.unlink()

    def accept(self, conn: socket.socket, listener: socket.socket) -> None:
        if peer_problem(*peer_credentials(conn)):  # the socket is 0600; and yet
            conn.close()
            return
        conn.settimeout(2)  # a client sends its request at once; never hold the server up
        try:
            req, fds = _recv(conn, maxfds=3 + MAX_FDS)
        except (OSError, ValueError):
            req, fds = None, []
        conn.settimeout(None)
        if req is None:  # nothing forked: the client may run in-process
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError), conn:
                _send(conn, {"declined": "incomplete request"})
            return
        if req.get("op") == "status":
            with conn:
                _send(
                    conn,
                    {
                        "pid": os.getpid(),
                        "started": self.started,
                        "served": self.served,
                        "declined": self.declined,
                        "running": len(self.runs),
                        "compositions": [len(self.composed), self.compositions_reused],
                        "python": sys.executable,
                    },
                )
            return
        if req.get("op") == "stop":
            with conn:
                _send(conn, {"stopping": os.getpid()})
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
                _send(conn, {"declined": reason or "no descriptors"})
            self.declined += 1
            if changed:
                self.restart_requested = True
            return
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
        pid = os.fork()
        if pid == 0:
            try:
                os.close(report)
                self.child(req, fds, listener, conn, report_w)
            finally:
                _exit_now(70)  # child() always exits; this is the line it cannot get past
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
            _send(conn, {"pid": pid})
        except OSError:  # the client is gone already
            run.killed_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            return
        self.sel.register(conn, selectors.EVENT_READ, "client")


def _finish_like_python(code: Any) -> int:
    """What the interpreter does after ``main`` returns or raises SystemExit, short of tearing
    down the (forked) interpreter: print a non-integer exit message, join non-daemon threads,
    run atexit handlers, flush; the exit status."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    import atexit
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# Modules a run imports on its way (lowering rules, store, snapshots, examples), measured with
# a sys.modules diff around a warm run of program=transformer_train.
_RUN_IMPORTS = (
    "hydra._internal.logging_config",
    "jax._src.checkify",
    "jax._src.pallas.core",
    "jax._src.pallas.mosaic.interpret.params",
    "jax.experimental.multihost_utils",
    "jax.extend",
    "jax.extend.backend",
    "jax.extend.core",
    "jax.extend.core.primitives",
    "jax.extend.linear_util",
    "jax.extend.mlir",
    "jax.extend.random",
    "jax.extend.sharding",
    "jax.extend.source_info_util",
    "jaxlib.mlir.dialects.mhlo",
    "jaxlib.mlir.dialects.builtin",
    "jaxaot.examples.axpy",
    "jaxaot.examples.collectives",
    "jaxaot.examples.mlp",
    "jaxaot.examples.transformer",
    "jaxaot.snapshots.snapshot",
    "jaxaot.store.cache",
    "jaxaot.store.maintenance",
    "jaxaot.sweeps.snapshot_check",
    "jaxaot.targets.cuda",
    "jaxaot.util.textdiff",
)


def _preimport() -> None:
    """What every run imports and warms up, short of starting a JAX backend: JAX, Hydra,
    jaxaot and its stages, Hydra's plugins, one composition (Hydra's first costs ~0.3 s more
    than later ones: lazy imports, plugin discovery, OmegaConf's grammar) and one trace."""
    import importlib

    import jax
    import jax.numpy as jnp
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins

    for name in (
        "jax.export",
        "jax.experimental.serialize_executable",
        "jax.experimental.shard_map",
        "jaxaot.cli.main",
        "jaxaot.engine.runner",
        "jaxaot.engine.summary",
        "jaxaot.sweeps.callbacks",
        "jaxaot.stages.stage_out",
        "jaxaot.stages.lower",
        "jaxaot.stages.compile",
        "jaxaot.stages.execute",
        "jaxaot.stages.inputs",
    ):
        importlib.import_module(name)
    for name in _RUN_IMPORTS:  # what a run imports as it goes (~80 ms): optional, none starts
        with contextlib.suppress(Exception):  # a backend (checked below)
            importlib.import_module(name)
    from jaxaot.api import compose

    Plugins.instance()  # discovers Hydra's plugins (search path, launchers, sweepers) once
    compose(["program=axpy"])
    GlobalHydra.instance().clear()  # each run initializes its own
    spec = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    jax.jit(lambda x: jnp.tanh(x @ x).sum()).trace(spec)  # tracing starts no backend
    from jax._src import xla_bridge

    if getattr(xla_bridge, "_backends", None):  # forked children must start their own
        raise RuntimeError("jaxaot server: a JAX backend started while warming up")


def serve_forever() -> None:
    """The server process, started by :func:`start` (detached, logging next to its socket)."""
    import fcntl
    import warnings

    path = socket_path()
    try:
        check_folder(path.parent, create=True)
    except UnsafeSocketError as exc:
        print(f"jaxaot: error: {exc}", file=sys.stderr)  # to the log: `start` said it first
        sys.exit(2)
    lock = path.with_suffix(".lock").open("a")
    try:  # one server per socket: a second one (two `JAXAOT_SERVER=1` runs at once) leaves
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    env_before = dict(os.environ)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("default")  # what an in-process run shows, once each
        _preimport()
    import gc

    # What the imports made stays put: children's collections skip it, and fewer of its pages
    # are copied into each child (CPython's gc.freeze, meant for exactly this).
    gc.collect()
    gc.freeze()
    _Server(path, env_before, list(warned), lock).serve()


# -------------------------------------------------------------------------------- commands


def _ask(op: str, quiet: bool = False) -> dict[str, Any] | None:
    sock = _connect(quiet)
    if sock is None:
        return None
    with sock:
        try:
            _send(sock, {"v": PROTOCOL, "op": op})
            return _recv(sock)[0]
        except (OSError, ValueError):
            return None


def _spawn() -> subprocess.Popen[bytes]:
    """Start a server in the background; UnsafeSocketError when its folder is not the user's
    alone (nothing started)."""
    path = socket_path()
    check_folder(path.parent, create=True)
    env = {k: v for k, v in os.environ.items() if k != CHILD_MARK}
    env[OVERRIDE] = str(path)  # absolute: the server runs in /, and finds what clients find
    with path.with_suffix(".log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd="/",  # no user folder on its sys.path, none kept busy
            start_new_session=True,
        )


def start(wait: float = 120.0) -> int:
    path = socket_path()
    check_folder(path.parent, create=True)  # UnsafeSocketError: one line (command)
    if (info := _ask("status")) is not None:
        print(f"jaxaot server: already running (pid {info['pid']}, {path})")
        return 0
    if len(os.fsencode(path.with_name(f".{path.name}.{2**22}"))) > 107:  # sun_path's 108 bytes
        print(
            f"jaxaot: error: server socket path {str(path)!r} is too long for a Unix socket "
            "(at most ~95 bytes); set JAXAOT_SERVER_SOCKET to a shorter path",
            file=sys.stderr,
        )
        return 2
    proc = _spawn()
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if (info := _ask("status")) is not None:
            print(f"jaxaot server: started (pid {info['pid']}, {path})")
            return 0
        if proc.poll() is not None:
            print(
                f"jaxaot: error: the server exited with status {proc.returncode}; see "
                f"{path.with_suffix('.log')}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
    print(
        f"jaxaot: error: the server did not start within {wait:.0f} s; see "
        f"{path.with_suffix('.log')}",
        file=sys.stderr,
    )
    return 1


def stop() -> int:
    reply = _ask("stop")
    if reply is None:
        print(f"jaxaot server: not running ({socket_path()})")
        return 0
    pid = int(reply["stopping"])
    for _ in range(400):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.025)
    print(f"jaxaot server: stopped (pid {pid})")
    return 0


def status() -> int:
    info = _ask("status")
    if info is None:
        print(f"jaxaot server: not running ({socket_path()})")
        return 3
    up = time.time() - float(info["started"])
    print(
        f"jaxaot server: running (pid {info['pid']}, {socket_path()}, up {up:.0f} s, "
        f"{info['running']} running, {info['declined']} declined, {info['served']} runs served, "
        f"{info['compositions'][1]} compositions reused)"
    )
    return 0


def usage() -> str:
    """``jaxaot server --help``: what each subcommand does, where the socket is, how runs use it."""
    return f"""usage: jaxaot server {{start,stop,status,restart}}

A resident process with Python, JAX, Hydra and jaxaot imported once: while it runs, each
`jaxaot ...` of yours (same Python environment) is run by a fresh child of it, without
those imports. Output, exit status, Ctrl-C and the run's folder are as without it.

  start    start the server (nothing to do when it runs already)
  stop     stop it
  status   pid, socket, uptime and runs served; exit status 3 when it is not running
  restart  stop, then start

socket: {socket_path()}
  one per user and Python environment; JAXAOT_SERVER_SOCKET names another; its log is
  beside it (.log)
A run the server cannot serve exactly (another JAX/XLA environment variable, another
checkout or venv, a run started from a served run) runs in-process, as with no server;
a changed source file restarts it. JAXAOT_SERVER=0: a run does not use it;
JAXAOT_SERVER=1: a run starts one for the runs after it. It exits after
JAXAOT_SERVER_IDLE seconds without a request (default {IDLE_SECONDS // 3600} hours)."""


def command(args: list[str]) -> int:
    """``jaxaot server start|stop|status|restart``; ``--help``/``-h``: :func:`usage`, status 0;
    nothing: the usage and one error line, status 2. A socket folder that is not the user's
    alone, or one that cannot be made, is one line and status 2."""
    if any(a in ("-h", "--help") for a in args):
        from jaxaot.util.console import quiet_broken_pipe

        with quiet_broken_pipe():  # `jaxaot server --help | head`
            print(usage())
        return 0
    if not args:
        print(usage(), file=sys.stderr)
        print(
            "jaxaot: error: jaxaot server: expected start, stop, status or restart",
            file=sys.stderr,
        )
        return 2
    verb = args[0] if len(args) == 1 else " ".join(args)
    verbs = {"start": start, "stop": stop, "status": status}
    if verb in verbs or verb == "restart":
        try:
            with contextlib.suppress(FileNotFoundError):  # no folder: no server
                check_folder(socket_path().parent, create=False)
            if verb == "restart":
                stop()
                return start()
            return verbs[verb]()
        except OSError as exc:  # UnsafeSocketError, or the log or socket cannot be made
            print(f"jaxaot: error: jaxaot server {verb}: {exc}", file=sys.stderr)
            return 2
    print(
        f"jaxaot: error: jaxaot server: expected start, stop, status or restart; found {verb!r}",
        file=sys.stderr,
    )
    return 2


def try_server(argv: list[str]) -> None:
    """Handle ``jaxaot server ...``, or run ``jaxaot argv`` through a running server and exit
    with its status; return (having done nothing) when the run belongs in this process."""
    if argv[:1] == ["server"]:
        sys.exit(command(argv[1:]))
    if not wanted():
        return
    code = run_via_server(argv)
    if code is not None:
        sys.exit(code)
    if os.environ.get("JAXAOT_SERVER") == "1" and _ask("status", quiet=True) is None:
        with contextlib.suppress(OSError):
            _spawn()  # serves the next run; this one runs in-process, as it would have


def entry() -> None:
    """The ``jaxaot`` command: through the server when one is running, else in-process."""
    try_server(sys.argv[1:])
    from jaxaot.cli.main import main

    main()


__all__ = ["CHILD_MARK", "command", "entry", "run_via_server", "serve_forever", "socket_path"]
