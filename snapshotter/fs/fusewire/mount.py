"""Mounting and unmounting a FUSE filesystem without libfuse: open
/dev/fuse, mount(2) with the descriptor in the options, umount2(2).

We are root (the layer server always is), so fusermount3's setuid dance is
not needed, and doing it ourselves keeps the descriptor in our hands from
the first instant: the descriptor is the connection, and keeping it alive
is the whole point of fusewire.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("bootseer.fs")

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


@dataclass(frozen=True)
class MountOptions:
    """What the mount looks like: `fsname` is the source column of
    /proc/mounts; the type is fuse.<subtype>."""

    fsname: str = "bootseer"
    subtype: str = "bootseer"
    read_only: bool = True
    allow_other: bool = True
    default_permissions: bool = True
    # Upper bound of one READ request (bytes); None: the kernel's (max_pages).
    max_read: int | None = None

    @property
    def fstype(self) -> str:
        return f"fuse.{self.subtype}" if self.subtype else "fuse"

    def data(self, fd: int) -> str:
        opts = [f"fd={fd}", "rootmode=40000", f"user_id={os.getuid()}", f"group_id={os.getgid()}"]
        if self.allow_other:
            opts.append("allow_other")
        if self.default_permissions:
            opts.append("default_permissions")
        if self.max_read is not None:
            opts.append(f"max_read={self.max_read}")
        return ",".join(opts)


def mount(mountpoint: Path, options: MountOptions) -> int:
    """Mount a new FUSE connection at `mountpoint`; its /dev/fuse descriptor
    (non-blocking, close-on-exec). The kernel has queued INIT on it."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if options.read_only else 0)
        rc = _libc.mount(
            options.fsname.encode(),
            os.fsencode(mountpoint),
            options.fstype.encode(),
            flags,
            options.data(fd).encode(),
        )
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {mountpoint}: {os.strerror(err)}")
    except BaseException:
        os.close(fd)
        raise
    log.info("mounted", mountpoint=str(mountpoint), fstype=options.fstype, fd=fd)
    return fd


def unmount(mountpoint: Path, lazy: bool = False) -> None:
    """umount2(2); a mountpoint with nothing mounted is not an error. `lazy`
    detaches even while files on it are open (MNT_DETACH)."""
    rc = _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, f"umount {mountpoint}: {os.strerror(err)}")
    log.info("unmounted", mountpoint=str(mountpoint), lazy=lazy)


def prepare_descriptor(fd: int) -> None:
    """A descriptor handed over by the holder or systemd: make it what
    `mount` gives (non-blocking, close-on-exec). O_NONBLOCK lives on the
    open file, which the holder shares: harmless, it never reads."""
    os.set_blocking(fd, False)
    os.set_inheritable(fd, False)
