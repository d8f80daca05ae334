"""`bootseer pull` against a real containerd, registry and bootseer snapshotter.

Until the snapshotter serves layers remotely every Prepare returns an active
snapshot, so these exercise the fallback (fetch, apply, commit) end to end;
containerd's own `ctr images pull` into overlayfs is the oracle.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import grpc
import pytest

from snapshotter.containerd_client import ContainerdClient, code_of
from snapshotter.pull import Puller, PullResult, chain_ids
from snapshotter.registry.client import RegistryClient
from tests.harness import tree
from tests.harness.containerd import Containerd
from tests.harness.oci import (
    CharDevice,
    Dir,
    File,
    Hardlink,
    ImageBuilder,
    Layer,
    Opaque,
    PushedImage,
    Symlink,
    Whiteout,
    busybox_layer,
)
from tests.harness.snapshotter import BOOTSEER_BIN

pytestmark = pytest.mark.integration


def _layers(token: str = "") -> list[Layer]:
    """Four layers; a `token` makes every one of them (and so every chain id) unique."""
    marker: Layer = [File(f"/markers/{token}", token.encode())] if token else []
    lower: Layer = [
        Dir("/data"),
        File("/data/keep.txt", b"keep\n"),
        File("/data/gone.txt", b"gone\n"),
        Dir("/data/replaced"),
        File("/data/replaced/old.txt", b"old\n"),
        File("/data/hard-a", b"one inode\n", mode=0o640, uid=1000, gid=1000),
        Hardlink("/data/hard-b", "/data/hard-a"),
        Symlink("/data/link", "keep.txt"),
        File("/data/xattr.txt", b"x\n", xattrs={"user.k": "v"}),
        File("/data/setuid", b"#!/bin/sh\n", mode=0o4755),
        CharDevice("/data/null-like", 1, 3),
        File("/data/big.bin", bytes(range(256)) * 8192),
    ]
    upper: Layer = [
        Dir("/data"),
        Whiteout("/data/gone.txt"),
        Dir("/data/replaced"),
        Opaque("/data/replaced"),
        File("/data/replaced/new.txt", b"new\n", uid=65534, gid=65534),
    ]
    top: Layer = [Dir("/data"), File("/data/keep.txt", b"keep v2\n", mode=0o600)]
    return [[*busybox_layer(), Dir("/markers"), *marker], [*lower, *marker], [*upper, *marker], [*top, *marker]]


def _bootseer_pull(containerd: Containerd, ref: str, snapshotter: str = "bootseer") -> str:
    """The CLI, as a user runs it."""
    result = subprocess.run(
        [
            str(BOOTSEER_BIN),
            "pull",
            ref,
            "--plain-http",
            "--address",
            str(containerd.address),
            "--namespace",
            containerd.namespace,
            "--snapshotter",
            snapshotter,
            "--log-format",
            "console",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _puller(containerd: Containerd, snapshotter: str = "bootseer") -> Iterator[Puller]:
    with (
        RegistryClient(plain_http=True) as registry,
        ContainerdClient(containerd.address, containerd.namespace) as ctrd,
    ):
        yield Puller(registry, ctrd, snapshotter)


def _pull(containerd: Containerd, ref: str, snapshotter: str = "bootseer") -> PullResult:
    for puller in _puller(containerd, snapshotter):
        return puller.pull(ref)
    raise AssertionError("unreachable")


def _rootfs_tree(containerd: Containerd, image: str, snapshotter: str) -> tree.Tree:
    container_id = f"pull-{uuid.uuid4().hex[:10]}"
    containerd.run(image, container_id, "/bin/sleep", "600", detach=True, snapshotter=snapshotter)
    try:
        return tree.walk(containerd.task_rootfs(container_id))
    finally:
        containerd.remove_container(container_id)


@pytest.fixture(scope="module")
def oracle(containerd: Containerd, images: ImageBuilder) -> Iterator[tuple[PushedImage, tree.Tree]]:
    """The image pulled by containerd itself into overlayfs, and its rootfs."""
    image = images.push(f"pull/oracle-{uuid.uuid4().hex[:8]}", _layers())
    containerd.pull(image.ref, "overlayfs")
    yield image, _rootfs_tree(containerd, image.ref, "overlayfs")
    containerd.ctr("images", "rm", "--sync", image.ref)


@pytest.mark.parametrize("target", ["bootseer", "overlayfs"])
def test_tree_matches_ctr_pull(
    containerd: Containerd, images: ImageBuilder, oracle: tuple[PushedImage, tree.Tree], unique: str, target: str
) -> None:
    image = images.push(f"pull/tree-{unique}", _layers())
    out = _bootseer_pull(containerd, image.ref, target)
    # overlayfs shares the oracle's layers, which are already unpacked there.
    assert ("0 remote, 4 fetched" if target == "bootseer" else "4 already present") in out, out
    ours = _rootfs_tree(containerd, image.ref, target)
    differences = tree.diff(ours, oracle[1], f"bootseer pull ({target})", "ctr pull (overlayfs)")
    assert not differences, differences
    assert ours.entries["/data/keep.txt"].size == len(b"keep v2\n")
    assert "/data/gone.txt" not in ours.entries
    assert frozenset({"/data/hard-a", "/data/hard-b"}) in ours.hardlinks
    containerd.ctr("images", "rm", "--sync", image.ref)


def test_run_after_pull_and_labels(containerd: Containerd, images: ImageBuilder, unique: str) -> None:
    image = images.push(f"pull/run-{unique}", _layers(unique), cmd=["/bin/cat", "/data/keep.txt"])
    result = _pull(containerd, image.ref)
    assert [layer.how for layer in result.layers] == ["fetched"] * 4
    assert result.name == image.ref
    assert containerd.run(image.ref, f"run-{unique}", "/bin/cat", "/data/keep.txt") == "keep v2\n"

    chains = chain_ids(image.layout.diff_ids)
    rows = containerd.snapshots("bootseer")
    assert [rows[c].kind for c in chains] == ["Committed"] * 4
    assert [rows[c].parent for c in chains] == ["", *chains[:-1]]
    # No extract-* snapshot survives a successful pull.
    assert not [k for k in rows if k.startswith("extract-")]
    info = containerd.ctr("snapshots", "--snapshotter", "bootseer", "info", chains[-1]).stdout
    assert f'"containerd.io/snapshot.ref": "{chains[-1]}"' in info
    assert "containerd.io/snapshot/cri.manifest-digest" in info
    images_out = containerd.ctr("images", "ls").stdout
    assert image.ref in images_out
    containerd.ctr("images", "rm", "--sync", image.ref)


def test_repull_is_idempotent(containerd: Containerd, images: ImageBuilder, unique: str) -> None:
    image = images.push(f"pull/again-{unique}", _layers(unique))
    first = _pull(containerd, image.ref)
    before = containerd.snapshots("bootseer")
    second = _pull(containerd, image.ref)
    assert [layer.how for layer in first.layers] == ["fetched"] * 4
    assert [layer.how for layer in second.layers] == ["present"] * 4
    assert second.fetched_bytes == 0
    assert containerd.snapshots("bootseer") == before
    assert containerd.ctr("images", "ls", "-q").stdout.split().count(image.ref) == 1
    containerd.ctr("images", "rm", "--sync", image.ref)


def test_images_rm_collects_everything(containerd: Containerd, images: ImageBuilder, unique: str) -> None:
    image = images.push(f"pull/gc-{unique}", _layers(unique))
    _pull(containerd, image.ref)
    chains = chain_ids(image.layout.diff_ids)
    assert chains[-1] in containerd.snapshots("bootseer")
    containerd.ctr("images", "rm", "--sync", image.ref)
    left = containerd.snapshots("bootseer")
    assert not [c for c in chains if c in left]
    content = containerd.ctr("content", "ls", "-q").stdout.split()
    layout_blobs = {p.name for p in (image.layout.directory / "blobs" / "sha256").iterdir()}
    assert not [d for d in content if d.removeprefix("sha256:") in layout_blobs]
    assert containerd.ctr("leases", "ls", "-q").stdout.split() == []


def test_bad_reference_and_missing_image(containerd: Containerd, images: ImageBuilder, unique: str) -> None:
    result = subprocess.run(
        [
            str(BOOTSEER_BIN),
            "pull",
            f"{images.registry_host}/pull/missing-{unique}:v1",
            "--plain-http",
            "--address",
            str(containerd.address),
            "--namespace",
            containerd.namespace,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert "not found" in result.stderr and f"pull/missing-{unique}" in result.stderr
    bad = subprocess.run(
        [str(BOOTSEER_BIN), "pull", "UPPER/case", "--address", str(containerd.address)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1 and "invalid repository" in bad.stderr


class _LayerArrivesFirst(ContainerdClient):
    """Between our Stat and our Prepare of the first layer, the layer becomes
    available (as when a remote snapshotter serves it, or a concurrent pull
    commits it): the real containerd then answers Prepare with ALREADY_EXISTS."""

    def __init__(self, *args: object, make_available: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.make_available = make_available
        self.already_exists_seen = 0

    def prepare_snapshot(self, snapshotter, key, parent, labels, lease):  # type: ignore[no-untyped-def]
        if self.make_available is not None:
            make, self.make_available = self.make_available, None
            make()  # type: ignore[operator]
        try:
            return super().prepare_snapshot(snapshotter, key, parent, labels, lease)
        except grpc.RpcError as exc:
            if code_of(exc) == grpc.StatusCode.ALREADY_EXISTS:
                self.already_exists_seen += 1
            raise


def test_already_exists_from_prepare_means_remote(containerd: Containerd, images: ImageBuilder, unique: str) -> None:
    layers = _layers(unique)
    twin = images.push(f"pull/twin-{unique}", layers)
    image = images.push(f"pull/raced-{unique}", layers, cmd=["/bin/true"])
    with RegistryClient(plain_http=True) as registry:

        def make_available() -> None:
            with ContainerdClient(containerd.address, containerd.namespace) as other:
                Puller(registry, other, "bootseer").pull(twin.ref)

        with _LayerArrivesFirst(containerd.address, containerd.namespace, make_available=make_available) as ctrd:
            result = Puller(registry, ctrd, "bootseer").pull(image.ref)
        assert ctrd.already_exists_seen == 1
    assert [layer.how for layer in result.layers] == ["remote", "present", "present", "present"]
    assert result.fetched_bytes == 0
    assert not [k for k in containerd.snapshots("bootseer") if k.startswith("extract-")]
    assert containerd.run(image.ref, f"raced-{unique}", "/bin/cat", "/data/keep.txt") == "keep v2\n"
    containerd.ctr("images", "rm", "--sync", image.ref, twin.ref)
