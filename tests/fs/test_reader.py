"""LayerReader without FUSE: when it reads ahead, and when it leaves that to
the hot-block prefetcher."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path

import trio

from snapshotter.fs.blockindex import BlockIndex, BlockRecord, BlockState
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import LayerReader, Origin
from tests.fs.conftest import Blob, add_layer, make_layer

SPAN = 64 << 10


def _reader(tmp_path: Path, source: Blob, blob: bytes) -> LayerReader:
    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    name = digest.split(":")[1]
    index, layer_source = store.load(name)
    return LayerReader(
        name,
        layer_source.cache_key,
        index,
        store.cache_path(name),
        BlockIndex(store.block_index_path),
        source.fetch,
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(1),
    )


def _layer() -> tuple[bytes, bytes]:
    data = random.Random(3).randbytes(2 << 20)
    info = tarfile.TarInfo("big")
    info.size = len(data)
    return make_layer([(info, data)]), data


def _fetched_blocks(reader: LayerReader, source: Blob) -> set[int]:
    return {
        n
        for n, b in enumerate(reader.index.blocks)
        for start, end in source.fetched
        if start <= b.cstart and b.cend <= end
    }


async def _read_in_order(reader: LayerReader, upto_block: int) -> None:
    end = reader.index.blocks[upto_block].uend
    for offset in range(0, end, 32 << 10):
        await reader.read(offset, min(offset + (32 << 10), end))
    # Let read-ahead tasks started by the last reads finish.
    await trio.sleep(0.2)


def test_sequential_misses_read_ahead(tmp_path: Path) -> None:
    blob, _ = _layer()
    source = Blob(blob)
    reader = _reader(tmp_path, source, blob)
    trio.run(_read_in_order, reader, 5)
    assert max(_fetched_blocks(reader, source)) > 5


def test_hot_blocks_do_not_set_off_read_ahead(tmp_path: Path) -> None:
    blob, data = _layer()
    source = Blob(blob)
    reader = _reader(tmp_path, source, blob)

    async def main() -> None:
        await reader.ensure(range(6), Origin.HOT)
        await _read_in_order(reader, 5)
        entry = next(e for e in reader.index.entries if e.name == "big")
        assert await reader.read(entry.offset, entry.offset + 4096) == data[:4096]

    trio.run(main)
    assert _fetched_blocks(reader, source) == set(range(6))


def test_a_pruned_layer_takes_its_block_records_with_it(tmp_path: Path) -> None:
    blob, _ = _layer()
    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    name = digest.split(":")[1]
    cache_key = store.load(name)[1].cache_key
    block_index = BlockIndex(store.block_index_path)
    block_index.put(cache_key, 0, BlockRecord(BlockState.CACHED, 1))
    block_index.put("ab" * 32 + "00", 0, BlockRecord(BlockState.CACHED, 2))
    block_index.close()

    assert store.prune(keep=set(), older_than_s=0) == [name]

    block_index = BlockIndex(store.block_index_path)
    try:
        assert block_index.cached(cache_key) == {}
        assert block_index.cached("ab" * 32 + "00") == {0: BlockRecord(BlockState.CACHED, 2)}
    finally:
        block_index.close()
