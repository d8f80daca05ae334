"""The block cache's bound (`[fs] cache_max_bytes`): every cached block of
every stored layer copy, loaded or not, is accounted here, in the order of
its last read, and a block is written to the cache only once there is room
for it under the cap.

Room is made before the write, not after: the cache file holds at most the
cap (plus the pages a block shares with a neighbour), however many fetches
land at once. Blocks of layers no container uses (`in_use`) go first, the
least recently used layer first; then the least recently read blocks of any
layer. A block a read is serving right now, or one on its way, is never
taken. When nothing can be taken the block is served from memory without
being cached, as on a full disk.

Eviction of a block deletes its record from the block index first, then
punches its bytes out of the cache file (fallocate PUNCH_HOLE|KEEP_SIZE):
a block is never recorded cached after its bytes are gone. A crash between
the two leaves bytes nobody records, never a record without bytes. A
loaded layer evicts through its reader (LayerReader.evict), which keeps
its readers and fetches off the block meanwhile; a layer that is not
loaded, from its record alone, under the layer server's load lock so it is
not loaded half way through."""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import trio

from snapshotter.fs import metrics
from snapshotter.fs.blockindex import BlockIndex, BlockIndexError, BlockRecord
from snapshotter.fs.layers import LayerStore

log = structlog.get_logger("bootseer.fs")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
# Holes are punched in whole pages: a page a block shares with a cached
# neighbour stays.
PAGE = 4096
# Eviction makes this much more room than one block needs (at most 1/64 of
# the cap), so a stream of misses evicts in batches, not block by block.
MAX_SLACK = 64 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate [offset, offset + length) of the file, keeping its size:
    reads of it answer zeros, and the filesystem gets the space back."""
    if length <= 0:
        return
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def hole(offset: int, size: int, free_before: bool, free_after: bool) -> tuple[int, int]:
    """(start, length) to punch for the block at [offset, offset + size):
    whole pages only, reaching into the page it shares with a neighbour
    only when that neighbour is not cached (`free_before`, `free_after`).
    A partial page is never punched: the kernel would zero it, neighbour
    bytes and all."""
    end = offset + size
    start = offset - offset % PAGE if free_before else -(-offset // PAGE) * PAGE
    stop = -(-end // PAGE) * PAGE if free_after else end - end % PAGE
    return start, max(stop - start, 0)


class Evictable(Protocol):
    """What the cache needs of a loaded layer's reader (LayerReader)."""

    def evictable(self, number: int) -> bool: ...

    async def evict(self, numbers: list[int]) -> list[int]:
        """Evict those of `numbers` still evictable; the ones evicted."""
        ...


@dataclass
class _Copy:
    # number -> (offset, size) in the cache file
    blocks: dict[int, tuple[int, int]] = field(default_factory=dict)
    # time.time() of the last read of any of its blocks
    used_at: float = 0.0


class BlockCache:
    def __init__(
        self,
        store: LayerStore,
        block_index: BlockIndex,
        max_bytes: int,
        load_lock: trio.Lock,
        in_use: Callable[[str], bool] = lambda _copy: False,
    ) -> None:
        """`max_bytes` 0: no cap (accounting only). `in_use(copy)`: a
        container uses that layer copy now. `load_lock`: held while a
        layer is loaded."""
        self.store = store
        self.block_index = block_index
        self.max_bytes = max_bytes
        self.slack = min(max_bytes // 64, MAX_SLACK)
        self.load_lock = load_lock
        self.in_use = in_use
        # Every cached block, least recently read first: (copy, number) -> size.
        self.lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.copies: dict[str, _Copy] = {}
        self.readers: dict[str, Evictable] = {}
        self.total = 0
        # Bytes of blocks being written, room made for them already.
        self.reserved = 0
        self._lock = trio.Lock()
        # Blocks read since their last read was written to the block index.
        self._touched: set[tuple[str, int]] = set()
        self._no_punch_logged = False
        metrics.CACHE_MAX_BYTES.set(max_bytes)
        self._set_total(0)

    # -- accounting ---------------------------------------------------------

    def load(self) -> None:
        """Account for every block the index records, oldest read first;
        drop records of copies the store no longer holds. Blocks recorded
        by earlier versions (no place in the file) get it from their layer
        index, once."""
        by_copy: dict[str, list[tuple[int, BlockRecord]]] = {}
        for copy, number, record in self.block_index.records():
            by_copy.setdefault(copy, []).append((number, record))
        rows: list[tuple[int, str, int, int, int]] = []
        for copy, found in by_copy.items():
            name, generation = copy[:64], copy[64:]
            if self.store.generation(name) != generation:
                log.info("dropping block records of a layer copy no longer stored", copy=copy, blocks=len(found))
                self.block_index.drop_layer(copy)
                continue
            try:
                records = self._sized(copy, found) if any(r.size == 0 for _, r in found) else found
            except Exception as exc:
                # Its layer cannot be loaded either (it answers EIO): nothing
                # will read these blocks, and they go when it is pruned.
                log.warning("cannot size a layer's cached blocks; not counted", copy=copy, error=repr(exc))
                continue
            rows += [(record.used_at, copy, n, record.offset, record.size) for n, record in records]
        for used_at, copy, n, offset, size in sorted(rows):
            state = self.copies.setdefault(copy, _Copy())
            state.blocks[n] = (offset, size)
            state.used_at = max(state.used_at, float(used_at))
            self.lru[(copy, n)] = size
            self.total += size
        self._set_total(self.total)
        log.info("block cache", blocks=len(self.lru), bytes=self.total, max_bytes=self.max_bytes)

    def _sized(self, copy: str, records: list[tuple[int, BlockRecord]]) -> list[tuple[int, BlockRecord]]:
        blocks = self.store.load(copy[:64])[0].blocks
        now = int(time.time())
        sized = [
            (n, BlockRecord(r.state, r.crc32, blocks[n].ustart, blocks[n].uend - blocks[n].ustart, now))
            for n, r in records
            if n < len(blocks)
        ]
        self.block_index.rewrite((copy, n, r) for n, r in sized)
        return sized

    def _set_total(self, total: int) -> None:
        self.total = total
        metrics.CACHE_BYTES.set(total)

    def touch(self, copy: str, number: int) -> None:
        """Block `number` of `copy` was read: the most recently used now."""
        key = (copy, number)
        if key in self.lru:
            self.lru.move_to_end(key)
            self._touched.add(key)
            self.copies[copy].used_at = time.time()

    def added(self, copy: str, number: int, offset: int, size: int) -> None:
        key = (copy, number)
        if key in self.lru:
            # Written again (it had lost its bytes, or only its first parts
            # were cached): counted once, at its size now.
            self.lru.move_to_end(key)
            before = self.lru[key]
            if before != size:
                self.lru[key] = size
                self.copies[copy].blocks[number] = (offset, size)
                self._set_total(self.total - before + size)
            return
        state = self.copies.setdefault(copy, _Copy())
        state.blocks[number] = (offset, size)
        state.used_at = time.time()
        self.lru[key] = size
        self._set_total(self.total + size)

    def _forget(self, copy: str, numbers: Iterable[int]) -> int:
        state = self.copies.get(copy)
        if state is None:
            return 0
        freed = 0
        for n in numbers:
            if state.blocks.pop(n, None) is not None:
                freed += self.lru.pop((copy, n))
                self._touched.discard((copy, n))
        if not state.blocks:
            del self.copies[copy]
        self._set_total(self.total - freed)
        return freed

    def forget_copy(self, copy: str) -> None:
        """A copy gone from the store (pruned): its blocks went with its files."""
        state = self.copies.get(copy)
        if state is not None:
            self._forget(copy, list(state.blocks))

    def attach(self, copy: str, reader: Evictable) -> None:
        self.readers[copy] = reader

    def detach(self, copy: str) -> None:
        self.readers.pop(copy, None)

    # -- room ---------------------------------------------------------------

    async def reserve(self, nbytes: int) -> bool:
        """Make room for a block of `nbytes` about to be written and hold it;
        False if there is none to be had (serve the block from memory).
        After the write: `settle`."""
        if self.max_bytes <= 0:
            self.reserved += nbytes
            return True
        async with self._lock:
            need = self.total + self.reserved + nbytes - self.max_bytes
            if need > 0:
                await self._evict(need + self.slack)
            if self.total + self.reserved + nbytes > self.max_bytes:
                return False
            self.reserved += nbytes
            return True

    def settle(self, nbytes: int, copy: str, number: int, offset: int, stored: bool, size: int | None = None) -> None:
        """A block `reserve` made room for was written (`stored`) or not;
        `size`: the bytes written, if fewer (a block's first parts)."""
        self.reserved -= nbytes
        if stored:
            self.added(copy, number, offset, nbytes if size is None else size)

    def room_for(self, nbytes: int) -> bool:
        """`nbytes` more fit under the cap without evicting anything."""
        return self.max_bytes <= 0 or self.total + self.reserved + nbytes <= self.max_bytes

    async def trim(self) -> None:
        """Evict down to the cap (lowered since the last start, say)."""
        if self.max_bytes <= 0 or self.total <= self.max_bytes:
            return
        async with self._lock:
            excess = self.total + self.reserved - self.max_bytes
            if excess > 0:
                await self._evict(excess)

    def _victims(self, need: int) -> dict[str, list[int]]:
        victims: dict[str, list[int]] = {}
        chosen: set[tuple[str, int]] = set()
        freed = 0
        # Layers no container uses, the least recently used first.
        unused = sorted((c for c in self.copies if not self.in_use(c)), key=lambda c: self.copies[c].used_at)
        for copy in unused:
            reader = self.readers.get(copy)
            for n, (_, size) in self.copies[copy].blocks.items():
                if reader is not None and not reader.evictable(n):
                    continue
                victims.setdefault(copy, []).append(n)
                chosen.add((copy, n))
                freed += size
                if freed >= need:
                    return victims
        # Then the least recently read blocks of any layer.
        for key, size in self.lru.items():
            if key in chosen:
                continue
            copy, n = key
            reader = self.readers.get(copy)
            if reader is not None and not reader.evictable(n):
                continue
            victims.setdefault(copy, []).append(n)
            freed += size
            if freed >= need:
                break
        return victims

    async def _evict(self, need: int) -> None:
        for copy, numbers in self._victims(need).items():
            reader = self.readers.get(copy)
            if reader is not None:
                evicted = await reader.evict(numbers)
            else:
                async with self.load_lock:
                    reader = self.readers.get(copy)
                    if reader is not None:
                        evicted = await reader.evict(numbers)
                    else:
                        evicted = await self._evict_unloaded(copy, numbers)
            freed = self._forget(copy, evicted)
            metrics.EVICTED_BLOCKS.inc(len(evicted))
            metrics.EVICTED_BYTES.inc(freed)

    async def _evict_unloaded(self, copy: str, numbers: list[int]) -> list[int]:
        state = self.copies.get(copy)
        if state is None:
            return []
        numbers = [n for n in numbers if n in state.blocks]
        doomed = set(numbers)
        ranges = []
        for n in numbers:
            offset, size = state.blocks[n]
            before = n - 1 not in state.blocks or n - 1 in doomed
            after = n + 1 not in state.blocks or n + 1 in doomed
            ranges.append(hole(offset, size, before, after))
        return await trio.to_thread.run_sync(self._punch_file, copy, numbers, ranges)

    def _punch_file(self, copy: str, numbers: list[int], ranges: list[tuple[int, int]]) -> list[int]:
        name, generation = copy[:64], copy[64:]
        if self.store.generation(name) != generation:
            # Pruned: records and bytes went with it.
            return numbers
        if not self.forget_records(copy, numbers):
            return []
        try:
            fd = os.open(self.store.cache_path(name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            log.warning("could not open a cache file to evict from", layer=name, error=str(exc))
            return numbers
        try:
            self.punch(fd, name, ranges)
        finally:
            os.close(fd)
        return numbers

    def forget_records(self, copy: str, numbers: list[int]) -> bool:
        """Delete the records of blocks about to be punched out (in a thread)."""
        try:
            self.block_index.delete(copy, numbers)
        except BlockIndexError as exc:
            log.warning("could not evict blocks: the block index refused", copy=copy, error=str(exc))
            return False
        return True

    def punch(self, fd: int, name: str, ranges: list[tuple[int, int]]) -> None:
        """Punch the ranges out of a cache file (in a thread). A filesystem
        that cannot punch holes keeps the bytes: the cap does not hold
        there, which is logged once."""
        for start, length in ranges:
            try:
                punch_hole(fd, start, length)
            except OSError as exc:
                metrics.EVICT_ERRORS.inc()
                if not self._no_punch_logged:
                    self._no_punch_logged = True
                    log.error(
                        "could not punch an evicted block out of its cache file; the space stays taken",
                        layer=name,
                        error=str(exc),
                    )
                return

    # -- last reads ---------------------------------------------------------

    def touched(self) -> list[tuple[str, int]]:
        """Blocks read since the last call (their last reads, for the index)."""
        keys = list(self._touched)
        self._touched.clear()
        return keys

    def write_last_reads(self, keys: list[tuple[str, int]], when: int) -> None:
        """In a thread: the index learns when `keys` were last read, so a
        restarted server evicts in the same order."""
        if not keys:
            return
        try:
            self.block_index.touch(keys, when)
        except BlockIndexError as exc:
            log.warning("could not record when blocks were read", error=str(exc))
