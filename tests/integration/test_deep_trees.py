"""A container that builds a directory tree deeper than PATH_MAX and Python's
recursion limit must not leave its snapshot behind, or stop containerd's
garbage collector: through containerd, Usage, Commit and Remove (which its
garbage collector calls, with Cleanup) work on such a tree."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract.deep_tree import DEPTH, build_deep_tree, remove_deep_tree
from tests.harness import tree
from tests.harness.containerd import Containerd
from tests.harness.oci import ImageBuilder, PushedImage, busybox_layer
from tests.harness.procs import wait_until
from tests.harness.snapshotter import Snapshotter

pytestmark = pytest.mark.integration

# Generous: containerd removes a snapshot from its garbage collector, which
# runs in the background some time after the removal.
GC_TIMEOUT_S = 60.0

# Rounds of `mkdir -p` and `cd -P` with a relative path short enough for any
# syscall: the shell never needs the absolute path of where it is.
_CHAIN = "/".join(["d"] * 100)
_BUILD_DEEP_TREE = (
    f"set -e; cd /tmp; i=0; while [ $i -lt {DEPTH // 100} ]; do "
    f"mkdir -p {_CHAIN}; cd -P {_CHAIN}; i=$((i+1)); done; echo leaf > leaf"
)


@pytest.fixture(scope="module")
def base(containerd: Containerd, images: ImageBuilder) -> Iterator[PushedImage]:
    image = images.push(f"deep/busybox-{uuid.uuid4().hex[:10]}", [busybox_layer()])
    containerd.pull(image.ref)
    yield image
    containerd.ctr("images", "rm", "--sync", image.ref)


def _snapshots(containerd: Containerd, *args: str) -> str:
    return containerd.ctr("snapshots", "--snapshotter", "bootseer", *args).stdout


def _usage(containerd: Containerd, key: str) -> tuple[int, int]:
    [row] = _snapshots(containerd, "usage", "-b", key).splitlines()[1:]
    _, size, inodes = row.split()
    return int(size), int(inodes)


def _wait_removed(snapshotter: Snapshotter, snap_id: str) -> None:
    wait_until(
        lambda: not {snap_id, f"rm-{snap_id}"} & snapshotter.snapshot_ids(),
        GC_TIMEOUT_S,
        f"containerd's garbage collector to have snapshot directory {snap_id} removed",
        snapshotter.daemon,
    )


def test_container_deep_tree_goes_with_the_container(
    containerd: Containerd, snapshotter: Snapshotter, base: PushedImage, unique: str
) -> None:
    container_id = f"deep-{unique}"
    before = snapshotter.snapshot_ids()
    containerd.ctr("run", "--snapshotter", "bootseer", base.ref, container_id, "/bin/sh", "-c", _BUILD_DEEP_TREE)
    [snap_id] = snapshotter.snapshot_ids() - before
    try:
        _, inodes = _usage(containerd, container_id)
        assert inodes > DEPTH
        containerd.remove_container(container_id)
        _wait_removed(snapshotter, snap_id)
    finally:
        containerd.remove_container(container_id, check=False)
        remove_deep_tree(snapshotter.snapshots_dir / snap_id)
        remove_deep_tree(snapshotter.snapshots_dir / f"rm-{snap_id}")


def test_deep_tree_committed_and_removed_through_containerd(
    containerd: Containerd, snapshotter: Snapshotter, base: PushedImage, unique: str, tmp_path: Path
) -> None:
    active, committed = f"deep-active-{unique}", f"deep-committed-{unique}"
    top = base.layout.chain_ids[-1]
    before = snapshotter.snapshot_ids()
    output = _snapshots(containerd, "prepare", "--mounts", active, top)
    [snap_id] = snapshotter.snapshot_ids() - before
    try:
        mounts = [tree.Mount.from_ctr_json(m) for m in json.loads(output)]
        with tree.mounted(mounts, tmp_path / "rw") as root:
            counted = build_deep_tree(root)
        # Through the overlay, the tree is the upper dir's.
        assert _usage(containerd, active) == (counted.size, counted.inodes)
        _snapshots(containerd, "commit", committed, active)
        assert _usage(containerd, committed) == (counted.size, counted.inodes)
        _snapshots(containerd, "rm", committed)
        _wait_removed(snapshotter, snap_id)
    finally:
        remove_deep_tree(snapshotter.snapshots_dir / snap_id)
        remove_deep_tree(snapshotter.snapshots_dir / f"rm-{snap_id}")
