"""LayerReader without FUSE: when it reads ahead, and when it leaves that to
the hot-block prefetcher."""

from __future__ import annotations

import functools
import gzip
import os
import random
import subprocess
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from snapshotter.fs.blockindex import BlockIndex, BlockRecord, BlockState
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import LayerReader, Origin
from tests.fs.conftest import Blob, add_layer, fill, make_layer, make_reader, metric

SPAN = 64 << 10


def _reader(
    tmp_path: Path,
    source: Blob,
    blob: bytes,
    store_dir: Path | None = None,
    span: int = SPAN,
    block_index_path: Path | None = None,
) -> LayerReader:
    return make_reader(tmp_path, blob, source.fetch, span, store_dir, block_index_path)


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


def test_prefetched_blocks_decode_outside_the_default_thread_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefetch landing many blocks must not hold the threads a reader's
    own miss (and the container's other requests) decode and read in."""
    blob, _ = _layer()
    reader = _reader(tmp_path, Blob(blob), blob)
    raw = gzip.decompress(blob)
    prefetched = range(1, 6)
    released = threading.Event()
    decode = reader.decoder.decode

    def held(n: int, compressed: memoryview) -> bytes:
        if n in prefetched:
            released.wait(30)
        return decode(n, compressed)

    monkeypatch.setattr(reader.decoder, "decode", held)
    wanted = reader.index.blocks[8]

    async def main() -> None:
        # One thread in the default pool: a prefetched block decoding there
        # would take it until released.
        trio.to_thread.current_default_thread_limiter().total_tokens = 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(reader.ensure, prefetched, Origin.HOT))
            await trio.sleep(0.5)
            try:
                with trio.fail_after(10):
                    got = await reader.read(wanted.ustart, wanted.ustart + 4096)
            finally:
                released.set()
        assert got == raw[wanted.ustart : wanted.ustart + 4096]

    try:
        trio.run(main)
    finally:
        _close(reader)
    assert set(prefetched) | {8} <= reader.cached


def _close(reader: LayerReader) -> None:
    reader.close()
    reader.block_index.close()


def test_a_store_without_rwf_nowait_is_read_through_a_thread(
    small_tmpfs: Callable[[int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob, _ = _layer()
    raw = gzip.decompress(blob)
    reader = _reader(tmp_path, Blob(blob), blob, small_tmpfs(8 << 20) / "store")
    attempts: list[int] = []
    preadv = os.preadv

    def counted(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        attempts.append(flags)
        return preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", counted)

    async def main() -> None:
        for _ in range(3):
            assert await reader.read(1000, 5000) == raw[1000:5000]

    try:
        trio.run(main)
    finally:
        _close(reader)
    # tmpfs refuses RWF_NOWAIT; asked once, it is not asked again.
    assert attempts == [os.RWF_NOWAIT]


def test_a_failed_cache_write_serves_from_memory_and_distrusts_the_cache(
    small_tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    blob, _ = _layer()
    raw = gzip.decompress(blob)
    disk = small_tmpfs(4 << 20)
    # The block index has room elsewhere: what it records is up to the reader.
    reader = _reader(tmp_path, Blob(blob), blob, disk / "store", 256 << 10, tmp_path / "blocks.lmdb")
    blocks = reader.index.blocks
    assert len(blocks) > 6

    async def read_block(n: int) -> bytes:
        return await reader.read(blocks[n].ustart, blocks[n].uend)

    async def main() -> None:
        assert await read_block(3) == raw[blocks[3].ustart : blocks[3].uend]
        assert 3 in reader.cached
        # Bytes the cache file took and then lost, unnoticed so far.
        with open(LayerStore(disk / "store").cache_path(reader.name), "r+b") as cache:
            cache.seek(blocks[3].ustart)
            cache.write(b"\0" * (blocks[3].uend - blocks[3].ustart))
        # Room for part of a block: its write comes up short.
        filler = fill(disk, leave=64 << 10)

        before = metric("bootseer_fs_cache_write_errors_total")
        assert await read_block(6) == raw[blocks[6].ustart : blocks[6].uend]
        assert metric("bootseer_fs_cache_write_errors_total") == before + 1
        assert 6 not in reader.cached
        assert 6 not in reader.block_index.cached(reader.cache_key)
        # After the failed write, block 3 is checked before it is served.
        assert await read_block(3) == raw[blocks[3].ustart : blocks[3].uend]

        # Space again: blocks are cached as usual.
        filler.unlink()
        assert await read_block(1) == raw[blocks[1].ustart : blocks[1].uend]
        assert 1 in reader.cached
        assert 1 in reader.block_index.cached(reader.cache_key)

    try:
        trio.run(main)
    finally:
        _close(reader)


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


@pytest.mark.integration  # a bind mount
def test_a_layer_that_cannot_be_pruned_does_not_stop_the_others(tmp_path: Path) -> None:
    blob, _ = _layer()
    store = LayerStore(tmp_path / "store")
    first = add_layer(store, tmp_path, blob, SPAN).split(":")[1]
    other_blob = make_layer([(_info("other", 10), b"0123456789")])
    second = add_layer(store, tmp_path, other_blob, SPAN).split(":")[1]
    # A bind mount inside a layer directory makes its removal fail with EBUSY.
    busy = store.path(first) / "busy"
    busy.mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path), str(busy)], check=True)
    try:
        assert sorted(store.prune(keep=set(), older_than_s=0)) == sorted([first, second])
        assert store.names() == []
        # Renamed away for removal, left until it can go.
        [doomed] = store.root.glob(".rm-*")
        busy = doomed / "busy"
    finally:
        subprocess.run(["umount", str(busy)], check=True)
    store.prune(keep=set(), older_than_s=0)
    assert list(store.root.glob(".rm-*")) == []


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info
