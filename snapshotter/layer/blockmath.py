"""Which compressed ranges to request for a set of missing blocks."""

from __future__ import annotations

from collections.abc import Iterable

from snapshotter.layer.index import Block

# One Range request covers at most this many compressed bytes, so that a
# large miss still streams in parallel requests and one slow request does not
# hold every block back.
MAX_RUN_BYTES = 16 << 20


def fetch_runs(numbers: Iterable[int], blocks: list[Block], max_bytes: int = MAX_RUN_BYTES) -> list[list[int]]:
    """Group block numbers into runs of consecutive blocks, each fetched with
    one Range request over [blocks[run[0]].cstart, blocks[run[-1]].cend)."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs:
            run = runs[-1]
            contiguous = n == run[-1] + 1
            size = blocks[n].cend - blocks[run[0]].cstart
            if contiguous and size <= max_bytes:
                run.append(n)
                continue
        runs.append([n])
    return runs


def split_run(run: list[int], blocks: list[Block], data: bytes) -> dict[int, bytes]:
    """Each block's compressed bytes out of one run's response (blocks overlap
    by a byte at checkpoints that start mid-byte)."""
    base = blocks[run[0]].cstart
    return {n: data[blocks[n].cstart - base : blocks[n].cend - base] for n in run}
