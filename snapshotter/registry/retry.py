"""When a registry request is sent again, how long to wait first, and when
to stop: a `Budget` of tries and time that every loop of one operation
spends from, so that nested loops (the transport's retries inside a body's
resumes) never multiply each other's counts."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import httpx

from snapshotter.registry.errors import DeadlineExceeded, RegistryError
from snapshotter.registry.reference import Reference

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
BACKOFF_CAP = 10.0


@dataclass(frozen=True)
class Backoff:
    """Up to `retries` more tries after the first, each after an exponential
    delay from `base` with jitter, capped, stretched to a Retry-After."""

    retries: int
    base: float

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Seconds to wait after failed try number `attempt` (0 for the first)."""
        delay = min(BACKOFF_CAP, self.base * 2.0**attempt)
        # Jitter keeps clients that failed together from retrying together.
        delay = delay / 2 + random.uniform(0, delay / 2)
        if response is not None:
            retry_after = response.headers.get("Retry-After", "")
            if retry_after.isdigit():
                delay = min(BACKOFF_CAP, max(delay, float(retry_after)))
        return delay

    def sleep(self, attempt: int, response: httpx.Response | None = None) -> None:
        time.sleep(self.delay(attempt, response))


@dataclass
class Budget:
    """What one operation may still spend on one endpoint: `backoff.retries`
    more tries, whichever loop asks for them (a retried status or reset, a
    redirect's or an auth round's request, a resumed body), and time up to
    `deadline` (a time.monotonic() value; None: only the tries bound it)."""

    backoff: Backoff
    deadline: float | None = None
    used: int = 0  # tries after the first
    began: float = field(default_factory=time.monotonic)

    @property
    def tries(self) -> int:
        return self.used + 1

    def timeout(self, per_attempt: float) -> float | None:
        """How long the next try may wait on the registry: `per_attempt`, or
        what is left before the deadline when that is less; None when
        nothing is."""
        if self.deadline is None:
            return per_attempt
        left = self.deadline - time.monotonic()
        return min(per_attempt, left) if left > 0 else None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def delay(self, response: httpx.Response | None = None) -> float | None:
        """Seconds to wait before another try; None when there is none: the
        tries are spent, or the deadline comes before the wait would end."""
        if self.used >= self.backoff.retries:
            return None
        delay = self.backoff.delay(self.used, response)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        return delay

    def wait(self, delay: float) -> None:
        time.sleep(delay)
        self.used += 1

    def overdue(self, ref: Reference, what: str, reason: str) -> DeadlineExceeded:
        tries = "1 attempt" if self.tries == 1 else f"{self.tries} attempts"
        return DeadlineExceeded.at(
            ref,
            f"{what}: not done by the caller's deadline ({time.monotonic() - self.began:.1f} s, {tries}, "
            f"the last: {reason}); the registry is stalled or too slow",
        )

    def spent(self, ref: Reference, what: str, reason: str, error: RegistryError) -> RegistryError:
        """The error to give up with once `delay` said no: `error`, or
        DeadlineExceeded when the deadline, not the count, ended the tries."""
        if self.used < self.backoff.retries:
            return self.overdue(ref, what, reason)
        return error
