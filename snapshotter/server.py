"""The snapshotter daemon: the gRPC service on a unix socket, signals,
readiness and health; and, with `[cri] address` set, the CRI image-service
proxy (snapshotter.cri) on its own socket.

The application serves the metrics and health endpoint (`metrics_address`)
and tells the service manager about readiness, through the callbacks
`serve` takes."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from snapshotter.cri.settings import CriConfig
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.settings import FsConfig
from snapshotter.pullservice import PullService
from snapshotter.registry.settings import RegistryConfig
from snapshotter.remote import RemoteLayers
from snapshotter.service import SnapshotsService
from snapshotter.settings import SnapshotterConfig
from snapshotter.snapshots import Snapshotter
from snapshotter.trust import IndexTrust
from snapshotter.trust_settings import TrustConfig

if TYPE_CHECKING:
    from snapshotter.cri.proxy import CriProxy
    from snapshotter.registry.client import RegistryClient, ResolvedImage

log = structlog.get_logger("bootseer.snapshotter")

# containerd issues many calls at once while unpacking and garbage collecting.
WORKERS = 16
SHUTDOWN_GRACE_S = 5.0
SIGNAL_POLL_S = 0.5
# How long a health check waits for a socket to accept a connection.
HEALTH_TIMEOUT_S = 2.0
# How long the sockets may take to accept after the servers started.
READY_TIMEOUT_S = 10.0


def _prepare_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        # Left by a previous instance that was killed; nobody serves it.
        path.unlink()
    elif path.exists():
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")


def _remote_layers(
    config: SnapshotterConfig, fs: FsConfig, registry: RegistryConfig, trust: TrustConfig
) -> RemoteLayers | None:
    if not config.lazy:
        return None
    index_trust = IndexTrust.from_config(trust)
    if index_trust.required and not index_trust.verifier.key_ids:
        log.warning(
            "[trust] keys is empty: no index is trusted, so every layer unpacks the normal way "
            "(add the public key `bootseer index` signs with, see docs/layer-index.md)"
        )

    def client() -> RegistryClient:
        from snapshotter.registry.config import client_from_config

        return client_from_config(registry)

    plain = fs.plain_mountpoint if fs.plain_mount else None
    return RemoteLayers(LayerStore(fs.store), fs.mountpoint, client, fs.layer_gc_grace_s, index_trust, plain)


def _head_start(remote: RemoteLayers | None) -> Callable[[ResolvedImage], None] | None:
    """What the pull socket tells the lazy path of an image it resolved."""
    if remote is None:
        return None
    return lambda image: remote.expect(image.ref, image.manifest_digest, image.manifest.layers)


def _cri_proxy(cri: CriConfig, registry: RegistryConfig) -> CriProxy | None:
    if not cri.address:
        return None
    from snapshotter.cri.credentials import CriCredentialStore
    from snapshotter.cri.proxy import CriProxy, registry_accepts

    if not registry.cri_credentials:
        log.warning("cri proxy without [registry] cri_credentials: pull secrets are forwarded but not kept")
    store = CriCredentialStore(Path(registry.cri_credentials)) if registry.cri_credentials else None
    return CriProxy(Path(cri.address), cri.containerd_address, store, registry_accepts(registry), cri.prefetch_roots)


def socket_refuses(path: Path, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """None if something accepts a connection on the unix socket `path`,
    else why not."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return f"{path} does not accept connections: {exc.strerror or exc}"
    return None


def _wait_accepting(paths: Sequence[Path], timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while (reason := next(filter(None, map(socket_refuses, paths)), None)) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f} s: {reason}")
        time.sleep(0.01)


class _Health:
    """The snapshotter can do its job: its metadata store answers a read
    transaction and is still the file on disk, and its sockets accept."""

    def __init__(self, snapshotter: Snapshotter, sockets: Sequence[Path]) -> None:
        self._snapshotter = snapshotter
        self._sockets = tuple(sockets)
        self._data_file = snapshotter.store.path / "data.mdb"
        self._identity = self._file_identity()
        # The store is closed at shutdown while a check may be running.
        self._lock = threading.Lock()
        self._closed = False

    def _file_identity(self) -> tuple[int, int]:
        st = os.stat(self._data_file)
        return st.st_dev, st.st_ino

    def __call__(self) -> str | None:
        with self._lock:
            if self._closed:
                return "the snapshotter has stopped"
            try:
                with self._snapshotter.store.read() as txn:
                    txn.get("\x00health")
            except Exception as exc:
                return f"the metadata store {self._snapshotter.store.path} cannot be read: {exc}"
        try:
            replaced = self._file_identity() != self._identity
        except OSError as exc:
            replaced, why = True, exc.strerror
        else:
            why = "replaced"
        if replaced:
            return (
                f"the metadata store {self._data_file} was removed or replaced while open ({why}): "
                "what is recorded from now on is lost at the next start"
            )
        for path in self._sockets:
            if (reason := socket_refuses(path)) is not None:
                return reason
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True


def serve(
    config: SnapshotterConfig,
    fs: FsConfig,
    registry: RegistryConfig,
    cri: CriConfig | None = None,
    trust: TrustConfig | None = None,
    *,
    on_started: Callable[[Callable[[], str | None]], None] = lambda _health: None,
    on_ready: Callable[[], None] = lambda: None,
    on_stopping: Callable[[], None] = lambda: None,
) -> None:
    """Serve until SIGTERM or SIGINT.

    `on_started(health)` once the store is open and the servers run
    (`health()`: None when healthy, else why not); `on_ready()` once every
    socket accepts; `on_stopping()` when a signal starts the shutdown."""
    snapshotter = Snapshotter(config.root, _remote_layers(config, fs, registry, trust or TrustConfig()))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    pb_grpc.add_SnapshotsServicer_to_server(SnapshotsService(snapshotter), server)
    proxy = _cri_proxy(cri or CriConfig(), registry)
    pulls: PullService | None = None
    # Only what this process bound is removed at the end.
    bound: list[Path] = []
    health: _Health | None = None
    stopping = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Nothing more: the handler runs between two bytecodes of the main
        # thread, which may be inside a log call holding the log's lock.
        signals.append(signum)
        stopping.set()

    try:
        _prepare_socket(config.address)
        server.add_insecure_port(f"unix://{config.address.resolve()}")
        server.start()
        bound.append(config.address)
        os.chmod(config.address, 0o660)
        if config.pull_address:
            pull_address = Path(config.pull_address)
            _prepare_socket(pull_address)
            pulls = PullService(pull_address, registry, _head_start(snapshotter.remote))
            pulls.start()
            bound.append(pull_address)
        if proxy is not None:
            proxy.start()
            bound.append(proxy.address)
        health = _Health(snapshotter, bound)
        on_started(health)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        _wait_accepting(bound)
        log.info(
            "serving",
            address=str(config.address),
            root=str(config.root),
            lazy=config.lazy,
            metrics=config.metrics_address or None,
            cri=(cri.address if cri else "") or None,
            pulls=config.pull_address or None,
        )
        on_ready()
        # The kernel may hand SIGTERM to one of gRPC's threads; Python then
        # runs the handler only when the main thread next runs bytecode, so
        # it must not block for good.
        while not stopping.wait(SIGNAL_POLL_S):
            pass
        log.info("stopping", signal=signal.Signals(signals[0]).name)
        on_stopping()
    finally:
        if proxy is not None and proxy.address in bound:
            proxy.stop()
        server.stop(SHUTDOWN_GRACE_S).wait()
        if pulls is not None:
            pulls.stop()
            pulls.address.unlink(missing_ok=True)
        if health is not None:
            health.close()
        snapshotter.close()
        if config.address in bound:
            config.address.unlink(missing_ok=True)
        log.info("stopped")
