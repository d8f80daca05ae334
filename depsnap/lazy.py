"""Lazy restore: the store's snapshot served as an image file through FUSE,
fetched chunk by chunk as the mounted environment reads it.

A fresh node mounts erofs on `MOUNTPOINT/image` (file-backed erofs works on a
FUSE file) instead of first unpacking the whole image: `ensure` returns once
the mounts are up, and the first imports pull only the chunks they touch.
Behind them, a background fill fetches the remaining chunks in order, so the
whole image soon lies in the node cache, where later restarts mount it
without this server.

Nothing unverified is served: a chunk is one zstd frame of the snapshot, with
its sha256 in the manifest; it is fetched by range through `hdfs_fuse`'s
striped reader, decompressed, checked, and only then written to the local
copy that reads are served from. A chunk that fails its digest, or that the
store cannot deliver, is answered with EIO, never with other bytes.

`start` forks the server into a session of its own; it lives as long as its
mount and exits when `release` unmounts it.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import structlog
import trio

import hdfs_fuse
from depsnap.cache import Cache
from depsnap.format import (
    Chunk,
    CorruptSnapshot,
    Manifest,
    Readable,
    bounded_map,
    chunk_data,
    read_exactly,
    read_manifest,
)
from depsnap.store import StoreUnavailable, open_store

log = structlog.get_logger("depsnap.lazy")

IMAGE_NAME = "image"
_IMAGE_INODE = pyfuse3.ROOT_INODE + 1
# Range reads of the chunks readers miss: a compressed chunk is a few
# stripes, fetched at once; no read-ahead (the fill streams the rest in
# order); few retries, since a reader waits behind every one.
_READER = hdfs_fuse.HdfsFuseConfig(stripe_size=1 << 20, streams=8, readahead=0, retries=3, io_timeout=10.0)
_FILL_WORKERS = 2
# Kernel requests served at once: read-ahead arrives as parallel requests.
_FUSE_TASKS = 16


@dataclass(frozen=True)
class Span:
    """Where chunk `index` lies in the image and in the snapshot file."""

    index: int
    image_offset: int
    size: int
    stored_offset: int
    length: int
    sha256: str


def spans(manifest: Manifest, data_offset: int) -> list[Span]:
    """Every chunk's place, from the manifest and where its first chunk starts."""
    found = []
    image_offset, stored_offset = 0, data_offset
    for index, chunk in enumerate(manifest.chunks):
        found.append(Span(index, image_offset, chunk.size, stored_offset, chunk.length, chunk.sha256))
        image_offset += chunk.size
        stored_offset += chunk.length
    return found


def covering(manifest: Manifest, offset: int, size: int) -> range:
    """Indices of the chunks that bytes [offset, offset+size) of the image lie in."""
    end = min(offset + size, manifest.image_size)
    if size <= 0 or offset >= end:
        return range(0)
    return range(offset // manifest.chunk_size, (end - 1) // manifest.chunk_size + 1)


def verified(frame: bytes, span: Span) -> bytes:
    """The image bytes of a fetched frame; CorruptSnapshot unless they match the digest."""
    return chunk_data(frame, Chunk(span.length, span.size, span.sha256), span.index)


class LazyImage:
    """The image, filled chunk by chunk into `fd` from `remote` (a snapshot
    file opened by range), each chunk fetched once however many want it."""

    def __init__(self, manifest: Manifest, data_offset: int, remote: hdfs_fuse.StripedFile, fd: int) -> None:
        self.manifest = manifest
        self.spans = spans(manifest, data_offset)
        self.remote = remote
        self.fd = fd
        self._present = [False] * len(self.spans)
        self._locks = [threading.Lock() for _ in self.spans]
        self.failure: Exception | None = None

    @property
    def complete(self) -> bool:
        return all(self._present)

    def has(self, indices: range) -> bool:
        return all(self._present[i] for i in indices)

    def load(self, index: int) -> None:
        """Make chunk `index` present, fetching it by range, or raise."""
        if self._present[index]:
            return
        with self._locks[index]:
            if self._present[index]:
                return
            span = self.spans[index]
            frame = self.remote.pread(span.length, span.stored_offset)
            if len(frame) != span.length:
                raise CorruptSnapshot(f"snapshot ends early, in chunk {index}")
            self._write(span, frame)

    def _write(self, span: Span, frame: bytes) -> None:
        os.pwrite(self.fd, verified(frame, span), span.image_offset)
        self._present[span.index] = True

    def _arrived(self, span: Span, frame: bytes) -> None:
        # A reader may have fetched it by range meanwhile.
        with self._locks[span.index]:
            if not self._present[span.index]:
                self._write(span, frame)

    def read(self, offset: int, size: int) -> bytes:
        for index in covering(self.manifest, offset, size):
            self.load(index)
        return os.pread(self.fd, size, offset)

    def fill(self, stream: Readable) -> bool:
        """Load every chunk from `stream`, the snapshot read front to back
        (one sequential read is cheaper than ranges), verifying a few at once.
        False if any chunk failed."""
        try:
            if read_manifest(stream, self.manifest.key) != self.manifest:
                raise CorruptSnapshot("the snapshot changed while it was being read")
            with ThreadPoolExecutor(_FILL_WORKERS, thread_name_prefix="fill", initializer=_background) as pool:
                frames = ((span, read_exactly(stream, span.length, f"chunk {span.index}")) for span in self.spans)
                for _ in bounded_map(pool, self._arrived, frames, 2 * _FILL_WORKERS):
                    pass
        except (OSError, CorruptSnapshot, StoreUnavailable) as exc:
            self.failure = exc
        return self.complete


def _background() -> None:
    """Lowest CPU priority for this thread: the fill must not slow the
    imports it runs beside (Linux nices threads one by one)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class ImageFS(pyfuse3.Operations):
    """A read-only directory holding one file, the image."""

    def __init__(self, image: LazyImage) -> None:
        super().__init__()
        self.image = image

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = inode
        if inode == pyfuse3.ROOT_INODE:
            attrs.st_mode = stat.S_IFDIR | 0o555
            attrs.st_nlink = 2
        else:
            attrs.st_mode = stat.S_IFREG | 0o444
            attrs.st_nlink = 1
            attrs.st_size = self.image.manifest.image_size
        # The file never changes: let the kernel keep its attributes and pages.
        attrs.entry_timeout = attrs.attr_timeout = 1 << 30
        return attrs

    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode not in (pyfuse3.ROOT_INODE, _IMAGE_INODE):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(inode)

    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE or name != IMAGE_NAME.encode():
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(_IMAGE_INODE)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_namemax = 255
        return data

    async def open(self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode != _IMAGE_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        if self.image.has(covering(self.image.manifest, off, size)):
            return os.pread(self.image.fd, size, off)
        try:
            return await trio.to_thread.run_sync(self.image.read, off, size)
        except (OSError, CorruptSnapshot) as exc:
            log.error("chunk unavailable, answering EIO", offset=off, size=size, reason=str(exc))
            raise pyfuse3.FUSEError(errno.EIO) from None


def _open_snapshot(uri: str, key: str) -> tuple[hdfs_fuse.StripedFile, Manifest, int]:
    remote = hdfs_fuse.open(uri, _READER)
    try:
        manifest = read_manifest(remote, key)
        return remote, manifest, remote.tell()
    except BaseException:
        remote.close()
        raise


def serve(store_uri: str, key: str, cache: Cache, mountpoint: Path, report: Callable[[str], None]) -> int:
    """Mount the snapshot of `key` in the store on `mountpoint`; `report`
    says "ok" once mounted or why not. Returns when the mount goes away."""
    try:
        store = open_store(store_uri)
        remote, manifest, data_offset = _open_snapshot(store.object_uri(key), key)
    except CorruptSnapshot as exc:
        report(f"corrupt {exc}")
        return 1
    except (OSError, StoreUnavailable) as exc:
        report(f"unavailable {exc}")
        return 1
    partial = cache.tmp / f"{key}.lazy.{os.getpid()}"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, manifest.image_size)
        image = LazyImage(manifest, data_offset, remote, fd)
        pyfuse3.init(ImageFS(image), str(mountpoint), {"ro", "fsname=depsnap", "subtype=depsnap"})
        report("ok")

        def fill() -> None:
            _background()
            try:
                stream = store.get(key)
                if stream is None:
                    raise StoreUnavailable("the snapshot left the store")
                with stream:
                    complete = image.fill(stream)
            except StoreUnavailable as exc:
                image.failure, complete = exc, False
            if complete:
                cache.put(key, partial)
                cache.evict(keep=key)
                log.info("image complete, now in the node cache", key=key)
                return
            log.error("background fill failed", key=key, reason=str(image.failure))
            if isinstance(image.failure, CorruptSnapshot):
                # The next node must miss and republish, not mount it again.
                try:
                    store.delete(key)
                except StoreUnavailable as exc:
                    log.warning("could not delete the corrupt snapshot", reason=str(exc))

        threading.Thread(target=fill, name="fill", daemon=True).start()
        try:
            trio.run(pyfuse3.main, 1, _FUSE_TASKS)
        finally:
            pyfuse3.close(unmount=False)
    finally:
        # `fd` stays open until the process exits: the fill may still be
        # writing to it, and a closed number could be reused under it.
        partial.unlink(missing_ok=True)
    return 0


@dataclass(frozen=True)
class Server:
    pid: int


def _read_answer(fd: int) -> str:
    with os.fdopen(fd, "rb") as answers:
        return answers.readline().decode().strip()


def start(store_uri: str, key: str, cache: Cache, mountpoint: Path, log_path: Path) -> Server:
    """Start a server for the snapshot of `key` in the store on `mountpoint`
    and wait until it is mounted. Raises CorruptSnapshot or StoreUnavailable
    if it cannot be.

    The server is a fork of this process, which has already imported what it
    needs: a fresh interpreter would spend ~0.3 s importing before mounting.
    (Forking with only C-level threads about, as multiprocessing does.)
    """
    answers, answer = os.pipe()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(answers)
            os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            _log_to(log_fd)
            code = serve(store_uri, key, cache, mountpoint, _reporter(answer))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(answer)
    os.close(log_fd)
    status, _, reason = _read_answer(answers).partition(" ")
    if status == "ok":
        return Server(pid)
    os.waitpid(pid, 0)
    if status == "corrupt":
        raise CorruptSnapshot(reason)
    raise StoreUnavailable(reason or "the lazy server exited before mounting")


def _log_to(fd: int) -> None:
    """Make `fd`, the server's log file, this process's stdout and stderr,
    and log there in JSON lines.

    The fork inherits the command's structlog set-up (bootseer's, which
    depsnap does not import), but its last processor may draw lines for a
    person (the command ran on a terminal); the log file is for machines, so
    the server keeps every processor but that renderer and renders JSON.
    """
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # The inherited sys.stderr need not write to fd 2 (pytest swaps in a file
    # of its own), and tracebacks and log lines must reach the log file. Never
    # closed: it is this process's stderr until it exits.
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    processors = structlog.get_config()["processors"][:-1]
    structlog.configure(
        processors=[*processors, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _reporter(fd: int) -> Callable[[str], None]:
    def report(line: str) -> None:
        os.write(fd, (line + "\n").encode())
        os.close(fd)

    return report
