"""The block index's group commit: puts from many threads at once all land,
each returning only once its own record is committed, and a commit that
fails fails every put it carried."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from snapshotter.fs.blockindex import BlockIndex, BlockIndexError, BlockRecord, BlockState

LAYER = "ab" * 32


def _record(n: int) -> BlockRecord:
    return BlockRecord(BlockState.CACHED, crc32=n, offset=n << 20, size=1 << 20, used_at=1)


def test_concurrent_puts_all_land_and_are_readable_on_return(tmp_path: Path) -> None:
    index = BlockIndex(tmp_path / "blocks.lmdb")
    seen_on_return: dict[int, bool] = {}
    start = threading.Barrier(16)

    def put_many(first: int) -> None:
        start.wait()
        for n in range(first, first + 50):
            index.put(LAYER, n, _record(n))
            # Committed by the time put returns, whoever committed it.
            seen_on_return[n] = n in index.cached(LAYER)

    threads = [threading.Thread(target=put_many, args=(t * 50,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(seen_on_return.values()) and len(seen_on_return) == 800
    index.close()
    reopened = BlockIndex(tmp_path / "blocks.lmdb")
    assert reopened.cached(LAYER) == {n: _record(n) for n in range(800)}
    reopened.close()


def test_a_failed_commit_fails_its_puts_and_later_puts_still_work(tmp_path: Path) -> None:
    # An LMDB map of a few pages: it fills after a few hundred records.
    index = BlockIndex(tmp_path / "blocks.lmdb", map_size=64 << 10)
    landed = 0
    with pytest.raises(BlockIndexError, match="not recorded"):
        for n in range(100_000):
            index.put(LAYER, n, _record(n))
            landed += 1
    assert 0 < landed < 100_000
    # What was committed stays; the failed put left nothing behind, and the
    # index is still usable.
    assert set(index.cached(LAYER)) == set(range(landed))
    index.delete(LAYER, range(landed))
    index.put(LAYER, 0, _record(0))
    assert index.cached(LAYER) == {0: _record(0)}
    index.close()
