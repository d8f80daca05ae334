"""The read-only FUSE filesystem over a remote prefix (pyfuse3, trio).

Directory listings and attributes come from the remote store and are kept
for `attr_ttl`; the kernel is told the same TTL. A read whose bytes lie in a
stripe that has arrived is answered on the trio loop with a view of the
stripe (no copy, no thread); any other read waits for its stripes in a
worker thread, so the loop keeps taking the kernel's parallel read-ahead
requests while stripes are in flight. Arriving stripes are also pushed into
the kernel's page cache (see `pagecache`), and a job may have a whole file
fetched ahead of its read (see `prefetch`). Anything
that would write gets EROFS (the mount is also `ro`, so the kernel mostly
refuses before asking).
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import pyfuse3
import structlog
import trio
from prometheus_client import Histogram

import eventlog
from hdfs_fuse import prefetch, prefetch_client
from hdfs_fuse import uri as uri_mod
from hdfs_fuse.backends.interface import Entry
from hdfs_fuse.pagecache import PageCacheFiller
from hdfs_fuse.reader import Client, StripedReader
from hdfs_fuse.striping import ReorderTolerantReadAhead

log = structlog.get_logger("bootseer.hdfs_fuse.mount")

FUSE_READ_BYTES = Histogram(
    "bootseer_hdfs_fuse_fuse_read_request_bytes",
    "Size of the read requests the kernel sends the mount.",
    buckets=(4096, 32768, 131072, 262144, 524288, 1048576, 4194304),
)


@dataclass
class Node:
    location: uri_mod.Location
    entry: Entry
    inode: int


@dataclass
class Handle:
    reader: StripedReader
    pattern: ReorderTolerantReadAhead
    inode: int
    # Lets go of the reader: closes it, or leaves the prefetch it shares.
    close: Callable[[], None]
    # End of the latest read asked through this handle: where its reader is.
    reach: int = 0
    # For the event record: when, and by whose cgroup (its container), it was opened.
    opened_at: float = 0.0
    cgroup: str = ""


@dataclass
class Listing:
    expires: float
    entries: list[Entry] = field(default_factory=list)


def _to_fuse_error(exc: BaseException) -> pyfuse3.FUSEError:
    if isinstance(exc, OSError) and exc.errno:
        return pyfuse3.FUSEError(exc.errno)
    return pyfuse3.FUSEError(errno.EIO)


class RemoteFS(pyfuse3.Operations):
    def __init__(self, client: Client, root: uri_mod.Location) -> None:
        super().__init__()
        self.client = client
        self.ttl = client.config.attr_ttl
        self.uid, self.gid = os.getuid(), os.getgid()
        root_entry = client.stat(root)
        # A file URI mounts as a directory holding just that file.
        self.single_file = not root_entry.is_dir
        root_dir = Entry(name="", is_dir=True, size=0, mtime=root_entry.mtime)
        self.nodes: dict[int, Node] = {pyfuse3.ROOT_INODE: Node(root, root_dir, pyfuse3.ROOT_INODE)}
        self._inode_of: dict[tuple[int, str], int] = {}
        self._next_inode = itertools.count(pyfuse3.ROOT_INODE + 1)
        self._listings: dict[int, Listing] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = itertools.count(1)
        # Version each file had when last opened: the kernel may keep its
        # page cache across opens only while the remote file is unchanged.
        self._opened_versions: dict[int, str] = {}
        self._lock = threading.Lock()
        self.filler = PageCacheFiller() if client.config.page_cache_push else None
        # The latest prefetch of each inode asked for one (running or ended, for its status).
        self._prefetches: dict[int, prefetch.Prefetch] = {}
        # How far past a reader's latest read the kernel may already hold
        # pages for reads it has not sent yet: two read-ahead windows, a stripe.
        config = client.config
        self._push_margin = 2 * max(config.kernel_readahead, 128 * 1024) + config.stripe_size
        self.initialized = trio.Event()

    def init(self) -> None:
        # Called while the kernel's INIT is being answered, in the trio thread.
        self.initialized.set()

    # --- attributes and listings -----------------------------------------------------

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        entry = node.entry
        attrs.st_ino = node.inode
        attrs.st_mode = (stat.S_IFDIR | 0o555) if entry.is_dir else (stat.S_IFREG | 0o444)
        attrs.st_nlink = 2 if entry.is_dir else 1
        attrs.st_uid, attrs.st_gid = self.uid, self.gid
        attrs.st_size = entry.size
        attrs.st_blksize = self.client.config.stripe_size
        attrs.st_blocks = -(-entry.size // 512)
        mtime_ns = int(entry.mtime * 1e9)
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = mtime_ns
        attrs.attr_timeout = attrs.entry_timeout = self.ttl
        return attrs

    def _listing_sync(self, inode: int) -> list[Entry]:
        now = time.monotonic()
        cached = self._listings.get(inode)
        if cached is not None and cached.expires > now:
            return cached.entries
        node = self.nodes[inode]
        if self.single_file and inode == pyfuse3.ROOT_INODE:
            entries = [self.client.stat(node.location)]
        else:
            entries = sorted(self.client.list(node.location), key=lambda e: e.name)
        self._listings[inode] = Listing(now + self.ttl, entries)
        return entries

    def _child_location(self, parent: int, name: str) -> uri_mod.Location:
        node = self.nodes[parent]
        if self.single_file and parent == pyfuse3.ROOT_INODE:
            return node.location
        return node.location.child(name)

    def _node_for(self, parent: int, entry: Entry) -> Node:
        location = self._child_location(parent, entry.name)
        with self._lock:
            inode = self._inode_of.get((parent, entry.name))
            if inode is None:
                inode = next(self._next_inode)
                self._inode_of[(parent, entry.name)] = inode
            node = Node(location, entry, inode)
            self.nodes[inode] = node
        return node

    async def _listing(self, inode: int) -> list[Entry]:
        try:
            return await trio.to_thread.run_sync(self._listing_sync, inode)
        except (OSError, ValueError) as exc:
            log.warning("listing failed", inode=inode, error=str(exc))
            raise _to_fuse_error(exc) from exc

    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        if parent_inode not in self.nodes or not self.nodes[parent_inode].entry.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        decoded = os.fsdecode(name)
        if decoded == ".":
            return self._attrs(self.nodes[parent_inode])
        for entry in await self._listing(parent_inode):
            if entry.name == decoded:
                return self._attrs(self._node_for(parent_inode, entry))
        raise pyfuse3.FUSEError(errno.ENOENT)

    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(node)

    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if not node.entry.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = await self._listing(fh)
        for index in range(start_id, len(entries)):
            node = self._node_for(fh, entries[index])
            if not pyfuse3.readdir_reply(token, os.fsencode(entries[index].name), self._attrs(node), index + 1):
                return

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        # Overlayfs and df need an answer; a remote store has no free space to report.
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_namemax = 255
        return data

    # --- reading ---------------------------------------------------------------------

    async def open(self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.entry.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        try:
            reader = await trio.to_thread.run_sync(self.client.reader, node.location)
        except (OSError, ValueError) as exc:
            log.warning("open failed", uri=str(node.location), error=str(exc))
            raise _to_fuse_error(exc) from exc
        previous = self._opened_versions.get(inode)
        self._opened_versions[inode] = reader.remote.version
        close = reader.close
        running = self._prefetches.get(inode)
        shared = running.join() if running is not None and running.version == reader.remote.version else None
        if running is not None and shared is not None:
            # Its stripes in flight are this reader's next ones: fetched once.
            await trio.to_thread.run_sync(reader.close)
            reader, close = shared, running.leave
        elif self.filler is not None:
            reader.on_fetched = self._pusher(inode, reader)
        fh = next(self._next_fh)
        self._handles[fh] = Handle(
            reader, reader.new_pattern(), inode, close, opened_at=eventlog.now(), cgroup=eventlog.cgroup_of(ctx.pid)
        )
        if reader.size != node.entry.size:
            node.entry = Entry(node.entry.name, False, reader.size, node.entry.mtime, reader.remote.version)
        return pyfuse3.FileInfo(fh=fh, keep_cache=previous == reader.remote.version)

    def _pusher(self, inode: int, reader: StripedReader) -> Callable[[int, int, bytes | bytearray], None]:
        filler = self.filler
        assert filler is not None
        version = reader.remote.version

        def on_fetched(index: int, start: int, data: bytes | bytearray) -> None:
            filler.offer(
                inode,
                start,
                data,
                stored=lambda n: reader.pushed(index, n),
                wanted=lambda: self._push_wanted(inode, version, start),
            )

        return on_fetched

    def _push_wanted(self, inode: int, version: str, start: int) -> bool:
        # Only bytes of the version readers open now (a reader of a newer one
        # must not find these), and only well beyond where every reader of the
        # file is: the kernel locks the pages of a read until it is answered,
        # and a push into them waits for that answer, uninterruptibly, and for
        # ever if the daemon is being killed.
        if self._opened_versions.get(inode) != version:
            return False
        return all(start >= h.reach + self._push_margin for h in list(self._handles.values()) if h.inode == inode)

    def _pread(self, handle: Handle, offset: int, size: int) -> memoryview:
        buffer = bytearray(max(0, min(size, handle.reader.size - offset)))
        n = handle.reader.readinto(offset, memoryview(buffer), handle.pattern)
        return memoryview(buffer)[:n]

    # A view, not bytes: pyfuse3 replies with any buffer (its stub says bytes),
    # and answering with a view of the stripe is what saves the copy.
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> memoryview:  # type: ignore[override]
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        FUSE_READ_BYTES.observe(size)
        handle.reach = off + size
        try:
            view = handle.reader.peek(off, size, handle.pattern)
            if view is not None:
                return view
            return await trio.to_thread.run_sync(self._pread, handle, off, size)
        except OSError as exc:
            log.error("read failed", uri=handle.reader.uri, offset=off, size=size, error=str(exc))
            raise _to_fuse_error(exc) from exc

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        await trio.to_thread.run_sync(handle.close)
        stats = handle.reader.stats
        if stats.served_bytes:
            log.info(
                "file closed",
                uri=handle.reader.uri,
                served_bytes=stats.served_bytes,
                fetched_bytes=stats.fetched_bytes,
                mb_per_s=round(stats.throughput() / 1e6, 1),
                retries=stats.retries,
                hedges=stats.hedges,
                readahead_hit_bytes=stats.readahead_hit_bytes,
                readahead_waste_bytes=stats.readahead_waste_bytes,
                pushed_bytes=stats.pushed_bytes,
            )
            # One record per file read, at its close: the checkpoint's bytes and throughput.
            eventlog.emit(
                "hdfs_fuse.file",
                uri=handle.reader.uri,
                served_bytes=stats.served_bytes,
                fetched_bytes=stats.fetched_bytes,
                cache_hit_bytes=stats.cache_hit_bytes,
                retries=stats.retries,
                hedges=stats.hedges,
                failures=stats.failures,
                start=handle.opened_at,
                end=eventlog.now(),
                cgroup=handle.cgroup,
            )

    def stop_pushing(self) -> None:
        """Stop prefetches and pushes into the page cache. Call while the mount
        still answers reads (a push may be waiting for one)."""
        for running in list(self._prefetches.values()):
            running.stop()
        if self.filler is not None:
            self.filler.close()

    def close_all(self) -> None:
        self.stop_pushing()
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    # --- prefetch (extended attributes) ----------------------------------------------

    async def getxattr(self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext) -> bytes:
        decoded = os.fsdecode(name)
        if decoded not in (prefetch_client.XATTR, prefetch_client.STATUS_XATTR):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.entry.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        known = self._prefetches.get(inode)
        if decoded == prefetch_client.STATUS_XATTR:
            return (known.status() if known is not None else "none").encode()
        if known is not None and known.state is prefetch.State.RUNNING:
            return known.status().encode()
        return (await self._start_prefetch(node, ctx)).encode()

    async def _start_prefetch(self, node: Node, ctx: pyfuse3.RequestContext) -> str:
        """The new prefetch's status; a store that cannot open the file
        fails it at once, and the answer says why."""
        try:
            reader = await trio.to_thread.run_sync(self.client.reader, node.location)
        except (OSError, ValueError) as exc:
            log.warning("prefetch: open failed", uri=str(node.location), error=str(exc))
            why = f"cannot open {node.location}: {exc}"
            return prefetch_client.Status(prefetch.State.FAILED.value, 0, node.entry.size, why).text()
        inode, version = node.inode, reader.remote.version
        # A reader opening the file later must keep the pages pushed for it.
        self._opened_versions[inode] = version

        def handover() -> None:
            if self.filler is not None:
                reader.on_fetched = self._pusher(inode, reader)

        started = prefetch.Prefetch(
            inode,
            reader,
            wanted=lambda start: self._push_wanted(inode, version, start),
            handover=handover,
            cgroup=eventlog.cgroup_of(ctx.pid),
        )
        self._prefetches[inode] = started
        log.info("prefetch started", uri=reader.uri, size=reader.size)
        started.start()
        return started.status()

    # --- everything that writes ------------------------------------------------------

    async def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = create = mknod = mkdir = symlink = link = _read_only
    unlink = rmdir = rename = write = setxattr = removexattr = _read_only
