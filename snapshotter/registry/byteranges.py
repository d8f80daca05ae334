"""A multipart/byteranges body (RFC 9110 14.6), parsed as it streams in.

The answer to a Range request that names several ranges: one part per range
(or per group of ranges the server coalesced), each with a Content-Range
header, between boundary delimiters. Each part's length comes from its
Content-Range, so a part's bytes are counted out rather than searched for a
boundary, and a part whose bytes do not end at a delimiter is refused.

Pure (no I/O): the registry client feeds it what the socket brings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# A part's headers are a few short lines (Content-Type, Content-Range).
MAX_HEADER_BYTES = 8 << 10

_CONTENT_RANGE = re.compile(
    rb"^content-range:[ \t]*bytes[ \t]+(\d{1,19})-(\d{1,19})/(?:\d{1,19}|\*)[ \t]*\r?$", re.I | re.M
)
_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^";\s]{1,70}))', re.I)


class MalformedByteRanges(ValueError):
    """The body is not a well-formed multipart/byteranges body."""


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a multipart/byteranges Content-Type, None for any other type."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/byteranges":
        return None
    found = _BOUNDARY.search(params)
    if found is None:
        return None
    return (found.group(1) or found.group(2)).encode("latin-1")


class ByteRangesParser:
    """Feed it the body's bytes in any pieces; it yields (blob offset, bytes)
    for the parts' contents, in the order they arrive."""

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"--" + boundary
        self._buffer = bytearray()
        self._offset = 0  # the blob offset of the next part byte
        self._left = 0  # bytes of the current part still to come
        self._state = "first"
        self.finished = False  # the closing delimiter was read

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        if self.finished:
            return
        if self._state == "body" and not self._buffer:
            # The common case: a piece of a part, passed on without copying.
            take = min(self._left, len(data))
            if take:
                yield self._take(data if take == len(data) else data[:take])
            data = data[take:]
            if not data:
                return
        self._buffer += data
        while True:
            if self._state == "body":
                if not self._buffer:
                    return
                take = min(self._left, len(self._buffer))
                if take:
                    piece = bytes(self._buffer[:take])
                    del self._buffer[:take]
                    yield self._take(piece)
                    continue
                self._state = "delimiter"
            if not self._step():
                return

    def _take(self, piece: bytes) -> tuple[int, bytes]:
        at = self._offset
        self._offset += len(piece)
        self._left -= len(piece)
        if not self._left:
            self._state = "delimiter"
        return at, piece

    def _step(self) -> bool:
        """Advance past a delimiter or a part's headers; False until more bytes are needed."""
        buffer = self._buffer
        if self._state == "first":
            # Some servers send a CRLF before the first delimiter.
            while buffer.startswith(b"\r\n"):
                del buffer[:2]
            if buffer == b"\r":
                return False
            return self._after_delimiter(0)
        if self._state == "delimiter":
            if len(buffer) < 2:
                return False
            if not buffer.startswith(b"\r\n"):
                raise MalformedByteRanges("a part does not end where its Content-Range says")
            return self._after_delimiter(2)
        # Headers: up to the blank line.
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEADER_BYTES:
                raise MalformedByteRanges(f"a part's headers exceed {MAX_HEADER_BYTES} bytes")
            return False
        found = _CONTENT_RANGE.search(bytes(buffer[:end]))
        if found is None:
            raise MalformedByteRanges("a part has no Content-Range")
        first, last = int(found.group(1)), int(found.group(2))
        if last < first:
            raise MalformedByteRanges(f"a part's Content-Range {first}-{last} is empty")
        del buffer[: end + 4]
        self._offset, self._left, self._state = first, last - first + 1, "body"
        return True

    def _after_delimiter(self, at: int) -> bool:
        """At `at` in the buffer a delimiter is due: then either the closing
        "--" (the end) or the line end before the next part's headers."""
        buffer, delimiter = self._buffer, self._delimiter
        if not delimiter.startswith(bytes(buffer[at : at + len(delimiter)])):
            raise MalformedByteRanges("expected a boundary delimiter")
        need = at + len(delimiter) + 2
        if len(buffer) < need:
            return False
        tail = bytes(buffer[at + len(delimiter) : need])
        if tail == b"--":
            self.finished = True
            buffer.clear()
            return False
        if tail != b"\r\n":
            raise MalformedByteRanges("a boundary delimiter is not followed by a line end")
        del buffer[:need]
        self._state = "headers"
        return True
