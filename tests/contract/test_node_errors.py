"""When the node, not the request, is at fault (the layer server is down,
the disk is full), the answer is a code containerd understands and a
message that says what is wrong and what to do, not a bare errno."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from snapshotter import labels
from tests.harness.layerserver import LayerServer, start_layer_server
from tests.harness.snapshotter import Snapshotter, start_snapshotter

pytestmark = pytest.mark.integration


@dataclass
class Node:
    layers: LayerServer
    snapshotter: Snapshotter
    stub: pb_grpc.SnapshotsStub


@pytest.fixture
def node() -> Iterator[Node]:
    """A layer server and a snapshotter configured to use it, as on a node."""
    layers = start_layer_server([])
    try:
        snapshotter = start_snapshotter(["--config", str(layers.config.path)])
        try:
            with grpc.insecure_channel(f"unix://{snapshotter.address}") as channel:
                yield Node(layers, snapshotter, pb_grpc.SnapshotsStub(channel))
        finally:
            assert not snapshotter.teardown()
    finally:
        assert not layers.teardown()


def refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def test_layer_server_down_is_said_in_words(node: Node) -> None:
    stub, mountpoint = node.stub, node.layers.config.mountpoint
    [mount] = stub.Prepare(pb.PrepareSnapshotRequest(key="default/1/extract")).mounts
    stub.Commit(pb.CommitSnapshotRequest(name="default/1/layer", key="default/1/extract"))
    stub.Prepare(pb.PrepareSnapshotRequest(key="default/1/ctr", parent="default/1/layer"))
    # Make the layer what the lazy Prepare path leaves: its files a symlink
    # to its directory in the layer server's mount, and the remote label.
    fs = Path(mount.source)
    fs.rmdir()
    fs.symlink_to(mountpoint / ("ab" * 32))
    stub.Update(
        pb.UpdateSnapshotRequest(
            info=pb.Info(name="default/1/layer", labels={labels.REMOTE: "true"}),
            update_mask={"paths": [f"labels.{labels.REMOTE}"]},
        )
    )
    # A killed FUSE server that nobody restarts, once its connection's
    # keeper lets go, leaves its mount answering ENOTCONN.
    node.layers.kill9()
    node.layers.abandon()
    with pytest.raises(OSError) as dead:
        os.stat(mountpoint)
    assert dead.value.errno == errno.ENOTCONN

    calls: list[Callable[[], object]] = [
        lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="default/1/next", parent="default/1/layer")),
        lambda: stub.View(pb.ViewSnapshotRequest(key="default/1/view", parent="default/1/layer")),
        lambda: stub.Mounts(pb.MountsRequest(key="default/1/ctr")),
    ]
    for call in calls:
        code, message = refused(call)
        assert code == grpc.StatusCode.UNAVAILABLE, message
        assert "'default/1/layer' is served lazily by the bootseer layer server, which is not running" in message
        assert f"its mount at {mountpoint} answers ENOTCONN" in message
        assert "start bootseer-layer-server" in message

    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=True)
    code, message = refused(calls[0])
    assert code == grpc.StatusCode.UNAVAILABLE, message
    assert f"nothing is mounted at {mountpoint}; start bootseer-layer-server" in message


@pytest.fixture
def full_disk() -> Iterator[Snapshotter]:
    """A snapshotter whose snapshots/ is a filesystem with no inode left."""
    snapshotter = start_snapshotter()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=32", "bootseer-full", str(snapshotter.snapshots_dir)],
            check=True,
        )
        for n in range(32):
            try:
                (snapshotter.snapshots_dir / f"filler-{n}").mkdir()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        else:
            raise AssertionError("the tmpfs never filled up")
        yield snapshotter
    finally:
        assert not snapshotter.teardown()


def test_full_disk_is_said_in_words(full_disk: Snapshotter) -> None:
    with grpc.insecure_channel(f"unix://{full_disk.address}") as channel:
        stub = pb_grpc.SnapshotsStub(channel)
        code, message = refused(lambda: stub.Prepare(pb.PrepareSnapshotRequest(key="default/1/a")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, message
    assert f"Prepare failed: No space left on device at {full_disk.snapshots_dir}/new-" in message
    assert "the filesystem is full: free space on it" in message
