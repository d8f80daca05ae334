"""Build a LayerIndex from a layer blob on local disk (read once from the
registry by `bootseer index`).

The layer's diff_id (sha256 of the uncompressed tar stream) is computed by a
second thread that inflates the blob with zlib while indexed_gzip builds the
checkpoints: both release the GIL, so on a node with two cores the hash costs
little wall time (docs/layer-index.md has the measurement).
"""

from __future__ import annotations

import hashlib
import io
import math
import tarfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import indexed_gzip

from snapshotter.layer import windows
from snapshotter.layer.checkpoints import parse as parse_checkpoints
from snapshotter.layer.checkpoints import raw_stream, with_windows, without
from snapshotter.layer.index import (
    DEFAULT_SPAN,
    MAX_BLOCK_BYTES,
    MAX_LAYER_BYTES,
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
from snapshotter.layer.parts import PART_BYTES, block_digest
from snapshotter.layer.tree import build_tree

_GZIP_MAGIC = b"\x1f\x8b"
# Blocks of data that compresses to at least this share of its size are
# merged, up to COARSE_SPANS of them and under COARSE_MAX_BYTES uncompressed
# a block (coarsen): with the default span, blocks of about 4 MiB, the block
# of older indexes; a span of 4 MiB or more merges nothing.
COARSE_RATIO = 0.75
COARSE_SPANS = 4
COARSE_MAX_BYTES = 8 << 20
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
    coarse: bool = False,
    part: int = PART_BYTES,
) -> LayerIndex:
    """`coarse`: merge blocks of data that does not compress (coarsen), as
    `bootseer index` does; without it every block is one span. `part`: what
    each block's digest chains over (parts.py)."""
    if not 0 < span <= MAX_BLOCK_BYTES:
        raise UnsupportedLayer(f"a span of {span} bytes is not between 1 and {MAX_BLOCK_BYTES}")
    compressed_size = blob.stat().st_size
    with open(blob, "rb") as f:
        magic = f.read(2)
    whole = hashlib.sha256()
    if magic == _GZIP_MAGIC:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diff-id") as pool:
            digested = pool.submit(_gunzip_digest, blob)
            try:
                with indexed_gzip.IndexedGzipFile(str(blob), spacing=span, readbuf_size=1 << 20) as gz:
                    # Seeking past the end builds the whole index, the same points
                    # as build_full_index, but with the GIL released (build_full_index
                    # holds it), so the diff_id thread runs meanwhile.
                    gz.seek(MAX_LAYER_BYTES + 1)
                    points = [(u, c) for u, c in gz.seek_points()]
                    try:
                        gz.seek(0, io.SEEK_END)
                    except indexed_gzip.NotCoveredError:
                        raise UnsupportedLayer(f"the layer inflates to more than {MAX_LAYER_BYTES} bytes") from None
                    uncompressed_size = gz.tell()
                    exported = io.BytesIO()
                    gz.export_index(fileobj=exported)
                    gz.seek(0)
                    entries = _table_of_contents(gz)
            except (UnsupportedLayer, OSError) as exc:  # indexed_gzip: ZranError, CrcError
                # A gzip stream containerd's reader fails on (truncated, or
                # followed by what is not a gzip member) is refused for what
                # is wrong with it, not for what indexed_gzip or the tar
                # reader then make of it.
                digested.result()
                if isinstance(exc, UnsupportedLayer):
                    raise
                raise UnsupportedLayer(f"indexed_gzip cannot read the gzip stream: {exc}") from None
            fine = _gzip_bounds(points, compressed_size, uncompressed_size)
            bounds = coarsen(fine, _windowless(exported.getvalue())) if coarse else fine
            # The checkpoints inside merged blocks go, with their windows.
            merged_away = {b[2] for b in fine} - {b[2] for b in bounds}
            checkpoints = without(exported.getvalue(), {(u, c) for u, c in points if u in merged_away})
            blocks = _digest_blocks(blob, bounds, part, progress)
            checkpoints = _prune_windows(blob, checkpoints, bounds)
            diff_id, hashed = digested.result()
        if hashed != uncompressed_size:
            raise UnsupportedLayer(
                f"zlib inflates the layer to {hashed} bytes, indexed_gzip to {uncompressed_size}; "
                "it is not a gzip stream both read alike"
            )
        compression = Compression.GZIP
    else:
        with open(blob, "rb") as f:
            entries = _table_of_contents(f)
        uncompressed_size = compressed_size
        bounds = [
            (start, min(start + span, compressed_size), start, min(start + span, compressed_size))
            for start in range(0, compressed_size, span)
        ]
        # Plain blocks tile the blob: hashing them in order hashes the tar.
        blocks = _digest_blocks(blob, bounds, part, progress, whole)
        diff_id = "sha256:" + whole.hexdigest()
        compression, checkpoints = Compression.NONE, b""
    index = LayerIndex(
        layer_digest=layer_digest,
        compression=compression,
        compressed_size=compressed_size,
        uncompressed_size=uncompressed_size,
        span=span,
        blocks=blocks,
        entries=entries,
        checkpoints=checkpoints,
        diff_id=diff_id,
        part=part,
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


def coarsen(bounds: list[tuple[int, int, int, int]], windowless: set[int]) -> list[tuple[int, int, int, int]]:
    """Merge runs of consecutive blocks of data deflate cannot shrink (at
    least COARSE_RATIO of their size compressed), up to COARSE_SPANS blocks
    and under COARSE_MAX_BYTES each; other blocks stay as they are. Such
    data (weights, archives, media) is mostly read whole, so fine blocks
    there move hardly fewer
    bytes, and each of its checkpoints costs the index a 32 KiB window zstd
    cannot shrink either (on the benchmark's weights layer, 1 MiB blocks
    moved 3% fewer bytes than 4 MiB ones for a 4x larger index). A block
    that starts a gzip member (`windowless`: its checkpoint has no window)
    is never merged into the one before it."""
    out: list[tuple[int, int, int, int]] = []
    merged = 0  # blocks in out[-1], if it is a run of incompressible ones
    for cstart, cend, ustart, uend in bounds:
        incompressible = cend - cstart >= COARSE_RATIO * (uend - ustart)
        if (
            incompressible
            and 0 < merged < COARSE_SPANS
            and uend - out[-1][2] < COARSE_MAX_BYTES
            and ustart not in windowless
        ):
            out[-1] = (out[-1][0], cend, out[-1][2], uend)
            merged += 1
            continue
        out.append((cstart, cend, ustart, uend))
        merged = 1 if incompressible else 0
    return out


def _prune_windows(blob: Path, exported: bytes, bounds: list[tuple[int, int, int, int]]) -> bytes:
    """The checkpoints with each block's window pruned to the bytes its
    inflation refers to (windows.prune), read block by block from `blob`."""
    starts = {ustart: (cstart, cend) for cstart, cend, ustart, _ in bounds}
    pruned: dict[int, bytes] = {}
    with open(blob, "rb") as f:
        for point in parse_checkpoints(exported):
            if point.window is None or point.uncompressed not in starts:
                continue
            cstart, cend = starts[point.uncompressed]
            f.seek(cstart)
            pruned[point.uncompressed] = windows.prune(point.window, raw_stream(point, f.read(cend - cstart)))
    return with_windows(exported, pruned)


def _windowless(exported: bytes) -> set[int]:
    """Uncompressed offsets of the checkpoints that start a gzip member."""
    return {p.uncompressed for p in parse_checkpoints(exported) if p.window is None}


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


def _gunzip_digest(blob: Path) -> tuple[str, int]:
    """The diff_id and length of the tar stream a gzip blob inflates to, every
    member in turn (as containerd's reader takes them), checking each
    member's CRC and length. Output is taken 4 MiB at a time: a small blob may
    inflate to a huge stream.

    The blob must be gzip members up to its last byte, as it must for
    containerd's normal path (Go's compress/gzip, multistream, read to EOF
    by the applier after the tar's end): a blob that ends inside a member
    fails there with "unexpected EOF", and bytes after a member that do not
    start another one (junk, or the zeros some tools pad with) with
    "gzip: invalid header" (or "unexpected EOF" when fewer than a header's
    10 bytes). Either is refused here, with the offset."""
    digest, size = hashlib.sha256(), 0
    member: zlib._Decompress | None = None
    pending = b""
    consumed = 0  # bytes of the blob before `pending`
    member_start, members = 0, 0
    try:
        with open(blob, "rb") as f:
            while True:
                if not pending:
                    pending = f.read(1 << 20)
                    if not pending:
                        break
                if member is None:
                    member, member_start = zlib.decompressobj(wbits=31), consumed
                out = member.decompress(pending, 4 << 20)
                digest.update(out)
                size += len(out)
                if member.eof:
                    consumed += len(pending) - len(member.unused_data)
                    pending, member = member.unused_data, None
                    members += 1
                else:
                    consumed += len(pending) - len(member.unconsumed_tail)
                    pending = member.unconsumed_tail
            if member is not None:
                # All input taken; what inflate still holds is at most a few bytes.
                out = member.flush()
                digest.update(out)
                size += len(out)
                if not member.eof:
                    raise UnsupportedLayer(
                        f"the gzip stream ends in the middle of a member (at byte {consumed}, the member "
                        f"starting at byte {member_start}): truncated, containerd fails on it (unexpected EOF)"
                    )
    except zlib.error as exc:
        if members:
            raise UnsupportedLayer(
                f"what follows the {members} complete gzip member(s) at byte {member_start} "
                f"({blob.stat().st_size - member_start} bytes) does not read as a gzip member ({exc}): "
                "trailing data, containerd fails on it (gzip: invalid header)"
            ) from None
        raise UnsupportedLayer(f"not a readable gzip stream: {exc}") from None
    return "sha256:" + digest.hexdigest(), size


def _digest_blocks(
    blob: Path,
    bounds: list[tuple[int, int, int, int]],
    part: int,
    progress: Callable[[int], None] | None,
    whole: hashlib._Hash | None = None,
) -> list[Block]:
    blocks = []
    with open(blob, "rb") as f:
        for cstart, cend, ustart, uend in bounds:
            f.seek(cstart)
            data = f.read(cend - cstart)
            blocks.append(Block(cstart, cend, ustart, uend, block_digest(data, part)))
            if whole is not None:
                whole.update(data)
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
