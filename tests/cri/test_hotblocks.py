"""Hot blocks through the CRI, on a private image: node 1's first pod is
recorded and its layer server publishes the manifest with the credentials
the proxy captured; node 2's PullImage (its own capture) prefetches it, and
node 2's first pod is served from cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from recorder import manifest as hot
from recorder.manifest import HotManifest
from snapshotter.registry import artifact
from snapshotter.registry.auth import Keychain
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.reference import parse as parse_reference
from tests.cri.conftest import PrivateImages, kubelet_auth
from tests.harness.cri import CriNode, start_cri_node, stop_cri_node
from tests.harness.procs import wait_until
from tests.harness.registry import AuthRegistry, Registry

pytestmark = pytest.mark.integration

READS = ["hit", "prefetched", "prefetch_wait", "miss"]
COMMAND = ["/bin/sha256sum", "/data/weights-a.bin"]


@pytest.fixture(scope="module")
def second_node(registry: Registry, auth_registry: AuthRegistry, cri_node: CriNode) -> Iterator[CriNode]:
    assert cri_node.containerd.cri is not None
    node = start_cri_node([registry.host, auth_registry.host], cri_node.containerd.cri.sandbox_image)
    try:
        yield node
    finally:
        stop_cri_node(node)


def published(ref: str, auth_registry: AuthRegistry) -> list[HotManifest]:
    reference = parse_reference(ref)
    with RegistryClient(plain_http=True, keychain=Keychain(auth_registry.docker_config())) as client:
        digest = client.resolve(reference).manifest_digest
        return [
            HotManifest.decode(client.fetch_blob_bytes(reference, found.layers[0].digest))
            for found in artifact.referrers(client, reference, digest, hot.ARTIFACT_TYPE)
        ]


def reads(node: CriNode) -> dict[str, float]:
    return {r: node.layers.metric(f'bootseer_fs_block_reads_total{{result="{r}"}}') for r in READS}


def test_second_node_prefetches_what_the_first_pod_read(
    cri_node: CriNode, second_node: CriNode, private_images: PrivateImages, auth_registry: AuthRegistry, unique: str
) -> None:
    image = private_images.push(f"private/hot-{unique}", 16 << 20, seed=4)
    private_images.index(cri_node, image)
    expected = image.sha256["/data/weights-a.bin"]
    first, second = cri_node.kubelet(), second_node.kubelet()
    try:
        first.pull(image.ref, kubelet_auth())
        pod = first.run_pod(f"record-{unique}")
        container = first.start_container(pod, "start", image.ref, COMMAND)
        assert first.wait_exited(container).exit_code == 0
        assert first.stdout(pod, "start").split()[0] == expected
        found: list[HotManifest] = []

        def manifest_published() -> bool:
            found[:] = published(image.ref, auth_registry)
            return bool(found)

        wait_until(manifest_published, 90, "node 1's hot-block manifest in the registry")
        manifest = found[-1]
        assert manifest.runs == 1 and image.layout.layer_digests[-1] in {b.layer for b in manifest.blocks}

        second.pull(image.ref, kubelet_auth())
        wait_until(
            lambda: second_node.layers.metric("bootseer_fs_prefetched_blocks_total") >= len(manifest.blocks),
            90,
            "node 2 to prefetch the manifest's blocks",
        )
        before = reads(second_node)
        pod2 = second.run_pod(f"warm-{unique}")
        container2 = second.start_container(pod2, "start", image.ref, COMMAND)
        assert second.wait_exited(container2).exit_code == 0
        assert second.stdout(pod2, "start").split()[0] == expected
        after = reads(second_node)
        delta = {r: after[r] - before[r] for r in READS}
        served = delta["hit"] + delta["prefetched"] + delta["prefetch_wait"]
        assert served / sum(delta.values()) >= 0.9, delta
    finally:
        first.close()
        second.close()
    for kubelet in (cri_node.kubelet(), second_node.kubelet()):
        kubelet.remove_image(image.ref)
        kubelet.close()
