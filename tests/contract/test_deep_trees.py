"""A tree deeper than PATH_MAX and Python's recursion limit, as a hostile
image or container leaves it, through every RPC that walks a snapshot:
Usage, Commit, Remove and Cleanup."""

from __future__ import annotations

import itertools
from pathlib import Path

from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from tests.contract.conftest import Client
from tests.contract.deep_tree import build_deep_tree, remove_deep_tree

_names = itertools.count()


def _unique(prefix: str) -> str:
    return f"default/deep-{next(_names)}/{prefix}"


def test_deep_tree_is_measured_committed_and_removed(client: Client) -> None:
    key, name = _unique("extract"), _unique("sha256:deep")
    [mount] = client.stub.Prepare(pb.PrepareSnapshotRequest(key=key)).mounts
    own = Path(mount.source).parent
    try:
        counted = build_deep_tree(Path(mount.source))
        active = client.stub.Usage(pb.UsageRequest(key=key))
        assert (active.size, active.inodes) == (counted.size, counted.inodes)
        client.stub.Commit(pb.CommitSnapshotRequest(name=name, key=key))
        assert client.stub.Usage(pb.UsageRequest(key=name)) == active
        client.stub.Remove(pb.RemoveSnapshotRequest(key=name))
        assert not {own.name, f"rm-{own.name}"} & client.process.snapshot_ids()
    finally:
        remove_deep_tree(own)
        remove_deep_tree(own.with_name(f"rm-{own.name}"))


def test_cleanup_removes_a_deep_orphan(client: Client) -> None:
    # What a Remove cut short by a crash leaves.
    orphan = client.process.snapshots_dir / "rm-424242"
    try:
        (orphan / "fs").mkdir(parents=True)
        build_deep_tree(orphan / "fs")
        client.stub.Cleanup(pb.CleanupRequest())
        assert not orphan.exists()
    finally:
        remove_deep_tree(orphan)
