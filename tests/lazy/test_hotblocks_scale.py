"""Hot-block publication that scales, on four real nodes (containerd,
snapshotter, layer server each) sharing one registry (distribution 2.8:
no referrers API, the `sha256-<hex>` tag fallback, deletes enabled).

Three nodes run with the default `[fs] hot_blocks_publish = "elected"`; the
fourth reaches the registry through a proxy that refuses every write (403),
as a node with pull-only credentials would. The four start a new image at
once: at most two manifests are pushed, every node keeps its own recording,
and after a CI-style `bootseer record publish` one manifest stays listed
for the image. A node without push rights that records an image nobody has
published prefetches from its own manifest on its next start, and picks up
the published one once another node has published it."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pytest

from recorder import manifest as hot
from snapshotter.fs import control
from snapshotter.fs.layers import BLOCK_INDEX
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.oci import ImageBuilder, PushedImage
from tests.harness.registry import Registry, stored_manifests, uploaded_hot_manifests
from tests.lazy.test_hotblocks import model_image, published, wait_for

pytestmark = pytest.mark.integration

NODES = 4
PUSHED = "bootseer_hot_manifests_pushed_total"
NOT_PUSHED = "bootseer_hot_manifests_not_pushed_total"
PREFETCHED = "bootseer_fs_prefetched_blocks_total"

T = TypeVar("T")


def at_once(nodes: Sequence[LazyNode], action: Callable[[int, LazyNode], T]) -> list[T]:
    """`action` on every node in its own thread, released together."""
    barrier = threading.Barrier(len(nodes))
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def one(i: int, node: LazyNode) -> None:
        barrier.wait()
        try:
            results[i] = action(i, node)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(nodes))]


def refuse_writes_through(node: LazyNode, registry: Registry, proxy: faultproxy.FaultProxy) -> None:
    """Send `node`'s traffic for the registry through `proxy` (hosts.toml is
    re-read when it changes), which answers every write with 403."""
    for method in ("PUT", "POST", "PATCH", "DELETE"):
        proxy.plan("status", method=method, status=403, times=1 << 30)
    hosts = node.layers.config.certs_dir / registry.host / "hosts.toml"
    hosts.write_text(
        f'server = "http://{proxy.host}"\n\n[host."http://{proxy.host}"]\n'
        '  capabilities = ["pull", "resolve", "push"]\n'
    )


@pytest.fixture(scope="module")
def proxy(registry: Registry) -> Iterator[faultproxy.FaultProxy]:
    with faultproxy.running(registry.port) as p:
        yield p


@pytest.fixture(scope="module")
def fleet(registry: Registry, proxy: faultproxy.FaultProxy) -> Iterator[list[LazyNode]]:
    nodes: list[LazyNode] = []
    try:
        for _ in range(NODES):
            nodes.append(start_lazy_node(registry.host))
        refuse_writes_through(nodes[-1], registry, proxy)
        yield nodes
    finally:
        for node in reversed(nodes):
            stop_lazy_node(node)


def image_digest(image: PushedImage) -> str:
    with RegistryClient(plain_http=True) as client:
        return client.resolve(parse_reference(image.ref)).manifest_digest


def settled(node: LazyNode) -> float:
    """Recordings this node finished: pushed or kept."""
    return node.layers.metric(PUSHED) + node.layers.metric(NOT_PUSHED)


def listed_hot_artifacts(registry: Registry, image: PushedImage, digest: str) -> list[str]:
    """Hot-block artifacts of the image the repository holds, read from storage."""
    repository = parse_reference(image.ref).repository
    return [
        d
        for d, data in stored_manifests(registry, repository).items()
        if hot.ARTIFACT_TYPE.encode() in data and digest.encode() in data and b'"subject"' in data
    ]


def test_four_nodes_starting_a_new_image_push_at_most_two_manifests(
    fleet: list[LazyNode], registry: Registry, images: ImageBuilder, unique: str
) -> None:
    image = model_image(images, f"scale/wave-{unique}")
    digest = image_digest(image)
    fleet[0].index(image.ref)
    at_once(fleet, lambda i, node: node.pull(image.ref))
    before = [settled(node) for node in fleet]
    pushed_before = sum(node.layers.metric(PUSHED) for node in fleet)

    outputs = at_once(fleet, lambda i, node: node.containerd.run(image.ref, f"wave{i}-{unique}"))
    assert [out.strip() for out in outputs] == ["READY"] * NODES
    wait_for(
        "every node's recording to settle",
        lambda: all(settled(node) > b for node, b in zip(fleet, before, strict=True)),
    )

    pushed = sum(node.layers.metric(PUSHED) for node in fleet) - pushed_before
    uploaded = uploaded_hot_manifests(registry, digest)
    reasons = {
        r: sum(node.layers.metric(f'{NOT_PUSHED}{{reason="{r}"}}') for node in fleet)
        for r in ("published", "lost", "refused", "failed")
    }
    print(f"N={NODES}: {pushed:.0f} hot-block manifest(s) pushed, {uploaded} uploaded; not pushed: {reasons}")
    assert pushed <= 2 and uploaded <= 2
    assert fleet[-1].layers.metric(PUSHED) == 0
    # Every node, the one that may not push included, keeps what it recorded.
    for node in fleet:
        shown = node.bootseer("record", "show", image.ref).stdout
        assert "hot blocks" in shown, shown
    assert "not published" in fleet[-1].bootseer("record", "show", image.ref).stdout
    assert len(published(image.ref)) <= 2

    # A designated recorder or CI run publishes: merged with what is there,
    # which it replaces.
    out = fleet[1].bootseer("record", "publish", image.ref).stdout
    assert "published" in out, out
    assert len(published(image.ref)) == 1
    assert len(listed_hot_artifacts(registry, image, digest)) == 1
    assert uploaded_hot_manifests(registry, digest) <= 3
    # A node without push rights cannot publish, and says so.
    refused = fleet[-1].bootseer("record", "publish", image.ref, check=False)
    assert refused.returncode != 0 and "403" in refused.stderr + refused.stdout, refused


def restart_cold(node: LazyNode, image: PushedImage, digest: str) -> None:
    """The node's next start of the image with nothing cached: its layer
    server restarted without its block index, then told about the image as
    the snapshotter's Prepare tells it (a control lookup)."""
    node.layers.stop()
    shutil.rmtree(node.layers.config.store / BLOCK_INDEX)
    node.layers.start()
    control.lookup(node.layers.config.mountpoint, control.CONTROL_PREFIX + digest.split(":", 1)[1])


def test_a_node_without_push_rights_prefetches_its_own_manifest_then_the_published_one(
    fleet: list[LazyNode], registry: Registry, images: ImageBuilder, unique: str
) -> None:
    refused, other = fleet[-1], fleet[0]
    image = model_image(images, f"scale/alone-{unique}")
    digest = image_digest(image)
    other.index(image.ref)
    refused.pull(image.ref)
    before = settled(refused)
    assert refused.containerd.run(image.ref, f"alone-{unique}").strip() == "READY"
    wait_for("the recording to settle", lambda: settled(refused) > before)
    assert refused.layers.metric(f'{NOT_PUSHED}{{reason="refused"}}') >= 1
    assert uploaded_hot_manifests(registry, digest) == 0 and published(image.ref) == []
    own = refused.bootseer("record", "show", image.ref).stdout
    assert "1 run(s)" in own and "not published" in own, own
    blocks = int(own.split(": ", 1)[1].split(" hot blocks", 1)[0])

    restart_cold(refused, image, digest)
    wait_for("the prefetch of the node's own manifest", lambda: refused.layers.metric(PREFETCHED) >= blocks)
    assert "using this node's own hot-block manifest" in refused.layers.logs()
    assert refused.containerd.run(image.ref, f"alone2-{unique}").strip() == "READY"

    # Another node publishes the image (its first run, elected alone); the
    # node without push rights picks that manifest up on its next start.
    other.pull(image.ref)
    assert other.containerd.run(image.ref, f"other-{unique}").strip() == "READY"
    wait_for("the published manifest", lambda: published(image.ref))
    restart_cold(refused, image, digest)
    wait_for("the published manifest picked up", lambda: "picked up the published" in refused.layers.logs())
    assert "published as sha256:" in refused.bootseer("record", "show", image.ref).stdout
