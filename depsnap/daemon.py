"""`bootseer depsnap serve`: the node cache behind a unix socket.

Every container on the node asks this one process for images, so the node
holds each image once, downloads it once however many containers ask for it
at the same moment (they wait on the same per-key lock and then find it
cached), and stays under its size cap by evicting the least recently used.

Protocol: one JSON line per request and per reply; an image travels as a
file descriptor (SCM_RIGHTS) beside the reply, so clients need the socket and
nothing else of the host.

    {"op": "fetch", "key": K, "store": URI|null} -> {"ok", "found", "source", "size"} + fd
    {"op": "put", "key": K} + fd                 -> {"ok"}
    {"op": "discard", "key": K}                  -> {"ok"}
    {"op": "stats"}                              -> {"ok", counters...}
    {"op": "pod-attach", "key": K, "target": T}  -> {"ok", "found", "source", "size"}
    {"op": "pod-capture", "key": K, "target": T} -> {"ok", "captured", "detail"}
    {"op": "mark", "name": N}                    -> {"ok"}

`mark` is how a job in a pod says it reached a point of its start (its
`ready`, before the first training step): the daemon writes it to its event
log with the caller's cgroup, which names the container, for `bootseer report`.

The pod operations (`depsnap.pods`) act on the caller's own mount namespace
and root, found from the socket's peer. `put`, `discard` and a `fetch` that
names its own store need a caller that could mount by itself
(CAP_SYS_ADMIN on the host): a pod must not plant images under the keys the
host's CLI restores, nor point the daemon at a store of its choosing.

The application serves the metrics and health endpoint (`metrics_address`)
and tells the service manager about readiness, through the callbacks
`serve` takes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import socketserver
import threading
from collections import Counter as Tally
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import Counter, Gauge

import eventlog
from depsnap import linux
from depsnap.cache import Cache
from depsnap.format import CorruptSnapshot
from depsnap.pods import PodRefused, Pods, privileged
from depsnap.settings import DepsnapConfig
from depsnap.store import SnapshotStore, StoreUnavailable, open_store
from depsnap.wire import daemon_answers, recv_message, send_message

log = structlog.get_logger("depsnap.daemon")

FETCHES = Counter("depsnap_fetches", "Image requests by outcome", ["outcome"])
DOWNLOADED = Counter("depsnap_downloaded_bytes", "Image bytes fetched from stores")
EVICTIONS = Counter("depsnap_evictions", "Images evicted to stay under the cap")
CACHED_BYTES = Gauge("depsnap_cache_bytes", "Bytes of images in the node cache")
POD_REQUESTS = Counter("depsnap_pod_requests", "Pod requests by operation and outcome", ["op", "outcome"])

_KEY_CHARS = frozenset("0123456789abcdef")
# How long a health check waits for the daemon to answer.
HEALTH_TIMEOUT_S = 2.0


class BadRequest(Exception):
    pass


class Refused(Exception):
    """A request this caller may not make."""


class AlreadyServing(Exception):
    """Another daemon answers on the socket this one was to serve on."""


def _key(request: dict[str, Any]) -> str:
    key = request.get("key")
    # Keys name files in the cache: only the digests depsnap makes are accepted.
    if not isinstance(key, str) or len(key) != 64 or not set(key) <= _KEY_CHARS:
        raise BadRequest("key must be 64 lowercase hex digits")
    return key


class NodeCache:
    """The daemon's state and operations, apart from the socket plumbing."""

    def __init__(self, settings: DepsnapConfig) -> None:
        self.cache = Cache(settings.cache_dir, settings.cache_max_bytes)
        self.default_store = settings.store or None
        self.tally: Tally[str] = Tally()
        self._lock = threading.Lock()
        self._stores: dict[str, SnapshotStore] = {}
        self.pods = Pods(
            self.cache,
            settings.pod_targets,
            settings.pod_capture_max_bytes,
            store=lambda: self._store(None),
            evict=self._evict,
        )
        CACHED_BYTES.set(self.cache.size())

    def _store(self, uri: str | None) -> SnapshotStore | None:
        uri = uri or self.default_store
        if not uri:
            return None
        with self._lock:
            if uri not in self._stores:
                self._stores[uri] = open_store(uri)
            return self._stores[uri]

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.tally[what] += n

    def _evict(self, key: str) -> None:
        for gone in self.cache.evict(keep=key):
            EVICTIONS.inc()
            self._count("evictions")
            log.info("evicted", key=gone.key, bytes=gone.size)
        CACHED_BYTES.set(self.cache.size())

    def fetch(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        key = _key(request)
        started = eventlog.now()
        fetched = self.cache.fetch(key, self._store(request.get("store")))
        eventlog.emit(
            "depsnap.fetch",
            key=key,
            source=fetched.source if fetched is not None else "absent",
            bytes=fetched.size if fetched is not None else 0,
            start=started,
            end=eventlog.now(),
        )
        if fetched is None:
            FETCHES.labels("absent").inc()
            self._count("absent")
            return {"ok": True, "found": False}, []
        outcome = "hits" if fetched.source == "cache" else "downloads"
        FETCHES.labels(outcome).inc()
        self._count(outcome)
        if fetched.source == "store":
            DOWNLOADED.inc(fetched.size)
            self._count("downloaded_bytes", fetched.size)
            log.info("downloaded", key=key, bytes=fetched.size)
            self._evict(key)
        fd = os.open(fetched.path, os.O_RDONLY)
        return {"ok": True, "found": True, "source": fetched.source, "size": fetched.size}, [fd]

    def put(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        key = _key(request)
        if len(fds) != 1:
            raise BadRequest("put needs exactly one file descriptor")
        temp = self.cache.tmp / f"put-{key}-{threading.get_ident()}"
        with os.fdopen(os.dup(fds[0]), "rb") as source, open(temp, "wb") as dest:
            shutil.copyfileobj(source, dest, 8 << 20)
        try:
            self.cache.put(key, temp)
        finally:
            temp.unlink(missing_ok=True)
        self._count("puts")
        self._evict(key)
        return {"ok": True}

    def discard(self, request: dict[str, Any]) -> dict[str, Any]:
        self.cache.discard(_key(request))
        self._count("discards")
        return {"ok": True}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self.tally)
        return {
            "ok": True,
            **counts,
            "cache_bytes": self.cache.size(),
            "entries": len(self.cache.entries()),
        }

    def _pod(self, op: str, request: dict[str, Any], peer: linux.Peer) -> dict[str, Any]:
        key = _key(request)
        started = eventlog.now()
        try:
            if op == "pod-attach":
                reply = self.pods.attach(peer, key, request.get("target"))
                outcome = "hit" if reply["found"] else "miss"
            else:
                reply = self.pods.capture(peer, key, request.get("target"))
                outcome = "captured" if reply["captured"] else "present"
        except PodRefused as exc:
            POD_REQUESTS.labels(op, "refused").inc()
            self._count("pod_refused")
            log.warning("pod request refused", op=op, pid=peer.pid, uid=peer.uid, reason=str(exc))
            raise Refused(str(exc)) from None
        POD_REQUESTS.labels(op, outcome).inc()
        self._count(f"pod_{outcome}")
        # A pod's restore (attach, hit), or the two ends of its install (attach
        # miss, then capture): the cgroup names its container.
        eventlog.emit(
            "depsnap.pod",
            op=op,
            outcome=outcome,
            key=key,
            target=request.get("target"),
            start=started,
            end=eventlog.now(),
            cgroup=eventlog.cgroup_of(peer.pid),
        )
        return reply

    def mark(self, request: dict[str, Any], peer: linux.Peer | None) -> dict[str, Any]:
        name = request.get("name", "ready")
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise BadRequest("a mark's name is 1 to 64 characters")
        pid = peer.pid if peer is not None else os.getpid()
        eventlog.emit("mark", name=name, cgroup=eventlog.cgroup_of(pid), caller_pid=pid)
        return {"ok": True}

    def handle(
        self,
        request: dict[str, Any],
        fds: list[int],
        peer: Callable[[], linux.Peer] | None = None,
    ) -> tuple[dict[str, Any], list[int]]:
        """One request; `peer()` identifies the caller (None: a trusted
        in-process caller, which may do everything but the pod operations)."""
        op = request.get("op")

        def require_privileged(what: str) -> None:
            if peer is not None and not privileged(peer()):
                raise Refused(f"{what} needs a caller with CAP_SYS_ADMIN on the host; pods use pod-attach/pod-capture")

        try:
            if op == "fetch":
                if request.get("store") not in (None, "", self.default_store):
                    require_privileged("naming a store")
                return self.fetch(request)
            if op == "put":
                require_privileged("put")
                return self.put(request, fds), []
            if op == "discard":
                require_privileged("discard")
                return self.discard(request), []
            if op == "stats":
                return self.stats(), []
            if op == "mark":
                return self.mark(request, peer() if peer is not None else None), []
            if op in ("pod-attach", "pod-capture"):
                if peer is None:
                    raise BadRequest(f"{op} needs a caller on the socket")
                return self._pod(op, request, peer()), []
            raise BadRequest(f"unknown op {op!r}")
        except BadRequest as exc:
            return {"ok": False, "error": "bad-request", "message": str(exc)}, []
        except (Refused, linux.PeerGone) as exc:
            return {"ok": False, "error": "refused", "message": str(exc)}, []
        except CorruptSnapshot as exc:
            FETCHES.labels("corrupt").inc()
            self._count("corrupt")
            log.warning("corrupt snapshot", key=request.get("key"), reason=str(exc))
            return {"ok": False, "error": "corrupt", "message": str(exc)}, []
        except StoreUnavailable as exc:
            FETCHES.labels("unavailable").inc()
            self._count("unavailable")
            log.warning("store unavailable", reason=str(exc))
            return {"ok": False, "error": "unavailable", "message": str(exc)}, []


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def setup(self) -> None:
        # No earlier than the accept: the peer connected before this.
        self.accepted = linux.boottime()
        self.peer: linux.Peer | None = None

    def identify(self) -> linux.Peer:
        if self.peer is None:
            self.peer = linux.peer(self.request, self.accepted)
        return self.peer

    def handle(self) -> None:
        fds: list[int] = []
        reply_fds: list[int] = []
        try:
            request, fds = recv_message(self.request)
            reply, reply_fds = self.server.node.handle(request, fds, self.identify)
            send_message(self.request, reply, reply_fds)
        except (ConnectionError, ValueError) as exc:
            log.warning("bad client message", reason=str(exc))
        except Exception:
            log.exception("request failed")
            with contextlib.suppress(OSError):
                send_message(self.request, {"ok": False, "error": "internal", "message": "see daemon log"})
        finally:
            for fd in fds + reply_fds:
                os.close(fd)
            if self.peer is not None:
                self.peer.close()


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, address: Path, node: NodeCache) -> None:
        self.node = node
        super().__init__(str(address), _Handler)


def answers(address: Path, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """None if the daemon on `address` answers a stats request within
    `timeout`, else why not. A real request, not a bare connect: it shows the
    daemon serves, and does not leave a "bad client message" in its log."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(address))
            send_message(sock, {"op": "stats"})
            reply, fds = recv_message(sock)
    except (OSError, ValueError) as exc:
        return f"{address} does not answer: {getattr(exc, 'strerror', None) or exc}"
    for fd in fds:
        os.close(fd)
    if not reply.get("ok"):
        return f"{address} answers {reply.get('error')}: {reply.get('message', '')}"
    return None


def serve(
    settings: DepsnapConfig,
    *,
    on_started: Callable[[Callable[[], str | None]], None] = lambda _health: None,
    on_ready: Callable[[], None] = lambda: None,
    on_stopping: Callable[[], None] = lambda: None,
) -> None:
    """Serve until SIGTERM or SIGINT.

    `on_started(health)` once the socket is bound (`health()`: None while
    the daemon answers on it, else why not); `on_ready()` once it accepts;
    `on_stopping()` when a signal starts the shutdown."""
    address = settings.socket
    address.parent.mkdir(parents=True, exist_ok=True)
    if daemon_answers(address):
        raise AlreadyServing(f"a daemon already answers on {address}")
    address.unlink(missing_ok=True)
    node = NodeCache(settings)
    node.cache.sweep_tmp()
    server = _Server(address, node)
    try:
        os.chmod(address, 0o660)
        on_started(lambda: answers(address))

        def stop(signum: int, _frame: object) -> None:
            # Only a thread started: the handler runs between two bytecodes
            # of the main thread, which may be inside a log call holding the
            # log's lock.
            threading.Thread(target=_stop, args=(signal.Signals(signum).name,), daemon=True).start()

        def _stop(name: str) -> None:
            log.info("stopping", signal=name)
            on_stopping()
            server.shutdown()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info(
            "serving",
            socket=str(address),
            cache_dir=str(settings.cache_dir),
            cache_max_bytes=settings.cache_max_bytes,
            store=settings.store or None,
        )
        # Bound and listening since _Server(): connections queue until
        # serve_forever, just below, takes them.
        on_ready()
        server.serve_forever()
    finally:
        server.server_close()
        address.unlink(missing_ok=True)
