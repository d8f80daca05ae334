"""A fault-injecting HTTP proxy that sits in front of a real docker-registry.

It forwards every request to the registry unchanged except when a planned
fault matches: drop the connection, answer a status itself, strip the Range
header, truncate or corrupt the body, redirect elsewhere, stall (never
answer, or answer the headers and half the body and then nothing more,
until the proxy stops: a registry that was SIGSTOPped), or hold a request
until the test releases it (then answer it as usual). It records each
request (method, path, headers) so tests can see what the client sent,
and counts the body bytes it sent back, per path. `blackhole` is the
other kind of dead host: one that never completes a TCP connection.
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.harness.procs import free_tcp_port

FAULTS = ("drop", "status", "strip_range", "truncate", "flip", "redirect", "stall", "stall_body", "hold")


@dataclass
class Fault:
    kind: str
    method: str = "GET"
    path_contains: str = ""
    times: int = 1  # how many matching requests it hits
    status: int = 503
    redirect_to: str = ""  # "http://127.0.0.1:PORT", the path is kept

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and method == self.method and self.path_contains in path


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    fault: str = ""


@dataclass
class FaultProxy:
    upstream_port: int
    port: int = field(default_factory=free_tcp_port)
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Set when the proxy stops: stalled answers end then.
    stopping: threading.Event = field(default_factory=threading.Event)
    # Set by release() (and when the proxy stops): held requests go on then.
    released: threading.Event = field(default_factory=threading.Event)
    # Body bytes written to clients, by request path (a client that hangs up
    # stops the count; bytes already in socket buffers are counted as sent).
    sent: dict[str, int] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def plan(
        self,
        kind: str,
        path_contains: str = "",
        *,
        method: str = "GET",
        times: int = 1,
        status: int = 503,
        redirect_to: str = "",
    ) -> None:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self.faults.append(Fault(kind, method, path_contains, times, status, redirect_to))

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()
            self.seen.clear()

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.times -= 1
                    return fault
        return None

    def release(self) -> None:
        """Let every held request (fault "hold") through, now and from now on."""
        self.released.set()

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def requests(self, method: str | None = None, path_contains: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if (method is None or s.method == method) and path_contains in s.path]

    def count_sent(self, path: str, n: int) -> None:
        with self._lock:
            self.sent[path] = self.sent.get(path, 0) + n

    def bytes_sent(self, path_contains: str = "") -> int:
        """Body bytes sent in answers to requests whose path contains `path_contains`."""
        with self._lock:
            return sum(n for path, n in self.sent.items() if path_contains in path)


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = dict(self.headers.items())
            fault = proxy.take_fault(self.command, self.path)
            proxy.record(Seen(self.command, self.path, headers, fault.kind if fault else ""))
            if fault is not None and fault.kind == "drop":
                self.close_connection = True
                return
            if fault is not None and fault.kind == "hold":
                proxy.released.wait()
            if fault is not None and fault.kind == "stall":
                proxy.stopping.wait()
                self.close_connection = True
                return
            if fault is not None and fault.kind == "status":
                self._answer(fault.status, {"Content-Length": "0"}, b"")
                return
            if fault is not None and fault.kind == "redirect":
                self._answer(307, {"Location": fault.redirect_to + self.path, "Content-Length": "0"}, b"")
                return
            if fault is not None and fault.kind == "strip_range":
                headers.pop("Range", None)
            upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
            try:
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                out_headers = {
                    k: v for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")
                }
            finally:
                upstream.close()
            if fault is not None and fault.kind == "flip" and data:
                middle = len(data) // 2
                data = data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]
            if self.command != "HEAD":
                out_headers["Content-Length"] = str(len(data))
            if fault is not None and fault.kind == "truncate" and len(data) > 1:
                # Announce the full length, send half, hang up: a broken transfer.
                self._answer(response.status, out_headers, data[: len(data) // 2])
                self.close_connection = True
                return
            if fault is not None and fault.kind == "stall_body" and len(data) > 1:
                # Announce the full length, send half, then nothing: a transfer that stalls.
                self._answer(response.status, out_headers, data[: len(data) // 2])
                proxy.stopping.wait()
                self.close_connection = True
                return
            self._answer(response.status, out_headers, data)

        def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
            self.send_response_only(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD" and data:
                # In pieces, so that a client hanging up stops the count.
                for at in range(0, len(data), 1 << 16):
                    piece = data[at : at + (1 << 16)]
                    self.wfile.write(piece)
                    proxy.count_sent(self.path, len(piece))
            self.wfile.flush()

        do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _relay

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hangs up early (a sliced whole-body answer) is expected.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextmanager
def running(upstream_port: int, port: int | None = None) -> Iterator[FaultProxy]:
    """A proxy on a free 127.0.0.1 port (or `port`) in front of 127.0.0.1:`upstream_port`."""
    proxy = FaultProxy(upstream_port=upstream_port) if port is None else FaultProxy(upstream_port, port)
    server = _QuietServer(("127.0.0.1", proxy.port), _handler(proxy))
    thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.stopping.set()
        proxy.released.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextmanager
def blackhole() -> Iterator[str]:
    """ "127.0.0.1:PORT" of a host whose TCP connections never complete: a
    listening socket that accepts nothing, its accept queue filled, so the
    kernel drops further SYNs and a connect waits for its timeout (as for a
    host behind a firewall that drops packets)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        # Backlog 0 queues one connection; connect until one does not complete.
        for _ in range(8):
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            fillers.append(filler)
            filler.settimeout(0.5)
            try:
                filler.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            raise RuntimeError("could not fill the accept queue of the blackhole listener")
        yield f"127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
