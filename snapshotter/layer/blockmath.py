"""Which compressed ranges to request for a set of missing blocks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from snapshotter.layer.index import Block

# One Range request covers at most this many compressed bytes, so that a
# large miss still streams in parallel requests and one slow request does not
# hold every block back. Side by side on the benchmark image, 4 MiB against
# 16 MiB let a start read its 100 MB weight shard sooner (prefetched, at 1
# Gbit/s: 0.38 s against 0.62 s, medians of 4) and cost nothing at 200
# Mbit/s; then a run's blocks landed only once its whole response was in,
# now each lands as soon as its bytes are (RunArrival).
MAX_RUN_BYTES = 4 << 20

# A hot block the manifest asks only the first parts of ends its Range
# request, the rest of it left out, unless that rest is under this many
# bytes: then it is fetched whole, with the hot block after it in the same
# request. On the tabular image's recording (398 hot blocks, 194 MB),
# computed from its reads: 110 requests and 181.9 MB with no such merging,
# 85 and 182.5 MB at 64 KiB, 57 and 186.4 MB at 256 KiB; a request costs the
# registry about 4 ms of CPU.
MIN_LEFT_OUT = 64 << 10


def fetch_runs(
    numbers: Iterable[int],
    blocks: list[Block],
    max_bytes: int = MAX_RUN_BYTES,
    prefixes: Mapping[int, int] | None = None,
) -> list[list[int]]:
    """Group block numbers, in the order given, into runs of consecutive
    blocks, each fetched with one Range request over
    [blocks[run[0]].cstart, blocks[run[-1]].cend). The order is the caller's:
    file order for reads, block order for a hot-block manifest (hot_runs).
    `prefixes`: the compressed bytes asked of blocks wanted only up to
    their first parts; such a block ends its run (MIN_LEFT_OUT)."""
    prefixes = prefixes or {}
    runs: list[list[int]] = []
    for n in numbers:
        if runs:
            run = runs[-1]
            last = blocks[run[-1]]
            contiguous = n == run[-1] + 1
            size = blocks[n].cend - blocks[run[0]].cstart
            left_out = last.cend - last.cstart - prefixes.get(run[-1], last.cend - last.cstart)
            if contiguous and size <= max_bytes and left_out < MIN_LEFT_OUT:
                run.append(n)
                continue
        runs.append([n])
    return runs


# A hot-block prefetch asks for up to this many bytes at once. A start's
# manifest lists a layer's blocks in the order it read them, which jumps
# about the layer: merged in that order, the benchmark image's 379 hot
# blocks took 182 Range requests; merged by number, 66 at 8 MiB (90 at
# 4 MiB, 57 at 16 MiB), the same bytes. A registry's cost is mostly per
# request (docker-registry 2.8: about 4 ms of CPU each).
HOT_RUN_BYTES = 8 << 20


def run_span(run: list[int], blocks: list[Block], prefix: int | None = None) -> tuple[int, int]:
    """[start, end) of the compressed bytes one Range request fetches for
    `run`; `prefix`: the bytes asked of its last block, if only its first parts."""
    last = blocks[run[-1]]
    return blocks[run[0]].cstart, last.cstart + prefix if prefix is not None else last.cend


# A prefetch worker takes the runs due next of one layer, up to this many
# and these bytes, and asks for them in one multi-range request (where the
# registry serves those: RegistryClient.stream_ranges). docker-registry 2.8
# spends about 7 ms of CPU on a request and 2 ms on each further range of
# one; on the benchmark image's manifest, 121 Range requests become 30.
HOT_BATCH_RUNS = 16
HOT_BATCH_BYTES = 8 << 20


def hot_runs(
    positions: dict[int, int],
    blocks: list[Block],
    prefixes: Mapping[int, int] | None = None,
    max_bytes: int = HOT_RUN_BYTES,
) -> list[tuple[int, list[int]]]:
    """A layer's hot blocks, given as block number -> place in the manifest
    (first access), as runs of consecutive blocks in block order, each
    fetched with one Range request, paired with the place of the run's
    earliest-read block: the prefetch takes runs in that order. `prefixes`:
    the compressed bytes the manifest asks of the blocks it wants only the
    first parts of; such a block ends its run (MIN_LEFT_OUT)."""
    return [(min(positions[n] for n in run), run) for run in fetch_runs(sorted(positions), blocks, max_bytes, prefixes)]


class RunArrival:
    """One run's blocks as its response arrives into `data`: which are whole
    once its first `received` bytes are in, each handed out once, as a view
    of its compressed bytes (blocks overlap by a byte at checkpoints that
    start mid-byte). `end`: where the response ends in the blob, if short of
    the last block's end (its first parts only)."""

    def __init__(self, run: list[int], blocks: list[Block], data: memoryview, end: int | None = None) -> None:
        self.base = blocks[run[0]].cstart
        self._data = data
        self._cends = {n: blocks[n].cend for n in run}
        if end is not None:
            self._cends[run[-1]] = end
        self._cstarts = {n: blocks[n].cstart for n in run}
        # Where, in the response, each block is whole: ascending.
        self.ends = sorted(c - self.base for c in self._cends.values())
        # By end, the next to be whole last.
        self._pending = sorted(run, key=self._cends.__getitem__, reverse=True)

    def whole(self, received: int) -> dict[int, memoryview]:
        """The blocks whole within the first `received` bytes and not handed out yet."""
        out = {}
        while self._pending and self._cends[self._pending[-1]] - self.base <= received:
            n = self._pending.pop()
            out[n] = self._data[self._cstarts[n] - self.base : self._cends[n] - self.base]
        return out


@dataclass
class InOrderReadAhead:
    """Which blocks to fetch ahead of a reader going through a layer in order.

    Reads inside the block last seen, or in the next one, count as sequential;
    each step into a new block doubles the window (from 2, up to
    `max_blocks`); any other read closes it. Random access fetches nothing
    it did not ask for. Unlike hdfs_fuse's ReorderTolerantReadAhead, it accepts
    no disorder beyond the block last seen and the next one.
    """

    max_blocks: int = 8
    window: int = 0
    next_block: int = -1

    def observe(self, first: int, last: int) -> range:
        if self.next_block - 1 <= first <= self.next_block:
            if last >= self.next_block:
                self.window = min(max(2, self.window * 2), self.max_blocks)
        else:
            self.window = 0
        self.next_block = last + 1
        return range(last + 1, last + 1 + self.window)
