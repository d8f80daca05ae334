"""The part of pyfuse3's interface the layer server uses, with the same
names, fields and call signatures, so a filesystem written for pyfuse3
switches to fusewire by changing its imports.

Differences that matter (docs/fuse-failover.md has the protocol subset):

- Listings go out as READDIRPLUS (SessionConfig.readdirplus): each entry
  carries its attributes and timeouts, so the kernel need not look the
  names up, and counts a lookup of each entry but "." and "..", which
  `forget` gives back like those of `lookup`.
- A handler's exception other than FUSEError answers EIO (with a log line)
  instead of ending the main loop; `forget` may raise without harm.
- `open` may answer ENOSYS: the kernel then opens files itself for the
  connection's life (no OPEN or RELEASE, page cache kept) and `read` gets
  the inode as `fh`. There is no `flush`: the kernel stops sending FLUSH
  after its first ENOSYS.
- `opendir` may answer ENOSYS likewise: no OPENDIR or RELEASEDIR, the
  kernel keeps listings (checking the directory's mtime first, as
  AUTO_INVAL_DATA asks) and `readdir` gets the inode as `fh`.
- `lookup` may return attributes with st_ino 0: a negative entry the
  kernel keeps for entry_timeout (as pyfuse3 allows).
- Beyond pyfuse3: `lookup_now`, `getattr_now`, `readlink_now`,
  `getxattr_now`, `listxattr_now`, `statfs_now` and `read_now` answer a request at
  once, in the session's read loop, when nothing needs waiting for; or
  raise NotNow, and the request goes to the async method as a task. Most
  requests of a start are such lookups and xattr probes (overlayfs asks
  one per lower file) and reads of cached bytes, and a task costs each of
  them a pass of the event loop.
"""

from __future__ import annotations

import errno as errnos
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from snapshotter.fs.fusewire import protocol

# A read's answer. A bytearray it hands over is the reply's own: a read
# from the page cache lands in one, and a bytes copy of it would allocate
# and copy every byte read once more (docs/benchmarks.md, bench-fuse).
FileBytes = bytes | bytearray

ROOT_INODE = protocol.ROOT_ID


class FUSEError(Exception):
    """Raised by a handler: the request fails with `errno`."""

    def __init__(self, errno: int) -> None:
        super().__init__(errno)
        self.errno = errno

    @property
    def errno_(self) -> int:
        return self.errno

    def __str__(self) -> str:
        return os.strerror(self.errno)


class NotNow(Exception):
    """Raised by a `*_now` method: answering needs waiting (a layer to
    load, a thread); the session runs the async method as a task instead."""


_U32 = (0, (1 << 32) - 1)
_U64 = (0, (1 << 64) - 1)
_S64 = (-(1 << 63), (1 << 63) - 1)
# The C types pyfuse3 stores these in: a value that does not fit fails
# where it is assigned, inside the handler (whose guard turns it into EIO
# and blames the right layer), not later while the reply is encoded.
_RANGES = {
    "st_ino": _U64,
    "generation": _U64,
    "st_mode": _U32,
    "st_nlink": _U32,
    "st_uid": _U32,
    "st_gid": _U32,
    "st_rdev": _U32,
    "st_size": _S64,
    "st_blksize": _U32,
    "st_blocks": _U64,
    "st_atime_ns": _S64,
    "st_mtime_ns": _S64,
    "st_ctime_ns": _S64,
    "st_birthtime_ns": _S64,
}


@dataclass
class EntryAttributes:
    """Attributes of a directory entry; pyfuse3's defaults. Integer fields
    are checked against their C types when assigned, as pyfuse3 does."""

    st_ino: int = 0
    generation: int = 0
    entry_timeout: float = 300.0
    attr_timeout: float = 300.0
    st_mode: int = stat.S_IFREG
    st_nlink: int = 1
    st_uid: int = 0
    st_gid: int = 0
    st_rdev: int = 0
    st_size: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_atime_ns: int = 0
    st_mtime_ns: int = 0
    st_ctime_ns: int = 0
    st_birthtime_ns: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        bounds = _RANGES.get(name)
        if bounds is not None:
            if not isinstance(value, int):
                raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
            if not bounds[0] <= value <= bounds[1]:
                raise OverflowError(f"{name}={value} is out of range")
        elif name in ("entry_timeout", "attr_timeout"):
            if not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, not {type(value).__name__}")
            value = float(value)
        object.__setattr__(self, name, value)


@dataclass
class FileInfo:
    fh: int = 0
    direct_io: bool = False
    keep_cache: bool = True
    nonseekable: bool = False


@dataclass
class StatvfsData:
    f_bsize: int = 0
    f_frsize: int = 0
    f_blocks: int = 0
    f_bfree: int = 0
    f_bavail: int = 0
    f_files: int = 0
    f_ffree: int = 0
    f_favail: int = 0
    f_namemax: int = 0


@dataclass(frozen=True)
class RequestContext:
    uid: int = 0
    gid: int = 0
    pid: int = 0
    umask: int = 0


@dataclass
class ReaddirToken:
    """Collects one READDIR reply, at most `size` bytes of dirents. For a
    READDIRPLUS reply, `entry` is the session's encoder of the entry (what
    a lookup answers) that goes before each dirent."""

    size: int
    chunks: list[bytes] = field(default_factory=list)
    used: int = 0
    entry: Callable[[EntryAttributes], bytes] | None = None


def readdir_reply(token: ReaddirToken, name: bytes, attr: EntryAttributes, next_id: int) -> bool:
    """Add an entry to the listing; False (and nothing added) once the
    kernel's buffer is full. `next_id` comes back as `start_id` to go on
    after this entry."""
    size = protocol.dirent_size(len(name)) if token.entry is None else protocol.direntplus_size(len(name))
    if token.used + size > token.size:
        return False
    if token.entry is not None:
        token.chunks.append(token.entry(attr))
    token.chunks.append(protocol.dirent(attr.st_ino, next_id, name, attr.st_mode))
    token.used += size
    return True


class Operations:
    """Base class of a filesystem: every request it does not override
    fails as pyfuse3's would (ENOSYS; EROFS never reaches it since the
    session answers writes itself)."""

    supports_dot_lookup = True

    def init(self) -> None:
        """The connection is ready: after INIT on a new mount, at once on a
        taken-over one."""

    async def lookup(self, parent_inode: int, name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errnos.ENOSYS)

    def lookup_now(self, parent_inode: int, name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise NotNow

    def getattr_now(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        raise NotNow

    def readlink_now(self, inode: int, ctx: RequestContext) -> bytes:
        raise NotNow

    def getxattr_now(self, inode: int, name: bytes, ctx: RequestContext) -> bytes:
        raise NotNow

    def listxattr_now(self, inode: int, ctx: RequestContext) -> Sequence[bytes]:
        raise NotNow

    def statfs_now(self, ctx: RequestContext) -> StatvfsData:
        raise NotNow

    def read_now(self, fh: int, off: int, size: int) -> FileBytes:
        raise NotNow

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return None

    async def getattr(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errnos.ENOSYS)

    async def readlink(self, inode: int, ctx: RequestContext) -> bytes:
        raise FUSEError(errnos.ENOSYS)

    async def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        raise FUSEError(errnos.ENOSYS)

    async def read(self, fh: int, off: int, size: int) -> FileBytes:
        raise FUSEError(errnos.ENOSYS)

    async def release(self, fh: int) -> None:
        return None

    async def opendir(self, inode: int, ctx: RequestContext) -> int:
        raise FUSEError(errnos.ENOSYS)

    async def readdir(self, fh: int, start_id: int, token: ReaddirToken) -> None:
        raise FUSEError(errnos.ENOSYS)

    async def releasedir(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        raise FUSEError(errnos.ENOSYS)

    async def getxattr(self, inode: int, name: bytes, ctx: RequestContext) -> bytes:
        raise FUSEError(errnos.ENOSYS)

    async def listxattr(self, inode: int, ctx: RequestContext) -> Sequence[bytes]:
        raise FUSEError(errnos.ENOSYS)

    async def access(self, inode: int, mode: int, ctx: RequestContext) -> bool:
        return True
