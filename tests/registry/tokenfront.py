"""A front for the real registry that wants Bearer tokens, as Docker Hub and
most hosted registries do: a request without a valid token gets a 401 whose
challenge names this server's /token realm; /token issues one (to anyone,
or only for the right Basic credentials). Authorized requests are relayed to
the registry unchanged. docker-registry's own token auth needs a JWT issuer
and a certificate bundle; this keeps the exchange itself real and visible."""

from __future__ import annotations

import base64
import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from tests.harness.procs import free_tcp_port

SERVICE = "bootseer-test"


@dataclass
class TokenFront:
    upstream_port: int
    # "user:password" the token server wants; empty: anonymous tokens.
    login: str = ""
    port: int = field(default_factory=free_tcp_port)
    issued: list[str] = field(default_factory=list)
    # The query of every /token request, parsed.
    token_requests: list[dict[str, list[str]]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def issue(self, query: dict[str, list[str]], authorization: str) -> str | None:
        with self._lock:
            self.token_requests.append(query)
            if self.login and authorization != "Basic " + base64.b64encode(self.login.encode()).decode():
                return None
            token = f"token-{len(self.issued)}"
            self.issued.append(token)
            return token

    def valid(self, authorization: str) -> bool:
        with self._lock:
            return authorization.removeprefix("Bearer ") in self.issued


def _handler(front: TokenFront) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            authorization = self.headers.get("Authorization", "")
            parts = urlsplit(self.path)
            if parts.path == "/token":
                token = front.issue(parse_qs(parts.query), authorization)
                if token is None:
                    self._answer(401, {}, b'{"errors": [{"code": "UNAUTHORIZED"}]}')
                else:
                    self._answer(200, {}, json.dumps({"token": token, "expires_in": 300}).encode())
                return
            if not front.valid(authorization):
                challenge = f'Bearer realm="http://{front.host}/token",service="{SERVICE}"'
                self._answer(401, {"WWW-Authenticate": challenge}, b"")
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "authorization"}
            upstream = http.client.HTTPConnection("127.0.0.1", front.upstream_port, timeout=30)
            try:
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                out = {k: v for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
            finally:
                upstream.close()
            self._answer(response.status, out, data)

        def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
            if self.command != "HEAD":
                headers = {**headers, "Content-Length": str(len(data))}
            self.send_response_only(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD" and data:
                self.wfile.write(data)
            self.wfile.flush()

        do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = _serve

    return Handler


@contextmanager
def running(upstream_port: int, login: str = "") -> Iterator[TokenFront]:
    """A token-guarded front on a free 127.0.0.1 port for 127.0.0.1:`upstream_port`."""
    front = TokenFront(upstream_port, login)
    server = ThreadingHTTPServer(("127.0.0.1", front.port), _handler(front))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="token-front", daemon=True)
    thread.start()
    try:
        yield front
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
