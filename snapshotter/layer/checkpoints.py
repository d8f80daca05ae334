"""Gzip checkpoints: where inflating can resume in the middle of a layer.

The layer index carries indexed_gzip's exported index (format "GZIDX"
version 1: sizes, then per point its compressed and uncompressed offsets,
its bit offset and whether a 32 KiB window of preceding output follows,
then the windows). This module reads that format and makes each checkpoint
usable by a plain raw-deflate decompressor, which can take the window as a
preset dictionary but has no way to start mid-byte.

A checkpoint that starts `bits` bits before its byte boundary gets a
prefix: one empty dynamic-Huffman deflate block whose length is chosen so
that the stream's own bits land exactly where they lie in the blob. The
stream keeps its original byte alignment, which stored blocks depend on, so
the decompressor sees the same bits in the same places as zlib after an
inflatePrime.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"GZIDX"
_HEADER = struct.Struct("<5sBBQQIII")
_POINT = struct.Struct("<QQBB")
# A checkpoint per block of the largest layer index (a 1 TiB layer in 1 MiB
# spans) and one at the end: a header may claim billions, each costing memory
# before the data runs out.
MAX_POINTS = (1 << 20) + 1
# Deflate looks back at most 32 KiB, and zran keeps exactly that.
MAX_WINDOW = 32 << 10

# Order in which a dynamic block lists its code-length code lengths (RFC 1951 3.2.7).
_CLEN_ORDER = (16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15)


class CheckpointFormatError(ValueError):
    """The checkpoint data is not an indexed_gzip index this reader knows."""


@dataclass(frozen=True)
class Checkpoint:
    compressed: int  # first whole byte of compressed data after the point
    uncompressed: int
    bits: int  # 1-7: the stream starts that many bits before `compressed`
    window: bytes | None  # the 32 KiB of output before the point; None at a member start


def parse(data: bytes) -> list[Checkpoint]:
    try:
        magic, version, _flags, _csize, _usize, _spacing, window_size, npoints = _HEADER.unpack_from(data, 0)
    except struct.error:
        raise CheckpointFormatError("checkpoint data is truncated") from None
    if magic != MAGIC or version != 1:
        raise CheckpointFormatError(f"checkpoint data is not a GZIDX v1 index ({magic!r}, version {version})")
    if npoints > MAX_POINTS or window_size > MAX_WINDOW:
        raise CheckpointFormatError(f"{npoints} checkpoints of {window_size}-byte windows is more than an index holds")
    offset = _HEADER.size
    heads = []
    for _ in range(npoints):
        try:
            heads.append(_POINT.unpack_from(data, offset))
        except struct.error:
            raise CheckpointFormatError("checkpoint data is truncated") from None
        offset += _POINT.size
    points = []
    for compressed, uncompressed, bits, has_window in heads:
        window = None
        if has_window:
            window = data[offset : offset + window_size]
            if len(window) != window_size:
                raise CheckpointFormatError("checkpoint window is truncated")
            offset += window_size
        if bits > 7:
            raise CheckpointFormatError(f"checkpoint at {uncompressed} has bit offset {bits}")
        points.append(Checkpoint(compressed, uncompressed, bits, window))
    if offset != len(data):
        raise CheckpointFormatError(f"{len(data) - offset} unexpected bytes after the checkpoints")
    return points


def _raw_points(data: bytes) -> tuple[tuple[int, ...], list[tuple[tuple[int, int, int, int], bytes]]]:
    """An index's header fields and, per checkpoint, its packed fields and
    window (b"" where it has none), as stored: for rewriting an index this
    module's own builder made (parse validates; this does not)."""
    header = _HEADER.unpack_from(data, 0)
    window_size, npoints = header[-2], header[-1]
    offset = _HEADER.size + npoints * _POINT.size
    points = []
    for i in range(npoints):
        head = _POINT.unpack_from(data, _HEADER.size + i * _POINT.size)
        window = b""
        if head[3]:
            window = data[offset : offset + window_size]
            offset += window_size
        points.append((head, window))
    return header, points


def _pack(header: tuple[int, ...], points: list[tuple[tuple[int, int, int, int], bytes]]) -> bytes:
    packed = _HEADER.pack(*header[:-1], len(points))
    return packed + b"".join(_POINT.pack(*head) for head, _ in points) + b"".join(w for _, w in points)


def without(data: bytes, dropped: set[tuple[int, int]]) -> bytes:
    """The same index without the checkpoints at the (uncompressed,
    compressed) offsets in `dropped`, and their windows."""
    header, points = _raw_points(data)
    return _pack(header, [(head, window) for head, window in points if (head[1], head[0]) not in dropped])


def with_windows(data: bytes, windows: dict[int, bytes]) -> bytes:
    """The same index with the windows of the checkpoints at the
    uncompressed offsets in `windows` replaced (each the same size)."""
    header, points = _raw_points(data)
    replaced = []
    for head, old in points:
        new = windows.get(head[1], old) if head[3] else old
        if len(new) != len(old):
            raise ValueError(f"a {len(new)}-byte window for a {len(old)}-byte checkpoint")
        replaced.append((head, new))
    return _pack(header, replaced)


class _BitWriter:
    """Deflate's bit order: fields least significant bit first, Huffman
    codes most significant bit first."""

    def __init__(self) -> None:
        self.value = 0
        self.nbits = 0

    def field(self, value: int, nbits: int) -> None:
        self.value |= value << self.nbits
        self.nbits += nbits

    def code(self, code: int, nbits: int) -> None:
        for shift in range(nbits - 1, -1, -1):
            self.field((code >> shift) & 1, 1)


def _empty_block(residue: int) -> _BitWriter:
    """A non-final dynamic-Huffman block with no output whose length in bits
    is `residue` modulo 8.

    Its literal/length code has two symbols (literal 0 and end-of-block) and
    its distance code two, all of length 1: complete codes, which every
    inflater accepts. Their lengths are sent with a code-length code over
    {0, 1, 17, 18}, 2 bits each; the 255 zero lengths between the two
    literal symbols are spelled with two 18s, perhaps a 17 and a few single
    0s, and that choice sets the block's length modulo 8.
    """
    for use17 in (False, True):
        for singles in range(4):
            out = _BitWriter()
            out.field(0, 1)  # BFINAL
            out.field(2, 2)  # BTYPE: dynamic Huffman
            out.field(0, 5)  # HLIT: 257 literal/length codes
            out.field(1, 5)  # HDIST: 2 distance codes
            out.field(len(_CLEN_ORDER) - 1 - 4, 4)  # HCLEN: up to symbol 1
            lengths = {0: 2, 1: 2, 17: 2, 18: 2}
            for symbol in _CLEN_ORDER[:-1]:
                out.field(lengths.get(symbol, 0), 3)
            # Canonical codes of the code-length code: 0, 1, 17, 18 -> 00, 01, 10, 11.
            clen_code = {0: 0b00, 1: 0b01, 17: 0b10, 18: 0b11}
            out.code(clen_code[1], 2)  # literal 0: length 1
            zeros = 255 - (3 if use17 else 0) - singles
            out.code(clen_code[18], 2)
            out.field(138 - 11, 7)
            out.code(clen_code[18], 2)
            out.field(zeros - 138 - 11, 7)
            if use17:
                out.code(clen_code[17], 2)
                out.field(0, 3)  # 3 zeros
            for _ in range(singles):
                out.code(clen_code[0], 2)
            for _ in range(3):  # end-of-block, distance 0, distance 1: length 1
                out.code(clen_code[1], 2)
            out.code(1, 1)  # end-of-block: literal 0 is code 0, 256 is code 1
            if out.nbits % 8 == residue:
                return out
    raise AssertionError(f"no empty block of {residue} bits modulo 8")


def raw_stream(point: Checkpoint, data: bytes | memoryview) -> bytes | memoryview:
    """The raw-deflate stream from `point` on, given the blob's bytes from
    the byte before `point.compressed` (the block's range in the index)."""
    if point.bits == 0:
        return data[1:]
    prefix = _empty_block((8 - point.bits) % 8)
    # The block's last partial byte holds 8 - bits bits; the stream's first
    # `bits` bits are the top bits of the blob's byte before the point.
    keep = (0xFF << (8 - point.bits)) & 0xFF
    head = prefix.value | ((data[0] & keep) << (prefix.nbits - (8 - point.bits)))
    return head.to_bytes((prefix.nbits + point.bits) // 8, "little") + data[1:]
