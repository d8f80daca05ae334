"""When a registry request is sent again, and how long to wait first."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx

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
