"""A read waiting on a stalled registry gets EIO by the fetch deadline,
whatever the fetch is doing; the mount stays up, and once the registry
answers again the same read succeeds. Over a real FUSE mount, then the
reader alone for what the kernel hides: readers waiting on one fetch, and
the deadline spanning the reader's verify attempts."""

from __future__ import annotations

import errno
import gzip
import random
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import BlockUnavailable, BoundedFetcher, LayerReader
from tests.fs.conftest import Mounted, add_layer, make_layer, make_reader
from tests.harness.tree import drop_page_cache

SPAN = 256 << 10
DEADLINE_S = 1.0


@dataclass
class StallingRegistry:
    """A layer blob behind a registry that, while `stalled`, takes every
    fetch and answers none until it recovers. It pays no heed to the
    deadline it is given: only the reader's own can end a read's wait."""

    data: bytes
    stalled: bool = False
    corrupt_next: bool = False
    answering: threading.Event = field(default_factory=threading.Event)
    # (start, end, deadline) of every fetch asked for.
    calls: list[tuple[int, int, float]] = field(default_factory=list)

    def fetch_by(self, start: int, end: int, deadline: float) -> bytes:
        self.calls.append((start, end, deadline))
        chunk = self.data[start:end]
        if self.corrupt_next:
            self.corrupt_next = False
            return bytes([chunk[0] ^ 0xFF]) + chunk[1:]
        if self.stalled:
            self.answering.wait()
        return chunk

    @property
    def fetch(self) -> BoundedFetcher:
        """What the layer server is given for the layer (as mount_layers takes it)."""
        return BoundedFetcher(lambda start, end, deadline, sink: sink(self.fetch_by(start, end, deadline)), DEADLINE_S)

    def recover(self) -> None:
        self.stalled = False
        self.answering.set()


@pytest.fixture
def registries(mount_layers: Callable[..., Mounted]) -> Iterator[list[StallingRegistry]]:
    """Stalled registries to let go of before the mounts are torn down."""
    made: list[StallingRegistry] = []
    yield made
    for registry in made:
        registry.recover()


def _tar(files: dict[str, bytes]) -> bytes:
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    for name, data in files.items():
        info = tarfile.TarInfo(name)
        info.size, info.mtime = len(data), 1_700_000_000
        members.append((info, data))
    return make_layer(members)


def test_a_read_on_a_stalled_registry_gets_eio_and_the_mount_stays_up(
    mount_layers: Callable[..., Mounted], registries: list[StallingRegistry], tmp_path: Path
) -> None:
    rng = random.Random(23)
    a, b = rng.randbytes(1 << 20), rng.randbytes(1 << 20)
    blob = _tar({"a": a, "b": b})
    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    registry = StallingRegistry(blob)
    registries.append(registry)
    m = mount_layers({digest: registry}, tmp_path / "store")
    assert (m.layer(digest) / "a").read_bytes() == a

    registry.stalled = True
    with pytest.raises(OSError) as exc:
        (m.layer(digest) / "b").read_bytes()
    assert exc.value.errno == errno.EIO
    # The fetch was asked for and is still unanswered: only the deadline
    # can have ended the read.
    asked = len(registry.calls)
    assert not registry.answering.is_set()

    # The mount is up: what is cached is served by the layer server.
    drop_page_cache()
    assert (m.layer(digest) / "a").read_bytes() == a
    assert sorted(p.name for p in m.layer(digest).iterdir()) == ["a", "b"]

    registry.recover()
    assert (m.layer(digest) / "b").read_bytes() == b
    assert len(registry.calls) > asked  # fetched again, not left failed


def _reader(tmp_path: Path, registry: StallingRegistry) -> LayerReader:
    return make_reader(tmp_path, registry.data, registry.fetch, SPAN)


@pytest.fixture
def stalling(tmp_path: Path) -> Iterator[tuple[LayerReader, StallingRegistry, bytes]]:
    """A reader of a 2 MiB layer whose registry is stalled, and the layer's bytes."""
    data = random.Random(29).randbytes(2 << 20)
    blob = _tar({"big": data})
    registry = StallingRegistry(blob, stalled=True)
    reader = _reader(tmp_path, registry)
    yield reader, registry, gzip.decompress(blob)
    registry.recover()
    reader.close()
    reader.block_index.close()


def test_readers_waiting_on_a_stalled_fetch_share_its_error(
    stalling: tuple[LayerReader, StallingRegistry, bytes],
) -> None:
    reader, registry, raw = stalling
    block = reader.index.blocks[2]
    errors: list[BlockUnavailable] = []

    async def read() -> None:
        try:
            await reader.read(block.ustart, block.uend)
        except BlockUnavailable as exc:
            errors.append(exc)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            while not registry.calls:
                await trio.sleep(0.01)
            nursery.start_soon(read)
        assert len(errors) == 2 and errors[0].__cause__ is errors[1].__cause__
        assert len(registry.calls) == 1  # the second reader waited on the first's fetch
        registry.recover()
        assert await reader.read(block.ustart, block.uend) == raw[block.ustart : block.uend]
        assert len(registry.calls) == 2

    trio.run(main)


def test_the_deadline_spans_the_verify_attempts(stalling: tuple[LayerReader, StallingRegistry, bytes]) -> None:
    reader, registry, _ = stalling
    block = reader.index.blocks[1]
    # A first answer that fails verification, then no answer.
    registry.corrupt_next = True
    with pytest.raises(BlockUnavailable, match="fetch deadline"):
        trio.run(reader.read, block.ustart, block.uend)
    first, second = registry.calls
    assert first == second  # the same range, by the same deadline


def test_a_block_is_served_while_the_rest_of_its_request_is_held_back(tmp_path: Path) -> None:
    """A miss's Range request carries the blocks after it too; the read gets
    its block once that block's bytes are in, not once the whole response
    is, and the blocks after it land when theirs come."""
    data = random.Random(31).randbytes(2 << 20)
    blob = _tar({"big": data})
    release = threading.Event()
    calls: list[tuple[int, int]] = []

    def stream(start: int, end: int, _deadline: float, sink: Callable[[bytes], None]) -> None:
        calls.append((start, end))
        first = next(b for b in reader.index.blocks if b.cstart == start)
        sink(blob[start : first.cend])
        release.wait(10)
        sink(blob[first.cend : end])

    reader = make_reader(tmp_path, blob, BoundedFetcher(stream, DEADLINE_S * 10), SPAN)
    reader.blocks_after_miss = 3
    raw = gzip.decompress(blob)
    blocks = reader.index.blocks

    async def main() -> None:
        block = blocks[1]
        assert await reader.read(block.ustart, block.uend) == raw[block.ustart : block.uend]
        assert not release.is_set()
        assert calls == [(blocks[1].cstart, blocks[4].cend)]
        assert reader.cached == {1}
        release.set()
        with trio.fail_after(10):
            while reader.cached != {1, 2, 3, 4}:
                await trio.sleep(0.01)
        assert len(calls) == 1

    try:
        trio.run(main)
    finally:
        release.set()
        reader.close()
        reader.block_index.close()
