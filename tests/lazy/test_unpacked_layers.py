"""A lazily pulled image whose layers became whole (fetched in the
background) is unpacked onto local disk by the layer server, and the
containers started from then on get plain overlayfs lowers: the same files
as containerd's own unpack, no request through the layer mount, and a start
that does not need the layer server at all. Containers started before keep
the layer mount."""

from __future__ import annotations

import hashlib
import random
import re
import urllib.request
from collections.abc import Iterator

import pytest

from snapshotter.fs.layers import LayerStore, layer_name
from tests.harness import tree
from tests.harness.images import awkward_layers
from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.oci import File, ImageBuilder, busybox_layer
from tests.harness.procs import wait_until
from tests.harness.registry import Registry

pytestmark = pytest.mark.integration

FUSE_REQUESTS = re.compile(r'^bootseer_fs_fuse_requests_total\{opcode="(\w+)"\} (\S+)$', re.MULTILINE)


def fuse_requests(node: LazyNode) -> dict[str, float]:
    """The FUSE requests the layer server has had, by opcode."""
    port = node.layers.config.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {op: float(n) for op, n in FUSE_REQUESTS.findall(text)}


@pytest.fixture
def unpacking_node(registry: Registry) -> Iterator[LazyNode]:
    node = start_lazy_node(registry.host, background_fetch=True, unpack_whole_layers=True)
    try:
        yield node
    finally:
        stop_lazy_node(node)


def test_whole_layers_are_served_from_local_disk(unpacking_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    node = unpacking_node
    image = images.push(f"lazy/unpacked-{unique}", awkward_layers(), cmd=["/bin/sleep", "600"])
    node.index(image.ref)
    node.pull(image.ref)
    c = node.containerd
    store = LayerStore(node.layers.config.store)
    trees = [store.tree_path(layer_name(digest)) for digest in image.layout.layer_digests]
    c.ctr("run", "-d", "--snapshotter", "bootseer", image.ref, f"before-{unique}", "/bin/sleep", "600")
    c.ctr("images", "pull", "--plain-http", "--snapshotter", "overlayfs", image.ref)
    c.ctr("run", "-d", "--snapshotter", "overlayfs", image.ref, f"ovl-{unique}", "/bin/sleep", "600")
    started = [f"before-{unique}", f"ovl-{unique}"]
    try:
        reference = tree.walk(c.task_rootfs(f"ovl-{unique}"))
        before = tree.walk(c.task_rootfs(f"before-{unique}"))
        assert before == reference, tree.diff(before, reference, "lazy", "overlayfs")
        wait_until(lambda: all(t.is_dir() for t in trees), 120, "every layer fetched whole and unpacked")

        requests = fuse_requests(node)
        started.append(f"after-{unique}")
        c.ctr("run", "-d", "--snapshotter", "bootseer", image.ref, f"after-{unique}", "/bin/sleep", "600")
        after = tree.walk(c.task_rootfs(f"after-{unique}"))
        assert after == reference, tree.diff(after, reference, "unpacked", "overlayfs")
        assert fuse_requests(node) == requests, "the start went through the layer mount"
        # The container started before still reads through the layer mount.
        assert tree.walk(c.task_rootfs(f"before-{unique}")) == reference

        # The layer server gone (its mount kept by the holder, so a request
        # would wait for the next server): a new container starts all the same.
        node.layers.kill9()
        out = c.ctr(
            "run", "--rm", "--snapshotter", "bootseer", image.ref, f"down-{unique}", "/bin/cat", "/data/keep.txt"
        )
        assert out.stdout == "keep\n"
        node.layers.start()
    finally:
        for container in started:
            c.remove_container(container, check=False)


def test_a_mount_of_unpacked_and_served_layers_together(registry: Registry, images: ImageBuilder, unique: str) -> None:
    """The product's defaults: only small layers are fetched whole (and so
    unpacked); a container's lowers are then some local, some the mount."""
    big = random.Random(23).randbytes(3 << 20)
    node = start_lazy_node(registry.host, unpack_whole_layers=True, whole_layer_bytes=2 << 20)
    try:
        image = images.push(f"lazy/mixed-{unique}", [busybox_layer(), [File("/big", big)]], cmd=["/bin/sleep", "600"])
        node.index(image.ref)
        node.pull(image.ref)
        c = node.containerd
        store = LayerStore(node.layers.config.store)
        small, large = (store.tree_path(layer_name(d)) for d in image.layout.layer_digests)
        c.ctr("run", "-d", "--snapshotter", "bootseer", image.ref, f"first-{unique}", "/bin/sleep", "600")
        try:
            wait_until(small.is_dir, 60, "the small layer fetched whole and unpacked")
            # Nothing has read /big yet: its layer is not whole, so still served.
            assert not large.exists()
            out = c.ctr(
                "run", "--rm", "--snapshotter", "bootseer", image.ref, f"mixed-{unique}", "/bin/sha256sum", "/big"
            )
            assert out.stdout.split()[0] == hashlib.sha256(big).hexdigest()
        finally:
            c.remove_container(f"first-{unique}", check=False)
    finally:
        stop_lazy_node(node)
