"""The hot-block tracker (recorder.tracker.HotBlocks) on real parts, without
FUSE, daemons or network: a real LayerStore with gzip layers, real
LayerReaders over in-memory blobs (tests.fs.conftest.Blob), the LMDB block
index and local manifest store in tmp_path, and a real RegistryClient aimed
at a closed port on 127.0.0.1, so looking for a published manifest finds
none and publishing fails. The end-to-end flow with containerd and a
registry is tests/lazy/test_hotblocks.py.

The client is built with retries=0: with the defaults that
`client_from_config` uses (4 retries, backoff from 0.25 s) every request to
the dead registry costs about 2-4 s of backoff before it gives up.
"""

from __future__ import annotations

import gzip
import hashlib
import random
import socket
import tarfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio
import trio.testing
from prometheus_client import REGISTRY

from recorder.localstore import LocalManifests
from recorder.manifest import HotBlock, HotManifest
from recorder.tracker import HotBlocks, HotBlockSettings
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.control import ImageRequest, write_request
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import BoundedFetcher, LayerReader, Sink
from snapshotter.fs.settings import FETCH_DEADLINE_S
from snapshotter.layer import parts
from snapshotter.registry.client import RegistryClient
from tests.fs.conftest import Blob, add_layer, make_layer

SPAN = 64 << 10
LAYER_BYTES = 1 << 20  # random, so about 17 blocks of SPAN each
IMAGE = "sha256:" + hashlib.sha256(b"bootseer tracker test image").hexdigest()
OTHER_IMAGE = "sha256:" + hashlib.sha256(b"some other image").hexdigest()
# Generous: waiting for an event, never a bound on how long it may take.
DEADLINE_S = 20.0


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def layer_blob(seed: int) -> bytes:
    data = random.Random(seed).randbytes(LAYER_BYTES)
    info = tarfile.TarInfo(f"data-{seed}")
    info.size = len(data)
    return make_layer([(info, data)])


@dataclass
class Served:
    """The ServedLayer protocol as the layer server implements it: the
    layer's reader, and whether it is still the copy the store holds."""

    reader: LayerReader
    current: bool = True


class Node:
    """The hot-block side of one layer server: the tracker wired to its
    layers' readers as LayerFS wires it (on_access -> HotBlocks.access,
    records -> HotBlocks.records), and
    a log of every Range fetch, in order, across all layers."""

    def __init__(self, tmp_path: Path, layers: int, prefetch_parallel: int, idle_s: float, max_s: float) -> None:
        self.store = LayerStore(tmp_path / "store")
        self.block_index = BlockIndex(self.store.block_index_path)
        self.local = LocalManifests(self.store.hot_manifests_path)
        self.client = RegistryClient(plain_http=True, certs_dir=tmp_path / "certs.d", retries=0)
        self.ref = f"127.0.0.1:{closed_port()}/test/hot:latest"
        self.fetches: list[tuple[str, int, int]] = []
        # The ranges of each request (several: one multi-range request).
        self.requests: list[list[tuple[int, int]]] = []
        self.layers: dict[str, Served] = {}
        self.hot = HotBlocks(
            self.store,
            self._layer_for,
            self.client,
            self.local,
            HotBlockSettings(idle_s=idle_s, max_s=max_s, prefetch_parallel=prefetch_parallel),
        )
        fetch_limiter = trio.CapacityLimiter(4)
        prefetch_limiter = trio.CapacityLimiter(prefetch_parallel)
        background_limiter = trio.CapacityLimiter(1)
        prefetch_decode_limiter = trio.CapacityLimiter(prefetch_parallel)
        self.digests: list[str] = []
        for seed in range(layers):
            blob = layer_blob(seed)
            digest = add_layer(self.store, tmp_path, blob, SPAN)
            name = digest.split(":")[1]
            index, source = self.store.load(name)
            reader = LayerReader(
                name,
                source.cache_key,
                index,
                self.store.cache_path(name),
                self.block_index,
                self._fetcher(digest, Blob(blob)),
                fetch_limiter,
                prefetch_limiter,
                background_limiter,
                prefetch_decode_limiter,
                self.hot.access,
                records=self.hot.records,
            )
            self.layers[digest] = Served(reader)
            self.digests.append(digest)

    def _fetcher(self, digest: str, blob: Blob) -> BoundedFetcher:
        def stream(start: int, end: int, _deadline: float, sink: Sink) -> None:
            self.requests.append([(start, end)])
            self.fetches.append((digest, start, end))
            sink(blob.fetch(start, end))

        def stream_many(ranges: list[tuple[int, int]], _deadline: float, sinks: Sequence[Sink]) -> None:
            self.requests.append(list(ranges))
            for (start, end), sink in zip(ranges, sinks, strict=True):
                self.fetches.append((digest, start, end))
                sink(blob.fetch(start, end))

        return BoundedFetcher(stream, FETCH_DEADLINE_S, stream_many)

    async def _layer_for(self, digest: str) -> Served | None:
        return self.layers.get(digest)

    def reader(self, layer: int) -> LayerReader:
        return self.layers[self.digests[layer]].reader

    def block(self, layer: int, n: int, ms: int = 0, digest: str | None = None) -> HotBlock:
        """Block `n` of layer number `layer` as a manifest entry."""
        b = self.reader(layer).index.blocks[n]
        return HotBlock(self.digests[layer], n, digest or b.digest, ms, b.cend - b.cstart)

    def run_range(self, layer: int, first: int, last: int) -> tuple[str, int, int]:
        """The one Range request that fetches blocks first..last of a layer."""
        blocks = self.reader(layer).index.blocks
        return (self.digests[layer], blocks[first].cstart, blocks[last].cend)

    def close(self) -> None:
        for served in self.layers.values():
            served.reader.close()
        self.block_index.close()
        self.local.close()
        self.client.close()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(layers: int = 2, prefetch_parallel: int = 1, idle_s: float = 0.3, max_s: float = 600.0) -> Node:
        node = Node(tmp_path / f"node{len(nodes)}", layers, prefetch_parallel, idle_s, max_s)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def run(node: Node, body: Callable[[Node], Awaitable[None]]) -> None:
    """Run `body` with the tracker's loop going; cancel the loop after."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.hot.run)
            # notify() ignores requests until run() has opened its nursery.
            await trio.testing.wait_all_tasks_blocked()
            await body(node)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def wait_for(what: str, probe: Callable[[], Any]) -> Any:
    """Poll `probe` until it is truthy; fail only if it never becomes so."""
    deadline = trio.current_time() + DEADLINE_S
    while True:
        value = probe()
        if value:
            return value
        if trio.current_time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.sleep(0.02)


async def announce(node: Node, layers: list[str] | None = None, record: bool = False, stop: bool = False) -> None:
    """What the snapshotter (or `bootseer record`) does: write the image's
    request file, then make the layer server read it."""
    request = ImageRequest(
        ref=node.ref, image=IMAGE, layers=node.digests if layers is None else layers, record=record, stop=stop
    )
    write_request(node.store, request)
    await node.hot.notify(request.name)


async def read_block(node: Node, layer: int, n: int) -> None:
    """A container's read of a few bytes inside block `n` (and no other)."""
    reader = node.reader(layer)
    b = reader.index.blocks[n]
    data = await reader.read(b.ustart, min(b.uend, b.ustart + 512))
    assert len(data) == min(b.uend - b.ustart, 512)
    # First accesses are kept to the millisecond, ties ordered by layer
    # digest: keep reads apart, so a manifest's order is the order read.
    await trio.sleep(0.005)


def recording(node: Node) -> bool:
    image = node.hot.images.get(IMAGE)
    return image is not None and image.session is not None


def prefetch_finished(node: Node) -> bool:
    """Every layer's runs queued and fetched, and the workers gone."""
    image = node.hot.images.get(IMAGE)
    p = image.prefetch if image is not None else None
    return p is not None and p.expected <= p.queued and not p.queue and p.workers == 0


def blocks_of(manifest: HotManifest | None) -> list[tuple[str, int]]:
    assert manifest is not None
    return [(b.layer, b.block) for b in manifest.blocks]


def test_prefetch_follows_first_access_across_layers_in_merged_runs(make_node: Callable[..., Node]) -> None:
    """A local manifest is prefetched in its first-access order across both
    layers (its first block is in the second layer), each layer's blocks
    merged into runs of consecutive blocks, and nothing else is fetched."""
    node = make_node(prefetch_parallel=1)
    l1, l2 = 0, 1
    order = [(l2, 3), (l2, 4), (l1, 5), (l1, 6), (l2, 0), (l1, 7), (l2, 9), (l1, 1)]
    manifest = HotManifest(IMAGE, 1, [node.block(layer, n, ms) for ms, (layer, n) in enumerate(order)])
    node.local.put(manifest)

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("the prefetch to finish", lambda: prefetch_finished(node))
        # A read of a prefetched block is served from the cache.
        fetched = len(node.fetches)
        await read_block(node, l2, 3)
        assert len(node.fetches) == fetched

    run(node, body)
    # Runs are grouped per layer in manifest order: layer 1's [5, 6, 7]
    # stays one run although (l2, 0) comes between 6 and 7. Across layers the
    # queue holds what has been checked so far: which layer's runs are queued
    # first is up to trio's scheduler, so only each layer's order is fixed.
    expected = [
        node.run_range(l2, 3, 4),
        node.run_range(l1, 5, 7),
        node.run_range(l2, 0, 0),
        node.run_range(l2, 9, 9),
        node.run_range(l1, 1, 1),
    ]
    assert sorted(node.fetches) == sorted(expected)
    for layer in (l1, l2):
        digest = node.digests[layer]
        assert [f for f in node.fetches if f[0] == digest] == [f for f in expected if f[0] == digest]
    # Runs of a layer due one after the other go in one request, in the
    # order they are due: [0] and [9] of layer 2 at least, whichever layer
    # was queued first.
    assert len(node.requests) < len(expected)
    assert node.reader(l1).cached == {1, 5, 6, 7}
    assert node.reader(l2).cached == {0, 3, 4, 9}
    # A usable manifest and no `record` request: this run is not recorded.
    assert not recording(node)


def test_a_batch_whose_run_fails_its_check_fetches_that_run_again(make_node: Callable[..., Node]) -> None:
    """One multi-range answer for three runs, the middle one's bytes
    corrupted: the other two land from it, the middle run is fetched again
    in a request of its own and lands, and the failure is counted."""
    node = make_node(prefetch_parallel=1)
    node.local.put(HotManifest(IMAGE, 1, [node.block(0, n, ms) for ms, n in enumerate((1, 4, 7))]))
    reader = node.reader(0)
    inner = reader.fetcher
    assert isinstance(inner, BoundedFetcher) and inner.stream_many is not None
    stream_many = inner.stream_many

    def corrupting(ranges: list[tuple[int, int]], deadline: float, sinks: Sequence[Sink]) -> None:
        def flipped(chunk: bytes) -> None:
            sinks[1](bytes([chunk[0] ^ 1]) + chunk[1:])

        stream_many(ranges, deadline, [sinks[0], flipped, *sinks[2:]])

    reader.fetcher = BoundedFetcher(inner.stream, inner.deadline_s, corrupting)
    failures = REGISTRY.get_sample_value("bootseer_fs_verify_failures_total") or 0.0

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("every hot block", lambda: reader.cached >= {1, 4, 7})

    run(node, body)
    runs = [node.run_range(0, n, n)[1:] for n in (1, 4, 7)]
    assert node.requests == [runs, [runs[1]]]
    assert (REGISTRY.get_sample_value("bootseer_fs_verify_failures_total") or 0.0) == failures + 1


def test_an_image_announced_before_its_layers_is_decided_on_at_once(make_node: Callable[..., Node]) -> None:
    """The snapshotter announces an image as soon as it has listed its
    indexes, before any layer is in: its manifest is decided on then, and
    each layer's blocks are prefetched as soon as that layer is announced."""
    node = make_node(prefetch_parallel=1)
    node.local.put(HotManifest(IMAGE, 1, [node.block(0, 1, 0), node.block(1, 2, 1)]))

    async def body(node: Node) -> None:
        await announce(node, layers=[])
        await wait_for("the manifest to be decided on", lambda: node.hot.images[IMAGE].decided)
        assert node.hot.images[IMAGE].manifest is not None
        assert node.fetches == []
        await announce(node, layers=node.digests[:1])
        await wait_for("the first layer's hot block", lambda: node.reader(0).cached == {1})
        assert node.reader(1).cached == set()
        await announce(node)
        await wait_for("the prefetch to finish", lambda: prefetch_finished(node))

    run(node, body)
    assert node.fetches == [node.run_range(0, 1, 1), node.run_range(1, 2, 2)]
    assert not recording(node)


@pytest.mark.parametrize("spoilt", ["another image", "stale"])
def test_unusable_manifest_is_ignored_and_the_run_recorded(make_node: Callable[..., Node], spoilt: str) -> None:
    """A local manifest that names another image, or one with a block whose
    digest no longer matches the layer's index, prefetches nothing; the run
    is recorded instead and its manifest replaces the unusable one."""
    node = make_node()
    if spoilt == "another image":
        foreign = HotManifest(OTHER_IMAGE, 1, [node.block(0, 2, 0), node.block(1, 4, 1)])
        # LocalManifests.put files a manifest under its own image; a foreign
        # one under this image's key (a mixed-up store) needs a raw write.
        with node.local._env.begin(write=True) as txn:
            txn.put(IMAGE.encode(), foreign.encode())
    else:
        node.local.put(HotManifest(IMAGE, 1, [node.block(0, 2, 0), node.block(1, 4, 1, digest="0" * 64)]))
    unusable = node.local.get(IMAGE)

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("a recording to start", lambda: recording(node))
        await read_block(node, 0, 5)
        await read_block(node, 1, 7)
        await wait_for("a new local manifest", lambda: node.local.get(IMAGE) != unusable)

    run(node, body)
    # The reads fetched their blocks. Nothing of the unusable manifest was
    # prefetched, except, for the stale one, what it names in layer 0, which
    # checks out: layers are checked as they are queued, and trio may run
    # layer 0's check and its prefetch before layer 1's check stops it.
    reads = [node.run_range(0, 5, 5), node.run_range(1, 7, 7)]
    allowed = [node.run_range(0, 2, 2)] if spoilt == "stale" else []
    assert [f for f in node.fetches if f not in allowed] == reads
    recorded = node.local.get(IMAGE)
    assert recorded is not None and recorded.image == IMAGE and recorded.runs == 1
    assert blocks_of(recorded) == [(node.digests[0], 5), (node.digests[1], 7)]


def test_first_run_is_recorded_and_kept_locally_when_publishing_fails(make_node: Callable[..., Node]) -> None:
    """No manifest here or in the (unreachable) registry: the first run's
    block reads are recorded, in first-access order, with the blocks' index
    digests and, as the run read only each block's first bytes, its first
    part and the link after it; once the run settles the manifest, which
    cannot be published, is kept in the local store. Reads of a layer the
    image does not have, and repeated reads, add nothing."""
    node = make_node(layers=3, idle_s=0.3)
    image_layers = node.digests[:2]  # layer 2 is in the store but not in this image
    reads = [(1, 6), (0, 2), (2, 0), (1, 1), (1, 6), (0, 9)]

    async def body(node: Node) -> None:
        await announce(node, layers=image_layers)
        await wait_for("a recording to start", lambda: recording(node))
        for layer, n in reads:
            await read_block(node, layer, n)
        await wait_for("the recorded manifest", lambda: node.local.get(IMAGE))

    with structlog.testing.capture_logs() as logs:
        run(node, body)

    recorded = node.local.get(IMAGE)
    assert recorded is not None and recorded.image == IMAGE and recorded.runs == 1
    assert blocks_of(recorded) == [
        (node.digests[1], 6),
        (node.digests[0], 2),
        (node.digests[1], 1),
        (node.digests[0], 9),
    ]
    for b in recorded.blocks:
        reader = node.layers[b.layer].reader
        index_block = reader.index.blocks[b.block]
        assert b.digest == index_block.digest
        assert b.size == reader.index.part < index_block.cend - index_block.cstart
        compressed = layer_blob(node.digests.index(b.layer))[index_block.cstart : index_block.cend]
        assert b.link == parts.links(compressed, reader.index.part)[1].hex()
    # The recording over, its layers' readers keep no reaches.
    assert not any(served.reader.reaches for served in node.layers.values())
    times = [b.first_access_ms for b in recorded.blocks]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert recorded.total_bytes == sum(b.size for b in recorded.blocks)
    assert "hot-block manifest kept locally; publishing failed" in [e["event"] for e in logs]


def test_stop_request_ends_the_recording_at_once(make_node: Callable[..., Node]) -> None:
    """A request with stop=True ends a recording that would otherwise run
    for ten minutes (idle_s and max_s 600): the manifest of what was read so
    far is kept, and reads after it are no longer recorded."""
    node = make_node(idle_s=600.0, max_s=600.0)

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("a recording to start", lambda: recording(node))
        await read_block(node, 0, 3)
        await read_block(node, 1, 2)
        await announce(node, stop=True)
        await wait_for("the recorded manifest", lambda: node.local.get(IMAGE))
        assert not recording(node)

    run(node, body)
    assert blocks_of(node.local.get(IMAGE)) == [(node.digests[0], 3), (node.digests[1], 2)]


def test_layer_no_longer_current_is_not_prefetched(make_node: Callable[..., Node]) -> None:
    """The manifest's blocks of a layer whose served copy is stale (removed
    or replaced in the store) are dropped; the other layer's are fetched."""
    node = make_node(prefetch_parallel=1)
    node.layers[node.digests[0]].current = False
    manifest = HotManifest(
        IMAGE,
        1,
        [node.block(0, 1, 0), node.block(0, 2, 1), node.block(1, 4, 2), node.block(1, 5, 3), node.block(0, 8, 4)],
    )
    node.local.put(manifest)

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("the prefetch to finish", lambda: prefetch_finished(node))

    run(node, body)
    assert node.fetches == [node.run_range(1, 4, 5)]
    assert node.reader(0).cached == set()
    assert node.reader(1).cached == {4, 5}


def test_reads_right_after_the_announcement_are_recorded(make_node: Callable[..., Node]) -> None:
    """The first run is recorded from the image's announcement: a read that
    arrives before the tracker has finished looking for a manifest (one
    registry round trip at best; seconds of retries if the registry is slow
    or down) belongs to the first run, and is its hottest block."""
    node = make_node()

    async def body(node: Node) -> None:
        await announce(node)
        await read_block(node, 0, 2)  # the container's first read
        await wait_for("a recording to start", lambda: recording(node))
        await read_block(node, 1, 5)
        await wait_for("the recorded manifest", lambda: node.local.get(IMAGE))

    run(node, body)
    assert blocks_of(node.local.get(IMAGE)) == [(node.digests[0], 2), (node.digests[1], 5)]


def test_requested_recording_is_merged_into_the_local_manifest_when_publishing_fails(
    make_node: Callable[..., Node],
) -> None:
    """`record` on an image that has a (local) manifest: the run is prefetched
    and recorded, and its record is merged into the manifest (README: "record
    the next run even if a manifest exists (merged into it)") - also when the
    registry cannot be reached, rather than a one-run manifest replacing a
    many-run one and dropping the blocks this run did not read."""
    node = make_node()
    old = HotManifest(IMAGE, 3, [node.block(0, 1, 0), node.block(1, 2, 10)])
    node.local.put(old)

    async def body(node: Node) -> None:
        await announce(node, record=True)
        await wait_for("the prefetch to finish", lambda: prefetch_finished(node))
        await wait_for("a recording to start", lambda: recording(node))
        await read_block(node, 0, 1)
        await read_block(node, 0, 6)
        await wait_for("the recorded manifest", lambda: node.local.get(IMAGE) != old)

    run(node, body)
    merged = node.local.get(IMAGE)
    assert merged is not None and merged.runs == 4
    assert set(blocks_of(merged)) == {(node.digests[0], 1), (node.digests[1], 2), (node.digests[0], 6)}


def test_a_node_that_never_publishes_keeps_its_recording_and_asks_no_election(
    make_node: Callable[..., Node],
) -> None:
    """[fs] hot_blocks_publish = "never": the recording is kept locally as
    this node's own (not published), and no election or push is tried."""
    node = make_node(layers=1, idle_s=0.3)
    node.hot.settings.publish = "never"

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("a recording to start", lambda: recording(node))
        await read_block(node, 0, 3)
        await wait_for("the recorded manifest", lambda: node.local.get(IMAGE))

    with structlog.testing.capture_logs() as logs:
        run(node, body)

    entry = node.local.entry(IMAGE)
    assert entry is not None and entry.published == "" and blocks_of(entry.manifest) == [(node.digests[0], 3)]
    not_pushed = [e for e in logs if e["event"] == "hot-block manifest not pushed"]
    assert [e["reason"] for e in not_pushed] == ["never"]
    assert "hot-block publish election" not in [e["event"] for e in logs]


def test_a_layer_the_manifest_covers_reads_ahead_only_within_it(make_node: Callable[..., Node]) -> None:
    """Once the prefetch has the manifest's blocks of a layer, a reader going
    through the layer in order fetches only the blocks it reads: read-ahead
    past what the manifest says a start reads would fetch 6-13 as well."""
    node = make_node(layers=1)
    hot = [0, 1, 2, 8, 9]
    node.local.put(HotManifest(IMAGE, 1, [node.block(0, n, ms) for ms, n in enumerate(hot)]))

    async def body(node: Node) -> None:
        await announce(node)
        await wait_for("the prefetch to finish", lambda: prefetch_finished(node))
        reader = node.reader(0)
        assert reader.hot_blocks == set(hot)
        end = reader.index.blocks[5].uend
        for offset in range(0, end, 32 << 10):
            await reader.read(offset, min(offset + (32 << 10), end), reader.index.uncompressed_size)
        # Read-ahead runs in tasks of its own: let them land what they fetch.
        await trio.sleep(0.5)

    run(node, body)
    assert node.reader(0).cached == set(range(6)) | {8, 9}
    # 3, 4 and 5 each on demand, after the prefetch's two runs.
    assert node.fetches[2:] == [node.run_range(0, n, n) for n in (3, 4, 5)]


def test_covers_says_which_layers_a_manifest_leaves_to_the_prefetch(make_node: Callable[..., Node]) -> None:
    """A small layer is fetched whole only where no manifest says what a
    start reads of it (LayerFS._fetch_whole asks this): the manifest's layer
    is covered once the image has found its manifest, the other is not, and
    neither is a layer no starting image has."""
    node = make_node(layers=2)
    node.local.put(HotManifest(IMAGE, 1, [node.block(0, 1)]))
    found: dict[str, bool] = {}

    async def body(node: Node) -> None:
        async def ask() -> None:
            found["manifest's layer"] = await node.hot.covers(node.digests[0])

        async with trio.open_nursery() as nursery:
            # Asked before the image is announced (the snapshotter has the
            # layer loaded first), answered once its manifest is found.
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            await announce(node)
        found["other layer"] = await node.hot.covers(node.digests[1])
        found["no image's layer"] = await node.hot.covers("sha256:" + "0" * 64)

    run(node, body)
    assert found == {"manifest's layer": True, "other layer": False, "no image's layer": False}


def test_a_first_run_covers_no_layer(make_node: Callable[..., Node]) -> None:
    """Without a manifest (a recording run) small layers are fetched whole as before."""
    node = make_node(layers=1)
    found: list[bool] = []

    async def body(node: Node) -> None:
        await announce(node)
        found.append(await node.hot.covers(node.digests[0]))
        assert recording(node)

    run(node, body)
    assert found == [False]


def test_a_block_recorded_as_read_only_at_its_start_is_prefetched_only_so_far(make_node: Callable[..., Node]) -> None:
    """A first run reads the start of some blocks and the whole of another:
    its manifest asks only the first part of the former. A second node
    prefetches from it: one Range request per such block ends after that
    part, the block's start is served from the cache, and a read beyond it
    fetches the block whole and gets the layer's bytes."""
    first = make_node(layers=1, idle_s=0.3)
    # Apart: a block whose left-out rest is under MIN_LEFT_OUT (these are
    # about 64 KiB) is fetched whole when the next block is hot.
    starts, whole = [2, 5, 7], 9

    async def record(node: Node) -> None:
        await announce(node)
        await wait_for("a recording to start", lambda: recording(node))
        for n in starts:
            await read_block(node, 0, n)
        b = node.reader(0).index.blocks[whole]
        assert len(await node.reader(0).read(b.ustart, b.uend)) == b.uend - b.ustart
        await wait_for("the recorded manifest", lambda: node.local.get(IMAGE))

    run(first, record)
    manifest = first.local.get(IMAGE)
    assert manifest is not None
    part = first.reader(0).index.part
    assert {b.block: (b.size, b.partial) for b in manifest.blocks} == {
        **dict.fromkeys(starts, (part, True)),
        whole: (first.block(0, whole).size, False),
    }

    second = make_node(layers=1)
    second.local.put(manifest)
    reader = second.reader(0)
    blocks = reader.index.blocks
    stream = gzip.decompress(layer_blob(0))

    async def prefetch(node: Node) -> None:
        await announce(node)
        await wait_for("the prefetch to finish", lambda: prefetch_finished(node))
        first_parts = [(node.digests[0], blocks[n].cstart, blocks[n].cstart + part) for n in starts]
        assert sorted(node.fetches) == sorted([*first_parts, node.run_range(0, whole, whole)])
        assert set(reader.partial) == set(starts) and reader.cached == {whole}
        fetched = len(node.fetches)
        for n in starts:
            await read_block(node, 0, n)
        assert len(node.fetches) == fetched
        b = blocks[7]
        assert await reader.read(b.uend - 100, b.uend) == stream[b.uend - 100 : b.uend]
        assert node.fetches[fetched:] == [node.run_range(0, 7, 7)]
        assert 7 in reader.cached and 7 not in reader.partial

    run(second, prefetch)
    # What the cache holds of the blocks fetched only in part is what the
    # block index records, for the next server to check and serve.
    records = second.block_index.cached(reader.cache_key)
    assert records[2].size == reader.partial[2] < blocks[2].uend - blocks[2].ustart
    assert records[7].size == blocks[7].uend - blocks[7].ustart
