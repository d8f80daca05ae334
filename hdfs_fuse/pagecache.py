"""Stripes pushed into the kernel's page cache as they arrive (FUSE
notify_store), so a sequential reader finds its pages cached.

Why: answering a read copies its bytes into the page cache inside pyfuse3's
reply, on the trio thread and holding the GIL, and on a VM that copy into
fresh pages is the most expensive step of the whole read path. A push copies
the same bytes from threads of its own with the GIL released, on every CPU,
while the event loop and the fetch workers go on.

The first page of each stripe is left out: the reader's miss there is the
request that tells the mount where the reader is, which drives read-ahead
and lets the stripes behind it go.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pyfuse3
import structlog

log = structlog.get_logger("bootseer.hdfs_fuse.mount")

PAGE = 4096
# Pushes waiting at most; past this a stripe is not pushed (its reads are
# answered as usual), so a stalled push cannot hold stripes' memory.
MAX_QUEUED = 16


@dataclass(frozen=True)
class Push:
    inode: int
    offset: int
    data: memoryview
    # Told the bytes stored, once they are.
    stored: Callable[[int], None]
    # Asked just before pushing: still worth it, and safe?
    wanted: Callable[[], bool]


class PageCacheFiller:
    """Threads storing stripes in the page cache. A push may wait in the kernel
    for pages a pending read holds, so pushes never run on fetch workers: a
    read waiting for a stripe must always have a worker to fetch it."""

    def __init__(self, threads: int = 2) -> None:
        self._queue: queue.Queue[Push | None] = queue.Queue(MAX_QUEUED)
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"page-cache-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def offer(
        self, inode: int, start: int, data: bytes | bytearray, stored: Callable[[int], None], wanted: Callable[[], bool]
    ) -> None:
        """Push stripe bytes `data` found at `start`, all but their first page."""
        if self._closed or len(data) <= PAGE:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(Push(inode, start + PAGE, memoryview(data)[PAGE:], stored, wanted))

    def _run(self) -> None:
        while (push := self._queue.get()) is not None:
            if not push.wanted():
                continue
            try:
                # pyfuse3's stub says bytes, but it takes any buffer: bytes() would copy the stripe again.
                pyfuse3.notify_store(push.inode, push.offset, push.data)  # type: ignore[arg-type]
            except OSError as exc:
                # The kernel forgot the inode, or the mount is going away:
                # reads are answered as usual.
                log.debug("page cache push failed", inode=push.inode, offset=push.offset, error=str(exc))
                continue
            push.stored(len(push.data))

    def close(self, timeout: float = 5.0) -> None:
        """Stop, dropping queued pushes. Call while the mount still answers
        reads (a push may be waiting for one), and before the session closes."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout)
