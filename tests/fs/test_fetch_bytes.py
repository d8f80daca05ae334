"""What a read through the layer mount moves: the blocks holding the bytes
read and, with the kernel read-ahead the layer server sets on its mount, not
the blocks around them, which a start never reads; and what the hot-block
record then holds: the blocks read, no more. A real FUSE mount of the layer
server (tests.fs.conftest), the server's own read-ahead set on it."""

from __future__ import annotations

import random
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from hdfs_fuse.mount import set_kernel_readahead
from snapshotter.fs.layers import LayerStore
from tests.fs.conftest import Blob, Events, Mounted, add_layer, make_layer

SPAN = 1 << 20
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
    m = mount_layers({digest: source}, tmp_path / "store")
    set_kernel_readahead(m.mountpoint, READ_AROUND)
    events = Events()
    m.ops.events = events
    return m, digest, data, source, events


def test_a_page_fault_in_a_big_file_fetches_only_the_block_it_is_in(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    """A mapped library's page faults are a start's sparsest reads: the
    kernel reads around each fault by the mount's read-ahead, so that
    window, not the page, decides how many blocks are fetched and recorded."""
    m, digest, data, source, events = _mounted(mount_layers, tmp_path)
    offset = 9 * SPAN + SPAN // 2  # the middle of the file's tenth block
    # In a process of its own: a page fault holds the GIL, which the server's thread here needs.
    faulted = subprocess.run(
        [sys.executable, "-c", _FAULT, str(m.layer(digest) / "weights"), str(offset)],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    assert faulted == data[offset : offset + 4096]
    reader = m.ops.layers_by_name[digest.split(":")[1]].reader
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
