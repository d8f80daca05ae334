"""Turn one block's compressed bytes into its uncompressed bytes, after
checking them against the index's digest."""

from __future__ import annotations

import hashlib
import io
import threading

import indexed_gzip

from snapshotter.layer.index import Compression, LayerIndex


class BlockVerificationError(Exception):
    """The bytes fetched for a block are not the ones the index describes."""


class _BlockWindow(io.RawIOBase):
    """A file whose only readable bytes are one block's compressed range.

    zran reads from the block's checkpoint onwards and stops once it has the
    block's output; a read past the range gets end-of-file, which cannot
    produce wrong output because the output length is checked.
    """

    def __init__(self, size: int) -> None:
        # zran checks the imported index against the file's size.
        self.size = size
        self.start = 0
        self.data = b""
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self.pos = offset
        elif whence == io.SEEK_CUR:
            self.pos += offset
        else:
            self.pos = self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        lo = self.pos - self.start
        if lo < 0:
            raise OSError(f"read at {self.pos} before the fetched block range at {self.start}")
        chunk = self.data[lo : lo + len(buffer)]
        buffer[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


class BlockDecoder:
    """One per layer; decode() is thread-safe (one block at a time per layer)."""

    def __init__(self, index: LayerIndex) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._window = _BlockWindow(index.compressed_size)
        self._gzip: indexed_gzip.IndexedGzipFile | None = None
        if index.compression == Compression.GZIP:
            self._gzip = indexed_gzip.IndexedGzipFile(fileobj=self._window, readbuf_size=1 << 16)
            self._gzip.import_index(fileobj=io.BytesIO(index.checkpoints))

    def verify(self, number: int, data: bytes) -> None:
        block = self.index.blocks[number]
        if len(data) != block.cend - block.cstart:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest}: got {len(data)} bytes, "
                f"expected {block.cend - block.cstart}"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != block.digest:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest}: sha256 {digest} does not match "
                f"the index ({block.digest})"
            )

    def decode(self, number: int, data: bytes) -> bytes:
        """Verify, then decompress block `number` from its compressed bytes."""
        self.verify(number, data)
        block = self.index.blocks[number]
        if self._gzip is None:
            return data
        with self._lock:
            self._window.start, self._window.data = block.cstart, data
            try:
                self._gzip.seek(block.ustart)
                out = self._gzip.read(block.uend - block.ustart)
            except Exception as exc:
                raise BlockVerificationError(
                    f"block {number} of {self.index.layer_digest} does not decompress: {exc}"
                ) from None
            finally:
                self._window.data = b""
        if len(out) != block.uend - block.ustart:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest} decompressed to {len(out)} bytes, "
                f"expected {block.uend - block.ustart}"
            )
        return out

    def close(self) -> None:
        if self._gzip is not None:
            self._gzip.close()
