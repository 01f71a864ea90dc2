"""A resident ``jaxaot`` server: Python, JAX and Hydra imported once, a fresh child per run.

A warm ``jaxaot`` run spends most of its time starting up: importing JAX, Hydra and the
pipeline costs more than loading the executable and running it (issue 19). ``jaxaot server
start`` keeps one process with those imports done (no JAX backend started: that happens per
run); every later ``jaxaot ...`` sends its argv, cwd, environment and its stdin/stdout/stderr
(the file descriptors themselves, SCM_RIGHTS) over a per-user Unix socket, and the server
forks a child that runs exactly what ``jaxaot`` would have run in-process. Each run still gets
its own backend, device count and JAX config, output goes straight to the client's terminal
or pipes, Ctrl-C and SIGTERM are forwarded to the child, and the client exits with the
child's status. (Prior art: Bazel's client/server, mypy's dmypy, Nailgun.)

The server never serves a run it could get wrong; the client then runs in-process, as if
there were no server:
- an environment variable that JAX, XLA or Python read at import differs from the server's;
- the client's ``sys.path`` would import another copy of a pre-imported package;
- a file of any module the server imported changed since it started (the server then
  re-executes itself, so the next run is served by fresh code).

This module imports only the standard library: the client side must cost milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The real os._exit, taken before anything can wrap it (a run guards os._exit while user code
# runs, pipeline.exits): a forked child must end here, whatever happened, and never return
# into the server's accept loop (it would become a second server on the same socket).
_exit_now = os._exit

PROTOCOL = 1
# Packages imported in the server, whose origin a client's sys.path must agree with.
_PREIMPORT = ("jax", "jax.numpy", "numpy", "hydra", "omegaconf", "pipeline", "stages")
# Variables read at import time (JAX's config defaults, XLA/TF logging, BLAS threads, Python's own): a run
# whose values differ cannot use the server's imports.
_IMPORT_ENV = re.compile(
    r"^(JAX_|XLA_|TF_|TPU_|LIBTPU|PJRT_|CUDA_|NVIDIA_|PYTHON|LD_|MALLOC|OMP_|OPENBLAS_|MKL_|GOTO)"
)
_HEADER = struct.Struct("!I")


def socket_path() -> Path:
    """``$XDG_RUNTIME_DIR/jaxaot/server.sock``, else ``/tmp/jaxaot-$UID/server.sock``."""
    override = os.environ.get("JAXAOT_SERVER_SOCKET")
    if override:
        return Path(override)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "jaxaot" if runtime else Path(f"/tmp/jaxaot-{os.getuid()}")
    return base / "server.sock"


def _private_dir(path: Path) -> None:
    """Create ``path`` owner-only, and refuse one that another user owns or can write."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is not owned by you alone; remove it")


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if _IMPORT_ENV.match(k)}


def _send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    first, fds, _, _ = socket.recv_fds(sock, 65536, maxfds) if maxfds else (
        sock.recv(65536), [], 0, None)  # fmt: skip
    if len(first) < _HEADER.size:
        return None, fds
    (size,) = _HEADER.unpack_from(first)
    data = first[_HEADER.size :]
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data[:size]), fds


# ---------------------------------------------------------------------------------- client


def _connect() -> socket.socket | None:
    path = socket_path()
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or not stat.S_ISSOCK(st.st_mode):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def wanted() -> bool:
    """Whether this ``jaxaot`` should try the server: ``JAXAOT_SERVER=0`` turns it off;
    ``JAXAOT_SERVER=1`` also starts one when none runs (for the runs after this one)."""
    return os.environ.get("JAXAOT_SERVER", "") not in ("0", "false", "no")


def run_via_server(argv: list[str], as_main: bool = False) -> int | None:
    """Run ``jaxaot argv`` in a child of the server; its exit status, or None when there is
    no server or it declined (then the caller runs in-process, nothing having happened)."""
    sock = _connect()
    if sock is None:
        return None
    with sock:
        request = {"v": PROTOCOL, "argv": argv, "argv0": sys.argv[0], "as_main": as_main,
                   "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path,
                   "isatty": [os.isatty(fd) for fd in (0, 1, 2)]}  # fmt: skip
        try:
            _send(sock, request, [0, 1, 2])
            reply, _ = _recv(sock)
        except OSError:
            return None
        if reply is None or "pid" not in reply:
            return None  # declined (stale code, another environment): run in-process
        pid = int(reply["pid"])

        def forward(signum: int, _frame: Any) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, forward)
        while True:
            try:
                done, _ = _recv(sock)
                break
            except InterruptedError:
                continue
        if done is None or "exit" not in done:
            print("jaxaot: error: the jaxaot server went away during the run", file=sys.stderr)
            return 1
        return int(done["exit"])


# ---------------------------------------------------------------------------------- server


class _Server:
    def __init__(self, path: Path, env_before: dict[str, str], warned: list[Any]) -> None:
        self.path = path
        self.warned = warned  # warnings the warm-up raised: an in-process run prints them too
        self.env_before = env_before
        self.env = _import_env(env_before)
        # What the imports themselves set (JAX and jaxaot quiet C++ logging this way): an
        # in-process run has them too, so every child gets them on top of its client's.
        self.added = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        self.origins = {name: getattr(sys.modules.get(name), "__file__", None)
                        for name in _PREIMPORT}  # fmt: skip
        self.files = self._module_files()
        self.started = time.time()
        self.served = 0

    @staticmethod
    def _module_files() -> dict[str, int]:
        out: dict[str, int] = {}
        for mod in list(sys.modules.values()):
            f = getattr(mod, "__file__", None)
            if f and f not in out:
                with contextlib.suppress(OSError):
                    out[f] = os.stat(f).st_mtime_ns
        return out

    def stale(self) -> str | None:
        for f, mtime in self.files.items():
            try:
                if os.stat(f).st_mtime_ns != mtime:
                    return f
            except OSError:
                return f
        return None

    def declines(self, req: dict[str, Any]) -> str | None:
        """Why this request cannot be served by this server's imports, or None."""
        if req.get("v") != PROTOCOL:
            return "protocol"
        theirs = _import_env(req["env"])
        if theirs != self.env:
            keys = sorted(
                k for k in theirs.keys() | self.env.keys() if theirs.get(k) != self.env.get(k)
            )
            return f"environment ({', '.join(keys)})"
        import importlib.machinery

        for name, origin in self.origins.items():
            if "." in name or origin is None:
                continue
            spec = importlib.machinery.PathFinder.find_spec(name, req["path"])
            if spec is None or spec.origin != origin:
                return f"sys.path ({name})"
        return None

    def child(self, req: dict[str, Any], fds: list[int], listener: socket.socket,
              conn: socket.socket) -> None:  # fmt: skip
        """In the forked child: become the client's ``jaxaot`` process and run it."""
        code = 1
        try:
            listener.close()
            conn.close()
            os.setsid()  # signals reach it from the client only, not from the server's session
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update({**req["env"], **self.added})
            sys.path[:] = req["path"]
            sys.argv = [req.get("argv0") or "jaxaot", *req["argv"]]
            tty = req.get("isatty", [False] * 3)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", buffering=1 if tty[1] else -1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            import warnings

            for w in self.warned:  # e.g. Hydra's "Error importing plugin ...", as in-process
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            global _IN_CHILD
            _IN_CHILD = True
            try:
                if req.get("as_main"):  # `python -m pipeline.cli`: Hydra sees a __main__ app
                    import runpy

                    sys.modules.pop("pipeline.cli", None)  # as in `python -m`: not imported yet
                    runpy.run_module("pipeline.cli", run_name="__main__", alter_sys=True)
                else:
                    from pipeline.cli import main

                    main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 2
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
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
        listener.listen(16)
        os.replace(tmp, self.path)  # atomically the socket clients connect to
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, client)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while not self.restart_requested:
                for key, _ in sel.select():
                    if key.data is None:
                        conn, _ = listener.accept()
                        self.accept(conn, listener, sel, running)
                    else:
                        sel.unregister(key.fd)
                        self.finish(key.fd, running)
        except KeyboardInterrupt:
            pass
        finally:
            listener.close()
            self._unlink_if_mine()
            for pidfd in list(running):  # runs in flight end as they would have
                self.finish(pidfd, running)
        if self.restart_requested:  # some imported file changed: start again from fresh code
            # With the environment it started with, not the one its imports added to.
            argv = [sys.executable, "-m", "pipeline.server", "--serve"]
            os.execve(sys.executable, argv, self.env_before)

    @staticmethod
    def finish(pidfd: int, running: dict[int, tuple[int, socket.socket]]) -> None:
        """Reap a child and send its exit status (128 + signal when killed) to its client."""
        pid, conn = running.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError), conn:
            _send(conn, {"exit": 128 - code if code < 0 else code})

    restart_requested = False

    def _unlink_if_mine(self) -> None:
        with contextlib.suppress(OSError):
            pid_file = self.path.with_suffix(".pid")
            if pid_file.read_text().strip() == str(os.getpid()):  # not a newer server's
                self.path.unlink()
                pid_file.unlink()

    def accept(self, conn: socket.socket, listener: socket.socket,
               sel: selectors.BaseSelector, running: dict[int, tuple[int, socket.socket]]) -> None:  # fmt: skip
        try:
            req, fds = _recv(conn, maxfds=3)
        except (OSError, ValueError):
            conn.close()
            return
        if req is None:
            conn.close()
            return
        if req.get("op") == "status":
            with conn:
                _send(conn, {"pid": os.getpid(), "started": self.started, "served": self.served,
                             "python": sys.executable})  # fmt: skip
            return
        if req.get("op") == "stop":
            with conn:
                _send(conn, {"stopping": os.getpid()})
            raise KeyboardInterrupt
        changed = self.stale()
        reason = f"changed: {changed}" if changed else self.declines(req)
        if reason or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            with conn:
                _send(conn, {"declined": reason or "no descriptors"})
            if changed:
                self.restart_requested = True
            return
        pid = os.fork()
        if pid == 0:
            try:
                self.child(req, fds, listener, conn)
            finally:
                _exit_now(70)  # child() always exits; this is the line it cannot get past
        for fd in fds:
            os.close(fd)
        self.served += 1
        try:
            _send(conn, {"pid": pid})
        except OSError:
            os.kill(pid, signal.SIGTERM)
        pidfd = os.pidfd_open(pid)
        running[pidfd] = (pid, conn)
        sel.register(pidfd, selectors.EVENT_READ, pid)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _preimport() -> None:
    """What every run imports and warms up, short of starting a JAX backend: JAX, Hydra, the
    pipeline and its stages, one composition (Hydra's first costs ~0.5 s more than later
    ones: lazy imports, plugin discovery, OmegaConf's grammar) and one trace."""
    import importlib

    import jax
    import jax.numpy as jnp
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins

    import pipeline

    for name in ("jax.export", "jax.experimental.serialize_executable", "jax.extend",
                 "jax.experimental.shard_map", "pipeline.cli", "pipeline.runner",
                 "pipeline.summary", "pipeline.callbacks", "stages.stage_out", "stages.lower",
                 "stages.compile", "stages.execute", "stages.inputs"):  # fmt: skip
        importlib.import_module(name)
    Plugins.instance()  # discovers Hydra's plugins (search path, launchers, sweepers) once
    pipeline.compose(["program=axpy"])
    GlobalHydra.instance().clear()  # each run initializes its own
    spec = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    jax.jit(lambda x: jnp.tanh(x @ x).sum()).trace(spec)  # tracing starts no backend
    from jax._src import xla_bridge

    if getattr(xla_bridge, "_backends", None):  # forked children must start their own
        raise RuntimeError("jaxaot server: a JAX backend started while warming up")


def serve_forever() -> None:
    """The server process: daemonized by :func:`start`, or run in the foreground (tests)."""
    import fcntl

    path = socket_path()
    _private_dir(path.parent)
    lock = path.with_suffix(".lock").open("a")
    try:  # one server per socket: a second one (two `JAXAOT_SERVER=1` runs at once) leaves
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    env_before = dict(os.environ)
    import warnings

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("default")  # what an in-process run shows, once each
        _preimport()
    path.with_suffix(".pid").write_text(f"{os.getpid()}\n")
    _Server(path, env_before, list(warned)).serve()


# -------------------------------------------------------------------------------- commands


def _ask(op: str) -> dict[str, Any] | None:
    sock = _connect()
    if sock is None:
        return None
    with sock:
        try:
            _send(sock, {"v": PROTOCOL, "op": op})
            return _recv(sock)[0]
        except OSError:
            return None


def _spawn() -> subprocess.Popen[bytes]:
    path = socket_path()
    _private_dir(path.parent)
    with path.with_suffix(".log").open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "pipeline.server", "--serve"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)  # fmt: skip


def start(wait: float = 60.0) -> int:
    if (info := _ask("status")) is not None:
        print(f"jaxaot server: already running (pid {info['pid']}, {socket_path()})")
        return 0
    path = socket_path()
    proc = _spawn()
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if (info := _ask("status")) is not None:
            print(f"jaxaot server: started (pid {info['pid']}, {path})")
            return 0
        if proc.poll() is not None:
            print(f"jaxaot: error: the server exited with status {proc.returncode}; see "
                  f"{path.with_suffix('.log')}", file=sys.stderr)  # fmt: skip
            return 1
        time.sleep(0.05)
    print(f"jaxaot: error: the server did not start within {wait:.0f} s; see "
          f"{path.with_suffix('.log')}", file=sys.stderr)  # fmt: skip
    return 1


def stop() -> int:
    reply = _ask("stop")
    if reply is None:
        print("jaxaot server: not running")
        return 0
    pid = int(reply["stopping"])
    for _ in range(200):
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
    print(f"jaxaot server: running (pid {info['pid']}, {socket_path()}, up {up:.0f} s, "
          f"{info['served']} runs served)")  # fmt: skip
    return 0


def command(args: list[str]) -> int:
    """``jaxaot server start|stop|status|restart``."""
    verb = args[0] if args else ""
    if verb == "start":
        return start()
    if verb == "stop":
        return stop()
    if verb == "status":
        return status()
    if verb == "restart":
        stop()
        return start()
    print(f"jaxaot: error: jaxaot server: expected start, stop, status or restart; found "
          f"{verb!r}", file=sys.stderr)  # fmt: skip
    return 2


_IN_CHILD = False  # set in a forked child: its `jaxaot` runs here, never through a server


def try_server(argv: list[str], as_main: bool = False) -> None:
    """Handle ``jaxaot server ...``, or run ``jaxaot argv`` through a running server and exit
    with its status; return (having done nothing) when the run belongs in this process."""
    if _IN_CHILD:
        return
    if argv[:1] == ["server"]:
        sys.exit(command(argv[1:]))
    if wanted():
        code = run_via_server(argv, as_main)
        if code is not None:
            sys.exit(code)
        if os.environ.get("JAXAOT_SERVER") == "1" and not socket_path().exists():
            with contextlib.suppress(OSError):
                _spawn()  # serves the next run; this one runs in-process, as it would have


def entry() -> None:
    """The ``jaxaot`` console script: the server when one is running, else in-process."""
    try_server(sys.argv[1:])
    from pipeline.cli import main

    main()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve_forever()
    else:
        entry()


__all__ = ["command", "entry", "run_via_server", "serve_forever", "socket_path", "wanted"]
