"""Keeping the /dev/fuse descriptor alive across restarts of the server, and
finding it again.

A FUSE connection lives as long as some process holds its descriptor. Two
keepers, tried in this order at start (docs/fuse-failover.md):

1. systemd's file descriptor store: the server pushes the descriptor with
   FDSTORE=1 and FDNAME=<the connection's name> (FDNAME, "fuse", for the
   layer mount) once it has mounted; on every later start of the unit
   systemd passes it back (LISTEN_FDS, LISTEN_FDNAMES).
2. A holder process (holder.py) listening on a unix socket: the server puts
   the descriptor there once it has mounted and gets it back at start.

Neither: a fresh mount.

The holder speaks one request per connection over SOCK_SEQPACKET:
  PUT <json> + SCM_RIGHTS fd  -> OK        keep this descriptor (replacing any)
  GET                          -> FD <json> + fd, or NONE
  DROP                         -> OK        close it and exit (final unmount)
  PING                         -> PONG <pid>
The json is the session's description (mountpoint and what INIT settled),
for the successor's checks and logs; the wire state itself is the kernel's.

This module is stdlib and structlog only: the holder imports it and must
stay small.
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger("bootseer.fs")

FDNAME = "fuse"
SD_LISTEN_FDS_START = 3
MAX_MESSAGE = 4096


class Notify(Protocol):
    """How the composition root lets us talk to systemd: bootseer.daemon's
    `Notifier.send` has this shape (assignments, descriptors with them;
    True once sent, False when there is no service manager)."""

    def __call__(self, *assignments: str, fds: Sequence[int] = ()) -> bool: ...


def connection_alive(fd: int) -> bool:
    """Whether a /dev/fuse descriptor still has a connection behind it. An
    aborted or unmounted connection polls POLLERR; asking for no events
    keeps pending requests (POLLIN) from answering, and nothing is read."""
    poller = select.poll()
    poller.register(fd, 0)
    return not any(events & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, events in poller.poll(0))


# -- systemd's file descriptor store --------------------------------------------


def systemd_store_size(environ: Mapping[str, str] | None = None) -> int | None:
    """How many descriptors the unit's store takes ($FDSTORE, systemd 254+:
    FileDescriptorStoreMax=); None where systemd does not say (older ones,
    such as Debian 12's 252, which drop a pushed descriptor silently, with a
    log line, when the unit has no store: the unit file must set it)."""
    env = os.environ if environ is None else environ
    try:
        return int(env["FDSTORE"])
    except (KeyError, ValueError):
        return None


def store_in_systemd(notify: Notify, fd: int, name: str = FDNAME) -> bool:
    """Hand systemd a copy of the descriptor under `name` (the unit's
    FileDescriptorStoreMax= must hold every connection it keeps). A second
    push under the same name adds a second entry, so a process that took
    the descriptor from systemd does not push it again."""
    return notify("FDSTORE=1", f"FDNAME={name}", fds=[fd])


def remove_from_systemd(notify: Notify, name: str = FDNAME) -> bool:
    """Final shutdown: systemd closes its copy, so the connection can go."""
    return notify("FDSTOREREMOVE=1", f"FDNAME={name}")


def from_systemd(environ: Mapping[str, str] | None = None, name: str = FDNAME) -> int | None:
    """The descriptor systemd passed back under FDNAME=`name`, if any: only
    when LISTEN_PID names this process (the variables are not ours
    otherwise). Other passed descriptors are left alone."""
    env = os.environ if environ is None else environ
    try:
        if int(env.get("LISTEN_PID", "0")) != os.getpid():
            return None
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    for i in range(count):
        if i < len(names) and names[i] == name:
            fd = SD_LISTEN_FDS_START + i
            os.set_inheritable(fd, False)
            return fd
    return None


# -- the holder's client side ----------------------------------------------------


@dataclass(frozen=True)
class Held:
    fd: int
    meta: dict[str, Any]


class HolderError(Exception):
    """The holder answered something unexpected."""


def _request(path: Path, message: bytes, fds: Sequence[int] = (), timeout: float = 5.0) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(os.fspath(path))
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg([message], ancillary)
        return receive(sock)


def receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (close-on-exec)."""
    space = socket.CMSG_SPACE(4 * 4)
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, space, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    return data, fds


def holder_alive(path: Path) -> int | None:
    """The holder's PID if one answers at `path`."""
    try:
        reply, _ = _request(path, b"PING", timeout=1.0)
    except OSError:
        return None
    if not reply.startswith(b"PONG "):
        return None
    return int(reply[5:])


def put(path: Path, fd: int, meta: Mapping[str, Any]) -> None:
    reply, _ = _request(path, b"PUT " + json.dumps(dict(meta)).encode(), [fd])
    if reply != b"OK":
        raise HolderError(f"holder at {path} answered {reply!r} to PUT")


def get(path: Path) -> Held | None:
    """The held descriptor (a copy: the holder keeps its own), or None when
    nothing answers at `path` or it holds nothing."""
    try:
        reply, fds = _request(path, b"GET")
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    if reply == b"NONE":
        for fd in fds:
            os.close(fd)
        return None
    if not reply.startswith(b"FD ") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise HolderError(f"holder at {path} answered {reply[:80]!r} to GET")
    return Held(fds[0], json.loads(reply[3:]))


def drop(path: Path) -> bool:
    """Tell the holder to close its copy and exit; False if none answered."""
    try:
        reply, _ = _request(path, b"DROP")
    except OSError:
        return False
    return reply == b"OK"


def spawn_holder(path: Path, timeout: float = 10.0) -> int:
    """Start a holder at `path`; its PID once it answers. A shell starts it
    in the background and exits at once, so the holder is nobody's child
    here (no zombie to reap, nothing to wait for) and, in a session of its
    own, a kill of the server's process group misses it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    starter = subprocess.run(
        ["sh", "-c", '"$0" -m snapshotter.fs.fusewire.holder "$1" </dev/null &', sys.executable, os.fspath(path)],
        start_new_session=True,
        check=False,
    )
    if starter.returncode != 0:
        raise HolderError(f"could not start a holder at {path} (sh exited with {starter.returncode})")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = holder_alive(path)
        if pid is not None:
            return pid
        time.sleep(0.02)
    raise HolderError(f"holder did not answer at {path} within {timeout} s")


def ensure_holder(path: Path) -> int:
    """The PID of the holder at `path`, started if none answers."""
    pid = holder_alive(path)
    return pid if pid is not None else spawn_holder(path)
