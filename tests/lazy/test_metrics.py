"""What a node's metrics say about lazy pulling, read from the snapshotter's
and the layer server's Prometheus endpoints: which path each remote layer
took and why (a silent fallback made visible), FUSE request times, and the
bytes each image fetched and prefetched."""

from __future__ import annotations

import io
import random
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from recorder import manifest as hot
from snapshotter.layer.artifact import index_blobs
from snapshotter.layer.index import ARTIFACT_TYPE, LayerIndex
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.containerd import start_containerd
from tests.harness.layerserver import LayerServer, start_layer_server
from tests.harness.lazynode import LazyNode, stop_lazy_node
from tests.harness.oci import Dir, File, ImageBuilder, PushedImage, busybox_layer
from tests.harness.procs import free_tcp_port
from tests.harness.registry import PASSWORD, USER, AuthRegistry, Registry
from tests.harness.snapshotter import Snapshotter, start_snapshotter

pytestmark = pytest.mark.integration

LAYERS = "bootseer_snapshotter_layers_total"


@dataclass
class Node:
    """A lazy node whose snapshotter serves metrics too."""

    lazy: LazyNode
    snapshotter_metrics: int  # port

    def snapshotter_metric(self, name: str, **labels: str) -> float:
        return _metric(self.snapshotter_metrics, name, labels)

    def layers_metric(self, name: str, **labels: str) -> float:
        return _metric(self.lazy.layers.config.metrics_port, name, labels)

    def pull(self, ref: str, *args: str) -> tuple[str, dict[str, int]]:
        """`bootseer pull`: the image's manifest digest and how its layers came."""
        c = self.lazy.containerd
        out = self.lazy.bootseer(
            "pull", "--address", str(c.address), "--namespace", c.namespace, "--snapshotter", "bootseer", *args, ref
        ).stdout
        match = re.search(r": (sha256:[0-9a-f]{64}) \((\d+) remote, (\d+) fetched, (\d+) already present", out)
        assert match, out
        remote, fetched, present = map(int, match.groups()[1:])
        return match.group(1), {"remote": remote, "fetched": fetched, "present": present}

    def snapshotter_log(self) -> str:
        return "\n".join(d.log_path.read_text(errors="replace") for d in self.lazy.snapshotter.incarnations)


def _metric(port: int, name: str, labels: dict[str, str]) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 if none)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


@pytest.fixture(scope="module")
def node(registry: Registry) -> Iterator[Node]:
    started: list[LayerServer | Snapshotter] = []
    try:
        layers = start_layer_server([registry.host])
        started.append(layers)
        port = free_tcp_port()
        snapshotter = start_snapshotter(["--config", str(layers.config.path), "--metrics-address", f"127.0.0.1:{port}"])
        started.append(snapshotter)
        containerd = start_containerd(snapshotter.address)
    except BaseException:
        for part in reversed(started):
            part.teardown()
        raise
    lazy = LazyNode(layers, snapshotter, containerd)
    try:
        yield Node(lazy, port)
    finally:
        stop_lazy_node(lazy)


def wait_for(what: str, probe: Callable[[], object], timeout: float = 60.0) -> None:
    """Wait for an event (not a timing assertion): fails only if it never happens."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _paths(node: Node) -> dict[tuple[str, str], float]:
    reasons = ("served", "no_index", "unauthorized", "layer_server_down", "error")
    return {
        (path, reason): node.snapshotter_metric(LAYERS, path=path, reason=reason)
        for path in ("lazy", "normal")
        for reason in reasons
    }


def _changed(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


# Not "open": the kernel sends OPEN once a connection (answered ENOSYS), then opens files itself.
OPS = ("lookup", "getattr", "read")


def test_a_lazy_pull_and_read_show_in_the_metrics(node: Node, images: ImageBuilder, unique: str) -> None:
    data = random.Random(unique).randbytes(4 << 20)
    image = images.push(
        f"metrics/lazy-{unique}",
        [busybox_layer(), [Dir("/data"), File("/data/weights.bin", data)]],
        cmd=["/bin/sh", "-c", "cat /data/weights.bin | wc -c"],
    )
    node.lazy.index(image.ref)
    before = _paths(node)
    digest, counts = node.pull(image.ref)
    assert counts["remote"] >= 1
    assert _changed(before, _paths(node)) == {("lazy", "served"): counts["remote"]}

    ops = {op: node.layers_metric("bootseer_fs_op_seconds_count", op=op) for op in OPS}
    assert node.layers_metric("bootseer_fs_image_fetched_bytes_total", image=digest) == 0
    assert node.lazy.containerd.run(image.ref, f"lazy-{unique}").strip() == str(len(data))
    for op in OPS:
        assert node.layers_metric("bootseer_fs_op_seconds_count", op=op) > ops[op], op
    # Every on-demand byte of this image counts for it.
    assert node.layers_metric("bootseer_fs_image_fetched_bytes_total", image=digest) > 0
    assert node.layers_metric("bootseer_fs_read_waits") == 0


def test_an_image_without_an_index_falls_back_loudly(node: Node, images: ImageBuilder, unique: str) -> None:
    image = images.push(
        f"metrics/plain-{unique}", [busybox_layer(), [File("/hello", b"plain\n")]], cmd=["/bin/cat", "/hello"]
    )
    before = _paths(node)
    _, counts = node.pull(image.ref)
    # The busybox base may be present from an earlier pull.
    assert counts["remote"] == 0 and counts["fetched"] >= 1
    assert _changed(before, _paths(node)) == {("normal", "no_index"): counts["fetched"]}
    assert node.lazy.containerd.run(image.ref, f"plain-{unique}") == "plain\n"
    warnings = [
        line
        for line in node.snapshotter_log().splitlines()
        if "layer takes the normal path" in line and f"metrics/plain-{unique}" in line
    ]
    assert warnings and all("warning" in line and "reason=no_index" in line for line in warnings), warnings


def test_a_node_without_credentials_pulls_normally_and_says_why(
    node: Node, auth_registry: AuthRegistry, unique: str, tmp_path: Path
) -> None:
    builder = ImageBuilder(auth_registry.host, tmp_path, creds=f"{USER}:{PASSWORD}")
    image = builder.push(
        f"private/metrics-{unique}",
        [busybox_layer(), [File("/secret.txt", b"authorised\n")]],
        cmd=["/bin/cat", "/secret.txt"],
    )
    node.lazy.layers.config.allow_plain_http(auth_registry.host)
    # Indexed by someone with a login; this node's daemons have none.
    indexer_config = tmp_path / "indexer.toml"
    indexer_config.write_text(
        node.lazy.layers.config.path.read_text().replace(
            str(node.lazy.layers.config.docker_config), str(auth_registry.docker_config())
        )
    )
    assert not node.lazy.layers.config.docker_config.exists()
    # The last --config wins: the indexer's, not the node's.
    node.lazy.bootseer("index", "--config", str(indexer_config), "--quiet", image.ref)
    before = _paths(node)
    # The pull itself has the login, as kubelet's pull secret gives containerd one.
    _, counts = node.pull(image.ref, "--docker-config", str(auth_registry.docker_config()))
    assert counts["remote"] == 0 and counts["fetched"] >= 1
    assert _changed(before, _paths(node)) == {("normal", "unauthorized"): counts["fetched"]}
    assert node.lazy.containerd.run(image.ref, f"auth-{unique}") == "authorised\n"
    warnings = [
        line
        for line in node.snapshotter_log().splitlines()
        if "layer takes the normal path" in line and f"private/metrics-{unique}" in line
    ]
    assert warnings and all("warning" in line and "reason=unauthorized" in line for line in warnings), warnings


def _attach_hot_manifest(image: PushedImage, blocks: int) -> hot.HotManifest:
    """Publish a hot-block manifest naming the first `blocks` blocks of the
    image's top layer, as a recorded run would."""
    ref = parse_reference(image.ref)
    top = image.layout.layer_digests[-1]
    with RegistryClient(plain_http=True) as client:
        data, media_type, digest = client.fetch_manifest(ref)
        [index_artifact] = artifact.referrers(client, ref, digest, ARTIFACT_TYPE)
        buffer = io.BytesIO()
        client.fetch_blob(ref, index_blobs([index_artifact])[top].digest, buffer)
        index = LayerIndex.decode(buffer.getvalue())
        record = hot.from_record(digest, {(top, n): n / 100 for n in range(blocks)}, {top: index})
        pushed = client.push_blob(ref, record.encode(), media_type=hot.MEDIA_TYPE)
        artifact.push(
            client,
            ref,
            Descriptor(media_type, digest, len(data)),
            hot.ARTIFACT_TYPE,
            [Descriptor(hot.MEDIA_TYPE, pushed.digest, pushed.size)],
        )
        return record


def test_an_image_with_hot_blocks_counts_its_prefetched_bytes(node: Node, images: ImageBuilder, unique: str) -> None:
    rng = random.Random(unique)
    parts = [File(f"/model/part-{i}.bin", rng.randbytes(1 << 20)) for i in range(12)]
    image = images.push(f"metrics/hot-{unique}", [busybox_layer(), [Dir("/model"), *parts]], cmd=["/bin/true"])
    node.lazy.index(image.ref)
    record = _attach_hot_manifest(image, blocks=2)
    others = node.layers_metric("bootseer_fs_image_prefetched_bytes_total")
    digest, _ = node.pull(image.ref)
    assert digest == record.image and record.total_bytes > 0
    # Nothing reads the image: every block the manifest names is prefetched, for this image.
    wait_for(
        "the image's hot blocks prefetched",
        lambda: node.layers_metric("bootseer_fs_image_prefetched_bytes_total", image=digest) >= record.total_bytes,
    )
    assert node.layers_metric("bootseer_fs_image_prefetched_bytes_total", image=digest) == record.total_bytes
    assert node.layers_metric("bootseer_fs_image_prefetched_bytes_total") == others + record.total_bytes
    # The prefetch's Range requests are the image's fetched bytes too.
    assert node.layers_metric("bootseer_fs_image_fetched_bytes_total", image=digest) > 0
