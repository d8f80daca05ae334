"""Optional local disk cache of stripes, shared by every reader of a host.

A stripe's key names the file, its version and the stripe geometry, so a
changed remote file never hits an old entry. Each entry carries its length
and CRC32 and is checked on every hit: a torn or corrupted entry is dropped
and fetched again, never served. Entries are written to a temporary name and
renamed, so readers and other processes see whole entries or none. The
least recently used entries go first once the cache outgrows its size.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from pathlib import Path

import structlog

log = structlog.get_logger("bootseer.hdfs_fuse.cache")

_HEADER = struct.Struct("<8sQI")
_MAGIC = b"BSSTRIP1"
# Evict down to this fraction of the limit, so eviction runs once per many puts.
_LOW_WATER = 0.9


def stripe_key(uri: str, version: str, stripe_size: int, index: int) -> str:
    return hashlib.sha256(f"{uri}\0{version}\0{stripe_size}\0{index}".encode()).hexdigest()


class DiskCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._used = sum(p.stat().st_size for p in self._entries())

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def _entries(self) -> list[Path]:
        return [p for p in self.root.glob("??/*") if not p.name.endswith(".tmp")]

    def get(self, key: str, length: int) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        if len(blob) == _HEADER.size + length:
            magic, stored_len, crc = _HEADER.unpack_from(blob)
            data = blob[_HEADER.size :]
            if magic == _MAGIC and stored_len == length and zlib.crc32(data) == crc:
                os.utime(path)
                return data
        log.warning("dropping corrupt cache entry", path=str(path))
        self._remove(path)
        return None

    def put(self, key: str, data: bytes | bytearray) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, len(data), zlib.crc32(data)))
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            self._used += _HEADER.size + len(data)
            over = self._used > self.max_bytes
        if over:
            self._evict()

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._used -= size

    def _evict(self) -> None:
        aged = []
        for path in self._entries():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            aged.append((st.st_mtime, st.st_size, path))
        aged.sort()
        with self._lock:
            self._used = sum(size for _, size, _ in aged)
        target = self.max_bytes * _LOW_WATER
        for _, _, path in aged:
            if self._used <= target:
                break
            self._remove(path)
