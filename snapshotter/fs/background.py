"""Optional background fetch of whole layers: once a layer is served, its
remaining blocks are fetched into the cache, one layer at a time, at a
bounded bandwidth, and paused whenever a reader is waiting on a fetch.
Under a cache cap it stops where the next run would not fit without
evicting: it would only evict what readers read to bring in what they may
never read."""

from __future__ import annotations

import math

import structlog
import trio

from snapshotter.fs.eviction import BlockCache
from snapshotter.fs.reader import BlockUnavailable, Origin
from snapshotter.fs.served import ServedLayer
from snapshotter.layer.blockmath import fetch_runs

log = structlog.get_logger("bootseer.fs")

# Requests stay small so a reader's miss never waits long behind one.
RUN_BYTES = 4 << 20
# How often to look again while readers are fetching.
YIELD_S = 0.05


class BackgroundFetch:
    def __init__(self, bandwidth: int, read_slots: trio.CapacityLimiter) -> None:
        self.bandwidth = bandwidth
        self.read_slots = read_slots
        self._send, self._receive = trio.open_memory_channel[ServedLayer](math.inf)
        # The block cache whose cap the background fetch stays under (None: no cap).
        self.cache: BlockCache | None = None

    def add(self, layer: ServedLayer) -> None:
        self._send.send_nowait(layer)

    async def run(self) -> None:
        async for layer in self._receive:
            await self._fetch(layer)

    async def _fetch(self, layer: ServedLayer) -> None:
        reader = layer.reader
        blocks = reader.index.blocks
        missing = [n for n in range(len(blocks)) if n not in reader.cached]
        for run in fetch_runs(missing, blocks, max_bytes=RUN_BYTES):
            if not layer.current:
                return
            while self.read_slots.borrowed_tokens:
                await trio.sleep(YIELD_S)
            if self.cache is not None and not self.cache.room_for(blocks[run[-1]].uend - blocks[run[0]].ustart):
                log.info("background fetch stopped at the cache cap", layer=reader.name)
                return
            began = trio.current_time()
            try:
                await reader.ensure(run, Origin.BACKGROUND)
            except BlockUnavailable as exc:
                log.warning("background fetch stopped", layer=reader.name, error=str(exc))
                return
            nbytes = blocks[run[-1]].cend - blocks[run[0]].cstart
            await trio.sleep(max(0.0, nbytes / self.bandwidth - (trio.current_time() - began)))
        log.info("layer fully cached in the background", layer=reader.name)
