"""A real S3 endpoint for tests: moto's threaded server on 127.0.0.1, restartable on the same port.

Moto keeps buckets and objects in process-wide backends, so data survives a stop/start; that is
what lets tests simulate a storage outage. Imports moto lazily: the library never needs it.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid

logger = logging.getLogger(__name__)

TEST_KEY = "testing"
# Distinctive, so a test can assert it never shows up in messages or events.
TEST_SECRET = "elastic-TEST-SECRET-do-not-leak-0123"


START_TIMEOUT_S = 30.0


def _check_free(port: int) -> None:
    """Raise a clear OSError if 127.0.0.1:``port`` cannot be bound (a restart on the same port)."""
    probe = socket.socket()
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug's server binds
        probe.bind(("127.0.0.1", port))
    except OSError as exc:
        raise OSError(exc.errno, f"moto's S3 server cannot start again on 127.0.0.1:{port}: {exc.strerror}") from exc
    finally:
        probe.close()


class MotoS3:
    """``start()``, ``stop()`` (an outage), ``start()`` again on the same port; ``storage_options()`` for s3fs."""

    def __init__(self) -> None:
        self.port = 0
        self._server = None

    def start(self) -> "MotoS3":
        from moto.server import ThreadedMotoServer

        # werkzeug logs every request at INFO; keep test output readable.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        if self.port:
            _check_free(self.port)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        # Bounded: moto's start() waits with no timeout for its server thread to bind, and that
        # thread dies on a bind error without a word, so a restart on a port taken meanwhile
        # (another process's port-0 bind during the outage) hung the test until pytest's timeout.
        starter = threading.Thread(target=server.start, name="moto-start", daemon=True)
        starter.start()
        starter.join(START_TIMEOUT_S)
        if starter.is_alive():
            raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{self.port} within {START_TIMEOUT_S:g} s")
        self.port = server.get_host_and_port()[1]
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, secret: str = TEST_SECRET) -> dict:
        """s3fs options: a single botocore attempt and short timeouts, so an outage shows up in
        milliseconds and the retries under test are ours, not botocore's."""
        return {
            "key": TEST_KEY,
            "secret": secret,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}, "connect_timeout": 2,
                              "read_timeout": 5},
        }

    def create_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"bkt-{uuid.uuid4().hex[:12]}"
        client = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=TEST_KEY,
                              aws_secret_access_key=TEST_SECRET, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return name


BACKENDS = ("file", "path", "memory", "s3")


def backend_url(kind: str, tmp_dir: str, moto: "MotoS3 | None" = None) -> tuple[str, dict]:
    """``(url, storage_options)`` for a fresh, empty location of one backend kind.

    file: ``file://`` URL under tmp_dir; path: a plain path; memory: a unique ``memory://`` root;
    s3: a new bucket on the moto server.
    """
    if kind == "file":
        return f"file://{tmp_dir}/ckpt", {}
    if kind == "path":
        return f"{tmp_dir}/plain-ckpt", {}
    if kind == "memory":
        return f"memory://elastic-test-{uuid.uuid4().hex}", {}
    if kind == "s3":
        if moto is None:
            raise ValueError("the s3 backend needs a running MotoS3")
        return f"s3://{moto.create_bucket()}/prefix", moto.storage_options()
    raise ValueError(f"unknown backend kind {kind!r}")


def clear_memory(url: str) -> None:
    """Drop what a test left in the process-wide memory:// filesystem."""
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)
