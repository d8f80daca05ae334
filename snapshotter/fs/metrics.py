"""Prometheus metrics of the FUSE layer server."""

from __future__ import annotations

import atexit
import bisect
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

import eventlog
from snapshotter.fs.fusewire import session

READ_BYTES = Counter("bootseer_fs_read_bytes", "Bytes returned to FUSE reads.")
BLOCK_READS = Counter(
    "bootseer_fs_block_reads",
    "Blocks touched by readers' reads: hit (cached), prefetched (cached by the "
    "prefetcher, first read), prefetch_wait (prefetch still in flight), miss.",
    ["result"],
)
PREFETCHED_BLOCKS = Counter("bootseer_fs_prefetched_blocks", "Blocks fetched by the hot-block prefetcher.")
PREFETCHED_BYTES = Counter("bootseer_fs_prefetched_bytes", "Compressed bytes fetched by the prefetcher.")
PREFETCH_UNREAD = Gauge(
    "bootseer_fs_prefetch_unread_blocks",
    "Prefetched blocks no reader has read (yet): the prefetch waste.",
)
FETCHED_BLOCKS = Counter("bootseer_fs_fetched_blocks", "Blocks fetched from the registry.")
FETCHED_BYTES = Counter("bootseer_fs_fetched_bytes", "Compressed bytes fetched from the registry.")
FETCH_SECONDS = Histogram(
    "bootseer_fs_fetch_seconds",
    "Time of one Range request to the registry.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
VERIFY_FAILURES = Counter("bootseer_fs_verify_failures", "Blocks whose fetched bytes did not match the index.")
FETCH_ERRORS = Counter("bootseer_fs_fetch_errors", "Block fetches that failed for good (EIO).")
BACKGROUND_BYTES = Counter(
    "bootseer_fs_background_bytes", "Compressed bytes fetched by the background whole-layer fetch."
)
HANDLER_ERRORS = Counter(
    "bootseer_fs_handler_errors",
    "FUSE requests that failed with an unexpected error, answered EIO; the layer they concern is broken from then on.",
    ["op"],
)
LAYER_LOAD_ERRORS = Counter(
    "bootseer_fs_layer_load_errors",
    "Layer copies that could not be loaded (index or tree refused, files missing); their lookups answer EIO.",
)
CACHE_WRITE_ERRORS = Counter(
    "bootseer_fs_cache_write_errors",
    "Verified blocks that could not be written to the cache (disk full, I/O error, short write): served from "
    "memory, not cached.",
)

CACHE_BYTES = Gauge(
    "bootseer_fs_cache_bytes",
    "Bytes of cached blocks in the layer store (uncompressed, every stored layer, loaded or not).",
)
CACHE_MAX_BYTES = Gauge("bootseer_fs_cache_max_bytes", "The block cache's cap ([fs] cache_max_bytes, resolved).")
EVICTED_BLOCKS = Counter("bootseer_fs_evicted_blocks", "Cached blocks evicted to stay under the cap.")
EVICTED_BYTES = Counter("bootseer_fs_evicted_bytes", "Bytes of cached blocks evicted to stay under the cap.")
EVICT_ERRORS = Counter(
    "bootseer_fs_evict_errors",
    "Evicted blocks whose bytes could not be punched out of their cache file (the space stays taken).",
)
UNCACHED_BLOCKS = Counter(
    "bootseer_fs_uncached_blocks",
    "Verified blocks served from memory without being cached because nothing under the cap could be evicted "
    "(every cached block being read or fetched right now).",
)
LOADED_LAYERS = Gauge(
    "bootseer_fs_loaded_layers",
    "Layers loaded in the layer server now (tree, index, open cache file); see process_resident_memory_bytes.",
)
LAYER_UNLOADS = Counter(
    "bootseer_fs_layer_unloads",
    "Layers unloaded: idle (no mount uses it, no request for [fs] unload_idle_s; reloaded on next use) or "
    "pruned (removed from the store; its cache file closed).",
    ["reason"],
)
UNPACKED_LAYERS = Counter(
    "bootseer_fs_unpacked_layers",
    "Whole layers written out as local directories for the mounts made from then on (fs.unpack): "
    "done, no_room (it would leave less than a tenth of the disk free) or failed (the log says why); "
    "a layer not unpacked stays on the layer mount.",
    ["result"],
)
UNPACKED_BYTES = Counter("bootseer_fs_unpacked_bytes", "File bytes of the layers unpacked onto local disk.")


class OpTimes:
    """One operation's request times: a histogram cheap enough for every
    FUSE request (about 100 ns an observation, against about 550 ns for a
    prometheus_client Histogram, which takes a lock per count). Observed
    only from the layer server's event loop, one thread, so plain integers
    do; a scrape copies them."""

    __slots__ = ("bounds_ns", "counts", "sum_ns")

    def __init__(self, bounds_ns: Sequence[int]) -> None:
        self.bounds_ns = bounds_ns
        # counts[i]: observations in (bounds[i - 1], bounds[i]]; the last one above every bound.
        self.counts = [0] * (len(bounds_ns) + 1)
        self.sum_ns = 0

    def observe_ns(self, ns: int) -> None:
        self.counts[bisect.bisect_left(self.bounds_ns, ns)] += 1
        self.sum_ns += ns


class OpLatency(Collector):
    """A histogram by operation, exposed like a prometheus_client Histogram
    with an `op` label; `labels(op)` is resolved once per handler."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.buckets = tuple(float(b) for b in buckets)
        self._bounds_ns = tuple(round(b * 1e9) for b in self.buckets)
        self._ops: dict[str, OpTimes] = {}
        REGISTRY.register(self)

    def labels(self, op: str) -> OpTimes:
        return self._ops.setdefault(op, OpTimes(self._bounds_ns))

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["op"])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["op"])
        for op, times in sorted(self._ops.items()):
            counts, sum_ns = list(times.counts), times.sum_ns
            cumulative, buckets = 0, []
            for bound, count in zip([*map(repr, self.buckets), "+Inf"], counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            family.add_metric([op], buckets, sum_ns / 1e9)
        yield family


OP_SECONDS = OpLatency(
    "bootseer_fs_op_seconds",
    "Time to answer one FUSE request, by operation, waits on the registry included.",
    (
        *(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005),
        *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    ),
)


class FuseRequests(Collector):
    """The FUSE engine's requests by opcode, read at scrape time: every
    request the kernel sent, answered by a handler or not (ENOSYS, forget,
    interrupt), which the op histogram does not see."""

    families = (
        (
            "bootseer_fs_fuse_requests",
            "FUSE requests read from the kernel, by opcode: what the kernel did not answer from its caches.",
            session.REQUESTS,
        ),
        (
            "bootseer_fs_fuse_requests_answered_now",
            "Of those, the ones answered in the session's read loop, without a task (the filesystem's *_now methods).",
            session.ANSWERED_NOW,
        ),
    )

    def __init__(self) -> None:
        REGISTRY.register(self)

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(name, doc, labels=["opcode"]) for name, doc, _ in self.families]

    def collect(self) -> Iterator[Metric]:
        for name, doc, counts in self.families:
            family = CounterMetricFamily(name, doc, labels=["opcode"])
            for opcode, count in sorted(session.requests_by_opcode(counts).items()):
                family.add_metric([opcode], float(count))
            yield family


FUSE_REQUESTS = FuseRequests()

READ_WAITS = Gauge(
    "bootseer_fs_read_waits",
    "Reads waiting right now on blocks being fetched from the registry (on-demand misses).",
)
READ_WAIT_SECONDS = Histogram(
    "bootseer_fs_read_wait_seconds",
    "How long a read that had to wait on blocks being fetched from the registry waited.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30),
)
IMAGE_FETCHED_BYTES = Counter(
    "bootseer_fs_image_fetched_bytes",
    "Compressed bytes fetched from the registry for an image's layers (every fetch: reads, read-ahead, "
    "prefetch, background), by image manifest digest. A hot-block prefetch counts for the image it is for; "
    "any other fetch for the image most recently prepared with the layer.",
    ["image"],
)
IMAGE_PREFETCHED_BYTES = Counter(
    "bootseer_fs_image_prefetched_bytes",
    "Compressed bytes the hot-block prefetcher fetched for an image, by image manifest digest "
    "(part of bootseer_fs_image_fetched_bytes_total).",
    ["image"],
)

# Images with per-image series at most: the ones most recently prepared.
MAX_IMAGES = 256


class ImageBytes:
    """Which image a layer's fetched bytes count for. A layer can belong to
    many images (a shared base); a fetch other than an image's own prefetch
    counts for the image most recently announced with that layer (the one
    whose Prepare named it last: the image that is starting). Bytes of a
    layer no image announced since the server started count in the totals
    only. Series are kept for the MAX_IMAGES images announced most recently;
    an older one's are dropped."""

    def __init__(self, max_images: int = MAX_IMAGES) -> None:
        self.max_images = max_images
        # image -> its layers, least recently announced first.
        self._images: OrderedDict[str, set[str]] = OrderedDict()
        self._owner: dict[str, str] = {}  # layer -> image its bytes count for

    def announce(self, image: str, layers: Iterable[str]) -> None:
        """`image` was (re)announced with `layers`."""
        layers = list(layers)
        IMAGE_STARTS.announce(image, layers)
        known = self._images.setdefault(image, set())
        known.update(layers)
        self._images.move_to_end(image)
        for layer in known:
            self._owner[layer] = image
        while len(self._images) > self.max_images:
            self._drop(next(iter(self._images)))

    def _drop(self, image: str) -> None:
        layers = self._images.pop(image)
        for series in (IMAGE_FETCHED_BYTES, IMAGE_PREFETCHED_BYTES):
            with contextlib.suppress(KeyError):
                series.remove(image)
        for layer in layers:
            if self._owner.get(layer) != image:
                continue
            heir = next((other for other, has in reversed(self._images.items()) if layer in has), None)
            if heir is None:
                del self._owner[layer]
            else:
                self._owner[layer] = heir

    def fetched(self, layer: str, nbytes: int, image: str | None = None, prefetched: bool = False) -> None:
        """`nbytes` of `layer` fetched, for `image` if the fetch knows it."""
        owner = image if image in self._images else self._owner.get(layer)
        if owner is None:
            return
        (IMAGE_PREFETCHED_BYTES if prefetched else IMAGE_FETCHED_BYTES).labels(owner).inc(nbytes)
        IMAGE_STARTS.fetched(owner, nbytes, prefetched)


# -- per-image start records (eventlog) ----------------------------------------

# Wait episodes closer than this are one: a reader's run of misses is one stall.
EPISODE_GAP_S = 0.05
# Episodes one summary carries at most; beyond, the closest ones are merged.
MAX_EPISODES = 128
READ_RESULTS = ("hit", "prefetched", "prefetch_wait", "miss")


class _ImageStart:
    """What one image's readers met since the layer server first heard of it."""

    __slots__ = (
        "busy_s",
        "busy_since",
        "dirty",
        "episode",
        "episodes",
        "fetched_bytes",
        "prefetched_blocks",
        "prefetched_bytes",
        "reads",
        "wait_s",
        "waiting",
        "waits",
    )

    def __init__(self) -> None:
        self.reads = dict.fromkeys(READ_RESULTS, 0)
        self.fetched_bytes = 0
        self.prefetched_bytes = 0
        self.prefetched_blocks = 0
        self.waits = 0
        # Summed over readers (two readers waiting 1 s each: 2 s)...
        self.wait_s = 0.0
        # ...and the wall time at least one reader waited (1 s): what the start lost.
        self.busy_s = 0.0
        self.waiting = 0
        self.busy_since = 0.0
        # [start, end] in the records' clock, not yet written.
        self.episodes: list[list[float]] = []
        self.episode: list[float] | None = None
        self.dirty = False


class ImageStarts:
    """Per image (manifest digest): block reads by result, bytes fetched and
    prefetched, and the stalls of readers waiting on the registry, written
    to the event log as a cumulative `fs.image` summary every
    `[events] summary_interval_s` while they change (never per request).
    Updated from the layer server's event loop only; a flusher thread reads
    counters (single integer loads) and takes the episodes under a lock."""

    def __init__(self, max_images: int = MAX_IMAGES) -> None:
        self.max_images = max_images
        self._images: OrderedDict[str, _ImageStart] = OrderedDict()
        self._owner: dict[str, str] = {}
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None

    def announce(self, image: str, layers: Iterable[str]) -> None:
        if image not in self._images:
            self._images[image] = _ImageStart()
        self._images.move_to_end(image)
        for layer in layers:
            self._owner[layer] = image
        while len(self._images) > self.max_images:
            gone, _ = self._images.popitem(last=False)
            for layer in [k for k, v in self._owner.items() if v == gone]:
                del self._owner[layer]

    def _of_layer(self, layer: str) -> _ImageStart | None:
        image = self._owner.get(layer)
        return None if image is None else self._images.get(image)

    def _touch(self, start: _ImageStart) -> None:
        start.dirty = True
        if self._flusher is None and eventlog.enabled():
            self._flusher = threading.Thread(target=self._flush_loop, name="event-summaries", daemon=True)
            self._flusher.start()
            atexit.register(self.flush)

    def read(self, layer: str, result: str) -> None:
        start = self._of_layer(layer)
        if start is not None:
            start.reads[result] += 1
            self._touch(start)

    def fetched(self, image: str, nbytes: int, prefetched: bool) -> None:
        start = self._images.get(image)
        if start is None:
            return
        if prefetched:
            start.prefetched_bytes += nbytes
            start.prefetched_blocks += 1
        else:
            start.fetched_bytes += nbytes
        self._touch(start)

    def wait_began(self, layer: str) -> None:
        start = self._of_layer(layer)
        if start is None:
            return
        with self._lock:
            start.waiting += 1
            if start.waiting > 1:
                return
            now = time.time()
            start.busy_since = now
            if start.episode is not None and now - start.episode[1] <= EPISODE_GAP_S:
                return
            start.episode = [now, now]
            start.episodes.append(start.episode)

    def wait_ended(self, layer: str, seconds: float) -> None:
        start = self._of_layer(layer)
        if start is None:
            return
        with self._lock:
            if start.waiting == 0:
                return
            start.waiting -= 1
            start.waits += 1
            start.wait_s += seconds
            if start.waiting == 0:
                now = time.time()
                start.busy_s += now - start.busy_since
                if start.episode is not None:
                    start.episode[1] = now
        self._touch(start)

    def _flush_loop(self) -> None:
        while True:
            time.sleep(eventlog.summary_interval())
            self.flush()

    def flush(self) -> None:
        """Write a summary of every image that changed since the last one."""
        for image, start in list(self._images.items()):
            if not start.dirty:
                continue
            start.dirty = False
            with self._lock:
                # An episode still open stays for the next summary, which carries its end.
                still_open = start.episode if start.waiting > 0 else None
                closed = [e for e in start.episodes if e is not still_open]
                start.episodes = [still_open] if still_open is not None else []
                if still_open is None:
                    start.episode = None
            while len(closed) > MAX_EPISODES:
                gaps = [closed[i + 1][0] - closed[i][1] for i in range(len(closed) - 1)]
                i = gaps.index(min(gaps))
                closed[i : i + 2] = [[closed[i][0], closed[i + 1][1]]]
            eventlog.emit(
                "fs.image",
                image=image,
                reads=dict(start.reads),
                fetched_bytes=start.fetched_bytes,
                prefetched_bytes=start.prefetched_bytes,
                prefetched_blocks=start.prefetched_blocks,
                waits=start.waits,
                wait_s=round(start.wait_s, 6),
                stalled_s=round(start.busy_s, 6),
                waiting=start.waiting,
                episodes=[[round(a, 6), round(b, 6)] for a, b in closed],
            )


IMAGE_STARTS = ImageStarts()
