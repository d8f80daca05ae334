"""Which slot each layer copy has in the layer mount, kept in the layer store.

A slot is the high half of every inode number of a layer's tree (layerfs.py).
The kernel keeps inode numbers for as long as it caches names and attributes
(an hour) or a file stays open, across a layer's unload and reload, and a new
layer-server process taking over a live mount inherits them all. Keeping the
table on disk gives every such inode number the meaning it had. Slots are
never reused, not even a pruned copy's: a pruned layer's inode numbers may
still be cached, and must find nothing rather than another layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("bootseer.fs")

# Slots fit the 32 bits above a tree's own inode numbers (layerfs.SLOT_SHIFT).
MAX_SLOT = (1 << 31) - 1


@dataclass
class SlotTable:
    path: Path
    slots: dict[tuple[str, str], int] = field(default_factory=dict)
    next_slot: int = 1

    @classmethod
    def load(cls, path: Path) -> SlotTable:
        """The table at `path`; an empty one if there is none. One that does
        not parse is set aside (renamed), with a warning, and slots start
        above any it might have named, so no inode number the kernel still
        holds can mean another layer."""
        try:
            doc = json.loads(path.read_text())
            slots = {(str(name), str(generation)): int(slot) for name, generation, slot in doc["copies"]}
            next_slot = int(doc["next"])
            if not 1 <= next_slot <= MAX_SLOT or any(not 1 <= s < next_slot for s in slots.values()):
                raise ValueError("slot out of range")
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = path.with_name(path.name + ".bad")
            log.warning("layer slot table unreadable; set aside", path=str(path), error=repr(exc), aside=str(aside))
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            return cls(path, next_slot=1 << 30)
        return cls(path, slots, next_slot)

    def get(self, name: str, generation: str) -> int | None:
        return self.slots.get((name, generation))

    def assign(self, name: str, generation: str) -> int:
        """The copy's slot, a new one (written down before it is used) if it has none."""
        slot = self.slots.get((name, generation))
        if slot is None:
            if self.next_slot > MAX_SLOT:
                raise OSError("no layer slot left")
            slot = self.slots[(name, generation)] = self.next_slot
            self.next_slot += 1
            self.save()
        return slot

    def drop(self, name: str, generation: str) -> None:
        if self.slots.pop((name, generation), None) is not None:
            self.save()

    def copies(self) -> Iterator[tuple[str, str, int]]:
        for (name, generation), slot in list(self.slots.items()):
            yield name, generation, slot

    def save(self) -> None:
        doc = {"next": self.next_slot, "copies": [[n, g, s] for (n, g), s in sorted(self.slots.items())]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".slots-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
