"""Hot blocks across two nodes sharing one registry: node 1 records the
first run and publishes the manifest; node 2 prefetches it and serves its
first run from cache. Foreign, corrupt and stale manifests are ignored."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from recorder import manifest as hot
from recorder.manifest import HotBlock, HotManifest
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.oci import Dir, File, ImageBuilder, PushedImage, busybox_layer
from tests.harness.registry import Registry

pytestmark = pytest.mark.integration

FILES = 48
# The start reads the first third of the model; other runs may read more.
READ = [f"/model/part-{i:02d}.bin" for i in range(0, FILES // 3, 2)]
READS = ["hit", "prefetched", "prefetch_wait", "miss"]


@pytest.fixture(scope="module")
def nodes(registry: Registry) -> Iterator[tuple[LazyNode, LazyNode]]:
    first = start_lazy_node(registry.host)
    try:
        second = start_lazy_node(registry.host)
        try:
            yield first, second
        finally:
            stop_lazy_node(second)
    finally:
        stop_lazy_node(first)


def model_image(images: ImageBuilder, name: str, files: int = FILES) -> PushedImage:
    rng = random.Random(name)
    parts = [File(f"/model/part-{i:02d}.bin", rng.randbytes(1 << 20)) for i in range(files)]
    script = "for f in " + " ".join(READ) + "; do cat $f > /dev/null; done; echo READY"
    return images.push(name, [busybox_layer(), [Dir("/model"), *parts]], cmd=["/bin/sh", "-c", script])


def wait_for(what: str, probe: Callable[[], object], timeout: float = 90.0, node: LazyNode | None = None) -> object:
    """Wait for an event (not a timing assertion): fails only if it never
    happens, then with `node`'s layer server logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{node.layers.logs()}" if node is not None else ""))


def published(ref: str) -> list[HotManifest]:
    reference = parse_reference(ref)
    with RegistryClient(plain_http=True) as client:
        digest = client.resolve(reference).manifest_digest
        found = []
        for art in artifact.referrers(client, reference, digest, hot.ARTIFACT_TYPE):
            found.append(HotManifest.decode(client.fetch_blob_bytes(reference, art.layers[0].digest)))
        return found


def reads(node: LazyNode) -> dict[str, float]:
    return {r: node.layers.metric(f'bootseer_fs_block_reads_total{{result="{r}"}}') for r in READS}


def test_second_node_starts_from_prefetched_blocks(
    nodes: tuple[LazyNode, LazyNode], images: ImageBuilder, unique: str
) -> None:
    first, second = nodes
    image = model_image(images, f"hot/model-{unique}")
    first.index(image.ref)
    first.pull(image.ref)
    assert first.containerd.run(image.ref, f"rec-{unique}").strip() == "READY"
    manifests = wait_for("the recorded manifest in the registry", lambda: published(image.ref))
    manifest = manifests[-1]  # type: ignore[index]
    model_layer = image.layout.layer_digests[-1]
    assert manifest.runs == 1 and {b.layer for b in manifest.blocks} >= {model_layer}

    second.pull(image.ref)
    wait_for(
        "node 2 to prefetch the manifest",
        lambda: second.layers.metric("bootseer_fs_prefetched_blocks_total") >= len(manifest.blocks),
    )
    before = reads(second)
    assert second.containerd.run(image.ref, f"warm-{unique}").strip() == "READY"
    after = reads(second)
    delta = {r: after[r] - before[r] for r in READS}
    served = delta["hit"] + delta["prefetched"] + delta["prefetch_wait"]
    assert served / sum(delta.values()) >= 0.9, delta


def test_recordings_of_two_runs_merge(nodes: tuple[LazyNode, LazyNode], images: ImageBuilder, unique: str) -> None:
    first, second = nodes
    image = model_image(images, f"hot/merge-{unique}")
    first.index(image.ref)
    first.pull(image.ref)
    first.containerd.run(image.ref, f"m1-{unique}")
    one = wait_for("the first record", lambda: published(image.ref))[-1]  # type: ignore[index]

    second.pull(image.ref)
    second.bootseer("record", "start", image.ref)
    other = "/model/part-47.bin"
    second.containerd.run(image.ref, f"m2-{unique}", "/bin/sh", "-c", f"cat {other} > /dev/null")
    shown = second.bootseer("record", "stop", image.ref).stdout
    assert "2 run(s)" in shown, shown
    merged = published(image.ref)[-1]
    assert merged.runs == 2
    assert {(b.layer, b.block) for b in one.blocks} < {(b.layer, b.block) for b in merged.blocks}


def attach(image: PushedImage, blob: bytes) -> None:
    """Publish `blob` as `image`'s hot-block manifest, whatever it holds."""
    reference = parse_reference(image.ref)
    with RegistryClient(plain_http=True) as client:
        data, media_type, digest = client.fetch_manifest(reference)
        pushed = client.push_blob(reference, blob, media_type=hot.MEDIA_TYPE)
        artifact.push(
            client,
            reference,
            Descriptor(media_type, digest, len(data)),
            hot.ARTIFACT_TYPE,
            [Descriptor(hot.MEDIA_TYPE, pushed.digest, pushed.size)],
        )


@pytest.mark.parametrize("kind", ["foreign", "corrupt", "stale"])
def test_bad_manifests_are_ignored_and_the_container_starts(
    nodes: tuple[LazyNode, LazyNode], images: ImageBuilder, unique: str, kind: str
) -> None:
    first, _ = nodes
    image = model_image(images, f"hot/bad-{kind}-{unique}", files=6)
    first.index(image.ref)
    with RegistryClient(plain_http=True) as client:
        digest = client.resolve(parse_reference(image.ref)).manifest_digest
    layer = image.layout.layer_digests[-1]
    if kind == "foreign":
        blob = HotManifest("sha256:" + "f" * 64, 1, [HotBlock(layer, 0, "0" * 64, 0, 1)]).encode()
    elif kind == "corrupt":
        blob = b'{"version": 1, "image": ' + b"\x00garbage"
    else:
        blob = HotManifest(digest, 1, [HotBlock(layer, 0, "0" * 64, 0, 1)]).encode()
    attach(image, blob)
    prefetched = first.layers.metric("bootseer_fs_prefetched_blocks_total")
    first.pull(image.ref)
    script = "cat /model/part-00.bin > /dev/null; echo READY"
    assert first.containerd.run(image.ref, f"bad-{kind}-{unique}", "/bin/sh", "-c", script).strip() == "READY"
    assert first.layers.metric("bootseer_fs_prefetched_blocks_total") == prefetched
    logs = first.layers.logs()
    expected = {"foreign": "belongs to another image", "corrupt": "no usable hot-block manifest", "stale": "stale"}
    assert expected[kind] in logs, logs[-3000:]
