"""Keep-alive HTTP connections whose range responses are received straight
into the caller's buffer.

The HTTP backend's hot path. httpx hands a body over in 64 KiB chunks, each
parsed by h11, allocated as bytes and copied into the stripe, in Python and
holding the GIL; with 32 streams on 2 CPUs that work per chunk was the
library's ceiling. An http.client response's `readinto` receives a body of
known length with `recv_into` directly into the stripe's buffer (the GIL
released while it waits): one C call per arrival, no copy, no parsing.
"""

from __future__ import annotations

import contextlib
import http.client
import select
import threading
from collections.abc import Iterator


def _stale(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection with something to read has been closed
    by the server (or sent junk): a request on it would fail."""
    if conn.sock is None:
        return True
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN)
    return bool(poller.poll(0))


class RangeConnections:
    """Connections to one `host:port`, one per concurrent request; idle
    ones (at most `keep`) are reused, most recently used first."""

    def __init__(self, host: str, port: int, timeout: float, keep: int) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.keep = keep
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            if not _stale(conn):
                return conn
            conn.close()

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.keep:
                self._idle.append(conn)
                return
        conn.close()

    @contextlib.contextmanager
    def get(self, target: str, headers: dict[str, str]) -> Iterator[http.client.HTTPResponse]:
        """GET `target`; the response's connection is reused if its body was
        read to the end, closed otherwise (or on any error)."""
        conn = self._take()
        response: http.client.HTTPResponse | None = None
        try:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            yield response
        except BaseException:
            if response is not None:
                response.close()
            conn.close()
            raise
        if response.isclosed() and not response.will_close:
            self._give(conn)
        else:
            response.close()
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
