"""The snapshot container: a manifest, then the image in zstd chunks.

    b"DSNAP\\x00\\x01\\n" | manifest length (u64 LE) | manifest (JSON) | chunk | chunk | ...

Each chunk is one independent zstd frame of `chunk_size` image bytes, with
the sha256 of those bytes in the manifest. Independent frames decompress on
every core at once, let a restore verify and write each chunk as it arrives
instead of after the whole download, and let an image be read lazily by
range (`depsnap.lazy`). A file that is cut short, has a flipped bit or
belongs to another key fails with `CorruptSnapshot`, never with half a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Protocol, TypeVar

import zstandard

MAGIC = b"DSNAP\x00\x01\n"
_LENGTH = struct.Struct("<Q")
# Large enough that per-chunk overhead vanishes, small enough to keep two
# cores busy on a few hundred MB and to bound memory in flight.
DEFAULT_CHUNK_SIZE = 8 << 20
_MAX_MANIFEST = 64 << 20

_T = TypeVar("_T")


class CorruptSnapshot(Exception):
    """The snapshot does not match its own manifest, or not the key asked for."""


class Readable(Protocol):
    """What a snapshot is read from: a file, a store's stream or a range
    reader; all any of them needs is `read`."""

    def read(self, size: int = -1, /) -> bytes: ...


@dataclass(frozen=True)
class Chunk:
    length: int  # compressed bytes in the file
    size: int  # image bytes it holds
    sha256: str  # of the image bytes


@dataclass
class Manifest:
    key: str
    kind: str  # "env" (a whole environment) or "run" (a command's effects)
    image_size: int
    chunk_size: int
    chunks: list[Chunk] = field(default_factory=list)
    # For "run": the paths the image's top-level directories 0, 1, ... restore to,
    # and per path what the command deleted under it.
    paths: list[str] = field(default_factory=list)
    deleted: list[list[str]] = field(default_factory=list)
    # The key's inputs, for people reading a store.
    inputs: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            table = json.loads(data)
            table["chunks"] = [Chunk(**c) for c in table["chunks"]]
            manifest = cls(**table)
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptSnapshot(f"unreadable manifest: {exc}") from None
        if sum(c.size for c in manifest.chunks) != manifest.image_size:
            raise CorruptSnapshot("manifest chunk sizes do not add up to the image size")
        return manifest


def header(manifest: Manifest) -> bytes:
    body = manifest.to_bytes()
    return MAGIC + _LENGTH.pack(len(body)) + body


def _compress(data: bytes, level: int) -> tuple[bytes, Chunk]:
    frame = zstandard.ZstdCompressor(level=level).compress(data)
    return frame, Chunk(len(frame), len(data), hashlib.sha256(data).hexdigest())


def bounded_map(
    pool: ThreadPoolExecutor, fn: Callable[..., _T], items: Iterable[tuple[Any, ...]], depth: int
) -> Iterator[_T]:
    """pool.map that keeps at most `depth` items in flight (bounded memory), in order."""
    pending: deque[Future[_T]] = deque()
    for item in items:
        pending.append(pool.submit(fn, *item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def pack(
    image: BinaryIO,
    body: BinaryIO,
    manifest: Manifest,
    level: int = 3,
    workers: int | None = None,
) -> Manifest:
    """Compress `image` into `body` chunk by chunk; fills in `manifest`'s
    size and chunk list and returns it (write `header(manifest)` before the body)."""
    workers = workers or os.cpu_count() or 1
    chunk_size = manifest.chunk_size

    def chunks() -> Iterator[tuple[bytes, int]]:
        while data := image.read(chunk_size):
            yield data, level

    manifest.chunks = []
    with ThreadPoolExecutor(workers) as pool:
        for frame, chunk in bounded_map(pool, _compress, chunks(), 2 * workers):
            body.write(frame)
            manifest.chunks.append(chunk)
    manifest.image_size = sum(c.size for c in manifest.chunks)
    return manifest


def read_exactly(stream: Readable, n: int, what: str) -> bytes:
    parts = []
    left = n
    while left:
        data = stream.read(left)
        if not data:
            raise CorruptSnapshot(f"snapshot ends early, in the {what}")
        parts.append(data)
        left -= len(data)
    return b"".join(parts)


def read_manifest(stream: Readable, key: str) -> Manifest:
    """Read and check the header; the stream is left at the first chunk."""
    magic = read_exactly(stream, len(MAGIC), "header")
    if magic != MAGIC:
        raise CorruptSnapshot("not a depsnap snapshot (bad magic)")
    (length,) = _LENGTH.unpack(read_exactly(stream, _LENGTH.size, "header"))
    if length > _MAX_MANIFEST:
        raise CorruptSnapshot(f"manifest length {length} is implausible")
    manifest = Manifest.from_bytes(read_exactly(stream, length, "manifest"))
    if manifest.key != key:
        raise CorruptSnapshot(f"snapshot holds key {manifest.key}, not {key}")
    return manifest


def chunk_data(frame: bytes, chunk: Chunk, index: int) -> bytes:
    """The image bytes of chunk `index` from its stored frame; CorruptSnapshot
    unless they match the chunk's digest."""
    try:
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=chunk.size)
    except zstandard.ZstdError as exc:
        raise CorruptSnapshot(f"chunk {index} does not decompress: {exc}") from None
    if len(data) != chunk.size or hashlib.sha256(data).hexdigest() != chunk.sha256:
        raise CorruptSnapshot(f"chunk {index} does not match its digest")
    return data


def _restore_chunk(frame: bytes, chunk: Chunk, index: int, fd: int, offset: int) -> int:
    os.pwrite(fd, chunk_data(frame, chunk, index), offset)
    return chunk.size


def unpack(
    stream: Readable,
    fd: int,
    key: str,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Verify and write the image held by `stream` into the file `fd`.

    Reading the next chunk overlaps decompressing and writing earlier ones,
    so a restore from a slow store costs about its download time.
    """
    manifest = read_manifest(stream, key)
    workers = workers or os.cpu_count() or 1
    os.ftruncate(fd, manifest.image_size)

    def frames() -> Iterator[tuple[bytes, Chunk, int, int, int]]:
        offset = 0
        for index, chunk in enumerate(manifest.chunks):
            yield read_exactly(stream, chunk.length, f"chunk {index}"), chunk, index, fd, offset
            offset += chunk.size

    with ThreadPoolExecutor(workers) as pool:
        for size in bounded_map(pool, _restore_chunk, frames(), 2 * workers):
            if progress:
                progress(size)
    if stream.read(1):
        raise CorruptSnapshot("snapshot has bytes after its last chunk")
    return manifest
