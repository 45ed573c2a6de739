"""Real object-store servers on loopback for the tests, and a TCP proxy that breaks connections.

- S3: moto's server (``moto[server]``), ``python -m moto.server``.
- GCS: ``gcp-storage-emulator`` (pure Python, from PyPI).
- Azure Blob: Azurite (``npm install azurite``), found on PATH, in ``$ZEPHON_AZURITE`` or under
  ``.ci/node/node_modules/.bin`` of this repository.

Each server is started on 127.0.0.1 with a free port, probed until it answers, and stopped at the end
of the session. A server that cannot start fails the tests that need it, with the reason and the
install line: object-store support is not optional in CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
INSTALL = {
    "moto": "pip install 'moto[server]' s3fs",
    "gcs": "pip install gcp-storage-emulator gcsfs",
    "azurite": "npm install --prefix .ci/node azurite  (or npm install -g azurite), and pip install adlfs",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(module: str, what: str) -> None:
    """Fail (not skip) when a client library the object-store tests need is missing."""
    try:
        __import__(module)
    except ImportError as exc:
        pytest.fail(f"{module} is not installed ({exc}); the object-store tests need it: {INSTALL[what]}",
                    pytrace=False)


class Server:
    """A server subprocess on 127.0.0.1:port, with its log kept for failure messages."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, ready: Callable[[int], bool],
                 timeout: float = 60.0, env: dict | None = None) -> None:
        self.name, self.port, self.log = name, port, log
        self._log_file = open(log, "wb")
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        except OSError as exc:
            pytest.fail(f"{name}: cannot start {argv[0]} ({exc})", pytrace=False)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"{name} exited with code {self.proc.returncode} while starting; its log:\n"
                            f"{self.tail()}", pytrace=False)
            if ready(port):
                return
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{name} did not answer on 127.0.0.1:{port} within {timeout:.0f}s; its log:\n"
                            f"{self.tail()}", pytrace=False)
            time.sleep(0.1)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()


def _http_ready(path: str = "/") -> Callable[[int], bool]:
    def ready(port: int) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1).close()
            return True
        except urllib.error.HTTPError:  # any HTTP answer means the server is up
            return True
        except OSError:
            return False
    return ready


@dataclass
class Store:
    """One running store: how a recipe points at it, and a client to upload with."""

    name: str  # s3, gcs, azure
    scheme: str  # URL scheme used in recipes
    bucket: str
    storage_options: dict[str, Any]
    fs: Any  # an fsspec filesystem (uploads, fault set-up)
    port: int
    env: dict[str, str] = field(default_factory=dict)

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def upload_dir(self, local: Path, prefix: str) -> None:
        for f in sorted(local.rglob("*")):
            if f.is_file():
                self.fs.pipe_file(f"{self.bucket}/{prefix}/{f.relative_to(local).as_posix()}", f.read_bytes())
        self.fs.invalidate_cache()

    def put_bytes(self, key: str, data: bytes) -> str:
        self.fs.pipe_file(f"{self.bucket}/{key}", data)
        self.fs.invalidate_cache()
        return self.url(key)


def start_moto(tmp: Path) -> tuple[Server, Store]:
    require("moto", "moto")
    require("s3fs", "moto")
    require("flask", "moto")
    port = free_port()
    server = Server("moto S3 server", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    port, tmp / "moto.log", _http_ready("/moto-api/"))
    import s3fs

    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    fs.mkdir("zephon")
    return server, Store("s3", "s3", "zephon", opts, fs, port)


def start_gcs(tmp: Path) -> tuple[Server, Store]:
    require("gcsfs", "gcs")
    require("gcp_storage_emulator", "gcs")
    port = free_port()
    server = Server("gcp-storage-emulator", [sys.executable, "-m", "gcp_storage_emulator", "start", "--host",
                                             "127.0.0.1", "--port", str(port), "--in-memory",
                                             "--default-bucket", "zephon"],
                    port, tmp / "gcs.log", _http_ready("/"))
    from gcsfs.core import GCSFileSystem

    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon", "project": "zephon-test"}
    fs = GCSFileSystem(**opts, skip_instance_cache=True)
    return server, Store("gcs", "gs", "zephon", opts, fs, port)


def azurite_binary() -> str | None:
    for candidate in (os.environ.get("ZEPHON_AZURITE"), shutil.which("azurite-blob"),
                      str(REPO / ".ci" / "node" / "node_modules" / ".bin" / "azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def azurite_connection_string(port: int, key: str = AZURITE_KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={key};"
            f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;")


def start_azurite(tmp: Path) -> tuple[Server, Store]:
    require("adlfs", "azurite")
    binary = azurite_binary()
    if binary is None:
        pytest.fail(f"Azurite (azurite-blob) was not found on PATH, in $ZEPHON_AZURITE or in .ci/node: "
                    f"{INSTALL['azurite']}", pytrace=False)
    port = free_port()
    data = tmp / "azurite"
    data.mkdir()
    server = Server("Azurite", [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data),
                                "--silent", "--skipApiVersionCheck", "--loose"],
                    port, tmp / "azurite.log", _http_ready("/devstoreaccount1?comp=list"))
    import adlfs

    opts = {"connection_string": azurite_connection_string(port)}
    fs = adlfs.AzureBlobFileSystem(**opts, skip_instance_cache=True)
    fs.mkdir("zephon")
    return server, Store("azure", "az", "zephon", opts, fs, port)


STARTERS = {"s3": start_moto, "gcs": start_gcs, "azure": start_azurite}


# -- fault injection -----------------------------------------------------------------------------------
class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port`` that breaks connections mid-response.

    It forwards bytes both ways and counts the bytes sent back to clients (``bytes_down``) and the HTTP
    requests sent up (``requests``). With ``break_every=N``, the connection carrying request number
    ``N, 2N, 3N, ...`` (counted over all connections: deterministic for a serial request stream) is cut
    after a few hundred to a few thousand bytes of the response (in the status line, the headers or the
    body): the client has received part of a response. Cuts alternate between a reset (RST) and a plain
    close (FIN), and are counted in ``cuts``. ``refuse=True`` resets every new connection at once.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.bytes_down = 0
        self.requests = 0
        self.cuts = 0
        self.connections = 0
        self.break_every: int | None = None
        self.refuse = False
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def configure(self, break_every: int | None = None, refuse: bool = False) -> None:
        with self._lock:
            self.break_every, self.refuse = break_every, refuse
            self.requests = self.cuts = self.bytes_down = 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                refuse = self.refuse
            if refuse:
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                _abort(client)
                continue
            conn = {"cut_after": None}  # bytes of response still to let through before the cut
            threading.Thread(target=self._up, args=(client, upstream, conn), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, conn), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, conn: dict) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                with self._lock:
                    for _ in range(data.count(b" HTTP/1.1\r\n")):
                        self.requests += 1
                        if self.break_every and self.requests % self.break_every == 0 and conn["cut_after"] is None:
                            conn["cut_after"] = 100 + (self.requests * 997) % 3000
                upstream.sendall(data)
        except OSError:
            pass
        _close(upstream)
        _close(client)

    def _down(self, upstream: socket.socket, client: socket.socket, conn: dict) -> None:
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                with self._lock:
                    left = conn["cut_after"]
                    cut = left is not None and len(data) > left
                    if cut:
                        data = data[:left]
                        self.cuts += 1
                        rst = self.cuts % 2 == 1
                    elif left is not None:
                        conn["cut_after"] = left - len(data)
                    self.bytes_down += len(data)
                if data:
                    client.sendall(data)
                if cut:
                    (_abort if rst else _close)(client)
                    _abort(upstream)
                    return
        except OSError:
            pass
        _close(client)
        _close(upstream)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)


def _abort(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer sees 'connection reset by peer'."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
