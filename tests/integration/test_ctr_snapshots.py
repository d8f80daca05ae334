"""`ctr snapshots --snapshotter bootseer ...` after a pull, and garbage collection.

These go through containerd's metadata layer to the proxy, as an operator's
commands would; mounts that the snapshotter hands out are mounted for real.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import tree
from tests.harness.containerd import Containerd, SnapshotRow
from tests.harness.oci import Dir, File, ImageBuilder, Layer, PushedImage
from tests.harness.snapshotter import Snapshotter

pytestmark = pytest.mark.integration

BIG = b"x" * 100_000


def _layers(token: str) -> list[Layer]:
    # The token makes every chain id unique to this image, so no other test's
    # image shares (and keeps alive) these snapshots.
    return [
        [File("/x", BIG), File("/token", token.encode())],
        [File("/y", b"y" * 5000)],
        [Dir("/z"), File("/z/leaf", b"leaf\n")],
    ]


# Paths each layer's snapshot shows (cumulative: a snapshot includes its parents).
LAYER_PATHS = [
    {"/", "/x", "/token"},
    {"/", "/x", "/token", "/y"},
    {"/", "/x", "/token", "/y", "/z", "/z/leaf"},
]


def snapshots_cmd(containerd: Containerd, *args: str, check: bool = True) -> str:
    return containerd.ctr("snapshots", "--snapshotter", "bootseer", *args, check=check).stdout


def mounts_from(output: str) -> list[tree.Mount]:
    return [tree.Mount.from_ctr_json(m) for m in json.loads(output)]


@dataclass(frozen=True)
class Pulled:
    image: PushedImage  # all three layers
    # Images of the first one, two and three layers: same blobs, same chain ids.
    prefixes: tuple[PushedImage, ...]


@pytest.fixture(scope="module")
def pulled(containerd: Containerd, images: ImageBuilder) -> Iterator[Pulled]:
    token = uuid.uuid4().hex[:10]
    layers = _layers(token)
    prefixes = tuple(images.push(f"snapshots/prefix-{n}-{token}", layers[:n]) for n in range(1, len(layers) + 1))
    for image in prefixes:
        containerd.pull(image.ref)
    yield Pulled(image=prefixes[-1], prefixes=prefixes)
    containerd.ctr("images", "rm", "--sync", *(image.ref for image in prefixes))


def test_ls_lists_committed_layers_with_parents(containerd: Containerd, pulled: Pulled) -> None:
    rows = containerd.snapshots()
    chain = pulled.image.layout.chain_ids
    for i, chain_id in enumerate(chain):
        want = SnapshotRow(parent=chain[i - 1] if i else "", kind="Committed")
        assert rows.get(chain_id) == want, rows


def test_info_prints_json(containerd: Containerd, pulled: Pulled) -> None:
    bottom, middle = pulled.image.layout.chain_ids[:2]
    info = json.loads(snapshots_cmd(containerd, "info", middle))
    assert (info["Name"], info["Parent"], info["Kind"]) == (middle, bottom, "Committed")


def test_label_sets_and_clears(containerd: Containerd, pulled: Pulled, unique: str) -> None:
    key, label = pulled.image.layout.chain_ids[1], f"test.bootseer/{unique}"
    snapshots_cmd(containerd, "label", key, f"{label}=yes")
    assert json.loads(snapshots_cmd(containerd, "info", key))["Labels"][label] == "yes"
    # An empty value removes the label.
    snapshots_cmd(containerd, "label", key, f"{label}=")
    assert label not in json.loads(snapshots_cmd(containerd, "info", key)).get("Labels", {})


def test_usage_reports_sizes(containerd: Containerd, pulled: Pulled) -> None:
    usage: dict[str, tuple[int, int]] = {}
    table = snapshots_cmd(containerd, "usage", "-b", *pulled.image.layout.chain_ids)
    for line in table.splitlines()[1:]:
        key, size, inodes = line.split()
        usage[key] = (int(size), int(inodes))
    bottom, middle, top = pulled.image.layout.chain_ids
    # Usage is per snapshot (its own layer only), measured on disk.
    assert usage[bottom][0] >= len(BIG) and usage[bottom][1] >= 3, usage
    assert usage[middle][0] >= 5000 and usage[middle][1] >= 2, usage
    assert usage[top][1] >= 3, usage
    assert usage[middle][0] < len(BIG), usage


def test_rm_of_snapshot_with_children_fails(containerd: Containerd, pulled: Pulled) -> None:
    bottom = pulled.image.layout.chain_ids[0]
    result = containerd.ctr("snapshots", "--snapshotter", "bootseer", "rm", bottom, check=False)
    assert result.returncode != 0
    assert "child" in result.stderr, result.stderr
    assert bottom in containerd.snapshots()


def test_rm_of_leaf_active_snapshot(containerd: Containerd, pulled: Pulled, unique: str) -> None:
    key, top = f"leaf-{unique}", pulled.image.layout.chain_ids[-1]
    snapshots_cmd(containerd, "prepare", key, top)
    assert containerd.snapshots().get(key) == SnapshotRow(parent=top, kind="Active")
    snapshots_cmd(containerd, "rm", key)
    rows = containerd.snapshots()
    assert key not in rows and top in rows


def test_image_mount_views_each_layer(containerd: Containerd, pulled: Pulled, tmp_path: Path) -> None:
    # `ctr images mount` takes a View of the image's top layer under a lease
    # and mounts what the snapshotter returns. The one-layer image has a
    # single lower, which overlayfs refuses: that needs a read-only bind.
    for i, image in enumerate(pulled.prefixes):
        target = tmp_path / f"view-{i}"
        target.mkdir()
        containerd.ctr("images", "mount", "--snapshotter", "bootseer", image.ref, str(target))
        try:
            assert set(tree.walk(target).entries) == LAYER_PATHS[i]
            assert (target / "x").read_bytes() == BIG
            with pytest.raises(OSError):
                (target / "written").write_text("views are read-only\n")
        finally:
            containerd.ctr("images", "unmount", "--rm", str(target))


def test_prepare_write_commit(containerd: Containerd, pulled: Pulled, unique: str, tmp_path: Path) -> None:
    active, committed, check_key = f"active-{unique}", f"committed-{unique}", f"check-{unique}"
    top = pulled.image.layout.chain_ids[-1]
    mounts = mounts_from(snapshots_cmd(containerd, "prepare", "--mounts", active, top))
    with tree.mounted(mounts, tmp_path / "rw") as root:
        (root / "written").write_text("by the test\n")
        (root / "y").unlink()

    snapshots_cmd(containerd, "commit", committed, active)
    rows = containerd.snapshots()
    assert active not in rows
    assert rows.get(committed) == SnapshotRow(parent=top, kind="Committed")

    # A second active snapshot on top shows what was committed (a view
    # would do, but ctr gives views no GC root, so GC may take it any time).
    mounts = mounts_from(snapshots_cmd(containerd, "prepare", "--mounts", check_key, committed))
    try:
        with tree.mounted(mounts, tmp_path / "check") as root:
            assert set(tree.walk(root).entries) == LAYER_PATHS[2] - {"/y"} | {"/written"}
            assert (root / "written").read_text() == "by the test\n"
    finally:
        snapshots_cmd(containerd, "rm", check_key)
    snapshots_cmd(containerd, "rm", committed)
    assert committed not in containerd.snapshots()


def test_image_rm_sync_removes_snapshots_and_dirs(
    containerd: Containerd, snapshotter: Snapshotter, images: ImageBuilder, unique: str
) -> None:
    image = images.push(f"snapshots/gc-{unique}", _layers(unique))
    before = snapshotter.snapshot_ids()
    containerd.pull(image.ref)
    created = snapshotter.snapshot_ids() - before
    assert len(created) >= len(image.layout.chain_ids), created

    containerd.ctr("images", "rm", "--sync", image.ref)
    remaining = set(image.layout.chain_ids) & containerd.snapshots().keys()
    assert not remaining, f"still listed after GC: {remaining}"
    leaked = created & snapshotter.snapshot_ids()
    assert not leaked, f"snapshot dirs left under {snapshotter.snapshots_dir}: {sorted(leaked)}"
