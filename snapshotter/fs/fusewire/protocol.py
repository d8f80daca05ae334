"""The FUSE wire format: opcodes, flags and the structs a read-only
filesystem exchanges with the kernel over /dev/fuse.

Layouts follow the kernel's include/uapi/linux/fuse.h (protocol 7.41 on
this kernel). The system header here is older (7.38), so the constants that
came later (resend, 7.40) are defined by value. Every struct is
little-endian on the architectures we run on and native-aligned without
padding surprises, which `=` (native order, no alignment) expresses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

KERNEL_VERSION = 7
# The newest minor we answer INIT with. Nothing a read-only filesystem sends
# changes layout between 7.31 and 7.41; 7.41 is where resend was added.
KERNEL_MINOR_MAX = 41
# The oldest minor whose struct sizes we speak (fuse_init_out's flags2 and
# max_pages; 64-byte fuse_init_out).
KERNEL_MINOR_MIN = 31

ROOT_ID = 1

# The request id's top bit marks a request the kernel resends after
# FUSE_NOTIFY_RESEND; a reply must carry the id exactly as received.
UNIQUE_RESEND = 1 << 63
# The id's low bit marks an INTERRUPT for the request with the same id.
INT_REQ_BIT = 1

MIN_READ_BUFFER = 8192


class Opcode(IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52


# Opcodes that would change the filesystem: EROFS, as a read-only mount says.
MUTATING = frozenset(
    {
        Opcode.SETATTR,
        Opcode.SYMLINK,
        Opcode.MKNOD,
        Opcode.MKDIR,
        Opcode.UNLINK,
        Opcode.RMDIR,
        Opcode.RENAME,
        Opcode.LINK,
        Opcode.WRITE,
        Opcode.SETXATTR,
        Opcode.REMOVEXATTR,
        Opcode.CREATE,
        Opcode.FALLOCATE,
        Opcode.RENAME2,
        Opcode.COPY_FILE_RANGE,
        Opcode.TMPFILE,
    }
)


class Notify(IntEnum):
    POLL = 1
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4
    RETRIEVE = 5
    DELETE = 6
    RESEND = 7


# INIT flags (flags | flags2 << 32).
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
# The kernel checks a file's (a directory's) mtime before trusting its
# cached pages (listing), so a changed one is read afresh.
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
INIT_EXT = 1 << 30
HAS_RESEND = 1 << 39

# OPEN reply flags.
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3

IN_HEADER = struct.Struct("=IIQQIIIHH")
OUT_HEADER = struct.Struct("=IiQ")
INIT_IN = struct.Struct("=IIIII44x")
INIT_IN_COMPAT = struct.Struct("=IIII")
INIT_OUT = struct.Struct("=IIIIHHIIHHIIH22x")
# Times are signed in the kernel (time64), whatever the header says.
ATTR = struct.Struct("=QQQqqqIIIIIIIIII")
ENTRY_OUT_HEAD = struct.Struct("=QQQQII")
ATTR_OUT_HEAD = struct.Struct("=QII")
FORGET_IN = struct.Struct("=Q")
BATCH_FORGET_IN = struct.Struct("=II")
FORGET_ONE = struct.Struct("=QQ")
GETATTR_IN = struct.Struct("=IIQ")
OPEN_IN = struct.Struct("=II")
OPEN_OUT = struct.Struct("=QIi")
READ_IN = struct.Struct("=QQIIQII")
RELEASE_IN = struct.Struct("=QIIQ")
GETXATTR_IN = struct.Struct("=II")
GETXATTR_OUT = struct.Struct("=II")
ACCESS_IN = struct.Struct("=II")
INTERRUPT_IN = struct.Struct("=Q")
KSTATFS = struct.Struct("=QQQQQIIII24x")
DIRENT_HEAD = struct.Struct("=QQII")

assert IN_HEADER.size == 40
assert OUT_HEADER.size == 16
assert INIT_OUT.size == 64
assert ATTR.size == 88
assert ENTRY_OUT_HEAD.size + ATTR.size == 128
assert KSTATFS.size == 80


@dataclass(frozen=True)
class InHeader:
    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int

    @property
    def resent(self) -> bool:
        return bool(self.unique & UNIQUE_RESEND)


def parse_header(buf: bytes | memoryview) -> InHeader:
    length, opcode, unique, nodeid, uid, gid, pid, _extlen, _pad = IN_HEADER.unpack_from(buf)
    return InHeader(length, opcode, unique, nodeid, uid, gid, pid)


def out_header(length: int, error: int, unique: int) -> bytes:
    """`error`: 0 or a negative errno (a reply), or a notify code with unique 0."""
    return OUT_HEADER.pack(OUT_HEADER.size + length, error, unique)


def dirent_size(name_len: int) -> int:
    return (DIRENT_HEAD.size + name_len + 7) & ~7


def direntplus_size(name_len: int) -> int:
    return ENTRY_OUT_HEAD.size + ATTR.size + dirent_size(name_len)


def dirent(ino: int, off: int, name: bytes, mode: int) -> bytes:
    """One fuse_dirent, padded to 8 bytes; `mode` gives the DT_* type."""
    head = DIRENT_HEAD.pack(ino, off, len(name), (mode & 0o170000) >> 12)
    pad = dirent_size(len(name)) - DIRENT_HEAD.size - len(name)
    return head + name + b"\0" * pad


def c_string(body: bytes | memoryview, start: int = 0) -> bytes:
    """A NUL-terminated name from a request body."""
    raw = bytes(body[start:])
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


def split_timeout(seconds: float) -> tuple[int, int]:
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)
