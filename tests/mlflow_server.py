"""A real ``mlflow server`` on loopback for the tracking tests: a sqlite backend and an artifact
folder in a temporary directory, a free port, started once per test module, stopped (its whole
process group) at the end. Needs the [testing] extra (the full mlflow: its server and SQL store)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import extra_reason


@dataclass(frozen=True)
class MlflowServer:
    uri: str  # http://127.0.0.1:<port>
    root: Path  # the backend database and the artifacts are under it
    log: Path  # the server's stdout and stderr

    def client(self):  # type: ignore[no-untyped-def]
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def start_server(
    root: Path, timeout_s: float = 120.0
) -> tuple[MlflowServer, subprocess.Popen[bytes]]:
    """``mlflow server`` with its database and artifacts under ``root``, once it answers."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = MlflowServer(uri=uri, root=root, log=log)
    deadline = time.monotonic() + timeout_s
    while not _healthy(uri):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"mlflow server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return server, proc


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """End the server's process group (the mlflow command and its uvicorn worker)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # a worker left behind by the command
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One ``mlflow server`` for the test module."""
    pytest.importorskip("mlflow.server", reason=extra_reason("testing"))
    server, proc = start_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        stop_server(proc)


__all__ = ["MlflowServer", "free_port", "mlflow_server", "start_server", "stop_server"]
