"""A real S3 server on loopback for the object-store tests: moto in server mode, and a small
HTTP proxy in front of it that injects faults (503 / SlowDown, 403, a server stopped mid-upload)
into the real request path. Loopback only: nothing here listens on or calls another address."""

from __future__ import annotations

import http.client
import os
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

HOST = "127.0.0.1"
_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "BOTO_CONFIG": "/dev/null",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class MotoServer:
    """``moto.server.ThreadedMotoServer`` on a fixed loopback port that can stop and restart
    (moto keeps its buckets in-process, so a restart finds them again)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self._server: Any = None

    def start(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        self._server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None


@dataclass
class Fault:
    """Answer ``status``/``code`` instead of forwarding, for requests that match, ``times`` times
    (``None``: always). ``action`` runs instead of answering (e.g. stop the server)."""

    method: str
    pattern: str  # regex on the request path + query
    status: int = 503
    code: str = "SlowDown"
    times: int | None = 1
    skip: int = 0  # let this many matching requests through first
    action: Callable[[], None] | None = None
    hits: int = 0
    seen: int = 0

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and re.search(self.pattern, path) is not None


@dataclass
class FaultProxy:
    """Forwards every request to moto unless a :class:`Fault` matches it."""

    upstream_port: int
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> str:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self._body()
                fault = proxy._take(self.command, self.path)
                if fault is not None and fault.action is not None:
                    fault.action()
                elif fault is not None:
                    xml = (
                        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{fault.code}</Code>"
                        f"<Message>injected by the test proxy</Message></Error>"
                    ).encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                try:
                    conn = http.client.HTTPConnection(HOST, proxy.upstream_port, timeout=30)
                    drop = ("connection", "transfer-encoding", "content-length")
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in drop}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:  # the server is down: the client sees its connection dropped
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(resp.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, keep it
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length", "0") if head else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    out = bytearray()
                    while True:  # HTTP/1.1 chunked framing: size line, data, CRLF; 0 ends it
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return f"http://{HOST}:{self._httpd.server_address[1]}"

    def _take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            self.requests.append((method, path))
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.seen += 1
                    if fault.seen <= fault.skip:
                        continue
                    if fault.times is None or fault.hits < fault.times:
                        fault.hits += 1
                        return fault
        return None

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@dataclass
class S3Env:
    """One test's bucket on the session's server, and the options that reach it."""

    server: MotoServer
    bucket: str
    endpoint: str
    proxy: FaultProxy | None = None

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def options(self, **extra: Any) -> dict[str, Any]:
        from dcp_datastates.storage.s3 import RetryPolicy

        opts: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "retry": RetryPolicy(attempts=4, base_s=0.01, max_s=0.05),
        }
        opts.update(extra)
        return opts

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.server.endpoint, region_name="us-east-1")

    def list_keys(self, prefix: str = "") -> list[str]:
        out = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in out.get("Contents", []))

    def open_uploads(self) -> list[str]:
        out = self.client().list_multipart_uploads(Bucket=self.bucket)
        return [u["Key"] for u in out.get("Uploads", [])]


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    server = MotoServer()
    server.start()
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _new_bucket(server: MotoServer) -> str:
    import boto3
    import s3fs

    if not server.running:  # a test that stopped it failed before restarting it
        server.start()
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket
    )
    return bucket


@pytest.fixture
def s3(moto_server: MotoServer) -> S3Env:
    """A fresh bucket, reached directly."""
    return S3Env(moto_server, _new_bucket(moto_server), moto_server.endpoint)


@pytest.fixture
def s3_proxy(moto_server: MotoServer) -> Iterator[S3Env]:
    """A fresh bucket, reached through a fault-injecting proxy (``env.proxy.faults``)."""
    bucket = _new_bucket(moto_server)
    proxy = FaultProxy(moto_server.port)
    endpoint = proxy.start()
    yield S3Env(moto_server, bucket, endpoint, proxy)
    proxy.stop()
