"""Fetch units and when prefetching can start, through a real registry,
containerd, snapshotter and FUSE layer server: indexes built with the
default 1 MiB span and with the 4 MiB span of older indexes serve the same
bytes, a small read fetches one small block, and every layer of an image is
announced to the layer server (so its hot blocks are prefetched) as soon as
its index is in, before containerd prepares it."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from proto.containerd.types import mount_pb2
from snapshotter.containerd_client import ContainerdClient
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.control import read_request
from snapshotter.fs.layers import LayerStore, layer_name
from snapshotter.layer.index import DEFAULT_SPAN, LayerIndex
from snapshotter.pull import Puller
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.lazynode import LazyNode
from tests.harness.oci import Dir, File, ImageBuilder, PushedImage, busybox_layer

pytestmark = pytest.mark.integration

OLD_SPAN = 4 << 20
# Generous: waiting for an event, never a bound on how long it may take.
ANNOUNCE_TIMEOUT_S = 60.0


def data_image(images: ImageBuilder, name: str) -> tuple[PushedImage, dict[str, bytes]]:
    """A layer of 8 MiB of text (which compresses), 8 MiB of random bytes
    (which does not) and, after them, a small file."""
    rng = random.Random(name)
    words = [rng.randbytes(4).hex() for _ in range(500)]
    text = " ".join(rng.choice(words) for _ in range(1 << 20)).encode()[: 8 << 20]
    files = {
        "/data/text.txt": text,
        "/data/noise.bin": rng.randbytes(8 << 20),
        "/data/small.txt": b"small %d\n" % rng.randrange(1 << 30),
    }
    image = images.push(
        name,
        [busybox_layer(), [Dir("/data"), *(File(path, data) for path, data in files.items())]],
        cmd=["/bin/cat", "/data/small.txt"],
    )
    return image, files


def stored(node: LazyNode, layer_digest: str) -> tuple[LayerIndex, set[int]]:
    """The layer's stored index, and the numbers of its blocks in the cache."""
    store = LayerStore(node.layers.config.store)
    index, source = store.load(layer_name(layer_digest))
    block_index = BlockIndex(store.block_index_path)
    try:
        return index, set(block_index.cached(source.cache_key))
    finally:
        block_index.close()


@pytest.mark.parametrize("span", [None, OLD_SPAN], ids=["default-span", "old-4MiB-span"])
def test_indexes_of_either_span_serve_the_layer(
    lazy_node: LazyNode, images: ImageBuilder, unique: str, span: int | None
) -> None:
    image, files = data_image(images, f"units/span-{span or 'default'}-{unique}")
    if span is None:
        lazy_node.index(image.ref)
    else:
        lazy_node.bootseer("index", "--quiet", "--span", str(span), image.ref)
    lazy_node.pull(image.ref)
    c = lazy_node.containerd
    assert c.run(image.ref, f"small-{unique}-{span}") == files["/data/small.txt"].decode()
    index, cached = stored(lazy_node, image.layout.layer_digests[-1])
    built = span or DEFAULT_SPAN
    assert index.span == built
    entries = {"/" + e.name: e for e in index.entries}
    small = entries["/data/small.txt"]
    # Reading the small file fetched its block and no other.
    assert cached == set(index.block_range(small.offset, small.offset + small.size))
    if span is None:
        # Text keeps blocks of about a span (zran ends each at a deflate
        # block boundary at least a span on): far smaller than 4 MiB ones.
        text = entries["/data/text.txt"]
        inside = index.block_range(text.offset + built, text.offset + text.size - built)
        assert len(inside) >= 4
        assert max(index.blocks[n].uend - index.blocks[n].ustart for n in inside) < 2 * built
    out = c.run(
        image.ref, f"all-{unique}-{span}", "/bin/sha256sum", "/data/text.txt", "/data/noise.bin", "/data/small.txt"
    )
    sums = {path: digest for digest, path in (line.split() for line in out.splitlines())}
    assert sums == {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}


class _WatchingPrepares(ContainerdClient):
    """Before the Prepare of the image's top layer, wait until the layer
    server's request file for the image lists that layer: the snapshotter
    announced it while it prepared the layers below."""

    def __init__(self, address: Path, namespace: str, store: LayerStore, manifest_hex: str, top_chain: str) -> None:
        super().__init__(address, namespace)
        self.store = store
        self.manifest_hex = manifest_hex
        self.top_chain = top_chain
        self.top_layer = ""
        self.announced_before_prepare = False

    def prepare_snapshot(
        self, snapshotter: str, key: str, parent: str, labels: Mapping[str, str], lease: str | None
    ) -> list[mount_pb2.Mount]:
        if key.endswith(" " + self.top_chain):
            deadline = time.monotonic() + ANNOUNCE_TIMEOUT_S
            while time.monotonic() < deadline and not self.announced_before_prepare:
                request = read_request(self.store, self.manifest_hex)
                self.announced_before_prepare = request is not None and self.top_layer in request.layers
                time.sleep(0.05)
        return super().prepare_snapshot(snapshotter, key, parent, labels, lease)


def test_layers_are_announced_before_containerd_prepares_them(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    rng = random.Random(unique)
    image = images.push(
        f"units/early-{unique}",
        [busybox_layer(), [File("/one.bin", rng.randbytes(1 << 20))], [File("/two.bin", rng.randbytes(1 << 20))]],
        cmd=["/bin/true"],
    )
    lazy_node.index(image.ref)
    c = lazy_node.containerd
    store = LayerStore(lazy_node.layers.config.store)
    with RegistryClient(plain_http=True) as registry:
        manifest_hex = registry.resolve(parse_reference(image.ref)).manifest_digest.split(":", 1)[1]
        watching = _WatchingPrepares(c.address, c.namespace, store, manifest_hex, image.layout.chain_ids[-1])
        watching.top_layer = image.layout.layer_digests[-1]
        with watching:
            result = Puller(registry, watching, "bootseer").pull(image.ref)
    assert [layer.how for layer in result.layers][1:] == ["remote", "remote"]
    assert watching.announced_before_prepare
