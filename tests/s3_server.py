"""An S3-compatible server on loopback for the bucket store's tests: moto's server mode
(``moto[server]``, the ``testing`` extra), one per test module, and the environment a
``jaxaot`` process needs to reach it (endpoint, fake credentials, region)."""

from __future__ import annotations

import functools
import logging
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    """A running moto server; :meth:`bucket` makes a fresh bucket and returns its store URL."""

    server: object
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What boto/s3fs read: the endpoint and credentials moto accepts."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        }

    @functools.cached_property
    def _client(self) -> object:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def client(self) -> object:
        """A boto3 client of this server (one, made on first use)."""
        return self._client

    def bucket(self, prefix: str = "team/store") -> str:
        name = f"jaxaot-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return f"s3://{name}/{prefix}"


def start_s3_server() -> S3Server:
    """moto's server on 127.0.0.1 and a free port (stop it with ``.server.stop()``)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return S3Server(server, port)


def running_s3_server() -> Iterator[S3Server]:
    """A module-scoped fixture's body: the server for the module, stopped at its end."""
    server = start_s3_server()
    try:
        yield server
    finally:
        server.server.stop()  # type: ignore[attr-defined]
