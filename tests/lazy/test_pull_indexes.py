"""The layer indexes of a pull, end to end through containerd: the image's
indexes are listed once and every layer's index is fetched once for the
whole pull (`bootseer pull` sets them all going as soon as it has the image
manifest, before containerd prepares any layer, and a Prepare that finds
none on its way does the same; the later Prepares take what was fetched),
and a corrupt index costs its own layer the lazy path, nothing else."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import quote

import pytest

from snapshotter.layer.build import build_index
from snapshotter.layer.index import ARTIFACT_TYPE, LAYER_ANNOTATION, MEDIA_TYPE
from snapshotter.registry import artifact, media
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.faultproxy import FaultProxy
from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, PushedImage, busybox_layer
from tests.harness.procs import wait_until
from tests.harness.registry import Registry
from tests.harness.trust import signed

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"


def _image(images: ImageBuilder, name: str) -> PushedImage:
    """Five layers of its own over busybox (which other images share)."""
    return images.push(
        name, [busybox_layer(), *([File(f"/layer{i}.txt", f"layer {i} of {name}\n".encode())] for i in range(1, 6))]
    )


def _counts(output: str) -> tuple[int, int]:
    match = re.search(r"\((\d+) remote, (\d+) fetched", output)
    assert match, output
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class _Indexed:
    image: PushedImage
    ref: str  # through the proxy
    manifest_digest: str
    config_digest: str
    blobs: list[Descriptor]  # its index blobs


def _indexed(
    lazy_node: LazyNode, images: ImageBuilder, registry: Registry, proxy: FaultProxy, name: str, layers: int
) -> _Indexed:
    """An image of `layers` layers of its own, one small file each, indexed
    and pulled through `proxy`, whose record then starts empty. Layers of
    its own only: a layer stored through the proxy keeps fetching its blocks
    from there, and the proxy goes with the test."""
    lazy_node.layers.config.allow_plain_http(proxy.host)
    image = images.push(name, [[File(f"/layer{i}.txt", f"layer {i} of {name}\n".encode())] for i in range(layers)])
    ref = image.ref.replace(registry.host, proxy.host)
    lazy_node.index(ref)
    reference = parse_reference(ref)
    with RegistryClient(plain_http=True) as client:
        data, media_type, manifest_digest = client.fetch_manifest(reference)
        listed = artifact.referrers(client, reference, manifest_digest, ARTIFACT_TYPE)
    manifest = media.parse(data, media_type)
    assert isinstance(manifest, media.Manifest)
    blobs = [blob for artifact_manifest in listed for blob in artifact_manifest.layers]
    assert len(blobs) == layers
    proxy.reset()
    return _Indexed(image, ref, manifest_digest, manifest.config.digest, blobs)


def _index_gets(proxy: FaultProxy, indexed: _Indexed) -> list[int]:
    return [len(proxy.requests("GET", f"/blobs/{blob.digest}")) for blob in indexed.blobs]


def test_a_pull_lists_and_fetches_each_layers_index_once(
    lazy_node: LazyNode, images: ImageBuilder, registry: Registry, unique: str
) -> None:
    with faultproxy.running(registry.port) as proxy:
        indexed = _indexed(lazy_node, images, registry, proxy, f"indexes/once-{unique}", 6)
        assert _counts(lazy_node.pull(indexed.ref)) == (6, 0)
        assert _index_gets(proxy, indexed) == [1] * 6
        # And the image's indexes were listed once, not once per layer.
        listings = proxy.requests(
            "GET", f"/referrers/{indexed.manifest_digest}?artifactType={quote(ARTIFACT_TYPE, safe='')}"
        )
        assert len(listings) == 1, listings


def test_a_pull_sets_every_layers_index_fetch_going_once_it_has_the_image_manifest(
    lazy_node: LazyNode, images: ImageBuilder, registry: Registry, unique: str
) -> None:
    with faultproxy.running(registry.port) as proxy:
        indexed = _indexed(lazy_node, images, registry, proxy, f"indexes/early-{unique}", 4)
        # The pull fetches the image's config right after its manifest, and
        # asks containerd for nothing before it has it (held, and any retry).
        proxy.plan("hold", f"/blobs/{indexed.config_digest}", times=100)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pulled = pool.submit(lazy_node.pull, indexed.ref)
            try:
                wait_until(
                    lambda: all(_index_gets(proxy, indexed)),
                    60,
                    "every layer's index fetched while the config is held",
                    lazy_node.snapshotter.daemon,
                )
            finally:
                proxy.release()
            output = pulled.result()
        assert _counts(output) == (4, 0)
        assert _index_gets(proxy, indexed) == [1] * 4
        # The layers' sizes came with the pull's own manifest: not fetched again by digest.
        by_digest = proxy.requests("GET", f"/manifests/{indexed.manifest_digest}")
        assert not by_digest, by_digest


def test_a_pull_into_another_snapshotter_fetches_no_index(
    lazy_node: LazyNode, images: ImageBuilder, registry: Registry, unique: str
) -> None:
    """Through the same daemon, but into containerd's overlayfs: the layers
    are not the lazy path's, so nothing of theirs is fetched ahead."""
    with faultproxy.running(registry.port) as proxy:
        indexed = _indexed(lazy_node, images, registry, proxy, f"indexes/elsewhere-{unique}", 3)
        c = lazy_node.containerd
        lazy_node.bootseer(
            "pull", "--address", str(c.address), "--namespace", c.namespace, "--snapshotter", "overlayfs", indexed.ref
        )
        layers = [len(proxy.requests("GET", f"/blobs/{layer}")) for layer in indexed.image.layout.layer_digests]
        assert layers == [1] * 3
        assert _index_gets(proxy, indexed) == [0] * 3
        assert not proxy.requests("GET", "/referrers/")


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
