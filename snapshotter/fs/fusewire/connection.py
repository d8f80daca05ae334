"""Where a server's FUSE connection comes from, and where it goes when the
server stops.

At start (`acquire`), in this order: the descriptor systemd kept
(LISTEN_FDNAMES has the connection's name, "fuse" for the layer mount), the
one the holder keeps, else a fresh mount.
The first two are takeovers: the connection is already initialised, the
session must not expect INIT and asks the kernel to resend what the dead
process left unanswered. After a fresh mount, `keep` hands a copy to
systemd or the holder at once, before INIT is even answered, so even a
crash in the first request leaves the mount alive.

At a graceful stop the server just stops reading and exits (the keeper
still has its copy): that is the restart. Only the final stop (`release`
with unmount=True) unmounts and tells the keeper to let go.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from snapshotter.fs.fusewire import handoff
from snapshotter.fs.fusewire.handoff import Notify
from snapshotter.fs.fusewire.mount import MountOptions, mount, prepare_descriptor, unmount

log = structlog.get_logger("bootseer.fs")


class MountpointBusy(Exception):
    """A live mount is at the mountpoint and no keeper has its descriptor:
    most likely another server runs it."""


@dataclass
class Connection:
    fd: int
    mountpoint: Path
    # "systemd", "holder" or "mount" (fresh).
    source: str
    # Its name in systemd's descriptor store.
    name: str = handoff.FDNAME

    @property
    def takeover(self) -> bool:
        return self.source != "mount"


def mounted_fstype(mountpoint: Path) -> str | None:
    """The type of the filesystem mounted right at `mountpoint` (the top of
    the stack), from /proc/self/mountinfo; None if nothing is. Nothing
    here touches the mount itself: until we serve it, a stat of it would
    wait for us."""
    absolute = Path(os.path.abspath(mountpoint))
    target = os.path.join(os.path.realpath(absolute.parent), absolute.name)
    found = None
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and _unescape(fields[4]) == target:
                found = right.split()[0]
    return found


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _usable(fd: int, mountpoint: Path, options: MountOptions, source: str) -> bool:
    """A kept descriptor is taken over only while its connection lives and
    our filesystem is still mounted at the mountpoint. (A connection whose
    mount was detached by hand still serves whoever has files open on it,
    but the mountpoint needs a mount now.)"""
    if not handoff.connection_alive(fd):
        log.warning("the kept FUSE connection is gone; mounting afresh", source=source)
        return False
    fstype = mounted_fstype(mountpoint)
    if fstype != options.fstype:
        log.warning(
            "the kept FUSE connection is no longer mounted at the mountpoint; mounting afresh",
            source=source,
            mountpoint=str(mountpoint),
            mounted=fstype,
        )
        return False
    return True


def clear_stale_mount(mountpoint: Path, options: MountOptions, timeout: float = 2.0) -> None:
    """A mount of ours whose connection died (every descriptor closed)
    answers ENOTCONN: detach it. One that answers, or does not answer at
    all (a connection someone holds but nobody serves), is not ours to take.
    The stat runs in a thread with a bound: it may wait forever."""
    fstype = mounted_fstype(mountpoint)
    if fstype is None:
        return
    if fstype != options.fstype:
        raise MountpointBusy(f"{mountpoint} has a {fstype} mounted on it")
    result: list[BaseException | None] = []

    def probe() -> None:
        try:
            os.stat(mountpoint)
            result.append(None)
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=probe, name="stale-mount-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        raise MountpointBusy(f"{mountpoint} is mounted and does not answer: a connection nobody serves")
    error = result[0]
    if isinstance(error, OSError) and error.errno == errno.ENOTCONN:
        unmount(mountpoint, lazy=True)
        log.warning("detached a stale mount", mountpoint=str(mountpoint))
        return
    if error is not None:
        raise error
    raise MountpointBusy(f"{mountpoint} is already mounted and no keeper holds its connection")


def acquire(
    mountpoint: Path,
    options: MountOptions,
    *,
    holder_socket: Path | None = None,
    environ: Mapping[str, str] | None = None,
    name: str = handoff.FDNAME,
) -> Connection:
    """The connection to serve: systemd's (stored as `name`), else the
    holder's, else new."""
    fd = handoff.from_systemd(environ, name)
    if fd is not None:
        if _usable(fd, mountpoint, options, "systemd"):
            prepare_descriptor(fd)
            log.info("took the FUSE connection over from systemd", mountpoint=str(mountpoint), fd=fd)
            return Connection(fd, mountpoint, "systemd", name)
        os.close(fd)
    if holder_socket is not None:
        held = handoff.get(holder_socket)
        if held is not None:
            if _usable(held.fd, mountpoint, options, "holder"):
                prepare_descriptor(held.fd)
                log.info("took the FUSE connection over from the holder", mountpoint=str(mountpoint), fd=held.fd)
                return Connection(held.fd, mountpoint, "holder", name)
            os.close(held.fd)
    clear_stale_mount(mountpoint, options)
    mountpoint.mkdir(parents=True, exist_ok=True)
    return Connection(mount(mountpoint, options), mountpoint, "mount", name)


def keep(
    conn: Connection,
    *,
    notify: Notify | None = None,
    holder_socket: Path | None = None,
    meta: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """Give a keeper a copy of a freshly mounted connection: systemd if it
    takes it, else the holder at `holder_socket` (started if none answers).
    Which one took it, or None (a crash will then take the mount along)."""
    if conn.takeover:
        # The keeper that handed it over still has its copy.
        return conn.source
    if (
        notify is not None
        and handoff.systemd_store_size(environ) != 0
        and handoff.store_in_systemd(notify, conn.fd, conn.name)
    ):
        log.info("the FUSE connection is kept in systemd's descriptor store")
        return "systemd"
    if holder_socket is not None:
        handoff.ensure_holder(holder_socket)
        handoff.put(holder_socket, conn.fd, {"mountpoint": str(conn.mountpoint), **(meta or {})})
        log.info("the FUSE connection is kept by the holder", socket=str(holder_socket))
        return "holder"
    log.warning("nobody keeps the FUSE connection: a crash of this server takes the mount along")
    return None


def ensure_kept(conn: Connection, holder_socket: Path, meta: Mapping[str, Any] | None = None) -> bool:
    """While serving, now and then: if the holder went away (killed, say),
    start another and give it a copy again, so the next crash still finds
    the connection. True if a copy had to be given again. (systemd's store
    needs no such care: it keeps its copy as long as the unit lives.)"""
    if handoff.holder_alive(holder_socket) is not None:
        return False
    handoff.ensure_holder(holder_socket)
    handoff.put(holder_socket, conn.fd, {"mountpoint": str(conn.mountpoint), **(meta or {})})
    log.warning("the descriptor holder was gone; a new one keeps the FUSE connection", socket=str(holder_socket))
    return True


def release(
    conn: Connection,
    *,
    notify: Notify | None = None,
    holder_socket: Path | None = None,
    unmount_it: bool = True,
) -> None:
    """The final stop: detach the mount, make every keeper let go, close our
    descriptor. With the last copy closed the kernel ends the connection:
    files still open on it answer ENOTCONN from then on."""
    if unmount_it:
        unmount(conn.mountpoint, lazy=True)
    if notify is not None:
        handoff.remove_from_systemd(notify, conn.name)
    if holder_socket is not None:
        handoff.drop(holder_socket)
    os.close(conn.fd)
