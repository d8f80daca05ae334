"""The layer index format (version 4).

An index describes one image layer blob, as pushed to a registry, without
changing it:

- the table of contents: every tar entry's name, type, mode, owner, mtime,
  size, link target, device numbers, xattrs and the offset of its data in the
  uncompressed stream;
- blocks: the blob split into spans between gzip checkpoints (restart points
  of the compressed stream, as zran/indexed_gzip take them), each with its
  place in the compressed blob and in the uncompressed stream and the digest
  of its compressed bytes (version 4: a hash chain over parts of the block,
  so that its first parts can be checked alone: parts.py). A block is the
  unit of verification, cache and record, and of fetch but where a
  hot-block manifest says a start reads only its first parts;
- for gzip, the checkpoints themselves (indexed_gzip's exported index: the
  compressed offset, bit offset and 32 KiB window of each, pruned to the
  bytes the block's inflation refers to: windows.py);
- the layer's diff_id (sha256 of the uncompressed tar stream), which binds
  the index to the chainID containerd commits the layer under (`chain_id`).

Encoding: MAGIC, then one zstd frame holding a 4-byte big-endian length, a
JSON document of that length, and the raw checkpoint index. docs/layer-index.md
documents the fields. Decoding validates every invariant the server relies on,
and every value it hands the kernel, so a malformed or hostile index is
refused rather than served from. `bootseer index` runs the same validation on
what it builds.
"""

from __future__ import annotations

import base64
import bisect
import enum
import functools
import hashlib
import json
import math
import operator
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn

import msgspec
import zstandard
from msgspec import Meta

from snapshotter.layer import parts
from snapshotter.layer.checkpoints import MAX_POINTS, Checkpoint, CheckpointFormatError
from snapshotter.layer.checkpoints import parse as parse_checkpoints

FORMAT_VERSION = 4
# Version 1 had no diff_id: it still decodes (the layer server goes on serving
# layers committed from one), but the remote Prepare path refuses it. Version
# 2 has whole windows, which version 3's check of a block's tail reads alike.
# Versions before 4 digest each block whole (sha256 of its bytes): read as
# `part` 0. An older bootseer refuses version 4, whose chained digests it
# would take for corrupt blocks.
READABLE_VERSIONS = (1, 2, 3, FORMAT_VERSION)
MAGIC = b"bootseer-layer-index\x00"
MEDIA_TYPE = "application/vnd.bootseer.layer-index.v1+zstd"
ARTIFACT_TYPE = "application/vnd.bootseer.layer-index.v1"
# The annotation on each index blob naming the layer blob it describes.
LAYER_ANNOTATION = "dev.bootseer.layer.digest"
# And the format version of the index blob, so that `bootseer index` can tell
# an index an older bootseer built (no annotation) without fetching it.
VERSION_ANNOTATION = "dev.bootseer.layer-index.version"
# The uncompressed bytes between checkpoints `bootseer index` takes by
# default: the unit of fetch for on-demand reads and hot-block prefetch
# (where data does not compress, blocks of up to 4 spans: build.coarsen).
# With 4 MiB (older indexes carry it, and are served alike: each index
# records its own span) the blocks a training start touched held 2x the
# compressed bytes it read, 1.6x with 1 MiB. Each checkpoint carries a
# 32 KiB window, pruned to what its block refers to (windows.py): on the
# benchmark image (0.86 GB of gzip) the indexes take 3.0 MB (18.7 MB with
# whole windows, 7 MB with whole windows at 4 MiB).
DEFAULT_SPAN = 1 << 20

# Bounds on what an index may hold. Each keeps a value the kernel (through
# FUSE) cannot take, or work and memory the layer server cannot afford, from
# getting past decoding; no layer containerd can apply comes near one.
#
# A decoded index larger than this is refused: it can only be hostile. The
# checkpoints' 32 KiB windows make most of a large layer's index.
MAX_DECODED = 1 << 30
# The JSON document is parsed whole into Python objects, several times its size.
MAX_DOCUMENT_BYTES = 256 << 20
# The layer store keeps a sparse cache file of the uncompressed size, which
# must fit one file on ext4 (16 TiB); no image layer comes near 1 TiB.
MAX_LAYER_BYTES = 1 << 40
# A block is fetched and decoded in memory, several at once. Honest blocks are
# the span (1 MiB by default, 4 MiB in older indexes) plus at most one
# deflate block, a few MiB from zlib's or Go's encoder.
MAX_BLOCK_BYTES = 128 << 20
# A 1 TiB layer in 1 MiB spans; a gzip layer has a checkpoint per block and
# one at the end.
MAX_BLOCKS = MAX_POINTS - 1
# The snapshotter and the layer server hold every entry (and the layer server
# its tree node) in memory, about a kilobyte in all: a million is a gigabyte.
MAX_ENTRIES = 1_000_000
# uid_t and gid_t are 32 bits, and (uid_t)-1 means "no change" to chown(2),
# so it names no owner.
MAX_ID = 2**32 - 2
# Permission bits with setuid, setgid and sticky; the file type comes from
# the entry's type.
MODE_BITS = 0o7777
# Linux's dev_t (and the 32-bit rdev FUSE hands the kernel) holds 12 bits of
# major and 20 of minor; mknod(2) in containerd's applier keeps only those.
MAX_DEV_MAJOR = (1 << 12) - 1
MAX_DEV_MINOR = (1 << 20) - 1
# Seconds since the epoch: the layer server gives the kernel nanoseconds in a
# signed 64-bit integer, and containerd's applier puts a time outside
# [0, 2**63 ns] at the epoch (boundTime), which `bootseer index` does too.
MAX_MTIME = (2**63 - 1) // 10**9
# NAME_MAX and PATH_MAX (which counts the terminating NUL): containerd applies
# a layer through absolute paths, so a longer name or path fails there too.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
# Components in a path, and directories a path may lead through after its
# symlinks are followed; deeper than any real image, and it bounds the work of
# resolving one path.
MAX_DEPTH = 1024
# symlink(2) refuses a longer target.
MAX_LINK_BYTES = 4095
# XATTR_NAME_MAX, XATTR_SIZE_MAX and XATTR_LIST_MAX: the kernel refuses
# longer xattr names and values, and a listxattr(2) answer over 64 KiB.
MAX_XATTR_NAME_BYTES = 255
MAX_XATTR_VALUE_BYTES = 65536
MAX_XATTR_LIST_BYTES = 65536
# The xattr namespaces an image may set. containerd's applier does not set
# trusted.* from a layer, and overlayfs reads trusted.overlay.* on its lower
# layers as instructions (redirects, metacopy), so an index may not carry
# them; the layer server adds trusted.overlay.opaque from opaque markers itself.
XATTR_NAMESPACES = ("user.", "security.", "system.")


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


# Rows of the index's document decode straight into Entry and Block
# (msgspec, in C): each value's type and an entry's numbers' ranges are
# checked on the way in, with no Python per row, and the tens of thousands of
# entries of a layer are not tracked by the garbage collector (they hold no
# references to other objects that could form a cycle). A pull decodes every
# layer's index, in the snapshotter and again in the layer server. Every field
# is required: a row is always written whole.
_Mode = Annotated[int, Meta(ge=0, le=MODE_BITS)]
_Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
_Bytes = Annotated[int, Meta(ge=0, le=MAX_LAYER_BYTES)]


class Entry(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    name: str  # normalised: relative, no "." or ".." parts, "" is the root
    type: EntryType
    mode: _Mode  # permission bits with setuid/setgid/sticky
    uid: _Id
    gid: _Id
    mtime: Annotated[int, Meta(ge=0, le=MAX_MTIME)] | Annotated[float, Meta(ge=0, le=MAX_MTIME)]
    size: _Bytes
    offset: _Bytes  # of the data, in the uncompressed stream
    linkname: str  # symlink target as written; hardlink target normalised
    devmajor: Annotated[int, Meta(ge=0, le=MAX_DEV_MAJOR)]
    devminor: Annotated[int, Meta(ge=0, le=MAX_DEV_MINOR)]
    xattrs: dict[str, bytes]  # base64 in the document


class Block(msgspec.Struct, array_like=True, frozen=True, gc=False, forbid_unknown_fields=True):
    cstart: int  # compressed bytes [cstart, cend) are fetched and verified
    cend: int
    ustart: int  # and decompress to uncompressed bytes [ustart, uend)
    uend: int
    digest: str  # of blob[cstart:cend], hex: sha256, or its parts' chain (LayerIndex.part)


@dataclass(frozen=True)
class IndexHeader:
    """What an index says of the blob it describes, without its blocks and
    entries: enough to check it against the image and to store it."""

    layer_digest: str
    diff_id: str  # "" in a version 1 index
    compressed_size: int
    uncompressed_size: int

    def validate(self) -> None:
        if not is_sha256_digest(self.layer_digest):
            raise IndexFormatError(f"bad layer digest {self.layer_digest!r}")
        if self.diff_id != "" and not is_sha256_digest(self.diff_id):
            raise IndexFormatError(f"bad diff_id {self.diff_id!r}")
        for what, value in (("compressed", self.compressed_size), ("uncompressed", self.uncompressed_size)):
            if not (type(value) is int and 0 <= value <= MAX_LAYER_BYTES):
                raise IndexFormatError(f"{what} size {value!r} is not between 0 and {MAX_LAYER_BYTES}")


class _Document(msgspec.Struct):
    """The JSON document as the fast decoder takes it (see Entry). Whatever
    it refuses, or cannot read (names that are not UTF-8 are escaped with
    lone surrogates, which it rejects), goes through the json module and the
    checks that name the offending entry instead (_rows_document)."""

    version: int
    layer_digest: str
    compression: Compression
    compressed_size: int
    uncompressed_size: int
    span: int
    blocks: list[Block]
    entries: list[Entry]
    diff_id: str | None = None  # from version 2
    part: int | None = None  # from version 4


_DOCUMENT = msgspec.json.Decoder(_Document)


@dataclass
class ParsedIndex:
    """An index whose document is parsed and header checked (LayerIndex.parse)."""

    header: IndexHeader
    version: int
    _doc: _Document | dict[str, Any]
    _checkpoint_bytes: bytes
    _checkpoints: bool

    def index(self) -> LayerIndex:
        """The whole index, every invariant checked (IndexFormatError if not)."""
        doc, version, header = self._doc, self.version, self.header
        if isinstance(doc, _Document):
            blocks, entries = doc.blocks, doc.entries
            compression, span = doc.compression, doc.span
            part = (doc.part or 0) if version >= 4 else 0
        else:
            try:
                rows, block_rows = doc["entries"], doc["blocks"]
                if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
                    raise ValueError(f"entries must be a list of at most {MAX_ENTRIES}")
                if not isinstance(block_rows, list) or len(block_rows) > MAX_BLOCKS:
                    raise ValueError(f"blocks must be a list of at most {MAX_BLOCKS}")
                compression, span = Compression(doc["compression"]), _typed(doc["span"], int)
                part = _typed(doc["part"], int) if version >= 4 else 0
                blocks, entries = [_row_block(row) for row in block_rows], _row_entries(rows)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise IndexFormatError(f"layer index is malformed: {exc!r}") from None
        index = LayerIndex(
            layer_digest=header.layer_digest,
            compression=compression,
            compressed_size=header.compressed_size,
            uncompressed_size=header.uncompressed_size,
            span=span,
            blocks=blocks,
            entries=entries,
            checkpoints=self._checkpoint_bytes,
            diff_id=header.diff_id,
            part=part,
        )
        index.validate(self._checkpoints, typed=isinstance(doc, _Document))
        return index


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
    # "sha256:<hex>" of the uncompressed tar stream; "" in a version 1 index.
    diff_id: str = ""
    # The part each block's digest chains over (parts.py); 0: the sha256 of
    # the whole block, as in versions before 4.
    part: int = 0

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
            "diff_id": self.diff_id,
            "compression": self.compression.value,
            "compressed_size": self.compressed_size,
            "uncompressed_size": self.uncompressed_size,
            "span": self.span,
            "part": self.part,
            "blocks": [[b.cstart, b.cend, b.ustart, b.uend, b.digest] for b in self.blocks],
            "entries": [_entry_row(e) for e in self.entries],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        payload = struct.pack(">I", len(body)) + body + self.checkpoints
        return MAGIC + zstandard.ZstdCompressor(level=10).compress(payload)

    @property
    def header(self) -> IndexHeader:
        return IndexHeader(self.layer_digest, self.diff_id, self.compressed_size, self.uncompressed_size)

    @classmethod
    def decode(cls, data: bytes, checkpoints: bool = True) -> LayerIndex:
        """`checkpoints` False: for a reader that never inflates a block (the
        snapshotter). The document alone is decompressed and checked; the
        checkpoints (most of a gzip index's bytes) are neither read nor
        checked, and the result's are empty. The layer server, which
        serves the layer, decodes and checks the whole index."""
        return cls.parse(data, checkpoints).index()

    @classmethod
    def parse(cls, data: bytes, checkpoints: bool = True) -> ParsedIndex:
        """decode() in two steps: the document parsed and its header
        checked now, its blocks and entries (most of the time a big layer's
        index takes) made and checked by ParsedIndex.index()."""
        if not data.startswith(MAGIC):
            raise IndexFormatError("not a bootseer layer index (bad magic)")
        try:
            body, rest = _decode_payload(data[len(MAGIC) :], checkpoints)
        except (zstandard.ZstdError, struct.error, ValueError) as exc:
            raise IndexFormatError(f"layer index is corrupt: {exc}") from None
        fast = _fast_document(body)
        doc = fast if fast is not None else _rows_document(body)
        version = doc.version if isinstance(doc, _Document) else doc.get("version") if isinstance(doc, dict) else "?"
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise IndexFormatError(
                f"layer index version {version!r} is not supported (this bootseer reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); re-run `bootseer index` with this bootseer"
            )
        if isinstance(doc, _Document):
            diff_id = (doc.diff_id or "") if version >= 2 else ""
            header = IndexHeader(doc.layer_digest, diff_id, doc.compressed_size, doc.uncompressed_size)
        else:
            try:
                header = IndexHeader(
                    layer_digest=_typed(doc["layer_digest"], str),
                    diff_id=_typed(doc["diff_id"], str) if version >= 2 else "",
                    compressed_size=_typed(doc["compressed_size"], int),
                    uncompressed_size=_typed(doc["uncompressed_size"], int),
                )
            except (KeyError, TypeError) as exc:
                raise IndexFormatError(f"layer index is malformed: {exc!r}") from None
        if version >= 2 and not is_sha256_digest(header.diff_id):
            raise IndexFormatError(f"bad diff_id {header.diff_id!r}")
        header.validate()
        return ParsedIndex(header, version, doc, rest, checkpoints)

    def validate(self, checkpoints: bool = True, typed: bool = False) -> None:
        """Refuse anything that would make the server read out of bounds,
        serve bytes from the wrong place, or hand the kernel a value it
        cannot take. The tree's own refusals (tree.build_tree) come on top.
        `checkpoints` False: all but the gzip checkpoints (see decode).
        `typed`: the entries came from the fast decoder, which checked each
        value's type and each number's range (Entry) on the way in."""
        self._validate_blocks(checkpoints)
        _validate_entries(self.entries, self.uncompressed_size, typed)

    def _validate_blocks(self, checkpoints: bool) -> None:
        self.header.validate()
        if not (type(self.span) is int and 0 < self.span <= MAX_BLOCK_BYTES):
            raise IndexFormatError(f"span {self.span!r} is not between 1 and {MAX_BLOCK_BYTES}")
        if self.part != 0 and not parts.valid_part(self.part):
            raise IndexFormatError(
                f"part {self.part!r} is neither 0 nor a power of two between "
                f"{parts.MIN_PART_BYTES} and {parts.MAX_PART_BYTES}"
            )
        if len(self.blocks) > MAX_BLOCKS:
            raise IndexFormatError(f"{len(self.blocks)} blocks, more than {MAX_BLOCKS}")
        expected_u = 0
        for n, b in enumerate(self.blocks):
            if b.ustart != expected_u or b.uend <= b.ustart:
                raise IndexFormatError(f"block {n} does not continue the uncompressed stream")
            if not 0 <= b.cstart < b.cend <= self.compressed_size:
                raise IndexFormatError(f"block {n} lies outside the compressed blob")
            if b.uend - b.ustart > MAX_BLOCK_BYTES or b.cend - b.cstart > MAX_BLOCK_BYTES:
                raise IndexFormatError(f"block {n} is larger than {MAX_BLOCK_BYTES} bytes")
            if len(b.digest) != 64 or not set(b.digest) <= _HEX:
                raise IndexFormatError(f"block {n} has a malformed digest")
            if self.compression != Compression.GZIP and (b.cstart, b.cend) != (b.ustart, b.uend):
                # A plain block is served as fetched.
                raise IndexFormatError(f"block {n} of an uncompressed layer is not where it lies in the blob")
            expected_u = b.uend
        if expected_u != self.uncompressed_size:
            raise IndexFormatError("blocks do not cover the uncompressed stream")
        # The blob is read to its last byte on the normal path (containerd's
        # applier drains the gzip reader after the tar), where a truncated
        # stream or trailing bytes that are not a gzip member fail the pull;
        # blocks that stop short of the blob's end would serve what the
        # normal path refuses. (The remote Prepare also checks
        # compressed_size against the layer's descriptor.)
        end = self.blocks[-1].cend if self.blocks else 0
        if end != self.compressed_size:
            raise IndexFormatError(f"blocks end at byte {end}, not at the end of the {self.compressed_size}-byte blob")
        if self.compression == Compression.GZIP and checkpoints:
            try:
                points = self.checkpoints_by_offset
            except CheckpointFormatError as exc:
                raise IndexFormatError(f"gzip layer index: {exc}") from None
            if any(b.ustart not in points for b in self.blocks):
                raise IndexFormatError("a block does not start at a gzip checkpoint")


def _decode_payload(frame: bytes, checkpoints: bool) -> tuple[bytes, bytes]:
    """The zstd frame's JSON document and the checkpoint bytes after it
    (b"" unless `checkpoints`: the frame is then decompressed only as far as
    the document's end)."""
    if checkpoints:
        payload = zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_DECODED)
        (length,) = struct.unpack(">I", payload[:4])
        if length > min(MAX_DOCUMENT_BYTES, len(payload) - 4):
            raise ValueError(f"the document claims {length} bytes")
        return payload[4 : 4 + length], payload[4 + length :]
    with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
        (length,) = struct.unpack(">I", reader.read(4))
        if length > MAX_DOCUMENT_BYTES:
            raise ValueError(f"the document claims {length} bytes")
        body = reader.read(length)
    if len(body) != length:
        raise ValueError(f"the document claims {length} bytes")
    return body, b""


def _fast_document(body: bytes) -> _Document | None:
    """The document through the fast decoder, if it takes it whole and it
    says all a version requires; None sends it to _rows_document."""
    try:
        doc = _DOCUMENT.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if (
        len(doc.entries) > MAX_ENTRIES
        or len(doc.blocks) > MAX_BLOCKS
        or (doc.version >= 2 and doc.diff_id is None)
        or (doc.version >= 4 and doc.part is None)
    ):
        return None
    return doc


def _rows_document(body: bytes) -> Any:
    """The document as plain JSON values, for the checks that say what is wrong with it."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise IndexFormatError(f"layer index is corrupt: {exc}") from None


def is_sha256_digest(value: object) -> bool:
    """A "sha256:" digest: the prefix and 64 lowercase hex digits."""
    return isinstance(value, str) and value.startswith("sha256:") and len(value) == 71 and set(value[7:]) <= _HEX


def chain_id(parent_chain: str, diff_id: str) -> str:
    """The OCI ChainID of a layer (containerd's snapshot name for it): its
    diff_id for a bottom layer (`parent_chain` ""), otherwise
    sha256(parent_chain + " " + diff_id)."""
    if not parent_chain:
        return diff_id
    return "sha256:" + hashlib.sha256(f"{parent_chain} {diff_id}".encode()).hexdigest()


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """containerd's snapshot names for a stack of layers, bottom first:
    chain(0) = diff(0), chain(n) = sha256(chain(n-1) + " " + diff(n))."""
    chain: list[str] = []
    for diff_id in diff_ids:
        chain.append(chain_id(chain[-1] if chain else "", diff_id))
    return chain


def normalize_name(name: str) -> str:
    """A tar member name as a relative path; raises on escapes from the root."""
    if "\x00" in name:
        raise IndexFormatError(f"entry {name!r} has a NUL byte in its name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise IndexFormatError(f"entry {name!r} climbs out of the layer root")
    return "/".join(parts)


def encode_name(name: str) -> bytes:
    """A name or link target as the kernel sees it: tar names that are not
    UTF-8 reach here with their bytes escaped (surrogateescape)."""
    return name.encode("utf-8", "surrogateescape")


_HEX = frozenset("0123456789abcdef")
_ENTRY_TYPES = {t.value: t for t in EntryType}
_TYPE = operator.attrgetter("type")
_NAME = operator.attrgetter("name")
_LINKNAME = operator.attrgetter("linkname")
_OFFSET = operator.attrgetter("offset")
_SIZE = operator.attrgetter("size")
_MTIME = operator.attrgetter("mtime")
_INT_FIELDS = {
    "mode": (0, MODE_BITS),
    "uid": (0, MAX_ID),
    "gid": (0, MAX_ID),
    "size": (0, MAX_LAYER_BYTES),
    "offset": (0, MAX_LAYER_BYTES),
    "devmajor": (0, MAX_DEV_MAJOR),
    "devminor": (0, MAX_DEV_MINOR),
}
# In "/" + "/".join(names) + "/" (the root, the one empty name, left out),
# what only a name that is not normalised can produce: an empty, "." or ".."
# part, or a leading or trailing "/". One regex starting with a literal is
# one fast pass; a character class or several substring searches are not.
_NOT_NORMALISED = re.compile(r"//|/\.\.?/")


def _typed(value: Any, kind: type[Any]) -> Any:
    # bool is an int to Python but never a size in an index.
    if type(value) is not kind:
        raise TypeError(f"{value!r} is not {kind.__name__}")
    return value


def _row_block(row: list[Any]) -> Block:
    cstart, cend, ustart, uend, digest = row
    return Block(_typed(cstart, int), _typed(cend, int), _typed(ustart, int), _typed(uend, int), _typed(digest, str))


def _row_entries(rows: list[list[Any]]) -> list[Entry]:
    # One comprehension, no call per row: this is most of the time a pull
    # spends on an index. Types are checked by _validate_entries, in bulk.
    types, xattrs = _ENTRY_TYPES, _decode_xattrs
    return [
        Entry(name, types[etype], mode, uid, gid, mtime, size, offset, link, major, minor, xattrs(xa) if xa else {})
        for name, etype, mode, uid, gid, mtime, size, offset, link, major, minor, xa in rows
    ]


def _decode_xattrs(xattrs: dict[str, str]) -> dict[str, bytes]:
    return {k: base64.b64decode(v, validate=True) for k, v in xattrs.items()}


def _validate_entries(entries: list[Entry], uncompressed_size: int, typed: bool = False) -> None:
    """Every entry's values in range, checked a column at a time with
    builtins (min, max, set, str.join): a pull decodes every layer's index,
    and a Python loop over tens of thousands of entries per check would cost
    more than the decoding itself. A check that fails then looks for the
    entry to name."""
    if len(entries) > MAX_ENTRIES:
        raise IndexFormatError(f"{len(entries)} entries, more than {MAX_ENTRIES}")
    if not entries:
        return
    if not typed:
        _validate_values(entries)
    if max(map(operator.add, map(_OFFSET, entries), map(_SIZE, entries))) > uncompressed_size:
        _refuse(entries, lambda e: e.offset + e.size > uncompressed_size, "has data outside the layer")
    _validate_names(entries, typed)
    for e in entries:
        if e.type is EntryType.HARDLINK:
            if not _is_normalized(e.linkname):
                raise IndexFormatError(f"hardlink {e.name!r} -> {e.linkname!r}: the target is not normalised")
            _check_path(e.linkname, f"hardlink {e.name!r} -> {e.linkname!r}")
        elif e.type is EntryType.SYMLINK and not e.linkname:
            # symlink(2) refuses an empty target.
            raise IndexFormatError(f"symlink {e.name!r} has an empty target")
        if e.xattrs:
            _validate_xattrs(e)


def _validate_values(entries: list[Entry]) -> None:
    """What Entry's types and bounds say, for entries the fast decoder did not make."""
    if not set(map(type, map(_TYPE, entries))) <= {EntryType}:
        _refuse(entries, lambda e: type(e.type) is not EntryType, "has no valid type")
    for attr, (low, high) in _INT_FIELDS.items():
        _validate_int_column(entries, attr, low, high)
    mtimes = list(map(_MTIME, entries))
    # NaN compares false with everything: either min or max returns it, or
    # isnan finds it among values already known to be in range.
    if (
        not set(map(type, mtimes)) <= {int, float}
        or not (min(mtimes) >= 0 and max(mtimes) <= MAX_MTIME)
        or any(map(math.isnan, mtimes))
    ):
        _refuse(entries, lambda e: not _mtime_ok(e.mtime), f"has an mtime outside [0, {MAX_MTIME}]")


def _validate_int_column(entries: list[Entry], attr: str, low: int, high: int) -> None:
    get = operator.attrgetter(attr)
    column = list(map(get, entries))
    if set(map(type, column)) != {int} or min(column) < low or max(column) > high:
        _refuse(entries, lambda e: not (type(get(e)) is int and low <= get(e) <= high), f"has {attr} out of range")


def _validate_names(entries: list[Entry], typed: bool) -> None:
    names = list(map(_NAME, entries))
    links = list(map(_LINKNAME, entries))
    if not typed and (set(map(type, names)) != {str} or set(map(type, links)) != {str}):
        _refuse(entries, lambda e: type(e.name) is not str or type(e.linkname) is not str, "has a name not a string")
    named = list(filter(None, names))
    joined = "/" + "/".join(named) + "/" if named else ""
    if "\x00" in joined:
        _refuse(entries, lambda e: "\x00" in e.name, "has a NUL byte in its name")
    if _NOT_NORMALISED.search(joined):
        _refuse(entries, lambda e: not _is_normalized(e.name), "is not normalised (or climbs out of the layer root)")
    links_joined = "".join(links)
    if "\x00" in links_joined:
        _refuse(entries, lambda e: "\x00" in e.linkname, "has a NUL byte in its link target")
    if not _encodable(joined):
        _refuse(entries, lambda e: not _encodable(e.name), "has a name that is neither UTF-8 nor escaped bytes")
    if not _encodable(links_joined):
        _refuse(entries, lambda e: not _encodable(e.linkname), "has a link target neither UTF-8 nor escaped bytes")
    # A name of at most MAX_NAME_BYTES characters, each one byte, is within
    # every bound on paths; only longer or non-ASCII names need their bytes
    # counted.
    if not joined.isascii() or max(map(len, names)) > MAX_NAME_BYTES:
        for e in entries:
            if len(e.name) > MAX_NAME_BYTES or not e.name.isascii():
                _check_path(e.name, f"entry {e.name!r}")
    if not links_joined.isascii() or max(map(len, links)) > MAX_LINK_BYTES:
        for e in entries:
            if len(encode_name(e.linkname)) > MAX_LINK_BYTES:
                raise IndexFormatError(f"entry {e.name!r} has a link target longer than {MAX_LINK_BYTES} bytes")


def _check_path(name: str, what: str) -> None:
    data = encode_name(name)
    if len(data) > MAX_PATH_BYTES:
        raise IndexFormatError(f"{what}: the path is longer than {MAX_PATH_BYTES} bytes")
    parts = data.split(b"/")
    if len(parts) > MAX_DEPTH:
        raise IndexFormatError(f"{what}: the path is deeper than {MAX_DEPTH} levels")
    if max(map(len, parts)) > MAX_NAME_BYTES:
        raise IndexFormatError(f"{what}: a part of the path is longer than {MAX_NAME_BYTES} bytes")


def _validate_xattrs(e: Entry) -> None:
    if type(e.xattrs) is not dict:
        raise IndexFormatError(f"entry {e.name!r} has malformed xattrs")
    listed = 0
    for key, value in e.xattrs.items():
        if not (type(key) is str and type(value) is bytes and "\x00" not in key and _encodable(key)):
            raise IndexFormatError(f"entry {e.name!r} has a malformed xattr {key!r}")
        if not key.startswith(XATTR_NAMESPACES) or key in XATTR_NAMESPACES:
            raise IndexFormatError(f"entry {e.name!r} has xattr {key!r}, outside the namespaces an image may set")
        size = len(encode_name(key))
        if size > MAX_XATTR_NAME_BYTES:
            raise IndexFormatError(f"entry {e.name!r} has an xattr name longer than {MAX_XATTR_NAME_BYTES} bytes")
        if len(value) > MAX_XATTR_VALUE_BYTES:
            raise IndexFormatError(f"entry {e.name!r} has xattr {key!r} larger than {MAX_XATTR_VALUE_BYTES} bytes")
        listed += size + 1
    if listed > MAX_XATTR_LIST_BYTES:
        raise IndexFormatError(f"entry {e.name!r} has xattr names longer than {MAX_XATTR_LIST_BYTES} bytes in all")


def _refuse(entries: list[Entry], bad: Callable[[Entry], bool], what: str) -> NoReturn:
    for e in entries:
        try:
            found = bad(e)
        except (TypeError, ValueError, OverflowError):
            found = True
        if found:
            raise IndexFormatError(f"entry {e.name!r} {what}")
    # The bulk check and the one per entry agree; should they not, the
    # refusal stands without a name.
    raise IndexFormatError(f"an entry {what}")


def _mtime_ok(mtime: object) -> bool:
    return isinstance(mtime, int | float) and type(mtime) is not bool and 0 <= mtime <= MAX_MTIME


def _encodable(text: str) -> bool:
    try:
        encode_name(text)
    except UnicodeEncodeError:
        return False
    return True


def _is_normalized(name: str) -> bool:
    """normalize_name(name) == name, without building paths."""
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
