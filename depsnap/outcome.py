"""What `ensure` and `run` report: one line a person or a log can read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    status: str  # "hit", "present" (already there), "miss" or "failed"
    key: str
    seconds: float
    detail: str
    returncode: int = 0

    def line(self) -> str:
        return f"depsnap: {self.status} {self.key} in {self.seconds:.2f} s ({self.detail})"
