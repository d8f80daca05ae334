"""What every bootseer daemon shares with the node around it: readiness and
status for systemd (sd_notify), and one HTTP endpoint serving Prometheus
`/metrics` and `/healthz`.

The parts never import this module. A part's `serve()` takes plain
callbacks, and the command that runs it (bootseer/commands/) passes a
`Daemon`'s methods:

    on_started(health)  the part's objects exist: bind the HTTP endpoint, whose
                        /healthz calls `health()` (None: healthy, else a
                        one-line reason)
    on_ready()          the daemon can do its job: READY=1
    on_stopping()       shutdown began: STOPPING=1

sd_notify is written here over an AF_UNIX datagram socket, as sd_notify(3)
does, so no C library is needed. `Notifier.send` already takes file
descriptors (SCM_RIGHTS), so that a later change can hand systemd the
/dev/fuse descriptor with FDSTORE=1 without a second way of talking to it.
"""

from __future__ import annotations

import array
import gc
import os
import socket
import threading
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

import prometheus_client
import structlog

from bootseer.options import CommandError

log = structlog.get_logger("bootseer.daemon")

NOTIFY_SOCKET = "NOTIFY_SOCKET"
HEALTH_PATH = "/healthz"

# A daemon's own check of its health: None when it can do its job, otherwise
# one line saying why not.
Health = Callable[[], str | None]


def _healthy() -> str | None:
    return None


class Notifier:
    """sd_notify(3): newline-separated KEY=VALUE assignments, one datagram per
    message, to the socket systemd names in $NOTIFY_SOCKET (a path, or an
    abstract name written with a leading '@'). Without the variable (not run
    by systemd, or a unit that is not Type=notify) every send does nothing."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Take $NOTIFY_SOCKET out of the environment, as sd_notify's
        unset_environment does: the daemon's children (fusermount3,
        installers, helper servers) must not speak for it."""
        return cls((os.environ if environ is None else environ).pop(NOTIFY_SOCKET, None) or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _sockaddr(self) -> str | bytes | None:
        assert self.address is not None
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()
        if self.address.startswith("/"):
            return self.address
        return None

    def send(self, *assignments: str, fds: Sequence[int] = ()) -> bool:
        """Send one message; file descriptors, if any, go with it (SCM_RIGHTS).

        True once it is sent; False without a notify socket or when it cannot
        be reached (logged: the daemon keeps serving whatever systemd thinks)."""
        if self.address is None:
            return False
        sockaddr = self._sockaddr()
        if sockaddr is None:
            log.warning("unsupported notify socket address", address=self.address)
            return False
        for line in assignments:
            if "=" not in line or "\n" in line:
                raise ValueError(f"not one KEY=VALUE assignment: {line!r}")
        payload = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # socket.send_fds would drop the address (CPython passes only
                # buffers and descriptors on to sendmsg).
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                sock.sendmsg([payload], ancillary, 0, sockaddr)
        except OSError as exc:
            log.warning("cannot notify the service manager", address=self.address, error=str(exc))
            return False
        return True


def _one_line(text: str) -> str:
    return " ".join(text.split())


def parse_address(address: str, default_host: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` too; an empty host is `default_host`, port 0 any free one)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address {address!r} must be host:port")
    return host.strip("[]") or default_host, int(port)


class _Server(ThreadingMixIn, WSGIServer):
    # A hung health check holds its own request thread only.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Endpoint:
    """The daemon's HTTP endpoint: `/healthz` answers 200 "ok" or 503 and the
    reason; every other path is prometheus_client's own metrics app, so
    `/metrics` is exactly what `prometheus_client.start_http_server` serves."""

    def __init__(self, host: str, port: int, health: Health) -> None:
        self._health = health
        self._metrics = prometheus_client.make_wsgi_app()
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_FamilyServer", (_Server,), {"address_family": family})
        self._server: WSGIServer = make_server(host, port, self._app, server_class, handler_class=_QuietHandler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="http-endpoint", daemon=True)
        self._thread.start()

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            body: Iterable[bytes] = self._metrics(environ, start_response)
            return body
        try:
            reason = self._health()
        except Exception as exc:  # a broken check is an unhealthy daemon, not a broken endpoint
            reason = f"health check failed: {type(exc).__name__}: {exc}"
        status, text = ("200 OK", "ok") if reason is None else ("503 Service Unavailable", _one_line(reason))
        data = (text + "\n").encode()
        start_response(
            status,
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(data))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [data]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Daemon:
    """One daemon process's ties to systemd and to its monitors.

    `status` says what the daemon does once ready (systemctl status shows
    it); `metrics_address` (empty: none) is where the endpoint listens, an
    empty host meaning `default_host`. /healthz answers 503 "starting" until
    the part calls `ready`, and "stopping" from `stopping` on."""

    def __init__(
        self,
        name: str,
        status: str,
        metrics_address: str = "",
        default_host: str = "127.0.0.1",
        notifier: Notifier | None = None,
    ) -> None:
        self.name = name
        self.status = _one_line(status)
        self.metrics_address = metrics_address
        self.default_host = default_host
        self.notifier = notifier if notifier is not None else Notifier.from_environment()
        self.endpoint: Endpoint | None = None
        self._health: Health = _healthy
        self._state = "starting"
        self.notifier.send(f"STATUS=starting: {self.status}")

    def check(self) -> str | None:
        """What /healthz reports: None when ready and the part's check passes."""
        if self._state != "ready":
            return f"{self.name} is {self._state}"
        return self._health()

    # -- the callbacks a part's serve() is given --------------------------

    def started(self, health: Health) -> None:
        self._health = health
        if not self.metrics_address or self.endpoint is not None:
            return
        try:
            host, port = parse_address(self.metrics_address, self.default_host)
            self.endpoint = Endpoint(host, port, self.check)
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot serve metrics on {self.metrics_address}: {exc}") from None
        log.info("http endpoint", address=self.metrics_address, paths=["/metrics", HEALTH_PATH])

    def ready(self) -> None:
        if self._state != "starting":
            return
        self._state = "ready"
        self.notifier.send("READY=1", f"STATUS={self.status}")
        log.info("ready", daemon=self.name, status=self.status)

    def stopping(self) -> None:
        if self._state == "stopping":
            return
        self._state = "stopping"
        self.notifier.send("STOPPING=1", "STATUS=stopping")

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def __enter__(self) -> Daemon:
        # What the process holds by now (its modules, classes, settings)
        # lives as long as it does: frozen, it is out of the garbage
        # collector's way, and a full collection walks only what came after.
        # In the layer server such a pass took 30-40 ms in each start, every
        # FUSE request in flight stalled behind it.
        gc.freeze()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
