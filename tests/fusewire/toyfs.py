"""A small read-only filesystem served by the fusewire engine, as its own
process: `python -m tests.fusewire.toyfs --mountpoint M --holder SOCK --big FILE`.

It takes the connection over from the holder when the holder has one,
mounts afresh otherwise (and gives the holder a copy), prints READY once it
serves, and on SIGTERM stops reading, answers what it has read and exits,
leaving the mount to its successor. Its inodes are constants: any
incarnation answers for any inode the kernel remembers.

Tree (inode):
  /            1
  hello.txt    2   "hello, fusewire\\n", xattrs user.color=blue, user.empty=""
  big.bin      3   the bytes of --big (direct I/O: every read reaches us)
  sub/         4
  link         5   -> hello.txt
  sub/nested.txt 6 "nested\\n"
  many/        7   MANY empty files f0000... (inodes 1000...): listings span replies

`--slow-offset N --slow-s S --slow-marker PATH`: the first read of big.bin
that covers offset N touches PATH and then sleeps S seconds before
answering, so a test can kill the server with that request in flight.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import stat
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import trio

from snapshotter.fs import fusewire as fw
from snapshotter.fs.fusewire.connection import acquire, keep
from snapshotter.fs.fusewire.mount import MountOptions
from snapshotter.fs.fusewire.session import Session

HELLO = b"hello, fusewire\n"
NESTED = b"nested\n"
MTIME_NS = 1_700_000_000_123_456_789
OPTIONS = MountOptions(fsname="toyfs", subtype="toyfs")

ROOT, HELLO_INO, BIG_INO, SUB_INO, LINK_INO, NESTED_INO, MANY_INO = 1, 2, 3, 4, 5, 6, 7
MANY = 1000
MANY_FIRST_INO = 1000


@dataclass(frozen=True)
class Node:
    mode: int
    size: int
    children: tuple[tuple[bytes, int], ...] = ()
    target: bytes = b""
    xattrs: tuple[tuple[bytes, bytes], ...] = ()


@dataclass
class Slow:
    offset: int
    seconds: float
    marker: Path
    done: bool = False


class ToyFS(fw.Operations):
    def __init__(self, big: Path, slow: Slow | None = None) -> None:
        self.big_fd = os.open(big, os.O_RDONLY | os.O_CLOEXEC)
        self.slow = slow
        big_size = os.fstat(self.big_fd).st_size
        self.nodes = {
            ROOT: Node(
                stat.S_IFDIR | 0o755,
                0,
                (
                    (b"big.bin", BIG_INO),
                    (b"hello.txt", HELLO_INO),
                    (b"link", LINK_INO),
                    (b"many", MANY_INO),
                    (b"sub", SUB_INO),
                ),
            ),
            HELLO_INO: Node(stat.S_IFREG | 0o644, len(HELLO), xattrs=((b"user.color", b"blue"), (b"user.empty", b""))),
            BIG_INO: Node(stat.S_IFREG | 0o444, big_size),
            SUB_INO: Node(stat.S_IFDIR | 0o755, 0, ((b"nested.txt", NESTED_INO),)),
            LINK_INO: Node(stat.S_IFLNK | 0o777, len(b"hello.txt"), target=b"hello.txt"),
            NESTED_INO: Node(stat.S_IFREG | 0o644, len(NESTED)),
            MANY_INO: Node(
                stat.S_IFDIR | 0o755,
                0,
                tuple((f"f{i:04d}".encode(), MANY_FIRST_INO + i) for i in range(MANY)),
            ),
        }
        for i in range(MANY):
            self.nodes[MANY_FIRST_INO + i] = Node(stat.S_IFREG | 0o644, 0)
        self.parents = {SUB_INO: ROOT, MANY_INO: ROOT}

    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise fw.FUSEError(errno.ENOENT)
        return node

    def _attr(self, inode: int) -> fw.EntryAttributes:
        node = self._node(inode)
        return fw.EntryAttributes(
            st_ino=inode,
            st_mode=node.mode,
            st_nlink=2 if stat.S_ISDIR(node.mode) else 1,
            st_size=node.size,
            st_blocks=(node.size + 511) // 512,
            st_atime_ns=MTIME_NS,
            st_mtime_ns=MTIME_NS,
            st_ctime_ns=MTIME_NS,
            entry_timeout=60,
            attr_timeout=60,
        )

    async def lookup(self, parent_inode: int, name: bytes, ctx: fw.RequestContext) -> fw.EntryAttributes:
        for child, ino in self._node(parent_inode).children:
            if child == name:
                return self._attr(ino)
        raise fw.FUSEError(errno.ENOENT)

    async def getattr(self, inode: int, ctx: fw.RequestContext) -> fw.EntryAttributes:
        return self._attr(inode)

    async def readlink(self, inode: int, ctx: fw.RequestContext) -> bytes:
        node = self._node(inode)
        if not stat.S_ISLNK(node.mode):
            raise fw.FUSEError(errno.EINVAL)
        return node.target

    async def open(self, inode: int, flags: int, ctx: fw.RequestContext) -> fw.FileInfo:
        node = self._node(inode)
        if not stat.S_ISREG(node.mode):
            raise fw.FUSEError(errno.EISDIR)
        # The file handle is the inode: stable across incarnations.
        return fw.FileInfo(fh=inode, direct_io=inode == BIG_INO, keep_cache=inode != BIG_INO)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh == HELLO_INO:
            return HELLO[off : off + size]
        if fh == NESTED_INO:
            return NESTED[off : off + size]
        if fh != BIG_INO:
            raise fw.FUSEError(errno.EBADF)
        slow = self.slow
        if slow is not None and not slow.done and off <= slow.offset < off + size:
            slow.done = True
            slow.marker.write_text(f"{off}\n")
            await trio.sleep(slow.seconds)
        return os.pread(self.big_fd, size, off)

    async def opendir(self, inode: int, ctx: fw.RequestContext) -> int:
        if not stat.S_ISDIR(self._node(inode).mode):
            raise fw.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: fw.ReaddirToken) -> None:
        node = self._node(fh)
        entries = [(b".", fh), (b"..", self.parents.get(fh, ROOT)), *node.children]
        for n, (name, ino) in enumerate(entries[start_id:], start_id + 1):
            if not fw.readdir_reply(token, name, self._attr(ino), n):
                return

    async def statfs(self, ctx: fw.RequestContext) -> fw.StatvfsData:
        return fw.StatvfsData(
            f_bsize=4096,
            f_frsize=4096,
            f_blocks=1000,
            f_bfree=500,
            f_bavail=400,
            f_files=10,
            f_ffree=5,
            f_favail=5,
            f_namemax=255,
        )

    async def getxattr(self, inode: int, name: bytes, ctx: fw.RequestContext) -> bytes:
        for key, value in self._node(inode).xattrs:
            if key == name:
                return value
        raise fw.FUSEError(errno.ENODATA)

    async def listxattr(self, inode: int, ctx: fw.RequestContext) -> Sequence[bytes]:
        return [key for key, _ in self._node(inode).xattrs]


async def _serve(session: Session, takeover: bool) -> str:
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    session.stop()
                    return

        async def announce() -> None:
            await session.initialized.wait()
            print("READY", flush=True)

        nursery.start_soon(on_signal)
        nursery.start_soon(announce)
        outcome = await session.serve(takeover)
        nursery.cancel_scope.cancel()
    return outcome.value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mountpoint", type=Path, required=True)
    parser.add_argument("--holder", type=Path, required=True)
    parser.add_argument("--big", type=Path, required=True)
    parser.add_argument("--stats", type=Path)
    parser.add_argument("--slow-offset", type=int)
    parser.add_argument("--slow-s", type=float, default=3600.0)
    parser.add_argument("--slow-marker", type=Path)
    args = parser.parse_args(argv)
    slow = None
    if args.slow_offset is not None:
        slow = Slow(args.slow_offset, args.slow_s, args.slow_marker)
    conn = acquire(args.mountpoint, OPTIONS, holder_socket=args.holder)
    keep(conn, holder_socket=args.holder)
    print(f"CONNECTION {conn.source}", flush=True)
    session = Session(ToyFS(args.big, slow), conn.fd)
    outcome = trio.run(_serve, session, conn.takeover)
    stats = {"outcome": outcome, "source": conn.source, **asdict(session.stats)}
    if args.stats is not None:
        args.stats.write_text(json.dumps(stats))
    print("STATS " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
