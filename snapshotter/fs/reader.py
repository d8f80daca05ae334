"""Reads from one lazily served layer: cache hits are a pread; misses fetch
their blocks (adjacent ones merged into one Range request), verify and
decompress them, write them to the cache, then read.

A block is fetched once however many readers want it: the first starts the
fetch, the others wait for it. Readers waiting so are counted while they
wait (bootseer_fs_read_waits) and timed (bootseer_fs_read_wait_seconds).

A read waits on the registry until its deadline (`[fs] fetch_deadline_s`
after it began), then gets EIO, whatever retries the fetch is in: the
fetch's thread is told the same deadline and stops by it on its own, and
the event loop stops waiting for it then in any case. The blocks it was for
land with the error, for every reader waiting on them; a later read fetches
them again. A prefetch, which may queue long for a fetch slot, tells its
fetch the same span from when it has one and waits for the thread: a reader
that needs the block meanwhile still waits no longer than its own deadline.

A block the cache cannot take (disk full, I/O error) is served to its
readers from memory and left uncached. Only a complete write is recorded,
and after a failed one every cached block of the layer is checked against
its crc again before it is served.

Under a cache cap (eviction.py) a block is written only once the cache has
made room for it, else it is served from memory the same way. Eviction
takes a block out of `cached` before its record and bytes go, never a block
a read is serving (pinned) or one on its way; a fetch of it, or of a
neighbour whose page it shares, waits until its bytes are gone, so a block
written again is never punched out after. A closed reader (its layer
unloaded or pruned) refuses work with BlockUnavailable, and never touches
its file descriptor again.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio
from isal import isal_zlib

from snapshotter.fs import metrics
from snapshotter.fs.blockindex import BlockIndex, BlockIndexError, BlockRecord, BlockState
from snapshotter.fs.eviction import BlockCache, hole
from snapshotter.fs.settings import FETCH_DEADLINE_S
from snapshotter.layer.blockmath import HOT_RUN_BYTES, InOrderReadAhead, RunArrival, fetch_runs, run_span
from snapshotter.layer.decode import BlockDecoder, BlockVerificationError
from snapshotter.layer.index import LayerIndex
from snapshotter.layer.parts import Reach

log = structlog.get_logger("bootseer.fs")


# Where a fetch hands the bytes it receives, as they arrive.
Sink = Callable[[bytes], None]


@dataclass(frozen=True)
class BoundedFetcher:
    """Streams [start, end) of a layer blob to a sink by a deadline it is
    given (a time.monotonic() value): exactly end - start bytes, in order,
    or an exception, by then. `deadline_s`: how long after a read began
    that deadline falls."""

    stream: Callable[[int, int, float, Sink], None]
    deadline_s: float = FETCH_DEADLINE_S
    # Several ranges, each to its sink, in one request where the registry
    # can (RegistryClient.stream_ranges); without it, a request each.
    stream_many: Callable[[list[tuple[int, int]], float, Sequence[Sink]], None] | None = None


# What fetches a layer's blocks. A plain (start, end) fetch cannot be told a
# deadline: readers stop waiting for it after FETCH_DEADLINE_S all the same,
# but its thread runs on.
RangeFetcher = Callable[[int, int], bytes] | BoundedFetcher

# A verification failure is retried this many times before readers get EIO.
VERIFY_ATTEMPTS = 2


class BlockUnavailable(Exception):
    """The block could not be fetched and verified; readers get EIO."""


class Origin(enum.Enum):
    """Who asked for a block: each has its own fetch slots, so neither the
    hot-block prefetcher nor the background fetch ever holds up a reader."""

    READ = "read"
    READAHEAD = "readahead"
    HOT = "hot"
    BACKGROUND = "background"


@dataclass
class _Flight:
    origin: Origin
    done: trio.Event = field(default_factory=trio.Event)
    error: Exception | None = None
    demanded: bool = False  # a reader waited for it
    # The image a hot-block prefetch fetches it for: its bytes count for that image.
    image: str | None = None
    # The block's bytes when the cache could not take them: its readers get these.
    uncached: bytes | None = None
    # The deadline its fetch lands it by (with the fetch's error if need be).
    deadline: float | None = None
    # A hot-block prefetch of the block's first parts only: (bytes, link after them).
    prefix: tuple[int, bytes] | None = None


class _RunSink:
    """The fetch thread's end of a run: the bytes go into the run's buffer,
    and the event loop is told (`arrived`, without waiting for it) each
    time a block's end is passed, so that the block lands while the rest
    is still coming."""

    def __init__(self, buffer: bytearray, ends: list[int], arrived: Callable[[int], None]) -> None:
        self.buffer = buffer
        self.ends = ends
        self.arrived = arrived
        self.received = 0
        self._next = 0
        self._loop = trio.lowlevel.current_trio_token()

    def __call__(self, chunk: bytes) -> None:
        size = len(chunk)
        if self.received + size > len(self.buffer):
            raise BlockVerificationError(f"the range answered more than its {len(self.buffer)} bytes")
        self.buffer[self.received : self.received + size] = chunk
        self.received += size
        passed = self._next
        while self._next < len(self.ends) and self.received >= self.ends[self._next]:
            self._next += 1
        if self._next != passed:
            self._loop.run_sync_soon(self.arrived, self.received)


class LayerReader:
    def __init__(
        self,
        name: str,
        cache_key: str,
        index: LayerIndex,
        cache_path: Path,
        block_index: BlockIndex,
        fetch: RangeFetcher,
        fetch_limiter: trio.CapacityLimiter,
        prefetch_limiter: trio.CapacityLimiter,
        background_limiter: trio.CapacityLimiter,
        prefetch_decode_limiter: trio.CapacityLimiter,
        on_access: Callable[[str, int, int], None] | None = None,
        on_fetched: Callable[[str, int, str | None, bool], None] | None = None,
        cache: BlockCache | None = None,
        blocks_after_miss: int = 0,
        records: Callable[[str], bool] | None = None,
    ) -> None:
        self.name = name
        self.cache_key = cache_key
        self.index = index
        self.block_index = block_index
        if isinstance(fetch, BoundedFetcher):
            self.fetcher = fetch
        else:
            self.fetcher = BoundedFetcher(lambda start, end, _deadline, sink: sink(fetch(start, end)))
        self.decoder = BlockDecoder(index)
        cached = {n: r for n, r in block_index.cached(cache_key).items() if n < len(index.blocks)}
        # Blocks cached only up to some byte (hot-block prefetches of their
        # first parts): how many of their bytes, from their start.
        self.partial: dict[int, int] = {
            n: r.size for n, r in cached.items() if 0 < r.size < index.blocks[n].uend - index.blocks[n].ustart
        }
        self.cached: set[int] = set(cached) - self.partial.keys()
        # Cached by an earlier server, or before a write to the cache failed:
        # checked against their crc on first read.
        self.unverified: dict[int, int] = {n: r.crc32 for n, r in cached.items()}
        self.inflight: dict[int, _Flight] = {}
        self.fd = os.open(cache_path, os.O_RDWR)
        # Cleared once the cache file's filesystem refuses RWF_NOWAIT (tmpfs).
        self.nowait = True
        self.limiters = {
            Origin.READ: fetch_limiter,
            # Read-ahead and hot-block prefetch share the prefetch slots.
            Origin.READAHEAD: prefetch_limiter,
            Origin.HOT: prefetch_limiter,
            Origin.BACKGROUND: background_limiter,
        }
        # Blocks no reader has waited for (hot-block prefetch, background
        # fetch) are decoded under their own limiter, not in trio's default
        # thread pool: a prefetch landing hundreds of blocks filled that
        # pool, and the container's reads (_pread) and the layer lookups of
        # its start queued behind them (a start's lookups took 14-37 ms each).
        self.prefetch_decode_limiter = prefetch_decode_limiter
        self.readahead = InOrderReadAhead()
        # `[fs] blocks_after_miss`: see _ahead_of_miss.
        self.blocks_after_miss = blocks_after_miss
        # The blocks hot-block manifests say a start of an image with this
        # layer reads (None: no manifest covers the layer). Read-ahead stays
        # within them: it only moves a hot block ahead of its turn in the
        # prefetch, never fetches what no start was seen to read.
        self.hot_blocks: set[int] | None = None
        # Blocks read ahead and not read yet: reaching one reads further ahead.
        # Blocks the hot-block prefetcher brought in do not: it is ahead already.
        self.readahead_marks: set[int] = set()
        # Told (layer digest, block number, how far into the block a read
        # reaches) of every block a read reaches into.
        self.on_access = on_access
        # Told (layer digest, compressed bytes, image if the fetch knows it,
        # prefetched) of every range fetched and every block the hot-block
        # prefetcher brought in: the per-image byte counts.
        self.on_fetched = on_fetched
        # Prefetched blocks no reader has asked for yet (the prefetch waste).
        self.unread_prefetched: set[int] = set()
        # The store-wide cache accounting and its cap (None: no cap).
        self.cache = cache
        # Told when the last missing block lands: every block is cached.
        self.on_whole: Callable[[], None] | None = None
        # Reads and ensures under way: the reader may close only when none is.
        self.busy = 0
        # Set by every read and ensure: the layer server's idle check clears it.
        self.touched = True
        self.closed = False
        # Blocks a read is serving now, with how many reads: never evicted.
        self.pinned: dict[int, int] = {}
        # Blocks being evicted: set once their bytes are gone.
        self.evicting: dict[int, trio.Event] = {}
        # Whether a hot-block recording reads this layer (by digest): then
        # the blocks a start's reads fetch have their reaches kept, by number,
        # for the recording to fetch each only as far as the start read it.
        self.records = records
        self.reaches: dict[int, Reach] = {}

    def follow_manifest(self, blocks: set[int]) -> None:
        """A hot-block manifest lists `blocks` of this layer: read-ahead
        fetches no other block (manifests of several images add up)."""
        self.hot_blocks = blocks if self.hot_blocks is None else self.hot_blocks | blocks

    @property
    def idle(self) -> bool:
        """Nothing under way: it may be closed."""
        return self.busy == 0 and not self.inflight and not self.evicting

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fd, self.fd = self.fd, -1
        os.close(fd)
        self.decoder.close()
        metrics.PREFETCH_UNREAD.dec(len(self.unread_prefetched))
        self.unread_prefetched.clear()

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise BlockUnavailable(f"layer {self.name} was unloaded")

    async def read(self, start: int, end: int, file_end: int | None = None) -> bytes | bytearray:
        """A reader's read: counted, recorded, fetched ahead of any prefetch.
        In-order read-ahead stays within the file, which ends at `file_end`;
        a miss also fetches the blocks right after it (`_ahead_of_miss`)."""
        end = min(end, self.index.uncompressed_size)
        if end <= start:
            return b""
        self._refuse_if_closed()
        numbers = self.index.block_range(start, end)
        self.touched = True
        with self.holding(numbers):
            return await self._read(start, end, numbers, file_end)

    def read_now(self, start: int, end: int) -> bytes | bytearray | None:
        """read() without waiting, or None (before counting anything) where
        it would wait or start a fetch: a block not cached, not checked since
        the server started, or marking where read-ahead goes on; or bytes
        not in the page cache."""
        end = min(end, self.index.uncompressed_size)
        if end <= start:
            return b""
        if self.closed:
            return None
        numbers = self.index.block_range(start, end)
        for n in numbers:
            if not self._covers(n, start, end) or n in self.unverified or n in self.readahead_marks:
                return None
        buffer = bytearray(end - start)
        if self._pread_nowait(buffer, start) < len(buffer):
            return None
        self.touched = True
        for n in numbers:
            self._account(n, start, end)
        self.readahead.observe(numbers.start, numbers.stop - 1)
        metrics.READ_BYTES.inc(len(buffer))
        return buffer

    @contextlib.contextmanager
    def holding(self, numbers: range) -> Iterator[None]:
        """Blocks `numbers` stay cached (never evicted) and the reader open
        while the block runs."""
        self.busy += 1
        for n in numbers:
            self.pinned[n] = self.pinned.get(n, 0) + 1
        try:
            yield
        finally:
            self.busy -= 1
            for n in numbers:
                if self.pinned[n] == 1:
                    del self.pinned[n]
                else:
                    self.pinned[n] -= 1

    def _covers(self, n: int, start: int, end: int) -> bool:
        """Block `n` is cached as far as bytes [start, end) reach into it."""
        if n in self.cached:
            return True
        block = self.index.blocks[n]
        return self.partial.get(n, 0) >= min(end, block.uend) - block.ustart

    @property
    def all_cached(self) -> bool:
        return len(self.cached) == len(self.index.blocks)

    async def whole(self) -> bool:
        """Whether every block is cached, each checked against its crc if an
        earlier server cached it (a block that lost its bytes is not)."""
        for n in list(self.unverified):
            if n in self.unverified:
                self._verify(n)
            # A block read is a few milliseconds: readers come in between.
            await trio.lowlevel.checkpoint()
        return self.all_cached

    async def _read(self, start: int, end: int, numbers: range, file_end: int | None) -> bytes | bytearray:
        limit = self.index.uncompressed_size if file_end is None else file_end
        wanting = False
        for n in numbers:
            if n in self.unverified:
                self._verify(n)
            self._account(n, start, end)
            if not self._covers(n, start, end) or n in self.readahead_marks:
                wanting = True
                self.readahead_marks.discard(n)
        window = self.readahead.observe(numbers.start, numbers.stop - 1)
        # Not a block whose first parts are cached: the manifest says that
        # is all a start reads of it.
        ahead = (
            [
                n
                for n in self._ahead_of_miss(window, limit)
                if n not in self.cached
                and n not in self.partial
                and n not in self.inflight
                and (self.hot_blocks is None or n in self.hot_blocks)
            ]
            if wanting
            else []
        )
        # Only a read that may wait on the registry needs a deadline: a hit
        # (nothing wanted, so nothing to wait for) spares the clock.
        deadline = time.monotonic() + self.fetcher.deadline_s if wanting else None
        needed = [n for n in numbers if not self._covers(n, start, end)]
        uncached = await self.ensure(needed, deadline=deadline, ahead=ahead)
        # A write to the cache may have failed while this read waited, or
        # the first parts of a block landed that this read goes beyond.
        if (
            uncached
            or (self.unverified and not self.unverified.keys().isdisjoint(numbers))
            or not all(self._covers(n, start, end) for n in needed)
        ):
            data: bytes | bytearray = await self._gather(start, end, numbers, uncached, deadline)
        else:
            data = await self._pread(start, end)
        metrics.READ_BYTES.inc(len(data))
        return data

    def _ahead_of_miss(self, window: range, limit: int) -> range:
        """The blocks after a miss to fetch with it: the in-order window
        (which starts right after the read) up to the file's end at `limit`,
        and, while no hot-block manifest covers the layer, at least the
        `blocks_after_miss` after it, whatever files they hold: a tar keeps a
        package's files together, and a start that reads one file of a block
        mostly reads the next blocks' too. Under a manifest the manifest says
        what to read."""
        blocks = self.index.blocks
        end = window.start
        while end < min(window.stop, len(blocks)) and blocks[end].ustart < limit:
            end += 1
        if self.hot_blocks is None:
            end = max(end, window.start + self.blocks_after_miss)
        return range(window.start, min(end, len(blocks)))

    async def _gather(
        self, start: int, end: int, numbers: range, uncached: dict[int, bytes], deadline: float | None
    ) -> bytes:
        """A read whose blocks are not all plainly in the cache: those the
        cache could not take come from memory, those under suspicion are
        checked first (and fetched again if they lost their bytes)."""
        pieces: list[bytes | bytearray] = []
        for n in numbers:
            block = self.index.blocks[n]
            lo, hi = max(start, block.ustart), min(end, block.uend)
            while True:
                if n in uncached:
                    pieces.append(uncached[n][lo - block.ustart : hi - block.ustart])
                    break
                if n in self.unverified:
                    self._verify(n)
                if self._covers(n, lo, hi):
                    pieces.append(await self._pread(lo, hi))
                    break
                uncached.update(await self.ensure([n], deadline=deadline))
        return b"".join(pieces)

    async def _pread(self, start: int, end: int) -> bytearray:
        """Cached bytes: straight from the page cache when they are there,
        which spares the event loop a thread hop; from disk in a thread."""
        buffer = bytearray(end - start)
        got = self._pread_nowait(buffer, start)
        if got < len(buffer):
            rest = await trio.to_thread.run_sync(os.pread, self.fd, len(buffer) - got, start + got)
            buffer[got : got + len(rest)] = rest
            del buffer[got + len(rest) :]
        return buffer

    def _pread_nowait(self, buffer: bytearray, start: int) -> int:
        """How many bytes from `start` the page cache gave `buffer`."""
        if not self.nowait:
            return 0
        try:
            return os.preadv(self.fd, [buffer], start, os.RWF_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
            self.nowait = False
            log.info("the layer store refuses RWF_NOWAIT; cached reads go through a thread", layer=self.name)
            return 0

    def _verify(self, n: int) -> None:
        # In the event loop, not a thread: a concurrent read of the same block
        # must not see it cached before the check is done. Once per block per
        # server start, a few milliseconds at most.
        block = self.index.blocks[n]
        expected = self.unverified.pop(n)
        data = os.pread(self.fd, self.partial.get(n, block.uend - block.ustart), block.ustart)
        if isal_zlib.crc32(data) != expected:
            log.warning("cached block lost its bytes; fetching it again", layer=self.name, block=n)
            self.cached.discard(n)
            self.partial.pop(n, None)

    def _account(self, n: int, start: int, end: int) -> None:
        """A read of bytes [start, end) reaches into block `n`."""
        block = self.index.blocks[n]
        if self.on_access is not None:
            self.on_access(self.index.layer_digest, n, min(end, block.uend) - block.ustart)
        if self._covers(n, start, end):
            if self.cache is not None:
                self.cache.touch(self.cache_key, n)
            if n in self.unread_prefetched:
                self.unread_prefetched.discard(n)
                metrics.PREFETCH_UNREAD.dec()
                result = "prefetched"
            else:
                result = "hit"
        else:
            flight = self.inflight.get(n)
            if flight is not None and flight.origin != Origin.READ:
                flight.demanded = True
                result = "prefetch_wait"
            else:
                result = "miss"
        metrics.BLOCK_READS.labels(result).inc()
        # Per image, for `bootseer report`'s hit ratio.
        metrics.IMAGE_STARTS.read(self.index.layer_digest, result)

    async def ensure(
        self,
        numbers: range | list[int],
        origin: Origin = Origin.READ,
        deadline: float | None = None,
        image: str | None = None,
        ahead: Sequence[int] = (),
        prefixes: Mapping[int, tuple[int, bytes]] | None = None,
    ) -> dict[int, bytes]:
        """Return once every block in `numbers` is cached, with the bytes of
        those the cache could not take, by number; raise BlockUnavailable if
        one can't be fetched, or by `deadline` (time.monotonic()) if one is
        given. A block already on its way is waited for, not fetched again.
        Without a deadline (prefetches) each fetch is bounded on its own.
        `image`: the image a prefetch is for, whose bytes the fetches it
        starts count for. `ahead`: blocks read ahead (a miss's next ones),
        fetched in the same Range request as those of `numbers` they follow
        and not waited for: they land after the read's own. `prefixes`:
        blocks a hot-block manifest asks only the first parts of, as
        (compressed bytes, link after them), fetched so where one ends its
        Range request; a block with some first parts cached already is not
        fetched again for them."""
        self._refuse_if_closed()
        self.busy += 1
        self.touched = True
        try:
            return await self._ensure(numbers, origin, deadline, image, ahead, prefixes or {})
        finally:
            self.busy -= 1

    async def _ensure(
        self,
        numbers: range | list[int],
        origin: Origin,
        deadline: float | None,
        image: str | None,
        ahead: Sequence[int],
        prefixes: Mapping[int, tuple[int, bytes]],
    ) -> dict[int, bytes]:
        await self._wait_evictions([*numbers, *ahead])
        self._refuse_if_closed()
        to_fetch: list[int] = []
        waits: list[tuple[int, _Flight]] = []
        for n in numbers:
            if n in self.cached or (n in prefixes and n in self.partial):
                continue
            flight = self.inflight.get(n)
            if flight is None:
                flight = self.inflight[n] = _Flight(
                    origin=origin, image=image, deadline=deadline, prefix=prefixes.get(n)
                )
                to_fetch.append(n)
            waits.append((n, flight))
        for n in ahead:
            if n not in self.cached and n not in self.inflight:
                self.inflight[n] = _Flight(origin=Origin.READAHEAD, deadline=deadline)
                to_fetch.append(n)
        if not waits:
            # All cached: what is read ahead lands on its own.
            self._fetch(to_fetch, origin, deadline, image)
            return {}
        if origin is not Origin.READ:
            return await self._wait(to_fetch, waits, origin, deadline, image)
        # A reader waits on the registry: what admins watch for.
        metrics.READ_WAITS.inc()
        metrics.IMAGE_STARTS.wait_began(self.index.layer_digest)
        began = time.monotonic()
        try:
            return await self._wait(to_fetch, waits, origin, deadline, image)
        finally:
            waited = time.monotonic() - began
            metrics.READ_WAITS.dec()
            metrics.READ_WAIT_SECONDS.observe(waited)
            metrics.IMAGE_STARTS.wait_ended(self.index.layer_digest, waited)

    async def _wait_evictions(self, numbers: range | list[int]) -> None:
        """Until no block in `numbers`, nor a neighbour it shares a page
        with, is being evicted: a block written while its old bytes are
        being punched out could be punched out with them."""
        if not self.evicting:
            return
        while True:
            event = next(
                (
                    e
                    for n in numbers
                    if n not in self.cached
                    for e in (self.evicting.get(n - 1), self.evicting.get(n), self.evicting.get(n + 1))
                    if e is not None
                ),
                None,
            )
            if event is None:
                return
            await event.wait()

    def evictable(self, n: int) -> bool:
        """Block `n` may be evicted now: cached, and no read serving it, no
        fetch bringing it (eviction.BlockCache)."""
        return (
            not self.closed
            and (n in self.cached or n in self.partial)
            and n not in self.pinned
            and n not in self.inflight
            and n not in self.evicting
        )

    async def evict(self, numbers: list[int]) -> list[int]:
        """Evict those of `numbers` still evictable: out of `cached` at once
        (later reads fetch them again), then, in a thread, their records out
        of the block index and their bytes out of the cache file. Returns
        the ones evicted."""
        assert self.cache is not None
        victims = [n for n in numbers if self.evictable(n)]
        if not victims:
            return []
        done = trio.Event()
        partial = {n: self.partial.pop(n) for n in victims if n in self.partial}
        for n in victims:
            self.cached.discard(n)
            self.unverified.pop(n, None)
            self.readahead_marks.discard(n)
            if n in self.unread_prefetched:
                self.unread_prefetched.discard(n)
                metrics.PREFETCH_UNREAD.dec()
            self.evicting[n] = done
        blocks = self.index.blocks

        def free(n: int) -> bool:
            return not 0 <= n < len(blocks) or (
                n not in self.cached and n not in self.partial and n not in self.inflight
            )

        ranges = [hole(blocks[n].ustart, blocks[n].uend - blocks[n].ustart, free(n - 1), free(n + 1)) for n in victims]
        self.busy += 1
        try:
            forgotten = await trio.to_thread.run_sync(self._evict_in_thread, victims, ranges)
        finally:
            for n in victims:
                del self.evicting[n]
            done.set()
            self.busy -= 1
        if not forgotten:
            # Records and bytes are still there, and match: cached again.
            self.cached.update(n for n in victims if n not in partial)
            self.partial.update(partial)
            return []
        return victims

    def _evict_in_thread(self, victims: list[int], ranges: list[tuple[int, int]]) -> bool:
        assert self.cache is not None
        if not self.cache.forget_records(self.cache_key, victims):
            return False
        self.cache.punch(self.fd, self.name, ranges)
        return True

    async def _wait(
        self,
        to_fetch: list[int],
        waits: list[tuple[int, _Flight]],
        origin: Origin,
        deadline: float | None,
        image: str | None,
    ) -> dict[int, bytes]:
        """Fetch `to_fetch`, then wait for every flight in `waits` (ensure)."""
        self._fetch(to_fetch, origin, deadline, image)
        uncached: dict[int, bytes] = {}
        for n, flight in waits:
            # Only a wait that has to block may time out: a block that landed
            # is served even when it landed at the deadline. A fetch bound by
            # this deadline or an earlier one lands the block by then, with
            # its error if it fails: that is the one to wait for.
            if not flight.done.is_set():
                bound = deadline is not None and flight.deadline is not None and flight.deadline <= deadline
                with trio.move_on_at(math.inf if deadline is None or bound else _on_trio_clock(deadline)):
                    await flight.done.wait()
                if not flight.done.is_set():
                    raise BlockUnavailable(
                        f"block {n} of layer {self.name} not fetched within the "
                        f"{self.fetcher.deadline_s:g} s fetch deadline"
                    )
            # A read that waited on a prefetch of a block's first parts
            # fetches the block itself if that failed (a stale link, say).
            if flight.error is not None and (flight.prefix is None or origin is not Origin.READ):
                raise BlockUnavailable(str(flight.error)) from flight.error
            # A block's first parts are no answer to a read: if it goes
            # beyond them (the cache took them or not) it fetches the block.
            if flight.uncached is not None and flight.prefix is None:
                uncached[n] = flight.uncached
        return uncached

    def _fetch(self, numbers: list[int], origin: Origin, deadline: float | None, image: str | None) -> None:
        """Set the fetches of `numbers` going, a Range request per run of
        them; each block's flight tells when it landed. The fetches outlive
        the ensure that started them, so that a read waits for its own
        blocks only, not for those read ahead in the same request."""
        prefixes = {n: f.prefix[0] for n in numbers if (f := self.inflight[n]).prefix is not None}
        if origin is Origin.HOT:
            # A prefetch's blocks, as hot_runs grouped them, the runs in the order given (first access).
            place = {n: i for i, n in enumerate(numbers)}
            runs = fetch_runs(sorted(numbers), self.index.blocks, HOT_RUN_BYTES, prefixes)
            runs.sort(key=lambda run: place[run[0]])
        else:
            runs = fetch_runs(numbers, self.index.blocks, prefixes=prefixes)
        for run in runs:
            # Only a run's last block can be fetched short of its end.
            for n in run[:-1]:
                self.inflight[n].prefix = None
        if origin is Origin.HOT and len(runs) > 1 and self.fetcher.stream_many is not None:
            trio.lowlevel.spawn_system_task(self._fetch_batch, runs, origin, image)
            return
        for run in runs:
            trio.lowlevel.spawn_system_task(self._fetch_run, run, origin, deadline, image)

    async def _fetch_batch(self, runs: list[list[int]], origin: Origin, image: str | None) -> None:
        """A prefetch's runs in one multi-range request; the blocks it did
        not land (not brought, or not verified) go run by run, as any fetch."""
        self.busy += 1
        try:
            errors = await self._fetch_runs(runs, origin, None, image)
        finally:
            self.busy -= 1
        if errors:
            metrics.VERIFY_FAILURES.inc(sum(isinstance(e, BlockVerificationError) for e in errors))
            log.warning("prefetch batch fell short; the rest go run by run", layer=self.name, error=str(errors[0]))
        for rest in runs:
            if rest:
                trio.lowlevel.spawn_system_task(self._fetch_run, rest, origin, None, image)

    async def _fetch_run(self, run: list[int], origin: Origin, deadline: float | None, image: str | None) -> None:
        # Blocks land one by one as they are stored; what is left here when
        # the attempts run out, or the deadline passes, gets the error.
        remaining = list(run)
        # Open (not closed under it) until every block of the run landed.
        self.busy += 1
        try:
            for attempt in range(1, VERIFY_ATTEMPTS + 1):
                try:
                    await self._fetch_and_store(remaining, origin, deadline, image)
                    return
                except BlockVerificationError as exc:
                    metrics.VERIFY_FAILURES.inc()
                    log.warning(
                        "fetched block failed verification",
                        layer=self.name,
                        blocks=remaining,
                        attempt=attempt,
                        error=str(exc),
                    )
                    if attempt == VERIFY_ATTEMPTS:
                        raise
        except Exception as exc:
            metrics.FETCH_ERRORS.inc()
            log.error("block fetch failed", layer=self.name, blocks=remaining, error=str(exc))
            for n in remaining:
                self._land(n, exc)
        finally:
            self.busy -= 1

    def _land(self, number: int, error: Exception | None, uncached: bytes | None = None) -> None:
        flight = self.inflight.pop(number)
        flight.error = error
        flight.uncached = uncached
        cached = error is None and uncached is None
        if cached and flight.origin == Origin.READAHEAD and not flight.demanded:
            self.readahead_marks.add(number)
        if error is None and flight.origin == Origin.BACKGROUND:
            block = self.index.blocks[number]
            metrics.BACKGROUND_BYTES.inc(block.cend - block.cstart)
        if error is None and flight.origin == Origin.HOT:
            block = self.index.blocks[number]
            size = flight.prefix[0] if flight.prefix is not None else block.cend - block.cstart
            metrics.PREFETCHED_BLOCKS.inc()
            metrics.PREFETCHED_BYTES.inc(size)
            if self.on_fetched is not None:
                self.on_fetched(self.index.layer_digest, size, flight.image, True)
            if cached and not flight.demanded:
                self.unread_prefetched.add(number)
                metrics.PREFETCH_UNREAD.inc()
        flight.done.set()

    async def _fetch_and_store(
        self, remaining: list[int], origin: Origin, deadline: float | None, image: str | None
    ) -> None:
        """Fetch the contiguous blocks in `remaining` with one Range request,
        verifying, decoding and landing each (in parallel, removing it from
        `remaining`) as soon as its bytes are in: a read waiting on the
        first block of a run does not wait for the rest of the response."""
        errors = await self._fetch_runs([remaining], origin, deadline, image)
        if errors:
            raise errors[0]

    async def _fetch_runs(
        self, runs: list[list[int]], origin: Origin, deadline: float | None, image: str | None
    ) -> list[Exception]:
        """_fetch_and_store for each run of `runs`, all in one request (one
        range each); what went wrong, if anything, with the blocks not landed
        left in their runs."""
        blocks = self.index.blocks
        stored: list[Exception] = []
        live = True

        def plan(remaining: list[int]) -> tuple[tuple[int, int], _RunSink]:
            last = remaining[-1]
            prefix = self.inflight[last].prefix
            start, end = run_span(remaining, blocks, prefix[0] if prefix is not None else None)
            # Of a fixed size, so that views of it stay valid while the rest
            # arrives. Views, not copies: a prefetch moves hundreds of megabytes
            # through here, and the event loop would make every copy.
            buffer = bytearray(end - start)
            arrival = RunArrival(list(remaining), blocks, memoryview(buffer), end)

            async def store(n: int, compressed: memoryview) -> None:
                try:
                    link = prefix[1] if prefix is not None and n == last else None
                    uncached = await self._store_block(n, compressed, origin, link)
                except Exception as exc:
                    stored.append(exc)
                    return
                remaining.remove(n)
                self._land(n, None, uncached)

            def arrived(received: int) -> None:
                # In the event loop, from the fetch thread: it must not raise
                # (a callback that does ends the loop), so nothing starts in
                # the nursery once this fetch is over. What a fetch the
                # deadline made us leave goes on delivering lands nowhere.
                if live:
                    for n, compressed in arrival.whole(received).items():
                        nursery.start_soon(store, n, compressed)

            return (start, end), _RunSink(buffer, arrival.ends, arrived)

        fetched: list[Exception] = []
        async with trio.open_nursery() as nursery:
            ranges, sinks = zip(*(plan(remaining) for remaining in runs), strict=True)
            try:
                try:
                    await self._fetch_ranges(list(ranges), origin, deadline, list(sinks))
                except Exception as exc:
                    fetched.append(exc)
                # Every block that arrived whole lands, whether or not the
                # rest came (what the thread announced may not have run yet).
                for sink in sinks:
                    sink.arrived(sink.received)
            finally:
                live = False
        received = sum(sink.received for sink in sinks)
        metrics.FETCHED_BYTES.inc(received)
        if self.on_fetched is not None:
            self.on_fetched(self.index.layer_digest, received, image, False)
        short = [
            BlockVerificationError(f"range {start}-{end} answered with {sink.received} bytes")
            for (start, end), sink in zip(ranges, sinks, strict=True)
            if sink.received != end - start
        ]
        return [*fetched, *short, *stored]

    async def _store_block(
        self, n: int, compressed: memoryview, origin: Origin, link: bytes | None = None
    ) -> bytes | None:
        """Verify and decode block `n`, then write it to the cache once there
        is room for it, in one worker thread: None once it is cached, else its
        bytes, for its readers from memory. Room is made first (the size is
        the index's), so that decoding, writing and recording cost one thread
        hop, not two. `origin`: who fetched it. `link`: `compressed` is the
        block's first parts only, checked with this link (parts.py)."""
        block = self.index.blocks[n]
        size = block.uend - block.ustart
        recording = self.records is not None and self.records(self.index.layer_digest)
        if not recording and self.reaches:
            self.reaches.clear()
        keep = recording and link is None and origin in (Origin.READ, Origin.READAHEAD)
        room = True
        if self.cache is not None:
            room = await self.cache.reserve(size)
        # Stays true if decoding raises: the room made is given back unused.
        failed = True
        stored = 0
        try:
            limiter = self.prefetch_decode_limiter if origin in (Origin.HOT, Origin.BACKGROUND) else None
            data, failed = await trio.to_thread.run_sync(
                self._decode_and_write, n, compressed, room, link, keep, limiter=limiter
            )
            stored = len(data)
        finally:
            if self.cache is not None and room:
                self.cache.settle(size, self.cache_key, n, block.ustart, not failed, stored or None)
        metrics.FETCHED_BLOCKS.inc()
        if not room:
            metrics.UNCACHED_BLOCKS.inc()
            log.info("nothing to evict under the cache cap; serving a block from memory", layer=self.name, block=n)
            return data
        if failed:
            if not self.closed:
                self._distrust_cache()
            return data
        if link is not None:
            self.partial[n] = len(data)
            return None
        self.partial.pop(n, None)
        self.cached.add(n)
        if self.on_whole is not None and self.all_cached:
            self.on_whole()
        return None

    def _decode_and_write(
        self, n: int, compressed: memoryview, write: bool, link: bytes | None, keep: bool
    ) -> tuple[bytes, bool]:
        """The block's verified bytes (its first ones, with a `link`) and
        whether writing them to the cache failed (True too when not written:
        `write` false or the reader closed). `keep`: keep the block's reach."""
        if link is not None:
            data = self.decoder.decode_prefix(n, compressed, link)
        elif keep:
            data, reach = self.decoder.decode_reach(n, compressed)
            if reach is not None:
                self.reaches[n] = reach
        else:
            data = self.decoder.decode(n, compressed)
        if not write or self.closed:
            return data, True
        return data, self._write(n, data)

    async def _fetch_ranges(
        self, ranges: list[tuple[int, int]], origin: Origin, deadline: float | None, sinks: list[_RunSink]
    ) -> None:
        """The bytes of each range into its sink from a worker thread holding
        one of `origin`'s fetch slots. The slot stays taken until the thread
        is done, even one the deadline made us stop waiting for: threads
        stuck on a registry never outnumber the slots."""
        limiter = self.limiters[origin]
        if deadline is None:
            await trio.to_thread.run_sync(self._fetch_in_thread, ranges, None, sinks, limiter=limiter)
            return
        with trio.move_on_at(_on_trio_clock(deadline)):
            await trio.to_thread.run_sync(
                self._fetch_in_thread, ranges, deadline, sinks, limiter=limiter, abandon_on_cancel=True
            )
            return
        what = ", ".join(f"[{start}, {end})" for start, end in ranges)
        raise BlockUnavailable(
            f"range {what} of layer {self.name} not fetched within the "
            f"{self.fetcher.deadline_s:g} s fetch deadline; the registry is stalled or too slow"
        )

    def _fetch_in_thread(self, ranges: list[tuple[int, int]], deadline: float | None, sinks: list[_RunSink]) -> None:
        # A deadline not set yet (a prefetch's) starts now that the fetch has its slot.
        began = time.monotonic()
        deadline = began + self.fetcher.deadline_s if deadline is None else deadline
        if len(ranges) == 1:
            (start, end), (sink,) = ranges[0], sinks
            self.fetcher.stream(start, end, deadline, sink)
        else:
            assert self.fetcher.stream_many is not None
            self.fetcher.stream_many(ranges, deadline, sinks)
        metrics.FETCH_SECONDS.observe(time.monotonic() - began)

    def _write(self, number: int, data: bytes) -> bool:
        """Write a verified, decompressed block to the cache, then record it
        with its crc and place. True if the cache could not take it."""
        block = self.index.blocks[number]
        try:
            written = os.pwrite(self.fd, data, block.ustart)
            if written == len(data):
                crc = isal_zlib.crc32(data)
                record = BlockRecord(BlockState.CACHED, crc, block.ustart, len(data), int(time.time()))
                self.block_index.put(self.cache_key, number, record)
                return False
            error = f"short write: {written} of {len(data)} bytes"
        except (OSError, BlockIndexError) as exc:
            error = str(exc)
        metrics.CACHE_WRITE_ERRORS.inc()
        log.warning("block could not be cached; serving it from memory", layer=self.name, block=number, error=error)
        return True

    def _distrust_cache(self) -> None:
        """A failed write can mean the file lost bytes it had taken (a failed
        writeback, a failing device): every cached block is checked against
        its recorded crc again before it is served."""
        records = self.block_index.cached(self.cache_key)
        self.unverified.update((n, r.crc32) for n, r in records.items() if n in self.cached or n in self.partial)


def _on_trio_clock(deadline: float) -> float:
    """A time.monotonic() deadline as the same instant on trio's clock."""
    return trio.current_time() + (deadline - time.monotonic())
