"""Snapshot metadata in LMDB.

Every change is one LMDB write transaction, so a kill -9 at any moment leaves
either the old or the new state on disk, never a mix. Three sub-databases:

- `snapshots`: key -> Snapshot record (JSON)
- `children`:  parent key + NUL + child key -> b"" (answers "has children?"
               without a scan)
- `meta`:      `next-id` -> the next directory id (ids are never reused, so a
               half-deleted directory can never be mistaken for a new one)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from snapshotter.errors import FailedPrecondition
from snapshotter.model import Snapshot

_NEXT_ID = b"next-id"


class Txn:
    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
        self._txn = txn
        self._snapshots = dbs["snapshots"]
        self._children = dbs["children"]
        self._meta = dbs["meta"]

    def get(self, key: str) -> Snapshot | None:
        data = self._txn.get(key.encode(), db=self._snapshots)
        return Snapshot.from_bytes(bytes(data)) if data is not None else None

    def put(self, snap: Snapshot) -> None:
        self._txn.put(snap.key.encode(), snap.to_bytes(), db=self._snapshots)
        if snap.parent:
            self._txn.put(_child_key(snap.parent, snap.key), b"", db=self._children)

    def delete(self, snap: Snapshot) -> None:
        self._txn.delete(snap.key.encode(), db=self._snapshots)
        if snap.parent:
            self._txn.delete(_child_key(snap.parent, snap.key), db=self._children)

    def children(self, key: str) -> list[str]:
        prefix = key.encode() + b"\x00"
        out: list[str] = []
        cursor = self._txn.cursor(db=self._children)
        if cursor.set_range(prefix):
            for raw in cursor.iternext(keys=True, values=False):
                child_key = bytes(raw)
                if not child_key.startswith(prefix):
                    break
                out.append(child_key[len(prefix) :].decode())
        return out

    def all(self) -> Iterator[Snapshot]:
        cursor = self._txn.cursor(db=self._snapshots)
        for _, data in cursor:
            yield Snapshot.from_bytes(bytes(data))

    def ancestors(self, snap: Snapshot) -> list[Snapshot]:
        """The parent chain, nearest first."""
        chain: list[Snapshot] = []
        parent_key = snap.parent
        while parent_key:
            parent = self.get(parent_key)
            if parent is None:
                raise RuntimeError(f"metadata store is inconsistent: {snap.key!r} has missing ancestor {parent_key!r}")
            chain.append(parent)
            parent_key = parent.parent
        return chain

    def allocate_id(self) -> int:
        raw = self._txn.get(_NEXT_ID, db=self._meta)
        next_id = int(raw) if raw else 1
        self._txn.put(_NEXT_ID, str(next_id + 1).encode(), db=self._meta)
        return next_id


def _child_key(parent: str, child: str) -> bytes:
    return parent.encode() + b"\x00" + child.encode()


class MetadataStore:
    def __init__(self, path: Path, map_size: int = 1 << 30) -> None:
        self.path = path
        self.map_size = map_size
        path.mkdir(parents=True, exist_ok=True)
        # sync/metasync stay on: durability across kill -9 and power loss is the point.
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=4)
        self._dbs = {name: self._env.open_db(name.encode()) for name in ("snapshots", "children", "meta")}

    @contextmanager
    def read(self) -> Iterator[Txn]:
        with self._env.begin(write=False) as txn:
            yield Txn(txn, self._dbs)

    @contextmanager
    def write(self) -> Iterator[Txn]:
        """Commits when the block ends normally, aborts when it raises.

        A full disk is an OSError like any other (so the caller is told what to
        do about it), and a full map is said in words."""
        try:
            with self._env.begin(write=True) as txn:
                yield Txn(txn, self._dbs)
        except lmdb.DiskError as exc:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path)) from exc
        except lmdb.MapFullError as exc:
            raise FailedPrecondition(
                f"the metadata store {self.path} has reached its size limit of {self.map_size} bytes; "
                "remove unused images and containers so that their snapshots go, then try again"
            ) from exc

    def close(self) -> None:
        self._env.close()
