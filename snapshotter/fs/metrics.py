"""Prometheus metrics of the FUSE layer server."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
