"""Block digests that a block's first parts can be checked against (layer
index version 4).

A block's compressed bytes are cut into parts of `part` bytes from its start
(the last one shorter). Its digest is a hash chain run back from its end:

    link[n] = sha256(part[n])                   the last part
    link[i] = sha256(part[i] || link[i + 1])
    digest  = link[1]

So the first k parts of a block check against its digest given only
link[k + 1], 32 bytes: a start that reads a block only up to some byte
fetches the parts up to it, with the link after them from its hot-block
manifest, and the parts are served only if they hash back to the index's
digest. A forged link cannot make other bytes match: that would take a
sha256 collision (every hash but the last takes a whole part and a 32-byte
link, so no two ways of cutting the same input line up). A block of one part
has the digest sha256 of its bytes, as in earlier versions.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

# The part `bootseer index` cuts blocks into. A block fetched only up to a
# byte a start needs moves on average half a part beyond it: about 3 MB over
# the benchmark images' 400 hot blocks. A 1 MiB block's check is then 20-60
# hashes instead of one, a few microseconds more.
PART_BYTES = 16 << 10
# What an index may declare: a part under a page would only add hashing.
MIN_PART_BYTES = 4 << 10
MAX_PART_BYTES = 4 << 20
LINK_BYTES = 32


def count(size: int, part: int) -> int:
    """The parts of a block of `size` compressed bytes (at least one)."""
    return max(1, -(-size // part))


def _chain(view: memoryview, part: int, n: int, after: bytes) -> list[bytes]:
    """The links of the first `n` parts of `view`, hashed back from the
    last with `after` as the link that follows it, first part's first."""
    out = [b""] * n
    for i in range(n - 1, -1, -1):
        h = hashlib.sha256(view[i * part : (i + 1) * part])
        h.update(after)
        after = out[i] = h.digest()
    return out


def links(data: bytes | memoryview, part: int) -> list[bytes]:
    """Every link of a block's chain, from its digest on: links(...)[k] is
    what its first k parts check against the digest with (k >= 1)."""
    view = memoryview(data)
    return _chain(view, part, count(len(view), part), b"")


def chain_digest(data: bytes | memoryview, part: int, after: bytes = b"") -> str:
    """The digest (hex) a block would have whose first bytes are `data` and
    whose chain goes on with link `after` (b"": `data` is the whole block).
    With a link, `data` must be whole parts."""
    view = memoryview(data)
    if after and (len(view) == 0 or len(view) % part):
        raise ValueError(f"a block's first parts are a multiple of {part} bytes, not {len(view)}")
    if after and len(after) != LINK_BYTES:
        raise ValueError(f"a link is {LINK_BYTES} bytes, not {len(after)}")
    n = len(view) // part if after else count(len(view), part)
    return _chain(view, part, n, after)[0].hex()


def valid_part(part: object) -> bool:
    return type(part) is int and MIN_PART_BYTES <= part <= MAX_PART_BYTES and part & (part - 1) == 0


def block_digest(data: bytes | memoryview, part: int) -> str:
    """A whole block's digest in an index with this `part` (0: before version 4)."""
    return chain_digest(data, part) if part else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Reach:
    """How far a block's first parts take it, as its decoding found:
    `outputs[i]` uncompressed bytes from its first i + 1 parts, and
    `links[k]` the link after its first k parts (links())."""

    outputs: tuple[int, ...]
    links: tuple[bytes, ...]

    def prefix(self, needed: int, part: int) -> tuple[int, bytes] | None:
        """(compressed bytes, link) of the fewest first parts that give the
        block's first `needed` uncompressed bytes; None if only the whole
        block does."""
        i = bisect.bisect_left(self.outputs, needed)
        if i + 1 >= min(len(self.outputs) + 1, len(self.links)):
            return None
        return (i + 1) * part, self.links[i + 1]
