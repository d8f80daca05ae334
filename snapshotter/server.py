"""The snapshotter daemon: the gRPC service on a unix socket, metrics,
signals; and, with `[cri] address` set, the CRI image-service proxy
(snapshotter.cri) on its own socket."""

from __future__ import annotations

import os
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import prometheus_client
import structlog

from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from snapshotter.cri.settings import CriConfig
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.settings import FsConfig
from snapshotter.registry.settings import RegistryConfig
from snapshotter.remote import RemoteLayers
from snapshotter.service import SnapshotsService
from snapshotter.settings import SnapshotterConfig
from snapshotter.snapshots import Snapshotter

if TYPE_CHECKING:
    from snapshotter.cri.proxy import CriProxy
    from snapshotter.registry.client import RegistryClient

log = structlog.get_logger("bootseer.snapshotter")

# containerd issues many calls at once while unpacking and garbage collecting.
WORKERS = 16
SHUTDOWN_GRACE_S = 5.0


def _bind_metrics(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address {address!r} must be host:port")
    prometheus_client.start_http_server(int(port), addr=host or "127.0.0.1")


def _prepare_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        # Left by a previous instance that was killed; nobody serves it.
        path.unlink()
    elif path.exists():
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")


def _remote_layers(config: SnapshotterConfig, fs: FsConfig, registry: RegistryConfig) -> RemoteLayers | None:
    if not config.lazy:
        return None

    def client() -> RegistryClient:
        from snapshotter.registry.config import client_from_config

        return client_from_config(registry)

    return RemoteLayers(LayerStore(fs.store), fs.mountpoint, client, fs.layer_gc_grace_s)


def _cri_proxy(cri: CriConfig, registry: RegistryConfig) -> CriProxy | None:
    if not cri.address:
        return None
    from snapshotter.cri.credentials import CriCredentialStore
    from snapshotter.cri.proxy import CriProxy, registry_accepts

    if not registry.cri_credentials:
        log.warning("cri proxy without [registry] cri_credentials: pull secrets are forwarded but not kept")
    store = CriCredentialStore(Path(registry.cri_credentials)) if registry.cri_credentials else None
    return CriProxy(Path(cri.address), cri.containerd_address, store, registry_accepts(registry))


def serve(config: SnapshotterConfig, fs: FsConfig, registry: RegistryConfig, cri: CriConfig | None = None) -> None:
    """Serve until SIGTERM or SIGINT."""
    snapshotter = Snapshotter(config.root, _remote_layers(config, fs, registry))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    pb_grpc.add_SnapshotsServicer_to_server(SnapshotsService(snapshotter), server)
    _prepare_socket(config.address)
    server.add_insecure_port(f"unix://{config.address.resolve()}")
    server.start()
    os.chmod(config.address, 0o660)
    proxy = _cri_proxy(cri or CriConfig(), registry)
    if proxy is not None:
        proxy.start()
    if config.metrics_address:
        _bind_metrics(config.metrics_address)

    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "serving",
        address=str(config.address),
        root=str(config.root),
        lazy=config.lazy,
        metrics=config.metrics_address or None,
        cri=(cri.address if cri else "") or None,
    )
    stopping.wait()
    if proxy is not None:
        proxy.stop()
    server.stop(SHUTDOWN_GRACE_S).wait()
    snapshotter.close()
    config.address.unlink(missing_ok=True)
    log.info("stopped")
