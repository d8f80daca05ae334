"""What the layer server's helpers (background fetch, unpacking, hot-block
prefetch and recording) see of a layer it serves."""

from __future__ import annotations

from typing import Protocol

from snapshotter.fs.reader import LayerReader
from snapshotter.layer.tree import LayerTree


class ServedLayer(Protocol):
    reader: LayerReader
    tree: LayerTree

    @property
    def current(self) -> bool:
        """Still the copy the layer store holds (not removed or replaced)
        and not broken: work for such a copy is dropped."""
        ...
