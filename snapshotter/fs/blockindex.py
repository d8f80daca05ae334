"""The LMDB block index: (layer, block number) -> where the block lives in
the compressed blob, in the uncompressed stream and in the local cache file,
its state and the crc32 of its uncompressed bytes. Blocks are recorded once
written, without waiting for the disk; the crc lets a restarted server check
each block on its first read, so a block lost in a power cut is fetched
again rather than served as zeros."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from pathlib import Path

import lmdb

_RECORD = struct.Struct(">QQQQQBI")


class BlockState(enum.IntEnum):
    CACHED = 1


@dataclass(frozen=True)
class BlockRecord:
    cstart: int
    cend: int
    ustart: int
    uend: int
    cache_offset: int
    state: BlockState
    crc32: int


def _key(layer: str, number: int) -> bytes:
    return bytes.fromhex(layer) + struct.pack(">I", number)


class BlockIndex:
    def __init__(self, path: Path, map_size: int = 1 << 32) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=1)

    def put(self, layer: str, number: int, record: BlockRecord) -> None:
        value = _RECORD.pack(
            record.cstart,
            record.cend,
            record.ustart,
            record.uend,
            record.cache_offset,
            record.state,
            record.crc32,
        )
        with self._env.begin(write=True) as txn:
            txn.put(_key(layer, number), value)

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
                    cstart, cend, ustart, uend, offset, state, crc = _RECORD.unpack(value)
                    out[number] = BlockRecord(cstart, cend, ustart, uend, offset, BlockState(state), crc)
        return out

    def drop_layer(self, layer: str) -> None:
        prefix = bytes.fromhex(layer)
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                while cursor.key().startswith(prefix):
                    if not cursor.delete():
                        break

    def close(self) -> None:
        self._env.close()
