"""The descriptor holder: `python -m snapshotter.fs.fusewire.holder SOCKET`.

A process that does nothing but keep a copy of the layer mount's /dev/fuse
descriptor, so the connection (and the mount, and every container reading
from it) outlives the server: a crash, an OOM kill or an upgrade. The
next server asks for the descriptor and takes the connection over. Used
when the server is not under systemd (whose file descriptor store does the
same job). The protocol is in handoff.py.

It never reads the descriptor (that would take requests from the server);
it polls it for no events, which still reports POLLERR once the connection
is gone (unmounted or aborted), and then exits: nothing outlives the mount.
It also exits on DROP, SIGTERM or SIGINT. It must stay small and never
fail: it owns nothing else, and it imports nothing heavy.

A held connection with no server is a mount whose readers wait. A serving
layer server pings the holder every few seconds (connection.ensure_kept),
and a successor asks for the descriptor at once; so when nobody has been in
touch for ORPHAN_S, no server is coming: the holder lets the connection go,
and the readers get ENOTCONN instead of waiting for ever.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from snapshotter.fs.fusewire.handoff import receive

log = structlog.get_logger("bootseer.fs")


class _Stopped(Exception):
    pass


# Well above a restart (the layer server is back within a second or two) and
# the server's ping period (5 s), well under "for ever".
ORPHAN_S = 60.0


class Holder:
    def __init__(self, path: Path, orphan_s: float = ORPHAN_S) -> None:
        self.path = path
        self.orphan_s = orphan_s
        self.fd: int | None = None
        self.meta: dict[str, Any] = {}
        self.running = True
        self.last_contact = time.monotonic()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)

    def listen(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A socket file left by a dead holder: nothing answers it any more.
        if self.path.exists():
            self.path.unlink()
        self.sock.bind(os.fspath(self.path))
        os.chmod(self.path, 0o600)
        self.sock.listen(8)

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        watched: int | None = None
        while self.running:
            if watched != self.fd:
                if watched is not None:
                    poller.unregister(watched)
                if self.fd is not None:
                    poller.register(self.fd, 0)
                watched = self.fd
            if self.fd is not None and time.monotonic() - self.last_contact >= self.orphan_s:
                log.warning(
                    "no layer server has been in touch; letting the FUSE connection go, so its readers fail "
                    "instead of waiting",
                    seconds=self.orphan_s,
                    **self.meta,
                )
                self._close_held()
                self.running = False
                continue
            wait_s = self.orphan_s - (time.monotonic() - self.last_contact) if self.fd is not None else None
            try:
                events = poller.poll(None if wait_s is None else max(wait_s, 0.0) * 1000 + 1)
            except InterruptedError:
                continue
            for fd, mask in events:
                if fd == self.sock.fileno():
                    self._serve_one()
                elif fd == self.fd and mask & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    log.info("the held FUSE connection is gone; holder exits", **self.meta)
                    self._close_held()
                    self.running = False

    def _serve_one(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5.0)
            try:
                message, fds = receive(conn)
                self.last_contact = time.monotonic()
                conn.sendmsg(*self._answer(message, fds))
            except OSError as exc:
                log.warning("holder request failed", error=str(exc))

    def _answer(self, message: bytes, fds: list[int]) -> tuple[list[bytes], list[tuple[int, int, bytes]]]:
        if message.startswith(b"PUT ") and len(fds) == 1:
            self._close_held()
            self.fd = fds[0]
            self.meta = json.loads(message[4:])
            log.info("holding a FUSE descriptor", **self.meta)
            return [b"OK"], []
        for fd in fds:
            os.close(fd)
        if message == b"GET":
            if self.fd is None:
                return [b"NONE"], []
            rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, self.fd.to_bytes(4, sys.byteorder, signed=True))
            return [b"FD " + json.dumps(self.meta).encode()], [rights]
        if message == b"DROP":
            self._close_held()
            self.running = False
            return [b"OK"], []
        if message == b"PING":
            return [f"PONG {os.getpid()}".encode()], []
        return [b"ERR"], []

    def _close_held(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self._close_held()
        self.sock.close()
        try:
            if self.path.exists():
                self.path.unlink()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m snapshotter.fs.fusewire.holder SOCKET [ORPHAN_S]", file=sys.stderr)
        return 2
    holder = Holder(Path(args[0]), float(args[1]) if len(args) == 2 else ORPHAN_S)

    def stop(signum: int, frame: FrameType | None) -> None:
        # Raised, not a flag: Python retries an interrupted poll() after
        # running the handler (PEP 475), so a flag would go unseen.
        raise _Stopped

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    holder.listen()
    log.info("descriptor holder listening", socket=args[0], pid=os.getpid())
    try:
        holder.run()
    except _Stopped:
        log.info("descriptor holder stopped by a signal")
    finally:
        holder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
