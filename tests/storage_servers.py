"""Real storage servers on 127.0.0.1 for the storage tests: an HTTP file server and an S3 server.

Import the fixtures into a test module (``from storage_servers import http_server, s3``). Nothing
here mocks fsspec: clients talk to these servers over real sockets.

- :class:`FileServer` (fixture ``http_server``): serves bytes from memory with the standard
  library, counts every request, can answer the next N requests with 503, can stall a GET halfway
  until the test releases it, and can reject credentials by quoting them back, as careless servers
  do (which is how secrets end up in client error messages).
- ``s3`` (session fixture): moto's S3-compatible server (``moto[server]``) on a free port, with the
  ``storage_options`` that point s3fs at it. :meth:`S3Endpoint.checking_keys_after` makes it start
  refusing unknown access keys (403 InvalidAccessKeyId, as S3 does) after a number of requests.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

__all__ = ["FileServer", "S3Endpoint", "Stall", "http_server", "s3"]

# A stalled GET gives up after this long, so a test that forgets to release it cannot hang the
# server's shutdown for more than this.
_STALL_LIMIT_S = 60.0


@dataclass
class Stall:
    """Send ``after_bytes`` of a file, then wait until ``release()`` returns true, then the rest."""

    after_bytes: int
    release: Callable[[], bool]
    # Set once the first part has been sent, so a test can act in the middle of the transfer.
    reached: threading.Event = field(default_factory=threading.Event)
    # Set when ``release()`` returned true (not when the stall ran out of time or the server closed).
    released: threading.Event = field(default_factory=threading.Event)


class FileServer:
    """An HTTP/1.0 server on 127.0.0.1 that serves ``files`` and records what it was asked.

    Attributes:
        files: URL path (``"/data.bin"``) to content.
        gets: Per path, GET requests answered with 200 (a started fetch, finished or not).
        completed: Per path, GETs whose whole body was sent.
        requests: ``(method, path, status)`` of every request, in order.
        expected_auth: When set, requests whose ``Authorization`` header differs get 401 with the
            header they sent quoted in the reason phrase. Uploads (POST, PUT) are never accepted.
        upload_gate: Uploads are answered only once this event is set (or the server closes).
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.gets: Counter[str] = Counter()
        self.completed: Counter[str] = Counter()
        self.requests: list[tuple[str, str, int]] = []
        self.stalls: dict[str, Stall] = {}
        self.expected_auth: str | None = None
        self.upload_gate = threading.Event()
        self.upload_gate.set()
        self._fail_next = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        # A short poll interval: shutdown() waits up to one interval, once per test.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="test-http", daemon=True
        )

    def start(self) -> FileServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def fail_next(self, count: int) -> None:
        """Answer the next ``count`` requests (any method) with 503 Service Unavailable."""
        with self._lock:
            self._fail_next = count

    def _take_failure(self) -> bool:
        with self._lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                return True
            return False

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))
            if method == "GET" and status == 200:
                self.gets[path] += 1

    def _stall(self, stall: Stall) -> None:
        stall.reached.set()
        deadline = time.monotonic() + _STALL_LIMIT_S
        while not self._closing.is_set() and time.monotonic() < deadline:
            if stall.release():
                stall.released.set()
                return
            time.sleep(0.02)


def _handler_for(server: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep test output clean

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_POST(self) -> None:
            self._drain_body()  # answering before the body is read would reset the connection
            server._stall(Stall(0, release=server.upload_gate.is_set))
            if not self._rejected("POST"):
                server._record("POST", urlsplit(self.path).path, 405)
                self.send_error(405, "this server does not take uploads")

        do_PUT = do_POST

        def _drain_body(self) -> None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    self.rfile.read(size + 2)  # the chunk and its CRLF
                    if size == 0:
                        return
            self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _rejected(self, method: str) -> bool:
            sent = self.headers.get("Authorization")
            if server.expected_auth is None or sent == server.expected_auth:
                return False
            server._record(method, urlsplit(self.path).path, 401)
            self.send_error(401, f"credentials {sent!r} rejected")
            return True

        def _answer(self, *, body: bool) -> None:
            method = "GET" if body else "HEAD"
            path = urlsplit(self.path).path
            if self._rejected(method):
                return
            if server._take_failure():
                server._record(method, path, 503)
                self.send_error(503, "failing on purpose")
                return
            data = server.files.get(path)
            if data is None:
                server._record(method, path, 404)
                self.send_error(404)
                return
            server._record(method, path, 200)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not body:
                return
            stall = server.stalls.get(path)
            try:
                if stall is None:
                    self.wfile.write(data)
                else:
                    self.wfile.write(data[: stall.after_bytes])
                    self.wfile.flush()
                    server._stall(stall)
                    self.wfile.write(data[stall.after_bytes :])
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return  # the client went away (a killed download)
            with server._lock:
                server.completed[path] += 1

    return Handler


@pytest.fixture
def http_server() -> Iterator[FileServer]:
    """A fresh :class:`FileServer` on a free port of 127.0.0.1, stopped after the test."""
    server = FileServer().start()
    try:
        yield server
    finally:
        server.close()


@dataclass(frozen=True)
class S3Endpoint:
    """Where the local S3 server listens, and the options that make s3fs use it."""

    url: str

    def options(self, **extra: Any) -> dict[str, Any]:
        # Explicit credentials keep botocore from looking for real ones (and from asking the
        # instance-metadata address, which is off limits here); the listings cache is off so that
        # one test's objects never hide another's.
        options: dict[str, Any] = {
            "key": "testing-key-id",
            "secret": "testing-secret-key",
            # Not us-east-1: s3fs sends the region as the location constraint when creating a
            # bucket, and S3 accepts every region there except that one.
            "client_kwargs": {"endpoint_url": self.url, "region_name": "eu-west-1"},
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }
        options.update(extra)
        return options

    @contextlib.contextmanager
    def checking_keys_after(self, requests: int) -> Iterator[None]:
        """Answer ``requests`` more requests as usual, then refuse every request whose access key
        the server does not know (all of them: it knows none) with 403 InvalidAccessKeyId, until
        the block ends. Uses moto's own switch (``/moto-api/reset-auth``), which counts requests
        from every client of the server.
        """
        previous = self._reset_auth(str(requests))
        try:
            yield
        finally:
            self._reset_auth(previous)

    def _reset_auth(self, count: str) -> str:
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would not reach moto's handler
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return str(json.loads(answer.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])

    def bucket(self, name: str) -> Any:
        """Create bucket ``name`` and return an s3fs filesystem for this server."""
        import fsspec

        fs = fsspec.filesystem("s3", **self.options())
        fs.mkdir(name)
        return fs


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    """moto's S3 server on a free port of 127.0.0.1 for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Endpoint(f"http://{host}:{port}")
    finally:
        server.stop()
