"""One image's recording: first accesses of its layers' blocks, from the
first mount until the run settles."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecordingSession:
    image: str
    layers: set[str]
    started: float
    # The run has settled once no new block was read for `idle_s`, or after
    # `max_s` whatever happens.
    idle_s: float
    max_s: float
    accesses: dict[tuple[str, int], float] = field(default_factory=dict)
    # How far into each block the run read (uncompressed bytes from its start).
    extents: dict[tuple[str, int], int] = field(default_factory=dict)
    last_new: float = 0.0
    stop_requested: bool = False
    # Asked for (`bootseer record start`): published even where a first run's would not be.
    explicit: bool = False

    def access(self, layer: str, block: int, now: float, extent: int) -> None:
        if layer not in self.layers:
            return
        key = (layer, block)
        if key not in self.accesses:
            self.accesses[key] = now - self.started
            self.last_new = now
        if extent > self.extents.get(key, 0):
            self.extents[key] = extent

    def settled(self, now: float) -> bool:
        if self.stop_requested or now - self.started >= self.max_s:
            return True
        return bool(self.accesses) and now - self.last_new >= self.idle_s
