"""The layer indexes of a pull, end to end through containerd: the image's
indexes are listed once and every layer's index is fetched once for the
whole pull (the first Prepare sets them all going, the later Prepares take
what it fetched), and a corrupt index costs its own layer the lazy path,
nothing else."""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest

from snapshotter.layer.build import build_index
from snapshotter.layer.index import ARTIFACT_TYPE, LAYER_ANNOTATION, MEDIA_TYPE
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, PushedImage, busybox_layer
from tests.harness.registry import Registry
from tests.harness.trust import signed

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"


def _image(images: ImageBuilder, name: str) -> PushedImage:
    """Five layers of its own over busybox (which other images share)."""
    return images.push(
        name, [busybox_layer(), *([File(f"/layer{i}.txt", f"layer {i} of {name}\n".encode())] for i in range(1, 6))]
    )


def _index_blobs(ref: str) -> tuple[str, list[Descriptor]]:
    """The image's manifest digest, and the index blobs attached to it."""
    reference = parse_reference(ref)
    with RegistryClient(plain_http=True) as client:
        _, _, digest = client.fetch_manifest(reference)
        listed = artifact.referrers(client, reference, digest, ARTIFACT_TYPE)
    return digest, [blob for manifest in listed for blob in manifest.layers]


def _counts(output: str) -> tuple[int, int]:
    match = re.search(r"\((\d+) remote, (\d+) fetched", output)
    assert match, output
    return int(match.group(1)), int(match.group(2))


def test_a_pull_lists_and_fetches_each_layers_index_once(
    lazy_node: LazyNode, images: ImageBuilder, registry: Registry, unique: str
) -> None:
    # Layers of its own only: a layer stored through the proxy keeps
    # fetching its blocks from there, and the proxy goes with this test.
    name = f"indexes/once-{unique}"
    with faultproxy.running(registry.port) as proxy:
        lazy_node.layers.config.allow_plain_http(proxy.host)
        image = images.push(name, [[File(f"/layer{i}.txt", f"layer {i} of {name}\n".encode())] for i in range(6)])
        ref = image.ref.replace(registry.host, proxy.host)
        lazy_node.index(ref)
        manifest_digest, blobs = _index_blobs(ref)
        assert len(blobs) == len(image.layout.layer_digests)
        proxy.reset()
        assert _counts(lazy_node.pull(ref)) == (len(blobs), 0)
        fetched = [len(proxy.requests("GET", f"/blobs/{blob.digest}")) for blob in blobs]
        assert fetched == [1] * len(blobs), fetched
        # And the image's indexes were listed once, not once per layer.
        listings = proxy.requests("GET", f"/referrers/{manifest_digest}?artifactType={quote(ARTIFACT_TYPE, safe='')}")
        assert len(listings) == 1, listings


def test_a_corrupt_index_costs_its_layer_the_lazy_path_and_the_pull_goes_on(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    image = _image(images, f"indexes/corrupt-{unique}")
    bad = 2
    bad_layer = image.layout.layer_digests[bad]
    # Signed by the trusted key, so the node takes it, but not an index: what
    # a broken indexer (or a registry's bad disk) would publish.
    reference = parse_reference(image.ref)
    layer_blobs = image.layout.directory / "blobs" / "sha256"
    with RegistryClient(plain_http=True) as client:
        data, media_type, digest = client.fetch_manifest(reference)
        indexes = []
        for layer in image.layout.layer_digests:
            encoded = b"not an index" if layer == bad_layer else build_index(layer_blobs / layer[7:], layer).encode()
            pushed = client.push_blob(reference, encoded, media_type=MEDIA_TYPE)
            indexes.append(
                signed(Descriptor(MEDIA_TYPE, pushed.digest, pushed.size, annotations={LAYER_ANNOTATION: layer}))
            )
        artifact.push(client, reference, Descriptor(media_type, digest, len(data)), ARTIFACT_TYPE, indexes)

    remote, fetched = _counts(lazy_node.pull(image.ref))
    # busybox may be there already, from an earlier test's image.
    assert fetched == 1 and remote >= len(indexes) - 2
    refused = lazy_node.fallbacks("index_refused", bad_layer)
    assert refused and "is unusable" in refused[0], lazy_node.snapshotter.daemon.log_tail()
    c = lazy_node.containerd
    for i, chain in enumerate(image.layout.chain_ids):
        info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", chain).stdout
        assert (REMOTE_LABEL in info) == (i != bad), (i, info)
    shown = c.run(image.ref, f"corrupt-{unique}", "/bin/cat", "/layer2.txt", "/layer5.txt")
    assert shown == f"layer 2 of indexes/corrupt-{unique}\nlayer 5 of indexes/corrupt-{unique}\n"
    assert lazy_node.snapshotter.daemon.alive() and lazy_node.layers.daemon.alive()
