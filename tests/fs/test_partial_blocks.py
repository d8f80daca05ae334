"""Blocks cached only up to their first parts (a hot-block prefetch of what a
start reads of them): served as far as they go, fetched whole for a read
beyond, kept across a restart of the layer server, and counted in the cache
at the size they have. Real LayerReaders over an in-memory blob, no FUSE."""

from __future__ import annotations

import gzip
import random
import tarfile
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from snapshotter.fs.eviction import BlockCache
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import BlockUnavailable, LayerReader, Origin
from snapshotter.layer import parts
from tests.fs.conftest import Blob, make_layer, make_reader

SPAN = 256 << 10


def _blob() -> bytes:
    rng = random.Random(3)
    members = []
    for i in range(4):
        data = rng.randbytes(200_000) + bytes(300_000)
        info = tarfile.TarInfo(f"f{i}")
        info.size = len(data)
        members.append((info, data))
    return make_layer(members)


def test_a_blocks_first_parts_are_served_kept_and_completed_on_a_read_beyond(tmp_path: Path) -> None:
    blob = Blob(_blob())
    raw = gzip.decompress(blob.data)
    store_dir = tmp_path / "store"
    first = make_reader(tmp_path, blob.data, blob.fetch, SPAN, store_dir=store_dir)
    index = first.index
    n, b = next((n, b) for n, b in enumerate(index.blocks) if b.cend - b.cstart > 3 * index.part)
    links = parts.links(blob.data[b.cstart : b.cend], index.part)
    cache = BlockCache(LayerStore(store_dir), first.block_index, 0, trio.Lock())
    first.cache = cache

    async def prefetch() -> int:
        await first.ensure([n], Origin.HOT, prefixes={n: (2 * index.part, links[2])})
        assert blob.fetched == [(b.cstart, b.cstart + 2 * index.part)]
        got = first.partial[n]
        assert 0 < got < b.uend - b.ustart and n not in first.cached
        assert cache.total == got
        # Asked again for those parts: nothing more is fetched.
        await first.ensure([n], Origin.HOT, prefixes={n: (2 * index.part, links[2])})
        assert await first.read(b.ustart, b.ustart + got) == raw[b.ustart : b.ustart + got]
        assert first.read_now(b.ustart, b.ustart + got) == raw[b.ustart : b.ustart + got]
        assert first.read_now(b.ustart, b.ustart + got + 1) is None
        assert len(blob.fetched) == 1
        return got

    got = trio.run(prefetch)
    first.close()

    # A restarted server: the block index says how far the block is cached.
    second = LayerReader(
        first.name,
        first.cache_key,
        index,
        LayerStore(store_dir).cache_path(first.name),
        first.block_index,
        blob.fetch,
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(1),
        trio.CapacityLimiter(4),
        cache=cache,
    )
    assert second.partial == {n: got} and n not in second.cached

    async def read_on() -> None:
        # Checked against its crc, then served without a fetch.
        assert await second.read(b.ustart + 10, b.ustart + got) == raw[b.ustart + 10 : b.ustart + got]
        assert len(blob.fetched) == 1
        # A read beyond fetches the block whole.
        assert await second.read(b.ustart + got - 5, b.uend) == raw[b.ustart + got - 5 : b.uend]
        assert blob.fetched[1:] == [(b.cstart, b.cend)]
        assert n in second.cached and n not in second.partial
        assert cache.total == b.uend - b.ustart

    trio.run(read_on)
    assert second.block_index.cached(second.cache_key)[n].size == b.uend - b.ustart
    second.close()


def test_first_parts_that_do_not_check_out_are_not_served(tmp_path: Path) -> None:
    """A manifest's link that does not match (stale, or forged) fails the
    prefetch; a read waiting on it then fetches the block whole."""
    blob = Blob(_blob())
    raw = gzip.decompress(blob.data)
    held = threading.Event()

    def fetch(start: int, end: int) -> bytes:
        if end - start == index.part:
            held.wait(30)
        return blob.fetch(start, end)

    reader = make_reader(tmp_path, blob.data, fetch, SPAN)
    index = reader.index
    n, b = next((n, b) for n, b in enumerate(index.blocks) if b.cend - b.cstart > 3 * index.part)
    links = parts.links(blob.data[b.cstart : b.cend], index.part)

    async def prefetch() -> None:
        with pytest.raises(BlockUnavailable, match="do not match"):
            await reader.ensure([n], Origin.HOT, prefixes={n: (index.part, links[2])})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefetch)
            await trio.testing.wait_all_tasks_blocked()
            # The prefetch's fetch is held: this read waits on it.
            read = trio.Event()
            got: list[bytes] = []

            async def reading() -> None:
                got.append(await reader.read(b.ustart, b.ustart + 100))
                read.set()

            nursery.start_soon(reading)
            await trio.testing.wait_all_tasks_blocked()
            assert n in reader.inflight and not read.is_set()
            held.set()
        assert got == [raw[b.ustart : b.ustart + 100]]
        assert blob.fetched[-1] == (b.cstart, b.cend) and n in reader.cached and n not in reader.partial

    trio.run(main)
    reader.close()
