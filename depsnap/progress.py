"""Progress bars for long transfers, shown only on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm


def byte_progress(description: str = "restoring") -> Callable[[int], None] | None:
    """A callback that advances a byte counter, or None when stderr is not a TTY."""
    if not sys.stderr.isatty():
        return None
    bar = tqdm(desc=description, unit="B", unit_scale=True, unit_divisor=1024, leave=False)

    def advance(n: int) -> None:
        bar.update(n)

    return advance
