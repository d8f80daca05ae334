"""The `[events]` section of the config file: where each daemon keeps its
event records for `bootseer report`, and how much of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class EventsConfig:
    # One `<daemon>.jsonl` per daemon (and per short-lived command: pull,
    # depsnap-ensure, mark), each with its previous file `<daemon>.jsonl.1`.
    dir: Path = Path("/var/lib/bootseer/events")
    # Per daemon, current and previous file together stay under this; 0 turns
    # the records off.
    max_bytes: int = 8 << 20
    # How often a daemon writes its running summaries (per image, per mount)
    # while they change.
    summary_interval_s: float = 1.0
