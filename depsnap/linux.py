"""Linux interfaces the pod operations need and Python 3.11 lacks: the new
mount API, openat2, statx's mount id, pidfds and setns.

x86_64 and aarch64 share these syscall numbers (they were added after the
tables were unified), so one table serves both.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

_NR = {
    "pidfd_send_signal": 424,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "openat2": 437,
}
_NR_STATX = {"x86_64": 332, "aarch64": 291}

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_EMPTY_PATH = 0x40

FSCONFIG_SET_STRING = 1
FSCONFIG_SET_FD = 5
FSCONFIG_CMD_CREATE = 6

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4

_CLONE_FS = 0x200
_CLONE_NEWNS = 0x20000
_STATX_MNT_ID = 0x1000
_STATX_MNT_ID_OFFSET = 144
_SO_PEERPIDFD = 77


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _syscall(name: str, *args: object) -> int:
    return _check(_libc.syscall(_NR[name], *args), name)


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2): `path` resolved under `dir_fd` with the RESOLVE_* rules."""
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, 0, resolve)
    return _syscall("openat2", dir_fd, os.fsencode(path), how, len(how))


def mount_id(fd: int) -> int:
    """The id of the mount `fd` lives on (statx STATX_MNT_ID): unlike st_dev,
    it tells two mounts of one filesystem, and overlayfs files, apart."""
    buffer = ctypes.create_string_buffer(256)
    number = _NR_STATX.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"statx: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(number, fd, b"", AT_EMPTY_PATH, _STATX_MNT_ID, buffer), "statx")
    mask = int.from_bytes(buffer.raw[0:4], "little")
    if not mask & _STATX_MNT_ID:
        raise OSError(errno.ENOTSUP, "statx: this kernel reports no mount id")
    return int.from_bytes(buffer.raw[_STATX_MNT_ID_OFFSET : _STATX_MNT_ID_OFFSET + 8], "little")


def fsopen(fstype: str) -> int:
    return _syscall("fsopen", fstype.encode(), 1)  # FSOPEN_CLOEXEC


def fsconfig_string(fs_fd: int, key: str, value: str) -> None:
    _syscall("fsconfig", fs_fd, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0)


def fsconfig_fd(fs_fd: int, key: str, fd: int) -> None:
    _syscall("fsconfig", fs_fd, FSCONFIG_SET_FD, key.encode(), None, fd)


def fsconfig_create(fs_fd: int) -> None:
    _syscall("fsconfig", fs_fd, FSCONFIG_CMD_CREATE, None, None, 0)


def fsmount(fs_fd: int, attributes: int = 0) -> int:
    """A detached mount of the filesystem context `fs_fd`: in no mount table
    until move_mount attaches it."""
    return _syscall("fsmount", fs_fd, 1, attributes)  # FSMOUNT_CLOEXEC


def move_mount_fd(mount_fd: int, target_fd: int) -> None:
    """Attach the detached mount `mount_fd` on the directory `target_fd`
    (which must be in the calling thread's mount namespace)."""
    _syscall("move_mount", mount_fd, b"", target_fd, b"", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)


def pidfd_alive(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has not exited (signal 0 checks, sends nothing)."""
    try:
        _syscall("pidfd_send_signal", pidfd, 0, None, 0)
    except ProcessLookupError:
        return False
    return True


T = TypeVar("T")


def in_mount_namespace(pidfd: int, work: Callable[[], T]) -> T:
    """Run `work` in a fresh thread that has entered the mount namespace of
    the process behind `pidfd`.

    A thread, because setns(CLONE_NEWNS) changes only the calling thread; it
    first unshares its filesystem attributes (root, cwd), which the kernel
    requires and which keeps the daemon's other threads where they are. The
    thread ends with `work`, so nothing else ever runs in that namespace.
    setns on a pidfd (Linux 5.8+) names the process itself, not a pid that
    could have been reused.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)")
            _check(_libc.setns(pidfd, _CLONE_NEWNS), "setns(CLONE_NEWNS)")
            outcome.append(work())
        except BaseException as exc:  # handed to the calling thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="depsnap-setns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


class PeerGone(Exception):
    """The process at the other end of the socket exited (or never was one)."""


@dataclass
class Peer:
    """The process that connected to the daemon's socket, pinned: `pidfd` is
    that process and no other, and `proc_fd` is its /proc directory, whose
    lookups fail rather than reach another process once it exits."""

    pid: int
    uid: int
    gid: int
    pidfd: int
    proc_fd: int

    def close(self) -> None:
        os.close(self.pidfd)
        os.close(self.proc_fd)


def _pidfd_pid(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as info:
        for line in info:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise PeerGone("the kernel did not say which process the peer is")


def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        # The command name may hold spaces and parentheses: fields count from the last ')'.
        return int(stat.read().rsplit(")", 1)[1].split()[19])


def peer(conn: socket.socket, accepted_boottime: float) -> Peer:
    """Identify and pin the peer of the unix socket `conn`.

    SO_PEERPIDFD (Linux 6.5+) hands over a pidfd of the process that
    connected, so a pid reused after it exited can never be mistaken for it.
    Older kernels get SO_PEERCRED's pid, a pidfd_open of it, and a check that
    the process behind it started before the connection was accepted
    (`accepted_boottime`, CLOCK_BOOTTIME seconds): a process that reused the
    pid later cannot pass.
    """
    uid_pid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    cred_pid, uid, gid = struct.unpack("3i", uid_pid)
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        pinned = True
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise PeerGone("the caller exited before it could be identified") from None
        if exc.errno != errno.ENOPROTOOPT:
            raise
        pinned = False
        if cred_pid <= 0:
            raise PeerGone("the socket's peer has no process") from None
        try:
            pidfd = os.pidfd_open(cred_pid)
        except ProcessLookupError:
            raise PeerGone("the caller exited before it could be identified") from None
    try:
        pid = _pidfd_pid(pidfd)
        if pid <= 0:
            raise PeerGone("the caller exited before it could be identified")
        try:
            proc_fd = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PeerGone("the caller exited before it could be identified") from None
        # Only now is the /proc directory known to be the pidfd's process:
        # while that process lives, its pid names nobody else.
        if not pidfd_alive(pidfd):
            os.close(proc_fd)
            raise PeerGone("the caller exited before it could be identified")
        if not pinned:
            ticks = os.sysconf("SC_CLK_TCK")
            if _start_ticks(pid) > accepted_boottime * ticks:
                os.close(proc_fd)
                raise PeerGone("the caller's pid was reused before it could be identified")
    except BaseException:
        os.close(pidfd)
        raise
    return Peer(pid=pid, uid=uid, gid=gid, pidfd=pidfd, proc_fd=proc_fd)


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)
