"""Which mirrors to skip for now: mirrors that failed, and mirrors that
answered a Range request for a blob with the whole blob.

A mirror (a `[host]` entry of hosts.toml; never the server, the last
resort) that refuses connections, does not connect within
`connect_timeout_s`, or does not answer within `response_timeout_s`, costs
one such wait and is then skipped for `backoff_s`; each failed retry after
that doubles the period, up to `backoff_max_s`, and a success forgets it.
When a period ends, one request (the probe) goes to the mirror while the
others still skip it, so a dead mirror costs one wait per period, not one
per concurrent read. The same bookkeeping, keyed by (mirror, blob), keeps
ranges of a blob away from a mirror that ignored Range for it.

Pure (no HTTP): the `[registry]` settings import its defaults.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# Mirrors are near (same rack or node): a healthy one connects in
# milliseconds, so 3 s only trips on a dead or unreachable one.
DEFAULT_CONNECT_TIMEOUT_S = 3.0
# A pull-through cache or P2P daemon may fetch upstream before it answers a
# miss; 10 s leaves it that, and is half the layer server's 20 s read deadline,
# so a hung mirror still leaves the next host time to serve the read.
DEFAULT_RESPONSE_TIMEOUT_S = 10.0
DEFAULT_BACKOFF_S = 2.0
DEFAULT_BACKOFF_MAX_S = 300.0

# Bounds the (mirror, blob) marks kept: a node sees thousands of blobs at most.
MAX_TRACKED = 4096


@dataclass(frozen=True)
class MirrorPolicy:
    """How long a mirror may keep a request, and how long it is skipped after."""

    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    response_timeout_s: float = DEFAULT_RESPONSE_TIMEOUT_S
    backoff_s: float = DEFAULT_BACKOFF_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "response_timeout_s", "backoff_s", "backoff_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"registry.mirror_{name} must be > 0")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError("registry.mirror_backoff_max_s must be >= registry.mirror_backoff_s")

    def period(self, failures: int) -> float:
        """Seconds skipped after the `failures`-th failure in a row (1 for the first)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, failures - 1))


@dataclass
class _State:
    failures: int
    until: float  # time.monotonic() before which the key is skipped


class Backoffs:
    """Skip periods by key (a mirror's base URL, or (base URL, digest)),
    shared by every thread of one client."""

    def __init__(self, policy: MirrorPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._states: OrderedDict[Hashable, _State] = OrderedDict()
        self._lock = threading.Lock()

    def usable(self, key: Hashable) -> bool:
        """Whether to send to `key` now: it has not failed, or its period is
        over and this caller is the one probe (the others keep skipping it
        until the probe's outcome is known, or the next period ends)."""
        with self._lock:
            state = self._states.get(key)
            if state is None:
                return True
            now = self._clock()
            if now < state.until:
                return False
            # Holding the others off for as long as a failed probe would.
            state.until = now + self.policy.period(state.failures + 1)
            return True

    def failed(self, key: Hashable) -> float:
        """Record a failure; returns the seconds `key` is now skipped for."""
        with self._lock:
            state = self._states.pop(key, None)
            failures = 1 if state is None else state.failures + 1
            period = self.policy.period(failures)
            self._states[key] = _State(failures, self._clock() + period)
            while len(self._states) > MAX_TRACKED:
                self._states.popitem(last=False)
            return period

    def succeeded(self, key: Hashable) -> bool:
        """Forget `key`'s failures; True if it had any (it recovered)."""
        with self._lock:
            return self._states.pop(key, None) is not None

    def skipped_until(self, key: Hashable) -> float | None:
        """The monotonic time `key` is skipped until, None if it is not."""
        with self._lock:
            state = self._states.get(key)
            return state.until if state is not None else None
