"""Build a LayerIndex from a layer blob on local disk (read once from the
registry by `bootseer index`)."""

from __future__ import annotations

import hashlib
import io
import math
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import indexed_gzip

from snapshotter.layer.index import (
    DEFAULT_SPAN,
    MAX_BLOCK_BYTES,
    MAX_MTIME,
    XATTR_NAMESPACES,
    Block,
    Compression,
    Entry,
    EntryType,
    IndexFormatError,
    LayerIndex,
    normalize_name,
)
from snapshotter.layer.tree import build_tree

_GZIP_MAGIC = b"\x1f\x8b"
_XATTR_PREFIX = "SCHILY.xattr."
_TYPES = {
    tarfile.REGTYPE: EntryType.REG,
    tarfile.AREGTYPE: EntryType.REG,
    tarfile.CONTTYPE: EntryType.REG,
    tarfile.DIRTYPE: EntryType.DIR,
    tarfile.SYMTYPE: EntryType.SYMLINK,
    tarfile.LNKTYPE: EntryType.HARDLINK,
    tarfile.CHRTYPE: EntryType.CHAR,
    tarfile.BLKTYPE: EntryType.BLOCK,
    tarfile.FIFOTYPE: EntryType.FIFO,
}


class UnsupportedLayer(Exception):
    """The layer cannot be served lazily; it takes the normal path."""


def build_index(
    blob: Path,
    layer_digest: str,
    span: int = DEFAULT_SPAN,
    progress: Callable[[int], None] | None = None,
) -> LayerIndex:
    if not 0 < span <= MAX_BLOCK_BYTES:
        raise UnsupportedLayer(f"a span of {span} bytes is not between 1 and {MAX_BLOCK_BYTES}")
    compressed_size = blob.stat().st_size
    with open(blob, "rb") as f:
        magic = f.read(2)
    if magic == _GZIP_MAGIC:
        with indexed_gzip.IndexedGzipFile(str(blob), spacing=span, readbuf_size=1 << 20) as gz:
            gz.build_full_index()
            points = [(u, c) for u, c in gz.seek_points()]
            gz.seek(0, io.SEEK_END)
            uncompressed_size = gz.tell()
            exported = io.BytesIO()
            gz.export_index(fileobj=exported)
            gz.seek(0)
            entries = _table_of_contents(gz)
        bounds = _gzip_bounds(points, compressed_size, uncompressed_size)
        compression, checkpoints = Compression.GZIP, exported.getvalue()
    else:
        with open(blob, "rb") as f:
            entries = _table_of_contents(f)
        uncompressed_size = compressed_size
        bounds = [
            (start, min(start + span, compressed_size), start, min(start + span, compressed_size))
            for start in range(0, compressed_size, span)
        ]
        compression, checkpoints = Compression.NONE, b""
    blocks = _digest_blocks(blob, bounds, progress)
    index = LayerIndex(
        layer_digest=layer_digest,
        compression=compression,
        compressed_size=compressed_size,
        uncompressed_size=uncompressed_size,
        span=span,
        blocks=blocks,
        entries=entries,
        checkpoints=checkpoints,
    )
    # What the snapshotter and the layer server will refuse (or what
    # containerd's applier fails on) is refused here, so that the layer takes
    # the normal path instead of being served from an index nobody can use.
    try:
        index.validate()
        build_tree(index.entries)
    except IndexFormatError as exc:
        raise UnsupportedLayer(str(exc)) from None
    return index


def _gzip_bounds(points: list[tuple[int, int]], csize: int, usize: int) -> list[tuple[int, int, int, int]]:
    """(cstart, cend, ustart, uend) per block from (uncompressed, compressed)
    checkpoints. A checkpoint may start mid-byte, so a block also takes the byte
    before it and the byte after its end; the first block takes the gzip header."""
    starts = [(u, c) for u, c in points if u < usize]
    bounds = []
    for n, (u, c) in enumerate(starts):
        last = n + 1 == len(starts)
        next_u, next_c = (usize, csize) if last else starts[n + 1]
        cstart = 0 if n == 0 else c - 1
        cend = csize if last else min(csize, next_c + 1)
        bounds.append((cstart, cend, u, next_u))
    return bounds


def _digest_blocks(
    blob: Path, bounds: list[tuple[int, int, int, int]], progress: Callable[[int], None] | None
) -> list[Block]:
    blocks = []
    with open(blob, "rb") as f:
        for cstart, cend, ustart, uend in bounds:
            f.seek(cstart)
            data = f.read(cend - cstart)
            blocks.append(Block(cstart, cend, ustart, uend, hashlib.sha256(data).hexdigest()))
            if progress:
                progress(cend - cstart)
    return blocks


def _table_of_contents(stream: BinaryIO) -> list[Entry]:
    entries = []
    try:
        with tarfile.open(fileobj=stream, mode="r:") as tar:
            for member in tar:
                entries.append(_entry(member))
    except tarfile.TarError as exc:
        raise UnsupportedLayer(f"not a readable tar stream: {exc}") from None
    return entries


def _entry(member: tarfile.TarInfo) -> Entry:
    etype = _TYPES.get(member.type)
    if etype is None:
        raise UnsupportedLayer(f"entry {member.name!r} has unsupported tar type {member.type!r}")
    if member.sparse:
        raise UnsupportedLayer(f"entry {member.name!r} is a sparse file")
    try:
        name = normalize_name(member.name)
        linkname = normalize_name(member.linkname) if etype == EntryType.HARDLINK else member.linkname
    except IndexFormatError as exc:
        raise UnsupportedLayer(str(exc)) from None
    device = etype in (EntryType.CHAR, EntryType.BLOCK)
    return Entry(
        name=name,
        type=etype,
        mode=member.mode & 0o7777,
        uid=member.uid,
        gid=member.gid,
        mtime=_bound_time(float(member.mtime)),
        size=member.size if etype == EntryType.REG else 0,
        offset=member.offset_data if etype == EntryType.REG else 0,
        linkname=linkname if etype in (EntryType.SYMLINK, EntryType.HARDLINK) else "",
        devmajor=member.devmajor if device else 0,
        devminor=member.devminor if device else 0,
        xattrs=_xattrs(member, etype),
    )


def _bound_time(mtime: float) -> float:
    """containerd's applier stamps a time it cannot set (before the epoch,
    or past 2262) as the epoch (boundTime); NaN and infinity, which Go's tar
    reader does not even parse, are left for validation to refuse."""
    if math.isfinite(mtime) and not 0 <= mtime <= MAX_MTIME:
        return 0.0
    return mtime


def _xattrs(member: tarfile.TarInfo, etype: EntryType) -> dict[str, bytes]:
    """The xattrs containerd's applier sets: it does not set trusted.*, the
    kernel refuses names outside the known namespaces and user.* on anything
    but files and directories, and containerd goes on without them."""
    xattrs = {}
    for key, value in member.pax_headers.items():
        if not key.startswith(_XATTR_PREFIX):
            continue
        name = key[len(_XATTR_PREFIX) :]
        if not name.startswith(XATTR_NAMESPACES):
            continue
        if name.startswith("user.") and etype not in (EntryType.REG, EntryType.DIR):
            continue
        xattrs[name] = value.encode("utf-8", "surrogateescape")
    return xattrs
