"""A Google Cloud Storage emulator on loopback for the bucket store's gs:// tests:
``gcp-storage-emulator`` (the ``testing`` extra) in this process, in memory, one per test
module, and the environment a ``jaxaot`` process needs to reach it. gcsfs finds the emulator
through ``STORAGE_EMULATOR_HOST`` and falls back to anonymous credentials (``NO_GCE_CHECK``
spares it the metadata-server probe). The emulator speaks only the JSON API: gcsfs's gRPC
bucket-type probe (on unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, read when gcsfs is
imported) would wait a minute for an answer, so the environment turns it off, and
:func:`plain_gcsfs` makes an already-imported gcsfs use its plain filesystem.

The emulator ignores preconditions (``ifGenerationMatch=0``): a create over an existing object
overwrites it; :meth:`GcsServer.honours_preconditions` says which."""

from __future__ import annotations

import functools
import logging
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from s3_server import free_port


@dataclass
class GcsServer:
    """A running emulator; :meth:`bucket` makes a fresh bucket and returns its store URL."""

    server: object
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What gcsfs and google-auth read: the endpoint, no metadata server, no gRPC probe."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "NO_GCE_CHECK": "true",
            "GOOGLE_APPLICATION_CREDENTIALS": "",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    @functools.cached_property
    def fs(self) -> object:
        """An anonymous gcsfs filesystem of this server (for the tests' own reads and writes)."""
        import gcsfs.core

        return gcsfs.core.GCSFileSystem(
            token="anon", endpoint_url=self.endpoint, skip_instance_cache=True
        )

    def bucket(self, prefix: str = "team/store") -> str:
        name = f"jaxaot-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(name)  # type: ignore[attr-defined]
        return f"gs://{name}/{prefix}"

    def honours_preconditions(self) -> bool:
        """Whether a create (``ifGenerationMatch=0``) over an existing object is refused."""
        name = f"jaxaot-probe-{uuid.uuid4().hex[:8]}"
        self.fs.mkdir(name)  # type: ignore[attr-defined]
        self.fs.pipe_file(f"{name}/x", b"1", mode="create")  # type: ignore[attr-defined]
        try:
            self.fs.pipe_file(f"{name}/x", b"2", mode="create")  # type: ignore[attr-defined]
        except FileExistsError:
            return True
        return False


def start_gcs_server() -> GcsServer:
    """The emulator on 127.0.0.1 and a free port, in memory (stop it with ``.server.stop()``)."""
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)  # a line per request
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    return GcsServer(server, port)


def running_gcs_server() -> Iterator[GcsServer]:
    """A module-scoped fixture's body: the server for the module, stopped at its end."""
    server = start_gcs_server()
    try:
        yield server
    finally:
        server.server.stop()  # type: ignore[attr-defined]


def plain_gcsfs(monkeypatch: pytest.MonkeyPatch, server: GcsServer) -> None:
    """This process reaches ``server`` through gcsfs's plain (JSON API) filesystem: the
    server's environment, and fsspec's ``gcs`` protocol bound to ``gcsfs.core.GCSFileSystem``
    even where gcsfs was imported before with its gRPC-probing default."""
    import gcsfs.core

    registry = sys.modules["fsspec.registry"]._registry  # fsspec.registry is its read-only view
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    for protocol in ("gcs", "gs"):
        monkeypatch.setitem(registry, protocol, gcsfs.core.GCSFileSystem)
