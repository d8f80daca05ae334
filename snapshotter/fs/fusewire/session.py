"""A FUSE session on a /dev/fuse descriptor: one loop reads requests, each
request is handled in its own trio task, each reply goes out in one
writev. A request the filesystem can answer at once (Operations'
`*_now` methods) is answered in the loop itself, without a task.

The session can begin on a new connection (the kernel sends INIT first) or
on one another process already initialised (takeover: no INIT comes; we
ask the kernel with FUSE_NOTIFY_RESEND to queue again every request the
previous process read but never answered). INIT is answered whenever it
comes, so a process that died before answering it is taken over as well.

A handler's FUSEError answers that errno; any other exception answers EIO
with a log line. Nothing a handler does ends the loop: it ends when the
connection goes (unmount, abort: ENODEV), on DESTROY, or on `stop()`.
`stop()` is the graceful handoff: no request is read after it, the
requests already read are answered (up to `drain_s`), and the descriptor
stays open for the next incarnation to take.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import structlog
import trio

from snapshotter.fs.fusewire import protocol
from snapshotter.fs.fusewire.api import (
    EntryAttributes,
    FileBytes,
    FUSEError,
    NotNow,
    Operations,
    ReaddirToken,
    RequestContext,
    StatvfsData,
)
from snapshotter.fs.fusewire.protocol import InHeader, Opcode

log = structlog.get_logger("bootseer.fs")

PAGE = 4096

# Requests answered in the loop one after another without yielding, at
# most. A yield is a pass of trio's scheduler, which costs about what the
# rest of such a request does (it doubled a lookup's round trip); the loop
# yields anyway whenever it waits for the next request or starts a task
# (which then starts at once: a read's fetch or disk read).
BURST = 32

# FUSE requests read from every connection this process served, by opcode:
# what the kernel did not keep (the layer server's
# bootseer_fs_fuse_requests_total). A plain dict: a count costs about 60 ns;
# the layer server has one session, and sessions in threads of one process
# (tests) may at worst lose a count to each other.
REQUESTS: dict[int, int] = {}
# Of those, the ones answered in the read loop by a `*_now` method, likewise.
ANSWERED_NOW: dict[int, int] = {}


def requests_by_opcode(counts: dict[int, int] = REQUESTS) -> dict[str, int]:
    """REQUESTS (or ANSWERED_NOW) by opcode name, lower case ("lookup",
    "batch_forget"). From any thread: the copy is taken in one step, while
    the loop may add a key."""
    return {_opname(op).lower(): n for op, n in list(counts.items())}


@dataclass(frozen=True)
class SessionConfig:
    """What we ask for in INIT. A successor that takes the connection over
    must use the same values (the kernel keeps what INIT settled), which a
    constant default guarantees."""

    # Writes never come on a read-only mount, but the kernel refuses reads
    # of the device into a buffer smaller than max_write plus the headers.
    max_write: int = 128 << 10
    # Largest READ: max_pages pages (1 MiB).
    max_pages: int = 256
    # Outstanding asynchronous (read-ahead) requests the kernel allows.
    max_background: int = 64
    congestion_threshold: int = 48
    # None: what the kernel offers (the layer server raises the bdi's
    # read-ahead itself after INIT).
    max_readahead: int | None = None
    async_read: bool = True
    # Listings carry each entry's attributes (READDIRPLUS), so the kernel
    # does not look up, one by one, the names it has just listed.
    readdirplus: bool = True
    # False: GETXATTR answers ENOSYS, which the kernel remembers for the
    # connection's life (EOPNOTSUPP from then on, without asking): for a
    # mount whose files have no extended attributes, on which overlayfs
    # would otherwise probe every file it looks up. LISTXATTR is still
    # answered (an empty list), as overlayfs on a disk would.
    getxattr: bool = True

    @property
    def buffer_size(self) -> int:
        return max(protocol.MIN_READ_BUFFER, self.max_write + 2 * PAGE)


@dataclass
class Negotiated:
    """What INIT settled (only known to the process that answered it)."""

    minor: int
    flags: int
    max_readahead: int

    @property
    def resend(self) -> bool:
        return bool(self.flags & protocol.HAS_RESEND)


@dataclass
class SessionStats:
    requests: int = 0
    # Requests that came with the resend bit (queued again by the kernel).
    resent: int = 0
    # Requests answered EIO for an unexpected exception.
    failed: int = 0
    # Replies the kernel no longer wanted (interrupted, or answered by another).
    stale_replies: int = 0
    resend_requested: bool = False
    resend_supported: bool | None = None
    resent_ops: list[str] = field(default_factory=list)


class _Accepted(Enum):
    ANSWERED = "answered"  # or nothing to answer: read on
    TASK = "task"  # a handler's task started: let it run
    DESTROY = "destroy"


class Outcome(Enum):
    STOPPED = "stopped"  # stop(): the descriptor is left for a successor
    UNMOUNTED = "unmounted"  # the connection is gone
    DESTROYED = "destroyed"  # the kernel said DESTROY


_Handler = Callable[[InHeader, memoryview, RequestContext], Awaitable[Sequence[FileBytes]]]
_NowHandler = Callable[[InHeader, memoryview, RequestContext], Sequence[FileBytes]]


def _entry_out(attr: EntryAttributes) -> bytes:
    entry_s, entry_ns = protocol.split_timeout(attr.entry_timeout)
    attr_s, attr_ns = protocol.split_timeout(attr.attr_timeout)
    return protocol.ENTRY_OUT_HEAD.pack(attr.st_ino, attr.generation, entry_s, attr_s, entry_ns, attr_ns) + _attr(attr)


def _attr_out(attr: EntryAttributes) -> bytes:
    attr_s, attr_ns = protocol.split_timeout(attr.attr_timeout)
    return protocol.ATTR_OUT_HEAD.pack(attr_s, attr_ns, 0) + _attr(attr)


def _attr(attr: EntryAttributes) -> bytes:
    atime, atime_ns = divmod(attr.st_atime_ns, 1_000_000_000)
    mtime, mtime_ns = divmod(attr.st_mtime_ns, 1_000_000_000)
    ctime, ctime_ns = divmod(attr.st_ctime_ns, 1_000_000_000)
    return protocol.ATTR.pack(
        attr.st_ino,
        attr.st_size,
        attr.st_blocks,
        atime,
        mtime,
        ctime,
        atime_ns,
        mtime_ns,
        ctime_ns,
        attr.st_mode,
        attr.st_nlink,
        attr.st_uid,
        attr.st_gid,
        attr.st_rdev & 0xFFFFFFFF,
        attr.st_blksize,
        0,
    )


def _statfs_out(data: StatvfsData) -> bytes:
    return protocol.KSTATFS.pack(
        data.f_blocks,
        data.f_bfree,
        data.f_bavail,
        data.f_files,
        data.f_ffree,
        data.f_bsize,
        data.f_namemax,
        data.f_frsize,
        0,
    )


def _sized(value: bytes, size: int) -> Sequence[bytes]:
    """GETXATTR/LISTXATTR: size 0 asks how big; too small a buffer is ERANGE."""
    if size == 0:
        return [protocol.GETXATTR_OUT.pack(len(value), 0)]
    if len(value) > size:
        raise FUSEError(errno.ERANGE)
    return [value]


def _names(names: Sequence[bytes], size: int) -> Sequence[bytes]:
    return _sized(b"".join(name + b"\0" for name in names), size)


class Session:
    def __init__(self, ops: Operations, fd: int, config: SessionConfig | None = None) -> None:
        self.ops = ops
        self.fd = fd
        self.config = config or SessionConfig()
        self.stats = SessionStats()
        self.negotiated: Negotiated | None = None
        # Set once the connection can serve: INIT answered, or taken over.
        self.initialized = trio.Event()
        self._reading: trio.CancelScope | None = None
        self._stop_requested = False
        self._drain_s: float | None = None
        self._connected = True
        self._handlers: dict[int, _Handler] = {
            Opcode.LOOKUP: self._lookup,
            Opcode.GETATTR: self._getattr,
            Opcode.READLINK: self._readlink,
            Opcode.OPEN: self._open,
            Opcode.READ: self._read,
            # No FLUSH: ENOSYS once, and the kernel stops sending one per close.
            Opcode.RELEASE: self._release,
            Opcode.OPENDIR: self._opendir,
            Opcode.READDIR: self._readdir,
            Opcode.READDIRPLUS: self._readdirplus,
            Opcode.RELEASEDIR: self._releasedir,
            Opcode.STATFS: self._statfs,
            Opcode.GETXATTR: self._getxattr,
            Opcode.LISTXATTR: self._listxattr,
            Opcode.ACCESS: self._access,
        }
        self._now: dict[int, _NowHandler] = {
            Opcode.LOOKUP: self._lookup_now,
            Opcode.GETATTR: self._getattr_now,
            Opcode.READLINK: self._readlink_now,
            Opcode.GETXATTR: self._getxattr_now,
            Opcode.LISTXATTR: self._listxattr_now,
            Opcode.STATFS: self._statfs_now,
            Opcode.READ: self._read_now,
        }
        if not self.config.getxattr:
            del self._handlers[Opcode.GETXATTR], self._now[Opcode.GETXATTR]

    # -- the loop -------------------------------------------------------------

    async def serve(self, takeover: bool = False) -> Outcome:
        """Serve until the connection goes, DESTROY, or `stop()`.
        `takeover`: the connection was initialised by an earlier process."""
        buf = bytearray(self.config.buffer_size)
        view = memoryview(buf)
        outcome = Outcome.STOPPED
        async with trio.open_nursery() as nursery:
            if takeover:
                self.request_resend()
                self._ready()
            with trio.CancelScope() as self._reading:
                if self._stop_requested:
                    self._reading.cancel()
                unyielded = 0
                while True:
                    try:
                        n = os.readv(self.fd, [buf])
                    except BlockingIOError:
                        unyielded = 0
                        await trio.lowlevel.wait_readable(self.fd)
                        continue
                    except InterruptedError:
                        continue
                    except OSError as exc:
                        # ENOENT: the request was interrupted between being
                        # queued and read; try the next one.
                        if exc.errno == errno.ENOENT:
                            continue
                        if exc.errno == errno.ENODEV:
                            outcome = Outcome.UNMOUNTED
                            break
                        if exc.errno == errno.EINVAL:
                            log.error(
                                "the kernel refuses our device read buffer: the connection was "
                                "initialised with a larger max_write than this server's",
                                buffer=len(buf),
                            )
                        raise
                    data = bytes(view[:n])
                    try:
                        accepted = self._accept(nursery, data)
                    except struct.error as exc:
                        # Never from a sane kernel; one bad request must not
                        # end the loop (its reply, if it has one, is lost).
                        log.error("malformed FUSE request", length=n, error=str(exc))
                        accepted = _Accepted.ANSWERED
                    if accepted is _Accepted.DESTROY:
                        outcome = Outcome.DESTROYED
                        break
                    # Let handlers run (and stop() land) between reads,
                    # never inside one.
                    unyielded += 1
                    if accepted is _Accepted.TASK or unyielded >= BURST:
                        unyielded = 0
                        await trio.lowlevel.checkpoint()
            if outcome is not Outcome.STOPPED or not self._connected:
                # Nobody wants the answers any more.
                nursery.cancel_scope.cancel()
            elif self._drain_s is not None:
                # Requests not answered by then are the successor's to answer
                # (they stay in the kernel's processing queue until RESEND).
                nursery.cancel_scope.deadline = trio.current_time() + self._drain_s
        if not self._connected:
            outcome = Outcome.UNMOUNTED
        log.info(
            "FUSE session ended",
            outcome=outcome.value,
            requests=self.stats.requests,
            resent=self.stats.resent,
            failed=self.stats.failed,
        )
        return outcome

    def stop(self, drain_s: float | None = 10.0) -> None:
        """Stop reading requests (the handoff): serve() returns once those
        already read are answered, or after `drain_s`."""
        self._stop_requested = True
        self._drain_s = drain_s
        if self._reading is not None:
            self._reading.cancel()

    def request_resend(self) -> bool:
        """FUSE_NOTIFY_RESEND: the kernel queues again, with the resend bit
        set in their ids, the requests read from this connection and not yet
        answered. False where the kernel cannot (before 6.9)."""
        self.stats.resend_requested = True
        try:
            os.write(self.fd, protocol.out_header(0, protocol.Notify.RESEND, 0))
        except OSError as exc:
            self.stats.resend_supported = False
            log.warning(
                "the kernel cannot resend requests the previous server took: they wait until the mount goes",
                error=str(exc),
            )
            return False
        self.stats.resend_supported = True
        log.info("asked the kernel to resend unanswered requests")
        return True

    def _ready(self) -> None:
        if self.initialized.is_set():
            return
        self.initialized.set()
        try:
            self.ops.init()
        except Exception as exc:
            log.error("filesystem init failed", error=repr(exc), exc_info=exc)

    def _accept(self, nursery: trio.Nursery, data: bytes) -> _Accepted:
        """Answer one request, or start the task that will."""
        header = protocol.parse_header(data)
        body = memoryview(data)[protocol.IN_HEADER.size : header.length]
        self.stats.requests += 1
        op = header.opcode
        REQUESTS[op] = REQUESTS.get(op, 0) + 1
        if header.resent:
            self.stats.resent += 1
            name = _opname(header.opcode)
            if len(self.stats.resent_ops) < 100:
                self.stats.resent_ops.append(name)
            log.info("resent request", op=name, unique=hex(header.unique))
        if op == Opcode.INIT:
            # Inline: nothing else comes before it is answered.
            self._init(header, body)
        elif op == Opcode.FORGET:
            (nlookup,) = protocol.FORGET_IN.unpack_from(body)
            nursery.start_soon(self._forget, [(header.nodeid, nlookup)])
            return _Accepted.TASK
        elif op == Opcode.BATCH_FORGET:
            count, _ = protocol.BATCH_FORGET_IN.unpack_from(body)
            items = [
                protocol.FORGET_ONE.unpack_from(body, protocol.BATCH_FORGET_IN.size + i * protocol.FORGET_ONE.size)
                for i in range(count)
            ]
            nursery.start_soon(self._forget, items)
            return _Accepted.TASK
        elif op == Opcode.INTERRUPT:
            # Every request is answered anyway; an interrupted one's reply
            # is dropped by the kernel (ENOENT on write).
            pass
        elif op == Opcode.DESTROY:
            self._reply(header.unique, [])
            return _Accepted.DESTROY
        else:
            handler = self._handlers.get(op)
            if handler is None:
                code = errno.EROFS if op in protocol.MUTATING else errno.ENOSYS
                self._reply_error(header.unique, code)
            else:
                ctx = RequestContext(header.uid, header.gid, header.pid, 0)
                now = self._now.get(op)
                if now is None or not self._answered_now(now, header, body, ctx):
                    nursery.start_soon(self._run, handler, header, body, ctx)
                    return _Accepted.TASK
        return _Accepted.ANSWERED

    def _answered_now(self, now: _NowHandler, header: InHeader, body: memoryview, ctx: RequestContext) -> bool:
        try:
            payload = now(header, body, ctx)
        except NotNow:
            return False
        except Exception as exc:
            self._failed(header, exc)
        else:
            self._reply(header.unique, payload)
        ANSWERED_NOW[header.opcode] = ANSWERED_NOW.get(header.opcode, 0) + 1
        return True

    async def _run(self, handler: _Handler, header: InHeader, body: memoryview, ctx: RequestContext) -> None:
        try:
            payload = await handler(header, body, ctx)
        except Exception as exc:
            self._failed(header, exc)
        else:
            self._reply(header.unique, payload)

    def _failed(self, header: InHeader, exc: Exception) -> None:
        if isinstance(exc, FUSEError):
            self._reply_error(header.unique, exc.errno)
            return
        self.stats.failed += 1
        log.error(
            "FUSE request failed; answering EIO",
            op=_opname(header.opcode),
            nodeid=header.nodeid,
            error=repr(exc),
            exc_info=exc,
        )
        self._reply_error(header.unique, errno.EIO)

    async def _forget(self, items: Sequence[tuple[int, int]]) -> None:
        try:
            await self.ops.forget(items)
        except Exception as exc:
            log.error("forget failed", error=repr(exc), exc_info=exc)

    # -- replies ------------------------------------------------------------

    def _reply(self, unique: int, payload: Sequence[FileBytes]) -> None:
        length = sum(len(p) for p in payload)
        self._write([protocol.out_header(length, 0, unique), *payload], unique)

    def _reply_error(self, unique: int, code: int) -> None:
        self._write([protocol.out_header(0, -code, unique)], unique)

    def _write(self, parts: list[FileBytes], unique: int) -> None:
        if not self._connected:
            return
        try:
            os.writev(self.fd, parts)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                # Interrupted, or resent and answered by a successor.
                self.stats.stale_replies += 1
                log.debug("reply to a request the kernel no longer waits for", unique=hex(unique))
            elif exc.errno == errno.ENODEV:
                self._connected = False
                if self._reading is not None:
                    self._reading.cancel()
            else:
                log.error("the kernel refused a reply", unique=hex(unique), error=str(exc))

    # -- INIT -----------------------------------------------------------------

    def _init(self, header: InHeader, body: memoryview) -> None:
        if len(body) >= protocol.INIT_IN.size:
            major, minor, max_readahead, flags, flags2 = protocol.INIT_IN.unpack_from(body)
        else:
            major, minor, max_readahead, flags = protocol.INIT_IN_COMPAT.unpack_from(body)
            flags2 = 0
        cfg = self.config
        if major > protocol.KERNEL_VERSION:
            # The kernel falls back to our major and sends INIT again.
            reply = protocol.INIT_OUT.pack(protocol.KERNEL_VERSION, protocol.KERNEL_MINOR_MAX, *([0] * 11))
            self._reply(header.unique, [reply])
            return
        if major < protocol.KERNEL_VERSION or minor < protocol.KERNEL_MINOR_MIN:
            log.error("FUSE protocol too old", major=major, minor=minor)
            self._reply_error(header.unique, errno.EPROTO)
            return
        offered = flags | (flags2 << 32 if flags & protocol.INIT_EXT else 0)
        want = (
            protocol.PARALLEL_DIROPS
            | protocol.MAX_PAGES
            | protocol.CACHE_SYMLINKS
            | protocol.BIG_WRITES
            | protocol.ASYNC_DIO
            | protocol.HAS_RESEND
            | protocol.INIT_EXT
            | (protocol.ASYNC_READ if cfg.async_read else 0)
            | (protocol.DO_READDIRPLUS if cfg.readdirplus else 0)
            | protocol.AUTO_INVAL_DATA
        )
        chosen = want & offered
        readahead = max_readahead if cfg.max_readahead is None else min(max_readahead, cfg.max_readahead)
        negotiated_minor = min(minor, protocol.KERNEL_MINOR_MAX)
        reply = protocol.INIT_OUT.pack(
            protocol.KERNEL_VERSION,
            negotiated_minor,
            readahead,
            chosen & 0xFFFFFFFF,
            cfg.max_background,
            cfg.congestion_threshold,
            cfg.max_write,
            1,  # time_gran: nanoseconds
            cfg.max_pages,
            0,
            chosen >> 32,
            0,
            0,
        )
        self._reply(header.unique, [reply])
        self.negotiated = Negotiated(negotiated_minor, chosen, readahead)
        log.info(
            "FUSE connection initialised",
            kernel=f"{major}.{minor}",
            minor=negotiated_minor,
            flags=hex(chosen),
            resend=bool(chosen & protocol.HAS_RESEND),
            max_readahead=readahead,
            max_pages=cfg.max_pages,
        )
        # After the reply: the kernel settles read-ahead while processing it,
        # and init() may raise it.
        self._ready()

    # -- requests -------------------------------------------------------------

    async def _lookup(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        attr = await self.ops.lookup(h.nodeid, protocol.c_string(body), ctx)
        return [_entry_out(attr)]

    async def _getattr(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [_attr_out(await self.ops.getattr(h.nodeid, ctx))]

    async def _readlink(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [await self.ops.readlink(h.nodeid, ctx)]

    def _lookup_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [_entry_out(self.ops.lookup_now(h.nodeid, protocol.c_string(body), ctx))]

    def _getattr_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [_attr_out(self.ops.getattr_now(h.nodeid, ctx))]

    def _readlink_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [self.ops.readlink_now(h.nodeid, ctx)]

    async def _open(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        flags, _ = protocol.OPEN_IN.unpack_from(body)
        info = await self.ops.open(h.nodeid, flags, ctx)
        open_flags = (
            (protocol.FOPEN_DIRECT_IO if info.direct_io else 0)
            | (protocol.FOPEN_KEEP_CACHE if info.keep_cache else 0)
            | (protocol.FOPEN_NONSEEKABLE if info.nonseekable else 0)
        )
        return [protocol.OPEN_OUT.pack(info.fh, open_flags, 0)]

    async def _read(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[FileBytes]:
        fh, offset, size, *_ = protocol.READ_IN.unpack_from(body)
        # fh 0: the file was opened without OPEN (open answered ENOSYS).
        data = await self.ops.read(fh or h.nodeid, offset, size)
        return [data if len(data) <= size else data[:size]]

    def _read_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[FileBytes]:
        fh, offset, size, *_ = protocol.READ_IN.unpack_from(body)
        data = self.ops.read_now(fh or h.nodeid, offset, size)
        return [data if len(data) <= size else data[:size]]

    async def _release(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        fh, *_ = protocol.RELEASE_IN.unpack_from(body)
        await self.ops.release(fh)
        return []

    async def _opendir(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        fh = await self.ops.opendir(h.nodeid, ctx)
        return [protocol.OPEN_OUT.pack(fh, 0, 0)]

    async def _readdir(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return await self._list(h, body, plus=False)

    async def _readdirplus(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return await self._list(h, body, plus=True)

    async def _list(self, h: InHeader, body: memoryview, plus: bool) -> Sequence[bytes]:
        fh, offset, size, *_ = protocol.READ_IN.unpack_from(body)
        token = ReaddirToken(size, entry=_entry_out if plus else None)
        # fh 0: the directory was opened without OPENDIR (opendir answered ENOSYS).
        await self.ops.readdir(fh or h.nodeid, offset, token)
        return token.chunks

    async def _releasedir(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        fh, *_ = protocol.RELEASE_IN.unpack_from(body)
        await self.ops.releasedir(fh)
        return []

    async def _statfs(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [_statfs_out(await self.ops.statfs(ctx))]

    def _statfs_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        return [_statfs_out(self.ops.statfs_now(ctx))]

    async def _getxattr(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        size, _ = protocol.GETXATTR_IN.unpack_from(body)
        name = protocol.c_string(body, protocol.GETXATTR_IN.size)
        return _sized(await self.ops.getxattr(h.nodeid, name, ctx), size)

    async def _listxattr(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        size, _ = protocol.GETXATTR_IN.unpack_from(body)
        return _names(await self.ops.listxattr(h.nodeid, ctx), size)

    def _getxattr_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        size, _ = protocol.GETXATTR_IN.unpack_from(body)
        name = protocol.c_string(body, protocol.GETXATTR_IN.size)
        return _sized(self.ops.getxattr_now(h.nodeid, name, ctx), size)

    def _listxattr_now(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        size, _ = protocol.GETXATTR_IN.unpack_from(body)
        return _names(self.ops.listxattr_now(h.nodeid, ctx), size)

    async def _access(self, h: InHeader, body: memoryview, ctx: RequestContext) -> Sequence[bytes]:
        mask, _ = protocol.ACCESS_IN.unpack_from(body)
        if not await self.ops.access(h.nodeid, mask, ctx):
            raise FUSEError(errno.EACCES)
        return []


def _opname(opcode: int) -> str:
    try:
        return Opcode(opcode).name
    except ValueError:
        return str(opcode)
