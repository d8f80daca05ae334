"""The LMDB block index: (layer copy, block number) -> the block's state,
the crc32 of its uncompressed bytes, where it lies in the cache file and
when it was last read. The cache file is the uncompressed layer, sparse.
Blocks are recorded once written in full, without waiting for the disk; the
crc lets a restarted server check each block on its first read, so a block
lost in a power cut is fetched again rather than served as zeros.

The place and the last read let the cache be bounded without loading any
layer: eviction punches a block's range out of its cache file from the
record alone, and a restarted server orders blocks by when they were read.
A record is deleted before its bytes are punched out, in the same step
(eviction.py): a block is never recorded after its bytes are gone.

Records of blocks landing together are committed together (group commit):
every LMDB commit is a sync, which on a filesystem busy with the cache
files' writes takes milliseconds, and a prefetch lands blocks from several
threads at once. Each put still returns only once its record is committed."""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb

# offset, size, last read (unix seconds), state, crc.
_RECORD = struct.Struct(">QQQBI")
# State and crc alone (records of earlier versions; those before them lead
# with five offsets of their own): always the tail of a record.
_TAIL = struct.Struct(">BI")
_NUMBER = struct.Struct(">I")


class BlockIndexError(Exception):
    """A record could not be written (the disk is full, say)."""


class BlockState(enum.IntEnum):
    CACHED = 1


@dataclass(frozen=True)
class BlockRecord:
    state: BlockState
    crc32: int
    # Where the block's uncompressed bytes lie in the cache file; size 0 in
    # records of earlier versions (eviction.py reads them from the layer index).
    offset: int = 0
    size: int = 0
    # Unix seconds of the block's last read as the index knows it (written
    # when cached, refreshed now and then): eviction's order after a restart.
    used_at: int = 0


def _key(layer: str, number: int) -> bytes:
    return bytes.fromhex(layer) + _NUMBER.pack(number)


def _encode(record: BlockRecord) -> bytes:
    return _RECORD.pack(record.offset, record.size, record.used_at, record.state, record.crc32)


def _decode(value: bytes) -> BlockRecord:
    state, crc = _TAIL.unpack(value[-_TAIL.size :])
    if len(value) == _RECORD.size:
        offset, size, used_at, _, _ = _RECORD.unpack(value)
        return BlockRecord(BlockState(state), crc, offset, size, used_at)
    return BlockRecord(BlockState(state), crc)


@dataclass
class _Put:
    key: bytes
    value: bytes
    committed: bool = False
    error: lmdb.Error | None = None


class BlockIndex:
    def __init__(self, path: Path, map_size: int = 1 << 32) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=1)
        # Puts waiting for a commit, and the one thread committing at a time.
        self._pending: list[_Put] = []
        self._pending_lock = threading.Lock()
        self._commit_lock = threading.Lock()

    def put(self, layer: str, number: int, record: BlockRecord) -> None:
        """Record a block; returns once the record is committed. Whoever gets
        the commit turn commits every put waiting by then, in one transaction."""
        put = _Put(_key(layer, number), _encode(record))
        with self._pending_lock:
            self._pending.append(put)
        with self._commit_lock:
            if not put.committed:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                error = None
                try:
                    with self._env.begin(write=True) as txn:
                        for item in batch:
                            txn.put(item.key, item.value)
                except lmdb.Error as exc:
                    error = exc
                for item in batch:
                    item.committed, item.error = True, error
        if put.error is not None:
            raise BlockIndexError(f"block {number} of {layer} not recorded: {put.error}") from put.error

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
                    (number,) = _NUMBER.unpack(key[len(prefix) :])
                    out[number] = _decode(value)
        return out

    def records(self) -> Iterator[tuple[str, int, BlockRecord]]:
        """Every record: (layer copy, block number, record), copy by copy."""
        with self._env.begin() as txn:
            for key, value in txn.cursor():
                (number,) = _NUMBER.unpack(key[-_NUMBER.size :])
                yield key[: -_NUMBER.size].hex(), number, _decode(value)

    def delete(self, layer: str, numbers: Iterable[int]) -> None:
        """Forget blocks of a layer copy, in one transaction (before their
        bytes are punched out of the cache file)."""
        try:
            with self._env.begin(write=True) as txn:
                for number in numbers:
                    txn.delete(_key(layer, number))
        except lmdb.Error as exc:
            raise BlockIndexError(f"blocks of {layer} not forgotten: {exc}") from exc

    def rewrite(self, records: Iterable[tuple[str, int, BlockRecord]]) -> None:
        """Write records again (a later last read, a size learnt), in one
        transaction; a record deleted meanwhile (evicted, pruned) stays deleted."""
        try:
            with self._env.begin(write=True) as txn:
                for layer, number, record in records:
                    key = _key(layer, number)
                    if txn.get(key) is not None:
                        txn.put(key, _encode(record))
        except lmdb.Error as exc:
            raise BlockIndexError(f"block records not rewritten: {exc}") from exc

    def touch(self, blocks: Iterable[tuple[str, int]], used_at: int) -> None:
        """Record `used_at` as the last read of `blocks` (layer copy, number),
        in one transaction; a record deleted meanwhile stays deleted."""
        try:
            with self._env.begin(write=True) as txn:
                for layer, number in blocks:
                    key = _key(layer, number)
                    value = txn.get(key)
                    if value is None or len(value) != _RECORD.size:
                        continue
                    offset, size, _, state, crc = _RECORD.unpack(value)
                    txn.put(key, _RECORD.pack(offset, size, used_at, state, crc))
        except lmdb.Error as exc:
            raise BlockIndexError(f"last reads not recorded: {exc}") from exc

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
