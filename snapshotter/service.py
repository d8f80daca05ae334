"""The gRPC face of the snapshotter: containerd.services.snapshots.v1.Snapshots.

Translates requests into Snapshotter calls and its errors into the status
codes containerd expects; nothing here knows about directories or LMDB.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import empty_pb2, timestamp_pb2

from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from proto.containerd.types import mount_pb2
from snapshotter import metrics
from snapshotter.errors import SnapshotError, Unavailable, from_os_error
from snapshotter.model import Snapshot
from snapshotter.mounts import Mount
from snapshotter.snapshots import Snapshotter

log = structlog.get_logger("bootseer.snapshotter")

# List streams its answer in batches, as containerd's own service does.
LIST_BATCH = 100

R = TypeVar("R")


@contextmanager
def _served(name: str, request: Any, context: grpc.ServicerContext) -> Iterator[None]:
    """Map SnapshotError, and OSError whose errno says what to do, to a status
    code containerd understands; log and count every call."""
    start = time.perf_counter()
    code = grpc.StatusCode.OK
    try:
        yield
    except SnapshotError as exc:
        code = exc.code
        # Unavailable is the node's trouble (a daemon down), not the caller's.
        report = log.warning if isinstance(exc, Unavailable) else log.info
        report("rpc refused", method=name, code=code.name, error=str(exc))
        context.abort(code, str(exc))
    except Exception as exc:
        known = from_os_error(exc, f"{name} failed") if isinstance(exc, OSError) else None
        if known is None:
            code = grpc.StatusCode.INTERNAL
            log.exception("rpc failed", method=name)
            context.abort(code, f"{name} failed: {exc}")
        else:
            code = known.code
            log.warning("rpc failed", method=name, code=code.name, error=str(known))
            context.abort(code, str(known))
    finally:
        metrics.RPCS.labels(name, code.name).inc()
        metrics.RPC_SECONDS.labels(name).observe(time.perf_counter() - start)
        log.debug("rpc", method=name, code=code.name, key=getattr(request, "key", None))


def _rpc(method: Callable[..., R]) -> Callable[..., R]:
    @functools.wraps(method)
    def wrapper(self: SnapshotsService, request: Any, context: grpc.ServicerContext) -> R:
        with _served(method.__name__, request, context):
            return method(self, request, context)

    return wrapper


def _stream_rpc(method: Callable[..., Iterator[R]]) -> Callable[..., Iterator[R]]:
    """_rpc for server-streaming methods, whose errors surface while iterating."""

    @functools.wraps(method)
    def wrapper(self: SnapshotsService, request: Any, context: grpc.ServicerContext) -> Iterator[R]:
        with _served(method.__name__, request, context):
            yield from method(self, request, context)

    return wrapper


def _mounts_pb(mounts: list[Mount]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, target=m.target, options=m.options) for m in mounts]


def _timestamp(ns: int) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(ns)
    return ts


def info_pb(snap: Snapshot) -> pb.Info:
    return pb.Info(
        name=snap.key,
        parent=snap.parent,
        kind=pb.Kind.Name(snap.kind),
        created_at=_timestamp(snap.created_ns),
        updated_at=_timestamp(snap.updated_ns),
        labels=snap.labels,
    )


class SnapshotsService(pb_grpc.SnapshotsServicer):
    def __init__(self, snapshotter: Snapshotter) -> None:
        self.snapshotter = snapshotter

    @_rpc
    def Prepare(self, request: pb.PrepareSnapshotRequest, context: grpc.ServicerContext) -> pb.PrepareSnapshotResponse:
        mounts = self.snapshotter.prepare(request.key, request.parent, dict(request.labels))
        return pb.PrepareSnapshotResponse(mounts=_mounts_pb(mounts))

    @_rpc
    def View(self, request: pb.ViewSnapshotRequest, context: grpc.ServicerContext) -> pb.ViewSnapshotResponse:
        mounts = self.snapshotter.view(request.key, request.parent, dict(request.labels))
        return pb.ViewSnapshotResponse(mounts=_mounts_pb(mounts))

    @_rpc
    def Mounts(self, request: pb.MountsRequest, context: grpc.ServicerContext) -> pb.MountsResponse:
        return pb.MountsResponse(mounts=_mounts_pb(self.snapshotter.mounts(request.key)))

    @_rpc
    def Commit(self, request: pb.CommitSnapshotRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self.snapshotter.commit(request.name, request.key, dict(request.labels))
        return empty_pb2.Empty()

    @_rpc
    def Remove(self, request: pb.RemoveSnapshotRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self.snapshotter.remove(request.key)
        return empty_pb2.Empty()

    @_rpc
    def Stat(self, request: pb.StatSnapshotRequest, context: grpc.ServicerContext) -> pb.StatSnapshotResponse:
        return pb.StatSnapshotResponse(info=info_pb(self.snapshotter.stat(request.key)))

    @_rpc
    def Update(self, request: pb.UpdateSnapshotRequest, context: grpc.ServicerContext) -> pb.UpdateSnapshotResponse:
        snap = self.snapshotter.update(request.info.name, dict(request.info.labels), list(request.update_mask.paths))
        return pb.UpdateSnapshotResponse(info=info_pb(snap))

    @_stream_rpc
    def List(
        self, request: pb.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ListSnapshotsResponse]:
        batch: list[pb.Info] = []
        for snap in self.snapshotter.list(list(request.filters)):
            batch.append(info_pb(snap))
            if len(batch) == LIST_BATCH:
                yield pb.ListSnapshotsResponse(info=batch)
                batch = []
        if batch:
            yield pb.ListSnapshotsResponse(info=batch)

    @_rpc
    def Usage(self, request: pb.UsageRequest, context: grpc.ServicerContext) -> pb.UsageResponse:
        usage = self.snapshotter.usage(request.key)
        return pb.UsageResponse(size=usage.size, inodes=usage.inodes)

    @_rpc
    def Cleanup(self, request: pb.CleanupRequest, context: grpc.ServicerContext) -> empty_pb2.Empty:
        removed = self.snapshotter.cleanup()
        if removed:
            log.info("cleanup removed orphaned directories", count=len(removed), names=removed)
        return empty_pb2.Empty()
