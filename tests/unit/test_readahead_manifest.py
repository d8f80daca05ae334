"""Read-ahead of a layer a hot-block manifest covers: it fetches ahead only
the blocks the manifest lists, never what no start was seen to read.
LayerReader on an in-memory blob (tests.fs.conftest.Blob), without FUSE."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path

import trio

from snapshotter.fs.reader import LayerReader
from tests.fs.conftest import Blob, make_layer, make_reader

SPAN = 64 << 10
READ = 32 << 10


def _reader(tmp_path: Path, source: Blob) -> LayerReader:
    return make_reader(tmp_path, source.data, source.fetch, SPAN)


def _source() -> Blob:
    # Random bytes: 2 MiB in about 32 blocks of SPAN.
    data = random.Random(5).randbytes(2 << 20)
    info = tarfile.TarInfo("big")
    info.size = len(data)
    return Blob(make_layer([(info, data)]))


def _read_blocks_in_order(reader: LayerReader, last: int) -> set[int]:
    """Read blocks 0..`last` in small sequential reads (read-ahead's cue);
    the blocks cached once read-ahead has settled."""

    async def main() -> None:
        end = reader.index.blocks[last].uend
        for offset in range(0, end, READ):
            await reader.read(offset, min(offset + READ, end), reader.index.uncompressed_size)
        # Read-ahead runs in tasks of its own: let them land what they fetch.
        await trio.sleep(0.5)

    trio.run(main)
    return set(reader.cached)


def test_read_ahead_fetches_only_blocks_the_manifest_lists(tmp_path: Path) -> None:
    reader = _reader(tmp_path, _source())
    hot = {0, 1, 2, 8, 9, 20}
    reader.follow_manifest(hot)
    try:
        cached = _read_blocks_in_order(reader, 5)
    finally:
        reader.close()
        reader.block_index.close()
    # What was read, and ahead of it only the manifest's blocks (20 lies
    # beyond the window's reach); without the manifest read-ahead takes 6-13.
    assert cached == set(range(6)) | {8, 9}


def test_without_a_manifest_read_ahead_goes_past_the_reads(tmp_path: Path) -> None:
    reader = _reader(tmp_path, _source())
    try:
        cached = _read_blocks_in_order(reader, 5)
    finally:
        reader.close()
        reader.block_index.close()
    assert cached > set(range(6)) | {6, 7}


def test_manifests_of_several_images_add_up(tmp_path: Path) -> None:
    reader = _reader(tmp_path, _source())
    try:
        assert reader.hot_blocks is None
        reader.follow_manifest({1, 2})
        reader.follow_manifest({2, 7})
        assert reader.hot_blocks == {1, 2, 7}
    finally:
        reader.close()
        reader.block_index.close()
