"""What the striped reader counts: per file in `ReadStats` (returned to
library callers and logged at close), and process-wide as Prometheus metrics
for the mount daemon. `ReadStats.add_*` is the one place that updates both."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

BYTES_SERVED = Counter("bootseer_hdfs_fuse_served_bytes", "Bytes returned to readers.")
BYTES_FETCHED = Counter("bootseer_hdfs_fuse_fetched_bytes", "Bytes read from remote stores, by scheme.", ["scheme"])
STRIPE_SECONDS = Histogram(
    "bootseer_hdfs_fuse_stripe_seconds",
    "Time to read one stripe from the remote store (one attempt that succeeded).",
    ["scheme"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RETRIES = Counter("bootseer_hdfs_fuse_retries", "Stripe reads retried after a failure.")
HEDGES = Counter("bootseer_hdfs_fuse_hedged_reads", "Second reads issued for stripes slower than the timeout.")
FAILURES = Counter("bootseer_hdfs_fuse_failed_reads", "Stripe reads that gave up (EIO).")
READAHEAD_HITS = Counter("bootseer_hdfs_fuse_readahead_hit_bytes", "Prefetched bytes a reader then asked for.")
READAHEAD_WASTE = Counter("bootseer_hdfs_fuse_readahead_waste_bytes", "Prefetched bytes dropped without being read.")
CACHE_HITS = Counter("bootseer_hdfs_fuse_cache_hit_bytes", "Bytes served from the disk cache.")
PUSHED = Counter("bootseer_hdfs_fuse_page_cache_pushed_bytes", "Bytes the mount pushed into the kernel's page cache.")


@dataclass
class ReadStats:
    scheme: str
    served_bytes: int = 0
    fetched_bytes: int = 0
    # Indices of the stripes read from the remote store, in order.
    fetched_stripes: list[int] = field(default_factory=list)
    retries: int = 0
    hedges: int = 0
    failures: int = 0
    readahead_hit_bytes: int = 0
    readahead_waste_bytes: int = 0
    cache_hit_bytes: int = 0
    pushed_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_served(self, n: int) -> None:
        with self._lock:
            self.served_bytes += n
        BYTES_SERVED.inc(n)

    def add_fetch(self, index: int, n: int, seconds: float) -> None:
        with self._lock:
            self.fetched_bytes += n
            self.fetched_stripes.append(index)
        BYTES_FETCHED.labels(self.scheme).inc(n)
        STRIPE_SECONDS.labels(self.scheme).observe(seconds)

    def add_cache_hit(self, n: int) -> None:
        with self._lock:
            self.cache_hit_bytes += n
        CACHE_HITS.inc(n)

    def add_pushed(self, n: int) -> None:
        with self._lock:
            self.pushed_bytes += n
        PUSHED.inc(n)

    def add_retry(self) -> None:
        with self._lock:
            self.retries += 1
        RETRIES.inc()

    def add_hedge(self) -> None:
        with self._lock:
            self.hedges += 1
        HEDGES.inc()

    def add_failure(self) -> None:
        with self._lock:
            self.failures += 1
        FAILURES.inc()

    def add_readahead_hit(self, n: int) -> None:
        with self._lock:
            self.readahead_hit_bytes += n
        READAHEAD_HITS.inc(n)

    def add_readahead_waste(self, n: int) -> None:
        with self._lock:
            self.readahead_waste_bytes += n
        READAHEAD_WASTE.inc(n)

    def throughput(self) -> float:
        """Bytes served per second since the file was opened."""
        elapsed = time.monotonic() - self.started
        return self.served_bytes / elapsed if elapsed > 0 else 0.0
