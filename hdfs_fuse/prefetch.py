"""Whole files fetched ahead of their reader, into the kernel's page cache.

A job asks by reading an extended attribute of the file on the mount,
`getxattr(path, "user.bootseer.prefetch")` (`getfattr -n ...`, or
`os.getxattr` in Python): the mount starts fetching the file from the first
stripe on, at its full stream count, and pushes each stripe into the page
cache (FUSE notify_store); the answer is the prefetch's status. So a job can
start its checkpoint's transfer the moment its container starts and do
everything else (dependencies, imports, building the model) while the
bytes arrive; its later read finds them cached.

Why an attribute: a pod sees the mount through a read-only host-path volume
and holds no socket of this daemon; reading an attribute needs no capability
and no tool beyond the language runtime. `user.bootseer.prefetch.status`
answers the status without starting anything, for a caller that waits.

A reader that opens the file meanwhile shares the prefetch's stripes (no
byte is fetched twice). Once a reader comes within the push margin of the
prefetch, the prefetch hands the rest to it and stops: pushing pages a
pending read holds would wait on that read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import pyfuse3
import structlog
from prometheus_client import Counter

import eventlog
from hdfs_fuse.errors import RemoteReadError
from hdfs_fuse.prefetch_client import RUNNING, Status
from hdfs_fuse.reader import StripedReader

log = structlog.get_logger("bootseer.hdfs_fuse.mount")


PREFETCHED = Counter("bootseer_hdfs_fuse_prefetched_bytes", "Bytes prefetches pushed into the page cache.")
PREFETCHES = Counter("bootseer_hdfs_fuse_prefetches", "Prefetches ended, by how.", ["outcome"])


class State(Enum):
    RUNNING = RUNNING
    # Every stripe is in the page cache.
    DONE = "done"
    # A reader caught up and took over the rest.
    HANDED_OVER = "handed-over"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(eq=False)
class Prefetch:
    """One file's prefetch: a thread walking its stripes in order.

    `wanted(start)`: may the stripe at `start` be pushed now (no reader near
    it)? `handover()`: called when a reader took over."""

    inode: int
    reader: StripedReader
    wanted: Callable[[int], bool]
    handover: Callable[[], None]
    cgroup: str = ""
    state: State = State.RUNNING
    detail: str = ""
    pushed_bytes: int = 0
    started: float = field(default_factory=eventlog.now)
    # The prefetch itself holds the reader, and so does each handle sharing it.
    _users: int = 1
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    @property
    def version(self) -> str:
        return self.reader.remote.version

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"prefetch-{self.inode}", daemon=True)
        self._thread.start()

    def status(self) -> str:
        return Status(self.state.value, self.pushed_bytes, self.reader.size, self.detail).text()

    def join(self) -> StripedReader | None:
        """The reader, for a handle to share while the prefetch runs; None
        once it ended (the handle then reads on its own)."""
        with self._lock:
            if self.state is not State.RUNNING:
                return None
            self._users += 1
            return self.reader

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.reader.close()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        state, detail = State.DONE, ""
        pattern = self.reader.new_pattern()
        try:
            for index in range(self.reader.geometry.count):
                if self._stop.is_set():
                    state, detail = State.STOPPED, "the mount is stopping"
                    break
                start, length = self.reader.geometry.extent(index)
                if not self.wanted(start):
                    state, detail = State.HANDED_OVER, f"a reader took over at byte {start}"
                    break
                data = self.reader.fetch(index, pattern)
                # Again: a reader may have come near while the stripe was on its way.
                if not self.wanted(start):
                    state, detail = State.HANDED_OVER, f"a reader took over at byte {start}"
                    break
                # pyfuse3's stub says bytes, but it takes any buffer.
                pyfuse3.notify_store(self.inode, start, data)  # type: ignore[arg-type]
                self.reader.pushed(index, length)
                self.pushed_bytes += length
                PREFETCHED.inc(length)
        except RemoteReadError as exc:
            state, detail = State.FAILED, str(exc)
        except OSError as exc:
            # The kernel forgot the inode, or the mount is going away.
            state, detail = State.STOPPED, f"the kernel took no more pages: {exc.strerror or exc}"
        except ValueError:
            state, detail = State.STOPPED, "the file was closed"
        self._end(state, detail)

    def _end(self, state: State, detail: str) -> None:
        with self._lock:
            self.state, self.detail = state, detail
        if state is State.HANDED_OVER:
            self.handover()
        PREFETCHES.labels(state.value).inc()
        ended = {"uri": self.reader.uri, "outcome": state.value, "pushed_bytes": self.pushed_bytes}
        log.info("prefetch ended", **ended, size=self.reader.size, detail=detail)
        # Its record: the checkpoint bytes a job had fetched ahead of its read.
        eventlog.emit(
            "hdfs_fuse.prefetch",
            **ended,
            size=self.reader.size,
            start=self.started,
            end=eventlog.now(),
            cgroup=self.cgroup,
        )
        self.leave()
