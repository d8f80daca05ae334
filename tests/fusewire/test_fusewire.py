"""The fusewire engine on real FUSE mounts, with real processes: a toy
read-only filesystem (tests/fusewire/toyfs.py) served by one process after
another over the same connection, kept by the descriptor holder.

- what a mount shows: bytes, listings, xattrs, statfs, symlinks, EROFS;
- kill -9 with a read in flight: the next server takes the connection
  over, the kernel resends the read (FUSE_NOTIFY_RESEND), every hash after
  the restart is right, nothing waits past a bound;
- SIGTERM: the old server answers what it read and leaves, the next one
  goes on, no read fails;
- nothing leaks: the mount goes, the holder exits, every process is gone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.fs.fusewire.mount import unmount
from tests.fusewire.harness import BIG_SIZE, Failover, Hang, make_big, wait_for
from tests.fusewire.toyfs import HELLO, MANY, MANY_FIRST_INO, MTIME_NS, NESTED

pytestmark = pytest.mark.integration

# Bounds, not timings: far above what each step takes on a loaded 2-core
# machine, there only so a hang fails the test instead of stalling it.
PASS_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("fusewire-data") / "big.bin"
    return path, make_big(path)


@pytest.fixture
def failover(tmp_path: Path, big: tuple[Path, str]) -> Iterator[Failover]:
    fo = Failover(tmp_path, big[0])
    fo.start_holder()
    try:
        yield fo
    finally:
        leaks = fo.teardown()
        assert not leaks, leaks


def _hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def test_a_mount_serves_the_tree(failover: Failover, big: tuple[Path, str]) -> None:
    server = failover.start_server()
    server.wait_ready()
    assert server.source == "mount"
    mnt = failover.mountpoint

    assert sorted(os.listdir(mnt)) == ["big.bin", "hello.txt", "link", "many", "sub"]
    assert os.listdir(mnt / "sub") == ["nested.txt"]
    # Far more than one READDIR reply holds: offsets carry the listing on.
    with os.scandir(mnt / "many") as entries:
        many = sorted((e.name, e.inode()) for e in entries)
    assert many == [(f"f{i:04d}", MANY_FIRST_INO + i) for i in range(MANY)]
    assert (mnt / "hello.txt").read_bytes() == HELLO
    assert (mnt / "sub" / "nested.txt").read_bytes() == NESTED
    st = os.stat(mnt / "hello.txt")
    assert (st.st_ino, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)) == (2, len(HELLO), MTIME_NS, 0o644)
    assert os.stat(mnt / "big.bin").st_size == BIG_SIZE
    assert os.readlink(mnt / "link") == "hello.txt"
    assert (mnt / "link").read_bytes() == HELLO
    assert stat.S_ISLNK(os.lstat(mnt / "link").st_mode)

    assert sorted(os.listxattr(mnt / "hello.txt")) == ["user.color", "user.empty"]
    assert os.getxattr(mnt / "hello.txt", "user.color") == b"blue"
    assert os.getxattr(mnt / "hello.txt", "user.empty") == b""
    with pytest.raises(OSError) as missing_xattr:
        os.getxattr(mnt / "hello.txt", "user.none")
    assert missing_xattr.value.errno == errno.ENODATA

    fs = os.statvfs(mnt)
    assert (fs.f_bsize, fs.f_blocks, fs.f_bfree, fs.f_bavail, fs.f_files, fs.f_ffree, fs.f_namemax) == (
        4096,
        1000,
        500,
        400,
        10,
        5,
        255,
    )

    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "nothing")
    with pytest.raises(OSError) as write:
        (mnt / "new.txt").write_bytes(b"x")
    assert write.value.errno == errno.EROFS
    with pytest.raises(OSError) as mkdir:
        os.mkdir(mnt / "dir")
    assert mkdir.value.errno == errno.EROFS

    assert _hash(mnt / "big.bin") == big[1]
    assert server.terminate() == 0
    assert server.stats()["outcome"] == "stopped"


def test_kill9_mid_read_the_next_server_answers_the_resent_read(failover: Failover, big: tuple[Path, str]) -> None:
    first = failover.start_server(slow_offset=BIG_SIZE // 2)
    first.wait_ready()
    reader = failover.start_reader(big[1])
    # The read covering the middle of the file is now in the first
    # server's hands, unanswered.
    wait_for("the slow read to begin", failover.marker.exists, PASS_TIMEOUT)
    first.kill9()
    killed_at = time.monotonic()
    # The mount outlives its server: the holder keeps the connection.
    assert failover.mounted()

    second = failover.start_server()
    second.wait_ready()
    assert second.source == "holder"
    try:
        reader.wait_passes(2, after=killed_at, timeout=PASS_TIMEOUT)
        reader.stop(timeout=STOP_TIMEOUT)
    except (Hang, subprocess.TimeoutExpired):
        failover.abort()
        raise

    passes = reader.passes()
    straddling = [p for p in passes if float(str(p["began"])) <= killed_at <= float(str(p["ended"]))]
    after = [p for p in passes if float(str(p["began"])) > killed_at]
    assert len(straddling) == 1
    assert straddling[0]["ok"] or straddling[0]["error"] == f"{errno.EIO}:{os.strerror(errno.EIO)}"
    assert not any(p["wrong_bytes"] for p in passes)
    assert len(after) >= 2 and all(p["ok"] for p in after), after

    assert second.terminate() == 0
    stats = second.stats()
    assert stats["resend_supported"] is True
    # The read the first server took came again, with the resend bit, to
    # the second, which answered it: the straddling pass hashed right.
    assert "READ" in list(stats["resent_ops"])  # type: ignore[call-overload]
    assert straddling[0]["ok"]


def test_sigterm_hands_over_without_a_failed_read(failover: Failover, big: tuple[Path, str]) -> None:
    # A read the first server holds for a second when SIGTERM comes: it
    # must answer it before it leaves.
    first = failover.start_server(slow_offset=BIG_SIZE // 2, slow_s=1.0)
    first.wait_ready()
    reader = failover.start_reader(big[1])
    try:
        wait_for("the slow read to begin", failover.marker.exists, PASS_TIMEOUT)
        assert first.terminate(timeout=STOP_TIMEOUT) == 0
        stopped_at = time.monotonic()
        assert failover.mounted()
        second = failover.start_server()
        second.wait_ready()
        assert second.source == "holder"
        reader.wait_passes(2, after=stopped_at, timeout=PASS_TIMEOUT)
        reader.stop(timeout=STOP_TIMEOUT)
    except (Hang, subprocess.TimeoutExpired):
        failover.abort()
        raise
    passes = reader.passes()
    assert passes and all(p["ok"] for p in passes), [p for p in passes if not p["ok"]]
    assert first.stats()["outcome"] == "stopped"
    assert second.terminate() == 0
    # The old server answered everything it had read: nothing was left for
    # the kernel to resend to the new one.
    assert second.stats()["resent"] == 0


def test_the_holder_leaves_with_the_mount(failover: Failover) -> None:
    server = failover.start_server()
    server.wait_ready()
    assert server.terminate() == 0
    assert failover.mounted()
    assert failover.holder is not None and failover.holder.poll() is None
    unmount(failover.mountpoint)
    assert failover.holder.wait(timeout=STOP_TIMEOUT) == 0
    assert not failover.mounted()


def test_a_connection_nobody_kept_is_replaced_by_a_fresh_mount(failover: Failover, big: tuple[Path, str]) -> None:
    first = failover.start_server()
    first.wait_ready()
    # The holder dies first, then the server: the last copy of the
    # connection goes, and the mount is left answering ENOTCONN.
    assert failover.holder is not None
    failover.holder.kill()
    failover.holder.wait()
    first.kill9()
    assert failover.mounted()
    with pytest.raises(OSError) as dead:
        os.stat(failover.mountpoint)
    assert dead.value.errno == errno.ENOTCONN

    failover.start_holder()
    second = failover.start_server()
    second.wait_ready()
    assert second.source == "mount"
    assert (failover.mountpoint / "hello.txt").read_bytes() == HELLO
    assert _hash(failover.mountpoint / "big.bin") == big[1]
    assert second.terminate() == 0
