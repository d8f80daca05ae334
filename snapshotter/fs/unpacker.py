"""The layer server's worker that unpacks layers once they are whole
(fs/unpack.py says why), one at a time, in a thread, when the mount is
quiet: writing a layer out (and syncing the filesystem) must not compete
with a container's start for the disk and the CPU."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

import structlog
import trio

from snapshotter.fs import metrics
from snapshotter.fs.layers import TREE, LayerStore
from snapshotter.fs.served import ServedLayer
from snapshotter.fs.unpack import unpack

log = structlog.get_logger("bootseer.fs")

# How long the layer mount must have had no request before a layer is unpacked.
QUIET_S = 5.0
# The share of the layer store's filesystem an unpack leaves free: a local
# copy is a speed-up, not worth a full disk for containers' writable layers
# and the block cache.
FREE_MARGIN = 0.1


class Unpacker:
    def __init__(self, store: LayerStore, last_request_ns: Callable[[], int]) -> None:
        """`last_request_ns`: when the mount's last request came, on
        time.perf_counter_ns's clock."""
        self.store = store
        self.last_request_ns = last_request_ns
        self.quiet_s = QUIET_S
        self._send, self._receive = trio.open_memory_channel[ServedLayer](math.inf)
        self._queued: set[str] = set()

    def add(self, layer: ServedLayer) -> None:
        """`layer` may be whole now (every block cached): unpack it unless
        it is not, or is unpacked already."""
        name = layer.reader.name
        if name not in self._queued:
            self._queued.add(name)
            self._send.send_nowait(layer)

    async def run(self) -> None:
        async for layer in self._receive:
            try:
                await self._quiet()
                await self._unpack(layer)
            except Exception as exc:
                # Layers are untrusted and disks fail: whatever unpacking one
                # raises costs that layer its local copy, never the server.
                metrics.UNPACKED_LAYERS.labels("failed").inc()
                log.warning(
                    "could not unpack a whole layer; containers go on reading it through the layer mount",
                    layer=layer.reader.name,
                    error=repr(exc),
                )
            finally:
                self._queued.discard(layer.reader.name)

    def _room_for(self, size: int) -> bool:
        """Room for `size` more bytes with FREE_MARGIN of the filesystem to spare."""
        st = os.statvfs(self.store.root)
        return st.f_bavail * st.f_frsize - size >= FREE_MARGIN * st.f_blocks * st.f_frsize

    async def _quiet(self) -> None:
        while (idle := (time.perf_counter_ns() - self.last_request_ns()) / 1e9) < self.quiet_s:
            await trio.sleep(self.quiet_s - idle)

    async def _unpack(self, layer: ServedLayer) -> None:
        reader = layer.reader
        name = reader.name
        if not layer.current or await trio.to_thread.run_sync(self.store.tree_path(name).is_dir):
            return
        if not await reader.whole():
            return
        if not await trio.to_thread.run_sync(self._room_for, reader.index.uncompressed_size):
            metrics.UNPACKED_LAYERS.labels("no_room").inc()
            log.info("not unpacking a whole layer: the layer store's disk has no room for it", layer=name)
            return
        began = time.monotonic()
        stop = threading.Event()
        try:
            # Pinned: eviction must not punch a block out of the cache file
            # while its bytes are being copied.
            with reader.holding(range(len(reader.index.blocks))):
                done = await trio.to_thread.run_sync(
                    unpack,
                    layer.tree,
                    self.store.cache_path(name),
                    self.store.path(name),
                    TREE,
                    stop,
                    abandon_on_cancel=True,
                )
        finally:
            # Cancelled (the server stops): the thread gives up at its next entry.
            stop.set()
        metrics.UNPACKED_LAYERS.labels("done").inc()
        metrics.UNPACKED_BYTES.inc(done.bytes)
        log.info(
            "layer unpacked; mounts made from now on read it from local disk",
            layer=name,
            entries=done.entries,
            bytes=done.bytes,
            seconds=round(time.monotonic() - began, 3),
        )
