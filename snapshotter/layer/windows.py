"""Pruned checkpoint windows.

A gzip checkpoint carries the 32 KiB of output before it, because deflate's
back-references may reach that far behind the point where inflating
resumes. Only the first 32 KiB of the block's output can reach behind its
start, and in practice they refer to about a tenth of the window. A pruned
window keeps those bytes and zeroes the rest: inflating the block with it
gives the same output, and zeros compress to nothing, so an index of pruned
windows is a third or less of one with whole windows (the windows are most
of an index, and an index is fetched whole before a layer is served).

Which bytes a block refers to comes from inflating its start with marker
windows: where window byte i is i's low byte (and, in another pass, its
high byte, and the low byte's complement), every output byte copied from
the window reveals which window byte it came from, and bytes not copied from
it are the same in every pass. The pruned window is then checked by
inflating with it; one that does not give the block's own output exactly is
not used (the whole window stays).
"""

from __future__ import annotations

import itertools
import sys

from isal import isal_zlib

from snapshotter.layer.checkpoints import MAX_WINDOW

_LOW = bytes(i & 0xFF for i in range(MAX_WINDOW))
_HIGH = bytes(i >> 8 for i in range(MAX_WINDOW))
_COMPLEMENT = bytes(0xFF - (i & 0xFF) for i in range(MAX_WINDOW))
# Byte -> 0xFF where a window keeps it (nonzero), 0x00 where it does not.
_KEEP_MASK = bytes([0] + [0xFF] * 255)


def _inflate(stream: bytes | memoryview, window: bytes) -> bytes | None:
    """The first len(window) bytes of output inflating raw deflate `stream`
    with `window` behind it; None if it does not inflate."""
    try:
        out: bytes = isal_zlib.decompressobj(-15, zdict=window).decompress(stream, len(window))
    # isal's stub declares `error` as an instance, not the class it is.
    except isal_zlib.error:  # type: ignore[misc]
        return None
    return out


def prune(window: bytes, stream: bytes | memoryview) -> bytes:
    """`window` with every byte that inflating `stream` (the raw deflate
    stream from the checkpoint, to the end of its block) does not refer to
    set to zero; `window` itself where pruning cannot be shown to be exact.

    `stream` must run to the end of the block or at least 32 KiB of output
    past the point: output further on cannot reach the window."""
    if len(window) != MAX_WINDOW:
        return window
    own = _inflate(stream, window)
    low, high, complement = (_inflate(stream, marker) for marker in (_LOW, _HIGH, _COMPLEMENT))
    if own is None or low is None or high is None or complement is None:
        return window
    # An output byte copied from window byte i is i & 0xFF in one pass and
    # its complement in another: never equal. Any other byte is equal in both.
    copied = (int.from_bytes(low, "big") ^ int.from_bytes(complement, "big")).to_bytes(len(low), "big")
    # Each output byte's source in the window, low | high << 8, as native
    # 16-bit values; kept where the byte was copied from the window.
    sources = bytearray(2 * len(low))
    first, second = (low, high) if sys.byteorder == "little" else (high, low)
    sources[0::2], sources[1::2] = first, second
    kept = bytearray(MAX_WINDOW)
    for i in set(itertools.compress(memoryview(sources).cast("H"), copied)):
        if i >= MAX_WINDOW:
            return window
        kept[i] = window[i]
    pruned = bytes(kept)
    if _inflate(stream, pruned) != own:
        return window
    return pruned


def tail_matches(window: bytes, tail: bytes | memoryview) -> bool:
    """Whether a block's last output bytes agree with the next checkpoint's
    window wherever the window keeps a byte: a pruned window's zeros stand
    for bytes nothing refers to, so only its other bytes are compared (of a
    whole window, every byte that is not zero)."""
    kept = window.translate(_KEEP_MASK)
    return int.from_bytes(tail, "big") & int.from_bytes(kept, "big") == int.from_bytes(window, "big")
