"""The striped reader: one implementation behind the library's file objects
and every read of the FUSE mount.

A file is cut into stripes (see `striping.Geometry`). A read asks for the
stripes it touches ("demand") and, while access is sequential, for a window
of stripes after them ("read-ahead"); a pool of worker threads fetches them
in parallel, demand first. Each fetch retries with backoff, a fetch slower
than `stripe_timeout` gets a second one racing it, and a stripe that runs out
of attempts fails every read that needs it with EIO. Stripes are held in
memory only while they may still be read, within a byte budget shared by all
files of a `Client`; read-ahead stops at the budget, demand reads do not.
"""

from __future__ import annotations

import builtins
import io
import itertools
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import structlog

from hdfs_fuse import uri as uri_mod
from hdfs_fuse.backends import backend_for
from hdfs_fuse.backends.interface import Backend, Entry, RemoteFile
from hdfs_fuse.cache import DiskCache, stripe_key
from hdfs_fuse.errors import PermanentError, RemoteReadError, TransientError
from hdfs_fuse.metrics import ReadStats
from hdfs_fuse.settings import HdfsFuseConfig
from hdfs_fuse.striping import Geometry, ReorderTolerantReadAhead, backoff_delay, window_limit

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = structlog.get_logger("bootseer.hdfs_fuse")

_T = TypeVar("_T")

_URGENT = 0
_AHEAD = 1
# One racing re-read per stripe: a second straggler means the store itself is
# slow, and more copies would only slow it further.
_MAX_HEDGES = 1
# Stripes a random reader keeps around (it may come back to them soon).
_RANDOM_KEEP = 4


class Workers:
    """Threads running stripe fetches, most urgent first, FIFO within an urgency."""

    def __init__(self, count: int, name: str = "stripe") -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, urgency: int, job: Callable[[], None]) -> None:
        self._queue.put((urgency, next(self._order), job))

    def _run(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put((-1, next(self._order), None))
        for thread in self._threads:
            thread.join(timeout=5)


class Budget:
    """Bytes of stripes in flight or buffered, across every file of a client."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def try_take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def take(self, n: int) -> None:
        with self._lock:
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


@dataclass(eq=False)
class _Stripe:
    index: int
    start: int
    length: int
    # Fetched ahead of demand and not read yet (a hit when read, waste when dropped).
    prefetched: bool
    done: threading.Event = field(default_factory=threading.Event)
    # Set when nobody wants the stripe any more: wakes a fetch sleeping in backoff.
    abandoned: threading.Event = field(default_factory=threading.Event)
    data: bytes | bytearray | None = None
    error: str = ""
    started: bool = False
    running: int = 0
    hedges: int = 0
    # Bytes readers copied out of it (overlapping reads count twice).
    consumed: int = 0
    read_started: float | None = None
    charged: bool = False


class StripedReader:
    """Striped reads of one open remote file."""

    def __init__(self, client: Client, remote: RemoteFile) -> None:
        config = client.config
        self.client = client
        self.config = config
        self.remote = remote
        self.uri = str(remote.location)
        self.geometry = Geometry(remote.size, config.stripe_size)
        self.stats = ReadStats(scheme=remote.location.scheme)
        self.max_window = window_limit(config.readahead, config.memory, config.stripe_size)
        self._stripes: OrderedDict[int, _Stripe] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        # Told (stripe index, start, bytes) of every stripe that arrives, from
        # the worker that fetched it; it must not block.
        self.on_fetched: Callable[[int, int, bytes | bytearray], None] | None = None

    @property
    def size(self) -> int:
        return self.geometry.file_size

    def new_pattern(self) -> ReorderTolerantReadAhead:
        return ReorderTolerantReadAhead(max_window=self.max_window)

    def readinto(self, offset: int, buf: memoryview, pattern: ReorderTolerantReadAhead) -> int:
        """Fill `buf` from `offset`; returns the bytes read (short only at EOF)."""
        end = min(offset + len(buf), self.size)
        if end <= offset:
            return 0
        span = self.geometry.span(offset, end - offset)
        # A huge read goes in groups of stripes, so memory stays bounded
        # however large the caller's buffer; the stripes of a group are
        # fetched in parallel.
        group = max(1, self.max_window)
        for first in range(span.start, span.stop, group):
            part = range(first, min(first + group, span.stop))
            self._read_group(part, offset, end, buf, pattern)
        self.stats.add_served(end - offset)
        return end - offset

    def peek(self, offset: int, size: int, pattern: ReorderTolerantReadAhead) -> memoryview | None:
        """The bytes at `offset` (`size` of them, fewer at EOF) as a view into
        a stripe that has already arrived, or None when they are not all in
        one such stripe (then `readinto` waits for them).

        Costs no copy and no wait, so the FUSE mount answers most reads
        without leaving its event loop; the view keeps the stripe's bytes
        alive after the stripe is dropped.
        """
        end = min(offset + size, self.size)
        if end <= offset:
            return memoryview(b"")
        index = offset // self.geometry.stripe_size
        if (end - 1) // self.geometry.stripe_size != index:
            return None
        with self._lock:
            stripe = self._stripes.get(index)
            if self._closed or stripe is None or stripe.data is None:
                return None
            part = range(index, index + 1)
            sequential = self._plan(part, pattern)[1]
            stripe.consumed += end - offset
            data = stripe.data
            self._evict(part, sequential)
        self.stats.add_served(end - offset)
        return memoryview(data)[offset - stripe.start : end - stripe.start]

    def fetch(self, index: int, pattern: ReorderTolerantReadAhead) -> bytes | bytearray:
        """Stripe `index`'s bytes, with the read-ahead a sequential reader
        would get behind it; not counted as served or read. The caller says
        what became of them (`pushed`), so a stripe it did not place anywhere
        stays for the readers that will ask for it."""
        part = range(index, index + 1)
        with self._lock:
            wanted, sequential = self._plan(part, pattern)
        data = self._wait(wanted[0])
        with self._lock:
            self._evict(part, sequential)
        return data

    def pushed(self, index: int, nbytes: int) -> None:
        """`nbytes` of stripe `index` went into the kernel's page cache: they
        count as read, so a sequential reader past the stripe drops it."""
        with self._lock:
            stripe = self._stripes.get(index)
            if stripe is not None:
                stripe.consumed += nbytes
        self.stats.add_pushed(nbytes)

    def _plan(self, part: range, pattern: ReorderTolerantReadAhead) -> tuple[list[_Stripe], bool]:
        """Demand `part`, read ahead of it; (its stripes, whether sequential). Under the lock."""
        if self._closed:
            raise ValueError("read of a closed file")
        sequential, ahead = pattern.on_access(part.start, part[-1])
        if not sequential:
            self._cancel_prefetches()
        wanted = [self._demand(index) for index in part]
        for later in ahead:
            if later >= self.geometry.count or not self._prefetch(later):
                break
        return wanted, sequential

    def _read_group(
        self, part: range, offset: int, end: int, buf: memoryview, pattern: ReorderTolerantReadAhead
    ) -> None:
        with self._lock:
            wanted, sequential = self._plan(part, pattern)
        for stripe in wanted:
            data = self._wait(stripe)
            lo = max(offset, stripe.start)
            hi = min(end, stripe.start + stripe.length)
            buf[lo - offset : hi - offset] = memoryview(data)[lo - stripe.start : hi - stripe.start]
            stripe.consumed += hi - lo
        with self._lock:
            self._evict(part, sequential)

    # --- stripe bookkeeping (under self._lock) ---------------------------------------

    def _new_stripe(self, index: int, prefetched: bool) -> _Stripe:
        start, length = self.geometry.extent(index)
        stripe = _Stripe(index=index, start=start, length=length, prefetched=prefetched)
        self._stripes[index] = stripe
        return stripe

    def _demand(self, index: int) -> _Stripe:
        stripe = self._stripes.get(index)
        if stripe is None:
            stripe = self._new_stripe(index, prefetched=False)
            self.client.budget.take(stripe.length)
            stripe.charged = True
            self.client.workers.submit(_URGENT, lambda: self._attempt(stripe))
            return stripe
        if stripe.prefetched:
            stripe.prefetched = False
            self.stats.add_readahead_hit(stripe.length)
        if not stripe.started:
            # Queued behind read-ahead: jump the queue (the later of the two
            # queue entries finds it started and does nothing).
            self.client.workers.submit(_URGENT, lambda: self._attempt(stripe))
        self._stripes.move_to_end(index)
        return stripe

    def _prefetch(self, index: int) -> bool:
        if index in self._stripes:
            return True
        _, length = self.geometry.extent(index)
        if not self.client.budget.try_take(length):
            return False
        stripe = self._new_stripe(index, prefetched=True)
        stripe.charged = True
        self.client.workers.submit(_AHEAD, lambda: self._attempt(stripe))
        return True

    def _drop(self, stripe: _Stripe) -> None:
        if self._stripes.get(stripe.index) is stripe:
            del self._stripes[stripe.index]
        stripe.abandoned.set()
        if stripe.charged:
            stripe.charged = False
            self.client.budget.give(stripe.length)
        if stripe.prefetched and stripe.data is not None:
            self.stats.add_readahead_waste(stripe.length)

    def _cancel_prefetches(self) -> None:
        for stripe in list(self._stripes.values()):
            if stripe.prefetched and not stripe.started:
                self._drop(stripe)

    def _evict(self, current: range, sequential: bool) -> None:
        finished = [s for s in self._stripes.values() if s.done.is_set() and s.index not in current]
        keep = max(_RANDOM_KEEP, self.max_window + 2)
        for position, stripe in enumerate(finished):
            # A sequential reader is done with a stripe behind it once all of
            # it was read; one not fully read yet may still be wanted by a
            # request that arrives out of order (the kernel sends FUSE
            # read-ahead as parallel requests). Otherwise least recently used
            # go first.
            used_up = stripe.index < current.start and stripe.consumed >= stripe.length
            if (sequential and used_up) or len(finished) - position > keep:
                self._drop(stripe)

    # --- fetching (worker threads) ---------------------------------------------------

    def _attempt(self, stripe: _Stripe, hedge: bool = False) -> None:
        with self._lock:
            if stripe.abandoned.is_set() or stripe.done.is_set():
                return
            if stripe.started and not hedge:
                return
            stripe.started = True
            stripe.running += 1
        error = ""
        data: bytes | bytearray | None = None
        try:
            data = self._fetch(stripe)
        except RemoteReadError as exc:
            error = exc.strerror or str(exc)
        except Exception as exc:  # a bug must fail the read, not hang its waiters
            log.exception("stripe fetch crashed", uri=self.uri, stripe=stripe.index)
            error = f"{self.uri}: stripe {stripe.index}: {type(exc).__name__}: {exc}"
        with self._lock:
            stripe.running -= 1
            if stripe.done.is_set():
                return
            if data is None:
                if stripe.running == 0 and error:
                    stripe.error = error
                    self.stats.add_failure()
                    self._drop(stripe)
                    stripe.done.set()
                return
            stripe.data = data
            stripe.done.set()
        if self.on_fetched is not None and not stripe.abandoned.is_set():
            self.on_fetched(stripe.index, stripe.start, data)

    def _where(self, stripe: _Stripe) -> str:
        return f"{self.uri} stripe {stripe.index} (bytes {stripe.start}-{stripe.start + stripe.length - 1})"

    def _fetch(self, stripe: _Stripe) -> bytes | bytearray | None:
        """The stripe's bytes, None if abandoned meanwhile; RemoteReadError when out of attempts."""
        cache = self.client.cache
        key = ""
        if cache is not None:
            key = stripe_key(self.uri, self.remote.version, self.config.stripe_size, stripe.index)
            cached = cache.get(key, stripe.length)
            if cached is not None:
                self.stats.add_cache_hit(stripe.length)
                return cached
        last_error = ""
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            if stripe.abandoned.is_set() or stripe.done.is_set():
                return None
            began = time.monotonic()
            stripe.read_started = began
            try:
                data = self.remote.read_at(stripe.start, stripe.length)
                if len(data) != stripe.length:
                    raise TransientError(f"short read: {len(data)} of {stripe.length} bytes")
            except (PermanentError, FileNotFoundError) as exc:
                raise RemoteReadError(f"{self._where(stripe)}: {exc}") from exc
            except (TransientError, OSError) as exc:
                last_error = str(exc)
                if attempt + 1 == attempts:
                    break
                self.stats.add_retry()
                delay = backoff_delay(attempt, self.config.backoff, self.config.backoff_max, random.random())
                log.warning(
                    "stripe read failed; retrying",
                    uri=self.uri,
                    stripe=stripe.index,
                    attempt=attempt + 1,
                    delay_s=round(delay, 3),
                    error=last_error,
                )
                stripe.abandoned.wait(delay)
                continue
            finally:
                stripe.read_started = None
            self.stats.add_fetch(stripe.index, stripe.length, time.monotonic() - began)
            if cache is not None:
                try:
                    cache.put(key, data)
                except OSError as exc:
                    log.warning("disk cache write failed", error=str(exc))
            return data
        raise RemoteReadError(f"{self._where(stripe)}: gave up after {attempts} attempts: {last_error}")

    def _wait(self, stripe: _Stripe) -> bytes | bytearray:
        timeout = self.config.stripe_timeout
        poll = min(0.25, timeout) if timeout > 0 else None
        while not stripe.done.wait(poll):
            with self._lock:
                began = stripe.read_started
                if (
                    began is not None
                    and time.monotonic() - began > timeout
                    and stripe.hedges < _MAX_HEDGES
                    and not stripe.done.is_set()
                ):
                    stripe.hedges += 1
                    self.stats.add_hedge()
                    log.info("straggling stripe; racing a second read", uri=self.uri, stripe=stripe.index)
                    self.client.workers.submit(_URGENT, lambda: self._attempt(stripe, hedge=True))
        if stripe.data is None:
            raise RemoteReadError(stripe.error or f"{self._where(stripe)}: read abandoned")
        return stripe.data

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for stripe in list(self._stripes.values()):
                self._drop(stripe)
        self.remote.close()


class StripedFile(io.RawIOBase):
    """A read-only, seekable file object over a `StripedReader`.

    `pread`/`preadinto` read at an offset without moving the position and
    may be called from several threads at once.
    """

    def __init__(self, reader: StripedReader, owned_client: Client | None = None) -> None:
        super().__init__()
        self._reader = reader
        self._pattern = reader.new_pattern()
        self._position = 0
        self._owned_client = owned_client
        self.name = reader.uri

    @property
    def size(self) -> int:
        return self._reader.size

    @property
    def stats(self) -> ReadStats:
        return self._reader.stats

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:
        self._checkClosed()
        n = self._reader.readinto(self._position, memoryview(b).cast("B"), self._pattern)
        self._position += n
        return n

    def readall(self) -> bytes:
        buffer = bytearray(max(0, self.size - self._position))
        n = self.readinto(buffer)
        return bytes(memoryview(buffer)[:n])

    def preadinto(self, b: bytearray | memoryview, offset: int) -> int:
        self._checkClosed()
        if offset < 0:
            raise ValueError("negative offset")
        return self._reader.readinto(offset, memoryview(b).cast("B"), self._pattern)

    def pread(self, size: int, offset: int) -> bytes:
        buffer = bytearray(max(0, min(size, self.size - offset)))
        n = self.preadinto(buffer, offset)
        return bytes(memoryview(buffer)[:n])

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._position = position
        return position

    def tell(self) -> int:
        self._checkClosed()
        return self._position

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
            if self._owned_client is not None:
                self._owned_client.close()
        super().close()


class Client:
    """Stripe workers, memory budget, disk cache and backends shared by the
    files it opens. Use one per process (the mount uses one)."""

    def __init__(self, config: HdfsFuseConfig | None = None) -> None:
        self.config = config or HdfsFuseConfig()
        self.config.validate()
        self.workers = Workers(self.config.streams)
        self.budget = Budget(self.config.memory)
        self.cache = DiskCache(Path(self.config.cache_dir), self.config.cache_size) if self.config.cache_dir else None
        self._backends: dict[tuple[str, str, str], Backend] = {}
        self._lock = threading.Lock()

    def backend(self, location: uri_mod.Location) -> Backend:
        key = (location.scheme, location.authority, location.user)
        with self._lock:
            if key not in self._backends:
                self._backends[key] = backend_for(location, self.config)
            return self._backends[key]

    def _call(self, what: str, location: uri_mod.Location, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except (TransientError, PermanentError) as exc:
            raise RemoteReadError(f"{what} {location}: {exc}") from exc

    def stat(self, uri: str | uri_mod.Location) -> Entry:
        location = uri if isinstance(uri, uri_mod.Location) else uri_mod.parse(uri)
        return self._call("stat", location, lambda: self.backend(location).stat(location))

    def list(self, uri: str | uri_mod.Location) -> builtins.list[Entry]:
        location = uri if isinstance(uri, uri_mod.Location) else uri_mod.parse(uri)
        return self._call("list", location, lambda: self.backend(location).list(location))

    def reader(self, uri: str | uri_mod.Location) -> StripedReader:
        location = uri if isinstance(uri, uri_mod.Location) else uri_mod.parse(uri)
        remote = self._call("open", location, lambda: self.backend(location).open(location))
        return StripedReader(self, remote)

    def open(self, uri: str | uri_mod.Location) -> StripedFile:
        return StripedFile(self.reader(uri))

    def close(self) -> None:
        self.workers.close()
        with self._lock:
            for backend in self._backends.values():
                backend.close()
            self._backends.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open(uri: str, config: HdfsFuseConfig | None = None) -> StripedFile:
    """Open `uri` for striped reading with a client of its own."""
    client = Client(config)
    try:
        return StripedFile(client.reader(uri), owned_client=client)
    except BaseException:
        client.close()
        raise
