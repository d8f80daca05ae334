"""The layer index format (version 1).

An index describes one image layer blob, as pushed to a registry, without
changing it:

- the table of contents: every tar entry's name, type, mode, owner, mtime,
  size, link target, device numbers, xattrs and the offset of its data in the
  uncompressed stream;
- blocks: the blob split into spans between gzip checkpoints (restart points
  of the compressed stream, as zran/indexed_gzip take them), each with its
  place in the compressed blob and in the uncompressed stream and the sha256
  of its compressed bytes. A block is the unit of fetch, verification, cache
  and record;
- for gzip, the checkpoints themselves (indexed_gzip's exported index: the
  compressed offset, bit offset and 32 KiB window of each).

Encoding: MAGIC, then one zstd frame holding a 4-byte big-endian length, a
JSON document of that length, and the raw checkpoint index. docs/layer-index.md
documents the fields. Decoding validates every invariant the server relies on,
so a malformed index is refused rather than served from.
"""

from __future__ import annotations

import base64
import bisect
import enum
import functools
import json
import posixpath
import struct
from dataclasses import dataclass, field
from typing import Any

import zstandard

from snapshotter.layer.checkpoints import Checkpoint, CheckpointFormatError
from snapshotter.layer.checkpoints import parse as parse_checkpoints

FORMAT_VERSION = 1
MAGIC = b"bootseer-layer-index\x00"
MEDIA_TYPE = "application/vnd.bootseer.layer-index.v1+zstd"
ARTIFACT_TYPE = "application/vnd.bootseer.layer-index.v1"
# The annotation on each index blob naming the layer blob it describes.
LAYER_ANNOTATION = "dev.bootseer.layer.digest"
DEFAULT_SPAN = 4 << 20
# A decoded index larger than this is refused: it can only be hostile.
MAX_DECODED = 1 << 30


class IndexFormatError(ValueError):
    pass


class Compression(enum.StrEnum):
    GZIP = "gzip"
    NONE = "none"


class EntryType(enum.StrEnum):
    REG = "reg"
    DIR = "dir"
    SYMLINK = "symlink"
    HARDLINK = "hardlink"
    CHAR = "char"
    BLOCK = "block"
    FIFO = "fifo"


@dataclass(frozen=True)
class Entry:
    name: str  # normalised: relative, no "." or ".." parts, "" is the root
    type: EntryType
    mode: int  # permission bits with setuid/setgid/sticky
    uid: int
    gid: int
    mtime: float
    size: int = 0
    offset: int = 0  # of the data, in the uncompressed stream
    linkname: str = ""  # symlink target as written; hardlink target normalised
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Block:
    cstart: int  # compressed bytes [cstart, cend) are fetched and verified
    cend: int
    ustart: int  # and decompress to uncompressed bytes [ustart, uend)
    uend: int
    digest: str  # sha256 hex of blob[cstart:cend]


@dataclass
class LayerIndex:
    layer_digest: str
    compression: Compression
    compressed_size: int
    uncompressed_size: int
    span: int
    blocks: list[Block]
    entries: list[Entry]
    checkpoints: bytes = b""  # indexed_gzip's exported index, for gzip

    def __post_init__(self) -> None:
        self._ustarts = [b.ustart for b in self.blocks]

    @functools.cached_property
    def checkpoints_by_offset(self) -> dict[int, Checkpoint]:
        """The gzip checkpoints by uncompressed offset (empty for plain tar)."""
        if self.compression != Compression.GZIP:
            return {}
        return {p.uncompressed: p for p in parse_checkpoints(self.checkpoints)}

    def block_range(self, ustart: int, uend: int) -> range:
        """Numbers of the blocks holding uncompressed bytes [ustart, uend)."""
        if uend <= ustart:
            return range(0)
        first = bisect.bisect_right(self._ustarts, ustart) - 1
        last = bisect.bisect_left(self._ustarts, uend) - 1
        return range(max(first, 0), last + 1)

    def encode(self) -> bytes:
        doc = {
            "version": FORMAT_VERSION,
            "layer_digest": self.layer_digest,
            "compression": self.compression.value,
            "compressed_size": self.compressed_size,
            "uncompressed_size": self.uncompressed_size,
            "span": self.span,
            "blocks": [[b.cstart, b.cend, b.ustart, b.uend, b.digest] for b in self.blocks],
            "entries": [_entry_row(e) for e in self.entries],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        payload = struct.pack(">I", len(body)) + body + self.checkpoints
        return MAGIC + zstandard.ZstdCompressor(level=10).compress(payload)

    @classmethod
    def decode(cls, data: bytes) -> LayerIndex:
        if not data.startswith(MAGIC):
            raise IndexFormatError("not a bootseer layer index (bad magic)")
        try:
            payload = zstandard.ZstdDecompressor().decompress(data[len(MAGIC) :], max_output_size=MAX_DECODED)
            (length,) = struct.unpack(">I", payload[:4])
            doc = json.loads(payload[4 : 4 + length])
        except (zstandard.ZstdError, struct.error, ValueError) as exc:
            raise IndexFormatError(f"layer index is corrupt: {exc}") from None
        if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
            raise IndexFormatError(
                f"layer index version {doc.get('version') if isinstance(doc, dict) else '?'} "
                f"is not supported (this bootseer reads version {FORMAT_VERSION})"
            )
        try:
            index = cls(
                layer_digest=str(doc["layer_digest"]),
                compression=Compression(doc["compression"]),
                compressed_size=int(doc["compressed_size"]),
                uncompressed_size=int(doc["uncompressed_size"]),
                span=int(doc["span"]),
                blocks=[Block(int(a), int(b), int(c), int(d), str(e)) for a, b, c, d, e in doc["blocks"]],
                entries=[_row_entry(row) for row in doc["entries"]],
                checkpoints=payload[4 + length :],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IndexFormatError(f"layer index is malformed: {exc!r}") from None
        index.validate()
        return index

    def validate(self) -> None:
        """Refuse anything that would make the server read out of bounds or
        serve bytes from the wrong place."""
        if not self.layer_digest.startswith("sha256:") or len(self.layer_digest) != 71:
            raise IndexFormatError(f"bad layer digest {self.layer_digest!r}")
        expected_u = 0
        for n, b in enumerate(self.blocks):
            if b.ustart != expected_u or b.uend <= b.ustart:
                raise IndexFormatError(f"block {n} does not continue the uncompressed stream")
            if not 0 <= b.cstart < b.cend <= self.compressed_size:
                raise IndexFormatError(f"block {n} lies outside the compressed blob")
            if len(b.digest) != 64 or any(c not in "0123456789abcdef" for c in b.digest):
                raise IndexFormatError(f"block {n} has a malformed digest")
            expected_u = b.uend
        if expected_u != self.uncompressed_size:
            raise IndexFormatError("blocks do not cover the uncompressed stream")
        if self.compression == Compression.GZIP:
            try:
                points = self.checkpoints_by_offset
            except CheckpointFormatError as exc:
                raise IndexFormatError(f"gzip layer index: {exc}") from None
            if any(b.ustart not in points for b in self.blocks):
                raise IndexFormatError("a block does not start at a gzip checkpoint")
        for e in self.entries:
            if not _is_normalized(e.name):
                if ".." in e.name.split("/"):
                    raise IndexFormatError(f"entry {e.name!r} climbs out of the layer root")
                raise IndexFormatError(f"entry name {e.name!r} is not normalised")
            if e.size < 0 or e.offset < 0 or e.offset + e.size > self.uncompressed_size:
                raise IndexFormatError(f"entry {e.name!r} has data outside the layer")


def normalize_name(name: str) -> str:
    """A tar member name as a relative path; raises on escapes from the root."""
    path = posixpath.normpath("/" + name.replace("\x00", ""))
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise IndexFormatError(f"entry {name!r} climbs out of the layer root")
    return path.lstrip("/")


def _is_normalized(name: str) -> bool:
    """normalize_name(name) == name, without building paths (indexes hold
    tens of thousands of names)."""
    if name == "":
        return True
    if name.startswith("/") or name.endswith("/") or "//" in name or "\x00" in name:
        return False
    wrapped = f"/{name}/"
    return "/./" not in wrapped and "/../" not in wrapped


def _entry_row(e: Entry) -> list[object]:
    xattrs = {k: base64.b64encode(v).decode() for k, v in e.xattrs.items()}
    return [
        e.name,
        e.type.value,
        e.mode,
        e.uid,
        e.gid,
        e.mtime,
        e.size,
        e.offset,
        e.linkname,
        e.devmajor,
        e.devminor,
        xattrs,
    ]


_ENTRY_TYPES = {t.value: t for t in EntryType}


def _row_entry(row: list[Any]) -> Entry:
    name, etype, mode, uid, gid, mtime, size, offset, linkname, major, minor, xattrs = row
    if {type(mode), type(uid), type(gid), type(size), type(offset), type(major), type(minor)} != {int} or (
        etype not in _ENTRY_TYPES
    ):
        raise ValueError(f"malformed entry row {row!r}")
    return Entry(
        str(name),
        _ENTRY_TYPES[etype],
        mode,
        uid,
        gid,
        float(mtime),
        size,
        offset,
        str(linkname),
        major,
        minor,
        {str(k): base64.b64decode(v) for k, v in xattrs.items()} if xattrs else {},
    )
