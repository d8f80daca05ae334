"""The LMDB block index: (layer copy, block number) -> the block's state and
the crc32 of its uncompressed bytes. Where a block lives (in the compressed
blob, the uncompressed stream, the cache file) follows from the layer index:
the cache file is the uncompressed layer, sparse. Blocks are recorded once
written in full, without waiting for the disk; the crc lets a restarted
server check each block on its first read, so a block lost in a power cut is
fetched again rather than served as zeros."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from pathlib import Path

import lmdb

_RECORD = struct.Struct(">BI")


class BlockIndexError(Exception):
    """A record could not be written (the disk is full, say)."""


class BlockState(enum.IntEnum):
    CACHED = 1


@dataclass(frozen=True)
class BlockRecord:
    state: BlockState
    crc32: int


def _key(layer: str, number: int) -> bytes:
    return bytes.fromhex(layer) + struct.pack(">I", number)


class BlockIndex:
    def __init__(self, path: Path, map_size: int = 1 << 32) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=1)

    def put(self, layer: str, number: int, record: BlockRecord) -> None:
        value = _RECORD.pack(record.state, record.crc32)
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_key(layer, number), value)
        except lmdb.Error as exc:
            raise BlockIndexError(f"block {number} of {layer} not recorded: {exc}") from exc

    def cached(self, layer: str) -> dict[int, BlockRecord]:
        """Every cached block of `layer`, by number."""
        prefix = bytes.fromhex(layer)
        out: dict[int, BlockRecord] = {}
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    (number,) = struct.unpack(">I", key[len(prefix) :])
                    # Records of earlier versions lead with five offsets:
                    # state and crc are always the tail.
                    state, crc = _RECORD.unpack(value[-_RECORD.size :])
                    out[number] = BlockRecord(BlockState(state), crc)
        return out

    def drop_layer(self, layer: str) -> None:
        """Forget every block of a layer copy (a pruned layer's records)."""
        prefix = bytes.fromhex(layer)
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                while cursor.key().startswith(prefix):
                    if not cursor.delete():
                        break

    def close(self) -> None:
        self._env.close()
