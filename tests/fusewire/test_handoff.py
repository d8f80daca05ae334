"""Where the descriptor goes between incarnations, without a mount: the
systemd file descriptor store (through bootseer.daemon's Notifier, as the
composition root passes it), LISTEN_FDS parsing, and the holder's protocol
on a plain pipe. Plus the readdir buffer arithmetic of the facade, and the
READDIRPLUS layout."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bootseer.daemon import Notifier
from snapshotter.fs import fusewire as fw
from snapshotter.fs.fusewire import handoff, protocol, session
from snapshotter.fs.fusewire.connection import Connection, ensure_kept
from tests.fusewire.harness import wait_for


def test_the_descriptor_goes_to_systemd_with_its_name(tmp_path: Path) -> None:
    address = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(address))
        read_end, write_end = os.pipe()
        try:
            assert handoff.store_in_systemd(Notifier(str(address)).send, read_end)
            message, fds = handoff.receive(systemd)
            assert message.split(b"\n") == [b"FDSTORE=1", b"FDNAME=fuse"]
            assert len(fds) == 1
            os.write(write_end, b"x")
            assert os.read(fds[0], 1) == b"x"
            os.close(fds[0])
            assert handoff.remove_from_systemd(Notifier(str(address)).send)
            message, _ = handoff.receive(systemd)
            assert message.split(b"\n") == [b"FDSTOREREMOVE=1", b"FDNAME=fuse"]
        finally:
            os.close(read_end)
            os.close(write_end)


def _from_systemd_in_child(names: str, same_pid: bool) -> str:
    # bash lays out descriptors 3 and 4 as systemd would and execs Python
    # in its own PID, so LISTEN_PID=$$ names the process that reads it.
    pid = "$$" if same_pid else "1"
    script = (
        "exec 3</dev/null 4</dev/null; "
        f"LISTEN_PID={pid} LISTEN_FDS=2 LISTEN_FDNAMES={names} "
        f"exec {sys.executable} -c 'from snapshotter.fs.fusewire import handoff; print(handoff.from_systemd())'"
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip()


def test_the_descriptor_is_found_again_by_name() -> None:
    assert _from_systemd_in_child("metrics:fuse", same_pid=True) == "4"
    assert _from_systemd_in_child("fuse:metrics", same_pid=True) == "3"
    assert _from_systemd_in_child("metrics:other", same_pid=True) == "None"
    # Variables meant for another process are not ours.
    assert _from_systemd_in_child("metrics:fuse", same_pid=False) == "None"


@contextmanager
def _holder(sock: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A holder process at `sock`, answering; killed at the end if it is still there."""
    holder = subprocess.Popen([sys.executable, "-m", "snapshotter.fs.fusewire.holder", str(sock), *args])
    try:
        wait_for("holder answering", lambda: handoff.holder_alive(sock) == holder.pid, 30)
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_the_holder_keeps_a_descriptor_and_hands_out_copies(tmp_path: Path) -> None:
    sock = tmp_path / "holder.sock"
    read_end, write_end = os.pipe()
    try:
        with _holder(sock) as holder:
            assert handoff.get(sock) is None
            handoff.put(sock, read_end, {"mountpoint": "/x"})
            os.close(read_end)
            read_end = -1
            for _ in range(2):
                held = handoff.get(sock)
                assert held is not None
                assert held.meta == {"mountpoint": "/x"}
                os.write(write_end, b"y")
                assert os.read(held.fd, 1) == b"y"
                os.close(held.fd)
            assert handoff.drop(sock)
            assert holder.wait(timeout=30) == 0
            assert not sock.exists()
    finally:
        if read_end >= 0:
            os.close(read_end)
        os.close(write_end)


def test_the_holder_leaves_when_its_descriptor_dies(tmp_path: Path) -> None:
    sock = tmp_path / "holder.sock"
    read_end, write_end = os.pipe()
    try:
        with _holder(sock) as holder:
            handoff.put(sock, read_end, {})
            # A pipe whose writer is gone polls POLLHUP, as a dead connection
            # polls POLLERR.
            os.close(write_end)
            write_end = -1
            assert holder.wait(timeout=30) == 0
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_readdir_reply_fills_the_buffer_and_no_more() -> None:
    attr = fw.EntryAttributes(st_ino=7)
    one = protocol.dirent_size(len(b"name"))
    token = fw.ReaddirToken(size=one * 2 + one // 2)
    assert fw.readdir_reply(token, b"name", attr, 1)
    assert fw.readdir_reply(token, b"name", attr, 2)
    assert not fw.readdir_reply(token, b"name", attr, 3)
    assert token.used == 2 * one == len(b"".join(token.chunks))
    ino, off, namelen, kind = protocol.DIRENT_HEAD.unpack_from(token.chunks[1])
    assert (ino, off, namelen, kind) == (7, 2, 4, 8)  # DT_REG


def test_readdirplus_entries_carry_what_a_lookup_answers() -> None:
    attr = fw.EntryAttributes(st_ino=7, st_size=5, entry_timeout=3600.0, attr_timeout=3600.0)
    entry_out = struct.Struct("=QQQQII")
    one = protocol.direntplus_size(len(b"name"))
    assert one == entry_out.size + protocol.ATTR.size + protocol.dirent_size(len(b"name"))
    token = fw.ReaddirToken(size=one * 2 + one // 2, entry=session._entry_out)
    assert fw.readdir_reply(token, b"name", attr, 1)
    assert fw.readdir_reply(token, b"name", attr, 2)
    assert not fw.readdir_reply(token, b"name", attr, 3)
    assert token.used == 2 * one == len(b"".join(token.chunks))
    # Each entry as fuse.h lays out fuse_direntplus: the entry, then the dirent.
    nodeid, generation, entry_valid, attr_valid, _, _ = entry_out.unpack_from(token.chunks[2])
    assert (nodeid, generation, entry_valid, attr_valid) == (7, 0, 3600, 3600)
    assert protocol.ATTR.unpack_from(token.chunks[2], entry_out.size)[:2] == (7, 5)
    assert protocol.DIRENT_HEAD.unpack_from(token.chunks[3]) == (7, 2, 4, 8)


def test_a_lost_holder_is_replaced_and_given_the_descriptor_again(tmp_path: Path) -> None:
    sock = tmp_path / "holder.sock"
    read_end, write_end = os.pipe()
    conn = Connection(read_end, tmp_path / "mnt", "mount")
    pid = None
    try:
        assert ensure_kept(conn, sock)
        pid = handoff.holder_alive(sock)
        assert pid is not None
        # Kept already: nothing to do.
        assert not ensure_kept(conn, sock)
        held = handoff.get(sock)
        assert held is not None
        os.write(write_end, b"z")
        assert os.read(held.fd, 1) == b"z"
        os.close(held.fd)
        assert handoff.drop(sock)
        wait_for("the holder to leave", lambda: handoff.holder_alive(sock) is None, 30)
        pid = None
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        os.close(read_end)
        os.close(write_end)


def test_a_holder_no_server_keeps_in_touch_with_lets_the_connection_go(tmp_path: Path) -> None:
    """No ping, no request for the descriptor: no server is coming, so the
    holder closes its copy (readers of a real mount then get ENOTCONN) and
    exits. While a server pings, it keeps the descriptor."""
    sock = tmp_path / "holder.sock"
    read_end, write_end = os.pipe()
    try:
        with _holder(sock, "3") as holder:
            handoff.put(sock, read_end, {})
            os.close(read_end)
            read_end = -1
            # A server in touch every 0.1 s, for longer than the orphan period.
            for _ in range(40):
                assert handoff.holder_alive(sock) == holder.pid
                time.sleep(0.1)
            assert holder.poll() is None
            # Then nobody: the holder lets go, and the pipe's reader is gone.
            assert holder.wait(timeout=60) == 0
            with pytest.raises(BrokenPipeError):
                os.write(write_end, b"x")
    finally:
        if read_end >= 0:
            os.close(read_end)
        os.close(write_end)
