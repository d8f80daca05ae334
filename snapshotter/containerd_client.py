"""A thin client for containerd's own gRPC services (content, images,
leases, snapshots, diff) over its unix socket.

Every call carries the `containerd-namespace` header, and the
`containerd-lease` header when made under a lease, as containerd's Go
client does. gRPC errors are left as `grpc.RpcError`; `code_of` reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from google.protobuf import field_mask_pb2

from proto.containerd.services.content.v1 import content_pb2, content_pb2_grpc
from proto.containerd.services.diff.v1 import diff_pb2, diff_pb2_grpc
from proto.containerd.services.images.v1 import images_pb2, images_pb2_grpc
from proto.containerd.services.leases.v1 import leases_pb2, leases_pb2_grpc
from proto.containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc
from proto.containerd.types import descriptor_pb2, mount_pb2
from snapshotter.labels import GC_EXPIRE

# A lease that outlives a crashed client is collected after this.
LEASE_EXPIRY = timedelta(hours=1)
# Another writer holding the same ingest ref: wait this long for it.
LOCKED_REF_WAIT = 30.0


def code_of(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.Call) else None


@dataclass(frozen=True)
class Blob:
    """A content-store blob: what containerd calls a descriptor."""

    media_type: str
    digest: str
    size: int

    def to_proto(self) -> descriptor_pb2.Descriptor:
        return descriptor_pb2.Descriptor(media_type=self.media_type, digest=self.digest, size=self.size)


class ContainerdClient:
    def __init__(self, address: Path, namespace: str) -> None:
        self.address = address
        self.namespace = namespace
        self.channel = grpc.insecure_channel(
            f"unix://{address}",
            options=[("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)],
        )
        self.content = content_pb2_grpc.ContentStub(self.channel)
        self.images = images_pb2_grpc.ImagesStub(self.channel)
        self.leases = leases_pb2_grpc.LeasesStub(self.channel)
        self.snapshots = snapshots_pb2_grpc.SnapshotsStub(self.channel)
        self.diff = diff_pb2_grpc.DiffStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ContainerdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def metadata(self, lease: str | None = None) -> tuple[tuple[str, str], ...]:
        namespace = ("containerd-namespace", self.namespace)
        return (namespace, ("containerd-lease", lease)) if lease else (namespace,)

    # -- leases ---------------------------------------------------------------

    @contextmanager
    def lease(self) -> Iterator[str]:
        """A lease for the duration of a `with` block; it also expires on its
        own (containerd.io/gc.expire) if this process dies first."""
        expire = (datetime.now(UTC) + LEASE_EXPIRY).strftime("%Y-%m-%dT%H:%M:%SZ")
        response = self.leases.Create(leases_pb2.CreateRequest(labels={GC_EXPIRE: expire}), metadata=self.metadata())
        try:
            yield response.lease.id
        finally:
            self.leases.Delete(leases_pb2.DeleteRequest(id=response.lease.id), metadata=self.metadata())

    def hold_snapshot(self, lease: str, snapshotter: str, key: str) -> None:
        """Keep snapshot `key` from containerd's garbage collector while the
        lease lives (it may hold nothing else that refers to it yet)."""
        resource = leases_pb2.Resource(id=key, type=f"snapshots/{snapshotter}")
        self.leases.AddResource(leases_pb2.AddResourceRequest(id=lease, resource=resource), metadata=self.metadata())

    # -- content --------------------------------------------------------------

    def content_info(self, digest: str) -> content_pb2.Info | None:
        try:
            return self.content.Info(content_pb2.InfoRequest(digest=digest), metadata=self.metadata()).info
        except grpc.RpcError as exc:
            if code_of(exc) == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def label_content(self, digest: str, labels: Mapping[str, str], lease: str | None = None) -> None:
        """Set `labels` on existing content, leaving its other labels alone."""
        info = content_pb2.Info(digest=digest, labels=dict(labels))
        mask = field_mask_pb2.FieldMask(paths=[f"labels.{key}" for key in labels])
        self.content.Update(content_pb2.UpdateRequest(info=info, update_mask=mask), metadata=self.metadata(lease))

    def write_content(
        self,
        ref: str,
        blob: Blob,
        chunks: Callable[[], Iterable[bytes]],
        labels: Mapping[str, str],
        lease: str | None = None,
    ) -> bool:
        """Write the bytes `chunks()` yields as `blob` under ingest `ref`
        (called again if the write has to start over); containerd checks size
        and digest on commit. If the blob is already stored only its labels
        are updated. Returns whether bytes were written."""
        deadline = time.monotonic() + LOCKED_REF_WAIT
        while True:
            try:
                self._write(ref, blob, chunks, labels, lease)
                return True
            except grpc.RpcError as exc:
                code = code_of(exc)
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    self.label_content(blob.digest, labels, lease)
                    return False
                # "ref ... locked": another client is writing the same blob.
                if (
                    code == grpc.StatusCode.UNAVAILABLE
                    and "locked" in (exc.details() or "")
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.5)
                    continue
                raise

    def _write(
        self, ref: str, blob: Blob, chunks: Callable[[], Iterable[bytes]], labels: Mapping[str, str], lease: str | None
    ) -> None:
        def requests() -> Iterator[content_pb2.WriteContentRequest]:
            offset = 0
            for data in chunks():
                yield content_pb2.WriteContentRequest(
                    action=content_pb2.WRITE,
                    ref=ref,
                    offset=offset,
                    data=data,
                    total=blob.size,
                    expected=blob.digest,
                )
                offset += len(data)
            yield content_pb2.WriteContentRequest(
                action=content_pb2.COMMIT,
                ref=ref,
                offset=offset,
                total=blob.size,
                expected=blob.digest,
                labels=dict(labels),
            )

        for _ in self.content.Write(requests(), metadata=self.metadata(lease)):
            pass

    # -- snapshots ------------------------------------------------------------

    def stat_snapshot(self, snapshotter: str, key: str) -> snapshots_pb2.Info | None:
        try:
            request = snapshots_pb2.StatSnapshotRequest(snapshotter=snapshotter, key=key)
            return self.snapshots.Stat(request, metadata=self.metadata()).info
        except grpc.RpcError as exc:
            if code_of(exc) == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def prepare_snapshot(
        self, snapshotter: str, key: str, parent: str, labels: Mapping[str, str], lease: str | None
    ) -> list[mount_pb2.Mount]:
        request = snapshots_pb2.PrepareSnapshotRequest(
            snapshotter=snapshotter, key=key, parent=parent, labels=dict(labels)
        )
        return list(self.snapshots.Prepare(request, metadata=self.metadata(lease)).mounts)

    def commit_snapshot(
        self, snapshotter: str, name: str, key: str, labels: Mapping[str, str], lease: str | None
    ) -> None:
        request = snapshots_pb2.CommitSnapshotRequest(snapshotter=snapshotter, name=name, key=key, labels=dict(labels))
        self.snapshots.Commit(request, metadata=self.metadata(lease))

    def remove_snapshot(self, snapshotter: str, key: str) -> None:
        request = snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key)
        self.snapshots.Remove(request, metadata=self.metadata())

    # -- diff -----------------------------------------------------------------

    def apply(self, blob: Blob, mounts: list[mount_pb2.Mount], lease: str | None) -> descriptor_pb2.Descriptor:
        """Unpack layer `blob` (already in the content store) onto `mounts`;
        returns the uncompressed layer's descriptor (its digest is the diff ID)."""
        request = diff_pb2.ApplyRequest(diff=blob.to_proto(), mounts=mounts)
        return self.diff.Apply(request, metadata=self.metadata(lease)).applied

    # -- images ---------------------------------------------------------------

    def put_image(self, name: str, target: Blob, labels: Mapping[str, str] | None = None) -> None:
        """Create the image record, or point an existing one at `target`."""
        image = images_pb2.Image(name=name, target=target.to_proto(), labels=dict(labels or {}))
        try:
            self.images.Create(images_pb2.CreateImageRequest(image=image), metadata=self.metadata())
        except grpc.RpcError as exc:
            if code_of(exc) != grpc.StatusCode.ALREADY_EXISTS:
                raise
            paths = ["target", *(f"labels.{key}" for key in labels or {})]
            request = images_pb2.UpdateImageRequest(image=image, update_mask=field_mask_pb2.FieldMask(paths=paths))
            self.images.Update(request, metadata=self.metadata())
