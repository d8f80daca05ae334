"""Lazy pulls and hot-block prefetch through a real pull-through cache
(distribution 2.8 in proxy mode) named in every node's hosts.toml, the
registry behind it reached through a proxy that counts what it serves
(referrers listings are read from the registry itself: the cache keeps
its first copy of a referrers tag).

The first node's start is served lazily and recorded, its manifest pushed
to the registry (the only host with `push`); once the cache holds the
layer, a second node's start is served and prefetched from the cache, and
the registry serves it no block of the layer: every block crossed from the
registry at most once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.registry.client import RegistryClient
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.oci import ImageBuilder
from tests.harness.procs import wait_until
from tests.harness.registry import Registry, cached_blob, start_pull_through_cache
from tests.lazy.test_hotblocks import model_image, published, wait_for

pytestmark = pytest.mark.integration

PREFETCHED = "bootseer_fs_prefetched_blocks_total"


def through_cache(node: LazyNode, registry: str, upstream: str, cache: str) -> None:
    """The node's hosts.toml: the cache first (pull, resolve), then the
    registry through the counting proxy, the only host that takes pushes."""
    path: Path = node.layers.config.certs_dir / registry / "hosts.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'server = "http://{upstream}"\n\n'
        f'[host."http://{cache}"]\n  capabilities = ["pull", "resolve"]\n\n'
        f'[host."http://{upstream}"]\n  capabilities = ["pull", "resolve", "push"]\n'
    )


@pytest.fixture(scope="module")
def upstream(registry: Registry) -> Iterator[faultproxy.FaultProxy]:
    with faultproxy.running(registry.port) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def nodes(registry: Registry, upstream: faultproxy.FaultProxy) -> Iterator[tuple[list[LazyNode], Registry]]:
    cache = start_pull_through_cache(f"http://{upstream.host}")
    started: list[LazyNode] = []
    try:
        for _ in range(2):
            node = start_lazy_node(registry.host)
            started.append(node)
            through_cache(node, registry.host, upstream.host, cache.host)
        yield started, cache
    finally:
        for node in reversed(started):
            stop_lazy_node(node)
        cache.stop()


def test_a_later_node_is_served_and_prefetched_from_the_cache(
    nodes: tuple[list[LazyNode], Registry],
    upstream: faultproxy.FaultProxy,
    images: ImageBuilder,
    unique: str,
) -> None:
    (first, second), cache = nodes
    image = model_image(images, f"mirror/prefetch-{unique}")
    ref = parse_reference(image.ref)
    with RegistryClient(plain_http=True) as client:
        layer = client.resolve(ref).manifest.layers[-1].digest
    first.index(image.ref)

    first.pull(image.ref)
    assert first.containerd.run(image.ref, f"first-{unique}").strip() == "READY"
    manifest = wait_for("the first start's hot-block manifest", lambda: published(image.ref))[-1]  # type: ignore[index]
    wait_until(lambda: cached_blob(cache, layer), 60, "the cache to store the layer")
    served_before = len(upstream.requests("GET", f"/blobs/{layer}"))

    # The prefetch runs to its end before the container starts, so that no
    # on-demand read takes a block from under it (a block read first is not
    # prefetched, and is not counted as such).
    second.pull(image.ref)
    wait_for(
        "the second node's prefetch of the manifest",
        lambda: second.layers.metric(PREFETCHED) >= len(manifest.blocks),
        node=second,
    )
    assert second.containerd.run(image.ref, f"second-{unique}").strip() == "READY"
    # Everything the second node read of the layer came from the cache.
    assert len(upstream.requests("GET", f"/blobs/{layer}")) == served_before
    # The first node's ranges each crossed once (the cache's own whole-blob
    # fills carry no Range).
    ranges = [s.headers.get("Range") for s in upstream.requests("GET", f"/blobs/{layer}")]
    asked = [r for r in ranges if r]
    assert len(asked) == len(set(asked)), asked
