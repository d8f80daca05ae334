"""Snapshot records: what the metadata store keeps for every snapshot."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field

from snapshotter.errors import InvalidArgument
from snapshotter.labels import MAX_LABEL_BYTES, label_bytes


class Kind(enum.IntEnum):
    """Values match containerd.services.snapshots.v1.Kind on the wire."""

    UNKNOWN = 0
    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3

    @property
    def filter_name(self) -> str:
        """The spelling containerd's filters and `ctr` use (`kind==committed`)."""
        return self.name.lower()


@dataclass
class Snapshot:
    """One snapshot. `id` names its directory; `key` is what containerd calls it."""

    key: str
    id: int
    kind: Kind
    parent: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    created_ns: int = 0
    updated_ns: int = 0
    # Stored at commit; active snapshots are measured when asked.
    size: int = 0
    inodes: int = 0

    def to_bytes(self) -> bytes:
        record = asdict(self)
        record["kind"] = int(self.kind)
        return json.dumps(record, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Snapshot:
        record = json.loads(data)
        record["kind"] = Kind(record["kind"])
        return cls(**record)


def validate_labels(labels: dict[str, str]) -> None:
    for key, value in labels.items():
        if not key:
            raise InvalidArgument("label key must not be empty")
        size = label_bytes(key, value)
        if size > MAX_LABEL_BYTES:
            raise InvalidArgument(
                f"label {key!r} is {size} bytes with its value; containerd allows at most {MAX_LABEL_BYTES}"
            )


def validate_key(what: str, key: str) -> None:
    if not key:
        raise InvalidArgument(f"{what} must not be empty")
    if "\x00" in key:
        raise InvalidArgument(f"{what} {key!r} contains a NUL byte")
