"""The snapshotter daemon's pull socket: `bootseer pull` run inside the
daemon, with its imports loaded and its connections to the registry and to
containerd warm (snapshotter.pullwire has the protocol and why).

Each connection is one pull on a thread of its own. Registry clients are
kept per (plain HTTP, hosts directory, credentials file) and containerd
clients per (socket, namespace), a few of each: a node pulls from a handful
of registries into one containerd. The socket is root's alone (0600): a
request names a credentials file the daemon reads and a containerd it
writes to; a peer of another user (SO_PEERCRED) is refused as well, for the
moment between the socket's bind and its chmod.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
from prometheus_client import Counter, Histogram

from snapshotter.containerd_client import ContainerdClient
from snapshotter.pull import LayerProgress, PullResult, failure_message, pull_request, registry_client
from snapshotter.pullwire import DEFAULT_SNAPSHOTTER, PullRequest, RequestError, encode_event, read_line
from snapshotter.registry.client import RegistryClient, ResolvedImage
from snapshotter.registry.media import Descriptor
from snapshotter.registry.settings import RegistryConfig

log = structlog.get_logger("bootseer.pull")

PULLS = Counter(
    "bootseer_snapshotter_pulls",
    "Pulls served on the pull socket, by outcome (ok, failed: the pull could not finish, "
    "bad_request: a request the daemon could not take, client_gone: the client left mid-pull).",
    ["outcome"],
)
PULL_SECONDS = Histogram(
    "bootseer_snapshotter_pull_seconds",
    "Time to serve one pull on the pull socket, from its request to its last event.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)

# How long a client may take to send its request, and to take an event.
CLIENT_TIMEOUT_S = 30.0
# What is read of a refused request's rest before the connection closes.
DRAIN_BYTES = 1 << 20
# Clients kept warm per kind; a request past that many keys gets its own.
WARM_CLIENTS = 8


class _ClientGone(Exception):
    """The client stopped reading: the pull is abandoned (its lease goes)."""


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Warm(Generic[K, V]):
    """Up to WARM_CLIENTS clients by key, made on first use and closed at
    the end; past that, a client made for one pull and closed after it."""

    def __init__(self, make: Callable[[K], V], close: Callable[[V], None]) -> None:
        self._make, self._close = make, close
        self._kept: dict[K, V] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def get(self, key: K) -> Iterator[V]:
        with self._lock:
            client = self._kept.get(key)
            if client is None and len(self._kept) < WARM_CLIENTS:
                client = self._kept[key] = self._make(key)
        if client is not None:
            yield client
            return
        own = self._make(key)
        try:
            yield own
        finally:
            self._close(own)

    def close(self) -> None:
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for client in kept:
            self._close(client)


class _Events:
    """Writes a pull's events to its client; a client that does not take
    them within CLIENT_TIMEOUT_S, or went away, ends the pull."""

    def __init__(self, stream: io.BufferedIOBase) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, event: str, **payload: Any) -> None:
        try:
            with self._lock:
                self._stream.write(encode_event(event, **payload))
                self._stream.flush()
        except OSError as exc:
            raise _ClientGone(str(exc)) from None

    def layer(self, index: int, count: int, layer: Descriptor) -> LayerProgress:
        self.send("layer", index=index, count=count, digest=layer.digest, size=layer.size)
        return _LayerEvents(self, index)


class _LayerEvents:
    def __init__(self, events: _Events, index: int) -> None:
        self._events, self._index = events, index

    def advance(self, n: int) -> None:
        self._events.send("fetched", index=self._index, bytes=n)

    def done(self, how: str) -> None:
        self._events.send("layer_done", index=self._index, how=how)


class PullService:
    """Serves pulls on `address` until `stop`."""

    def __init__(
        self, address: Path, registry: RegistryConfig, resolved: Callable[[ResolvedImage], None] | None = None
    ) -> None:
        """`resolved`: told the image of each pull into this daemon's
        snapshotter (the one containerd's config names DEFAULT_SNAPSHOTTER)
        once it is resolved (Puller); pulls into any other snapshotter are
        not its business."""
        self.address = address
        self._resolved = resolved
        self._registries: _Warm[tuple[bool, str | None, str | None], RegistryClient] = _Warm(
            lambda key: registry_client(registry, *key), RegistryClient.close
        )
        self._containerds: _Warm[tuple[str, str], ContainerdClient] = _Warm(
            lambda key: ContainerdClient(Path(key[0]), key[1]), ContainerdClient.close
        )
        service = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = CLIENT_TIMEOUT_S

            def handle(self) -> None:
                service._serve(self.rfile, self.wfile, _peer_uid(self.connection))

        self._server = _Server(str(address), Handler)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.address.chmod(0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="pull-socket", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._registries.close()
        self._containerds.close()

    def _serve(self, rfile: io.BufferedIOBase, wfile: io.BufferedIOBase, peer_uid: int) -> None:
        began = time.monotonic()
        events = _Events(wfile)
        try:
            line = read_line(rfile)
            if not line:
                return  # a health check's bare connect
            if peer_uid not in (0, os.geteuid()):
                raise RequestError(f"uid {peer_uid} may not pull through the snapshotter (root only)")
            request = PullRequest.decode(line)
        except (RequestError, OSError) as exc:
            PULLS.labels("bad_request").inc()
            log.warning("pull.bad_request", error=str(exc))
            with contextlib.suppress(_ClientGone):
                events.send("error", message=f"bad request: {exc}", refused=True)
            # Closing on unread bytes would reset the connection, and the
            # client might lose the reason: read on to its end, boundedly.
            with contextlib.suppress(OSError):
                rfile.read(DRAIN_BYTES)
            return
        log.info("pull.request", image=request.image, namespace=request.namespace, snapshotter=request.snapshotter)
        try:
            result = self._pull(request, events)
        except _ClientGone as exc:
            PULLS.labels("client_gone").inc()
            log.warning("pull.client_gone", image=request.image, error=str(exc))
            return
        except Exception as exc:
            PULLS.labels("failed").inc()
            message = failure_message(exc, request.address)
            if message is not None:
                log.warning("pull.failed", image=request.image, error=message)
            else:
                log.exception("pull.failed", image=request.image)
                message = f"the snapshotter failed the pull: {type(exc).__name__}: {exc} (see its log)"
            with contextlib.suppress(_ClientGone):
                events.send("error", message=message)
            return
        PULLS.labels("ok").inc()
        PULL_SECONDS.observe(time.monotonic() - began)
        with contextlib.suppress(_ClientGone):
            events.send("done", **result.as_event())

    def _pull(self, request: PullRequest, events: _Events) -> PullResult:
        with (
            self._registries.get((request.plain_http, request.hosts_dir, request.docker_config)) as registry,
            self._containerds.get((request.address, request.namespace)) as containerd,
        ):
            resolved = self._resolved if request.snapshotter == DEFAULT_SNAPSHOTTER else None
            return pull_request(request, registry, containerd, events.layer, resolved)


def _peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
