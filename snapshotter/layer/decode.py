"""Turn one block's compressed bytes into its uncompressed bytes, after
checking them against the index's digest.

Blocks inflate with ISA-L from their checkpoint (see checkpoints.py), which
releases the GIL, so blocks of one layer decode in parallel. A block that
path cannot finish goes through indexed_gzip's own reader instead, one at a
time. Either way the
output's length must match the index, and its last 32 KiB the next
checkpoint's window wherever that window keeps a byte (windows.py).
"""

from __future__ import annotations

import io
import threading
from typing import TYPE_CHECKING, Any

import indexed_gzip
from isal import isal_zlib

from snapshotter.layer import checkpoints, parts, windows
from snapshotter.layer.index import Compression, LayerIndex
from snapshotter.layer.parts import Reach

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


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
        self.data: bytes | memoryview = b""
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

    def readinto(self, buffer: WriteableBuffer) -> int:
        lo = self.pos - self.start
        if lo < 0:
            raise OSError(f"read at {self.pos} before the fetched block range at {self.start}")
        view = memoryview(buffer).cast("B")
        chunk = self.data[lo : lo + len(view)]
        view[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


class BlockDecoder:
    """One per layer; decode() is thread-safe."""

    def __init__(self, index: LayerIndex) -> None:
        self.index = index
        self._points = index.checkpoints_by_offset
        self._lock = threading.Lock()
        self._window = _BlockWindow(index.compressed_size)
        self._gzip: indexed_gzip.IndexedGzipFile | None = None

    def verify(self, number: int, data: bytes | memoryview) -> None:
        self._check(number, data, parts.block_digest(data, self.index.part))

    def _check(self, number: int, data: bytes | memoryview, digest: str) -> None:
        """`data`, whose digest is `digest`, is block `number`."""
        block = self.index.blocks[number]
        if len(data) != block.cend - block.cstart:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest}: got {len(data)} bytes, "
                f"expected {block.cend - block.cstart}"
            )
        if digest != block.digest:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest}: digest {digest} does not match "
                f"the index ({block.digest})"
            )

    def decode(self, number: int, data: bytes | memoryview) -> bytes:
        """Verify, then decompress block `number` from its compressed bytes."""
        self.verify(number, data)
        return self._decompress(number, data, None)

    def decode_reach(self, number: int, data: bytes | memoryview) -> tuple[bytes, Reach | None]:
        """decode(), and how far the block's first parts take it (what a
        hot-block recording needs to fetch it only up to a byte): its links
        are the ones its check hashes. None where that is not known (an
        index without parts, a block only indexed_gzip inflates)."""
        if not self.index.part:
            return self.decode(number, data), None
        chain = parts.links(data, self.index.part)
        self._check(number, data, chain[0].hex())
        outputs: list[int] = []
        out = self._decompress(number, data, outputs)
        return out, Reach(tuple(outputs), tuple(chain)) if outputs else None

    def _decompress(self, number: int, data: bytes | memoryview, reach: list[int] | None) -> bytes:
        """Block `number` from its checked bytes; `reach`, if given, filled
        with the output bytes its first 1, 2, ... parts give, or left empty."""
        block = self.index.blocks[number]
        want = block.uend - block.ustart
        if self.index.compression != Compression.GZIP:
            if reach is not None:
                reach.extend(min((i + 1) * self.index.part, want) for i in range(parts.count(want, self.index.part)))
            return bytes(data)
        out = self._inflate(number, data, want, reach)
        if out is None or len(out) != want:
            if reach:
                reach.clear()
            out = self._inflate_with_zran(number, data, want)
        if len(out) != want:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest} decompressed to {len(out)} bytes, expected {want}"
            )
        following = self._points.get(block.uend)
        if (
            following is not None
            and following.window is not None
            and want >= len(following.window)
            and not windows.tail_matches(following.window, memoryview(out)[len(out) - len(following.window) :])
        ):
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest} decompressed to bytes the next checkpoint disowns"
            )
        return out

    def decode_prefix(self, number: int, data: bytes | memoryview, link: bytes) -> bytes:
        """Verify the first parts of block `number` (`data`, whole parts)
        against its digest with the `link` after them (parts.py), then
        decompress them: the block's first bytes, as many as those parts
        give."""
        block = self.index.blocks[number]
        part = self.index.part
        if not part or not 0 < len(data) < block.cend - block.cstart or len(data) % part:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest}: {len(data)} bytes are not its first parts"
            )
        try:
            digest = parts.chain_digest(data, part, link)
        except ValueError as exc:
            raise BlockVerificationError(f"block {number} of {self.index.layer_digest}: {exc}") from None
        if digest != block.digest:
            raise BlockVerificationError(
                f"block {number} of {self.index.layer_digest}: its first {len(data)} bytes do not match the index"
            )
        want = block.uend - block.ustart
        if self.index.compression != Compression.GZIP:
            return bytes(data)
        out = self._inflate(number, data, want)
        if not out:
            raise BlockVerificationError(
                f"the first parts of block {number} of {self.index.layer_digest} do not inflate"
            )
        return out

    def _inflate(
        self, number: int, data: bytes | memoryview, want: int, reach: list[int] | None = None
    ) -> bytes | None:
        """The block's output through ISA-L, at most `want` bytes (all of
        them if `data` is the whole block); None if this path cannot make
        it. `reach`: see decode."""
        point = self._points.get(self.index.blocks[number].ustart)
        if point is None:
            return None
        try:
            if self.index.blocks[number].cstart == 0:
                # The layer's first block: the gzip header and all.
                inflater = isal_zlib.decompressobj(31)
                stream = data
            else:
                # No window: a later gzip member's deflate data starts here.
                zdict = {"zdict": point.window} if point.window is not None else {}
                inflater = isal_zlib.decompressobj(-15, **zdict)
                stream = checkpoints.raw_stream(point, data)
            if reach is None:
                out: bytes = inflater.decompress(stream, want)
                return out
            return self._inflate_in_parts(inflater, stream, len(stream) - len(data), want, reach)
        # isal's stub declares `error` as an instance, not the class it is.
        except isal_zlib.error:  # type: ignore[misc]
            return None

    def _inflate_in_parts(
        self, inflater: Any, stream: bytes | memoryview, shift: int, want: int, reach: list[int]
    ) -> bytes:
        """Inflate `stream` a part of the block at a time (the stream's
        bytes sit `shift` after the block's), noting the output after each."""
        part = self.index.part
        pieces: list[bytes] = []
        total = 0
        edges = [i * part + shift for i in range(1, parts.count(len(stream) - shift, part))]
        for lo, hi in zip([0, *edges], [*edges, len(stream)], strict=True):
            piece = inflater.decompress(stream[lo:hi], want - total)
            pieces.append(piece)
            total += len(piece)
            reach.append(total)
            if total == want:
                break
        return b"".join(pieces)

    def _inflate_with_zran(self, number: int, data: bytes | memoryview, want: int) -> bytes:
        block = self.index.blocks[number]
        with self._lock:
            if self._gzip is None:
                self._gzip = indexed_gzip.IndexedGzipFile(fileobj=self._window, readbuf_size=1 << 16)
                self._gzip.import_index(fileobj=io.BytesIO(self.index.checkpoints))
            self._window.start, self._window.data = block.cstart, data
            try:
                self._gzip.seek(block.ustart)
                out: bytes = self._gzip.read(want)
                return out
            except Exception as exc:
                raise BlockVerificationError(
                    f"block {number} of {self.index.layer_digest} does not decompress: {exc}"
                ) from None
            finally:
                self._window.data = b""

    def close(self) -> None:
        if self._gzip is not None:
            self._gzip.close()
