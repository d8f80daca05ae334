"""What a read through the layer mount moves: the blocks holding the bytes
read, the few after a miss while no hot-block manifest covers the layer, and
nothing else; and what the hot-block record then holds: the blocks read, no
more. A real FUSE mount of the layer server (tests.fs.conftest), the
server's own read-ahead set on it."""

from __future__ import annotations

import random
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from hdfs_fuse.mount import set_kernel_readahead
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.settings import FsConfig
from snapshotter.layer.blockmath import fetch_runs
from tests.fs.conftest import Blob, Events, Mounted, add_layer, make_layer
from tests.harness.procs import wait_until

SPAN = 1 << 20
# The product's `[fs] blocks_after_miss`.
AFTER_MISS = FsConfig().blocks_after_miss
FILE_BYTES = 16 << 20
# The mount's read-ahead here: half a block, so a fault's read-around stays
# inside the block it is in (the server's own, larger window trades bytes
# for cached starts; see KERNEL_READAHEAD).
READ_AROUND = SPAN // 2
# Maps a file and touches one page of it (argv: path, offset): a library's load.
_FAULT = """
import mmap, sys
with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
    offset = int(sys.argv[2])
    sys.stdout.buffer.write(mapped[offset : offset + 4096])
"""


def _mounted(mount_layers: Callable[..., Mounted], tmp_path: Path) -> tuple[Mounted, str, bytes, Blob, Events]:
    # Random bytes: blocks of exactly SPAN (an explicit span is every block's).
    data = random.Random(21).randbytes(FILE_BYTES)
    info = tarfile.TarInfo("weights")
    info.size = len(data)
    blob = make_layer([(info, data)])
    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    source = Blob(blob)
    m = mount_layers({digest: source}, tmp_path / "store", blocks_after_miss=AFTER_MISS)
    set_kernel_readahead(m.mountpoint, READ_AROUND)
    events = Events()
    m.ops.events = events
    return m, digest, data, source, events


def _fault(m: Mounted, digest: str, offset: int) -> bytes:
    # In a process of its own: a page fault holds the GIL, which the server's thread here needs.
    return subprocess.run(
        [sys.executable, "-c", _FAULT, str(m.layer(digest) / "weights"), str(offset)],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout


def test_a_page_fault_fetches_its_block_and_the_next_ones_and_records_its_own(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    """A mapped library's page faults are a start's sparsest reads: the
    kernel reads around each fault by the mount's read-ahead, so that
    window decides which block the reader waits for and is recorded; with
    no hot-block manifest for the layer the blocks right after it come too,
    in the same request, and are not recorded, since nothing read them."""
    m, digest, data, source, events = _mounted(mount_layers, tmp_path)
    offset = 9 * SPAN + SPAN // 2  # the middle of the file's tenth block
    assert _fault(m, digest, offset) == data[offset : offset + 4096]
    reader = m.ops.layers_by_name[digest.split(":")[1]].reader
    entry = next(e for e in reader.index.entries if e.name == "weights")
    block = reader.index.block_range(entry.offset + offset, entry.offset + offset + 1).start
    after = range(block + 1, block + 1 + AFTER_MISS)
    wait_until(lambda: reader.cached == {block, *after}, 30, "the blocks after the fault to land")
    blocks = reader.index.blocks
    # The blocks after it in the same Range request, as far as one goes
    # (MAX_RUN_BYTES): the fault's block comes first and lands first.
    runs = fetch_runs([block, *after], blocks)
    assert sorted(source.fetched) == [(blocks[run[0]].cstart, blocks[run[-1]].cend) for run in runs]
    assert events.accessed == {(digest, block)}


def test_under_a_hot_block_manifest_a_page_fault_fetches_only_its_block(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    """Once a manifest says what a start reads, a miss fetches nothing
    beyond it: the blocks after the fault are not in the manifest."""
    m, digest, data, source, events = _mounted(mount_layers, tmp_path)
    (m.layer(digest) / "weights").stat()  # loads the layer
    reader = m.ops.layers_by_name[digest.split(":")[1]].reader
    reader.follow_manifest({0})
    offset = 9 * SPAN + SPAN // 2
    assert _fault(m, digest, offset) == data[offset : offset + 4096]
    entry = next(e for e in reader.index.entries if e.name == "weights")
    block = reader.index.block_range(entry.offset + offset, entry.offset + offset + 1).start
    assert reader.cached == {block}
    assert source.fetched == [(reader.index.blocks[block].cstart, reader.index.blocks[block].cend)]
    assert events.accessed == {(digest, block)}


def test_a_whole_file_read_in_order_is_served_whole_and_recorded_whole(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    """The smaller read-ahead costs a sequential reader nothing in bytes:
    every byte right, every block fetched once; what the server's own
    read-ahead fetched is recorded only once read."""
    m, digest, data, source, events = _mounted(mount_layers, tmp_path)
    assert (m.layer(digest) / "weights").read_bytes() == data
    reader = m.ops.layers_by_name[digest.split(":")[1]].reader
    entry = next(e for e in reader.index.entries if e.name == "weights")
    read = set(reader.index.block_range(entry.offset, entry.offset + entry.size))
    assert events.accessed == {(digest, n) for n in read}
    blocks = reader.index.blocks
    fetches = [
        sum(1 for start, end in source.fetched if start <= blocks[n].cstart < blocks[n].cend <= end) for n in read
    ]
    assert fetches == [1] * len(read)
