"""A hostile layer index end to end: published for an image and pulled
while another image's container runs from the same layer server, it costs
its own layer the lazy path and nothing else: the layer server keeps
serving, and the image still runs."""

from __future__ import annotations

import msgspec
import pytest

from snapshotter.layer.build import build_index
from snapshotter.layer.index import ARTIFACT_TYPE, LAYER_ANNOTATION, MEDIA_TYPE, EntryType
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, PushedImage, busybox_layer
from tests.harness.trust import signed

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"


def publish_hostile_index(image: PushedImage, entry: str, **changes: object) -> None:
    """Index `image` as `bootseer index` would, but for `changes` to entry
    `entry`, and publish it signed: what a compromised indexer (one holding
    the trusted key) could push."""
    reference = parse_reference(image.ref)
    blobs = image.layout.directory / "blobs" / "sha256"
    with RegistryClient(plain_http=True) as client:
        data, media_type, digest = client.fetch_manifest(reference)
        indexes = []
        for layer in image.layout.layer_digests:
            index = build_index(blobs / layer.split(":")[1], layer)
            index.entries = [msgspec.structs.replace(e, **changes) if e.name == entry else e for e in index.entries]
            pushed = client.push_blob(reference, index.encode(), media_type=MEDIA_TYPE)
            blob = Descriptor(MEDIA_TYPE, pushed.digest, pushed.size, annotations={LAYER_ANNOTATION: layer})
            indexes.append(signed(blob))
        artifact.push(client, reference, Descriptor(media_type, digest, len(data)), ARTIFACT_TYPE, indexes)


def test_a_hostile_index_costs_its_layer_not_the_node(lazy_node: LazyNode, images: ImageBuilder, unique: str) -> None:
    good = images.push(f"hostile/good-{unique}", [busybox_layer(), [File("/good.txt", b"good\n")]])
    bad = images.push(f"hostile/bad-{unique}", [busybox_layer(), [File("/bad.txt", b"bad\n"), File("/link", b"")]])
    lazy_node.index(good.ref)
    lazy_node.pull(good.ref)
    c = lazy_node.containerd
    running = f"good-{unique}"
    c.ctr("run", "-d", "--snapshotter", "bootseer", good.ref, running, "/bin/sleep", "600")
    try:
        # The decoder takes it; the layer server cannot build its tree (a
        # hardlink to nothing), which used to end the server's main loop.
        publish_hostile_index(bad, "link", type=EntryType.HARDLINK, linkname="missing")
        before = lazy_node.layers.metric("bootseer_fs_layer_load_errors_total")
        lazy_node.pull(bad.ref)
        assert lazy_node.layers.metric("bootseer_fs_layer_load_errors_total") == before + 1
        # Its layer took the normal path, and the image runs.
        top = c.ctr("snapshots", "--snapshotter", "bootseer", "info", bad.layout.chain_ids[-1]).stdout
        assert REMOTE_LABEL not in top, top
        assert c.run(bad.ref, f"bad-{unique}", "/bin/cat", "/bad.txt") == "bad\n"

        # The node carries on: the running container reads, a new one starts.
        assert lazy_node.layers.daemon.alive(), lazy_node.layers.logs()
        assert c.exec(running, "read", "/bin/cat", "/good.txt") == "good\n"
        assert c.run(good.ref, f"good2-{unique}", "/bin/cat", "/good.txt") == "good\n"
    finally:
        c.remove_container(running)


# Values no kernel interface takes, in an index a trusted (but compromised)
# indexer signed: the decoder refuses each before anything is served.
HOSTILE_VALUES: dict[str, dict[str, object]] = {
    "uid 2^40": {"uid": 2**40},
    "mode 2^40": {"mode": 2**40},
    "device 2^40": {"type": EntryType.CHAR, "devmajor": 2**40},
    "mtime 1e300": {"mtime": 1e300},
    "5000 levels": {"name": "d/" * 4999 + "bad.txt"},
}


def test_hostile_values_in_a_signed_index_cost_their_layer_not_the_node(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    c = lazy_node.containerd
    with lazy_node.bystander(images, f"values-{unique}") as bystander:
        for n, (case, changes) in enumerate(HOSTILE_VALUES.items()):
            bad = images.push(f"hostile/values-{n}-{unique}", [busybox_layer(), [File("/bad.txt", f"{n}\n".encode())]])
            publish_hostile_index(bad, "bad.txt", **changes)
            lazy_node.pull(bad.ref)
            top = c.ctr("snapshots", "--snapshotter", "bootseer", "info", bad.layout.chain_ids[-1]).stdout
            assert REMOTE_LABEL not in top, (case, top)
            assert c.run(bad.ref, f"values-{n}-{unique}", "/bin/stat", "-c", "%u %a", "/bad.txt") == "0 644\n", case
            assert lazy_node.fallbacks("index_refused", bad.layout.layer_digests[-1]), case
            bystander.still_fine(case)
