"""The benchmark's delay line (bench/link.py): every byte through, in order,
both ways; each side's end passed on; one connection's failure leaves the
others alone. A real proxy process between real sockets."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench import link


@dataclass
class Upstream:
    """A server that reads one request line naming a size, answers that many
    random bytes and closes; it keeps what it read and sent."""

    listener: socket.socket
    requests: list[bytes] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()
        return f"{host}:{port}"

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while not request.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    return
                request += chunk
            self.requests.append(request)
            body = os.urandom(int(request.split()[-1]))
            self.sent.append(body)
            try:
                conn.sendall(body)
            except OSError:
                return


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = Upstream(listener)
    threading.Thread(target=server.serve, daemon=True).start()
    yield server
    listener.close()


@pytest.fixture
def proxy(upstream: Upstream, tmp_path: Path) -> Iterator[link.DelayProxy]:
    delay_line = link.start_proxy(upstream.address, 2.0, 0.0, tmp_path / "proxy.log")
    yield delay_line
    delay_line.stop()


def _fetch(proxy: link.DelayProxy, request: bytes) -> bytes:
    host, port = proxy.host.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn:
        # An end not passed on fails the test instead of hanging it.
        conn.settimeout(30)
        conn.sendall(request)
        got = bytearray()
        while chunk := conn.recv(1 << 20):
            got += chunk
    return bytes(got)


def test_every_byte_goes_through_in_order_both_ways(upstream: Upstream, proxy: link.DelayProxy) -> None:
    request = b"x" * 300_000 + b" 12000000\n"
    answer = _fetch(proxy, request)
    assert upstream.requests == [request]
    assert hashlib.sha256(answer).digest() == hashlib.sha256(upstream.sent[0]).digest()


def test_connections_at_once_each_get_their_own_bytes(upstream: Upstream, proxy: link.DelayProxy) -> None:
    sizes = [1, 4096, 3_000_000, 7_000_001]
    answers: dict[int, bytes] = {}

    def one(size: int) -> None:
        answers[size] = _fetch(proxy, f"get {size}\n".encode())

    threads = [threading.Thread(target=one, args=(size,)) for size in sizes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(len(a) for a in answers.values()) == sizes
    assert set(answers.values()) == set(upstream.sent)


def test_a_client_that_leaves_early_leaves_the_proxy_serving(upstream: Upstream, proxy: link.DelayProxy) -> None:
    host, port = proxy.host.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"get 50000000\n")
    assert conn.recv(1 << 16)
    conn.close()
    assert len(_fetch(proxy, b"get 2000000\n")) == 2_000_000
    assert proxy.daemon.alive()
