"""The arithmetic of striped reads: which stripes a read touches, how far to
read ahead, how long to back off. Pure and deterministic, shared by the
library and the FUSE mount."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """A file of `file_size` bytes cut into stripes of `stripe_size`."""

    file_size: int
    stripe_size: int

    def __post_init__(self) -> None:
        if self.stripe_size <= 0:
            raise ValueError("stripe_size must be positive")
        if self.file_size < 0:
            raise ValueError("file_size must not be negative")

    @property
    def count(self) -> int:
        return -(-self.file_size // self.stripe_size)

    def extent(self, index: int) -> tuple[int, int]:
        """(start, length) of stripe `index`; the last one may be short."""
        if not 0 <= index < self.count:
            raise IndexError(f"stripe {index} outside 0..{self.count - 1}")
        start = index * self.stripe_size
        return start, min(self.stripe_size, self.file_size - start)

    def span(self, offset: int, size: int) -> range:
        """Stripes holding bytes [offset, offset+size), clipped to the file."""
        if offset < 0 or size < 0:
            raise ValueError("offset and size must not be negative")
        end = min(offset + size, self.file_size)
        if end <= offset:
            return range(0)
        return range(offset // self.stripe_size, (end - 1) // self.stripe_size + 1)


def window_limit(readahead: int, memory: int, stripe_size: int) -> int:
    """Most stripes one reader may hold ahead of itself.

    One stripe of `memory` stays free for the stripe being read, so a reader
    at its full window can still make progress.
    """
    return max(0, min(readahead // stripe_size, memory // stripe_size - 1))


@dataclass
class ReorderTolerantReadAhead:
    """Sequential detection for one reader, by stripe index.

    An access is sequential when it starts at the start of the file with no
    history, or inside the zone the previous accesses made likely: within
    the read-ahead window (at least `initial` stripes) either side of the
    last stripe read.
    Accepting a little disorder matters because the kernel sends a FUSE
    file's read-ahead as several requests at once and they arrive in any
    order. The window opens at `initial` stripes, doubles for every new
    stripe the reader enters, and collapses to nothing on a random access,
    so random reads fetch only what they touch.
    """

    max_window: int
    initial: int = 2
    window: int = 0
    last: int = -1

    def on_access(self, first: int, last: int) -> tuple[bool, range]:
        """Record an access to stripes first..last; return (sequential, stripes to prefetch)."""
        if self.last < 0:
            sequential = first == 0
        else:
            reach = max(self.initial, self.window)
            sequential = self.last - reach <= first <= self.last + reach
        if not sequential or self.max_window == 0:
            self.window = 0
            self.last = last
            return sequential, range(0)
        advanced = max(0, last - max(self.last, 0)) if self.last >= 0 else 1
        if self.window == 0:
            self.window = min(self.initial, self.max_window)
            advanced = max(0, advanced - 1)
        for _ in range(advanced):
            if self.window >= self.max_window:
                break
            self.window = min(self.window * 2, self.max_window)
        self.last = max(self.last, last)
        return True, range(self.last + 1, self.last + 1 + self.window)


def backoff_delay(attempt: int, base: float, cap: float, jitter: float) -> float:
    """Delay before retry number `attempt` (0-based): exponential, capped,
    scaled by `jitter` in [0, 1) to 50..100% so clients that failed together
    do not all come back at the same instant."""
    return min(cap, base * 2.0**attempt) * (0.5 + jitter / 2)
