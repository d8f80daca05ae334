"""The hostile-tree rules (`depsnap.podfs`) and the caller identification
(`depsnap.linux.peer`) on their own, against real files, mounts and processes."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from depsnap import linux, podfs
from depsnap.pods import PodConfigError, pod_key, validate_targets

pytestmark = pytest.mark.integration


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    source, dest = tmp_path / "pod-target", tmp_path / "copy"
    source.mkdir()
    dest.mkdir()
    yield source, dest
    subprocess.run(["umount", "--recursive", "--lazy", str(source / "volume")], capture_output=True, check=False)


def copy(source: Path, dest: Path, limits: podfs.Limits | None = None) -> podfs.Copied:
    source_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return podfs.copy_tree(source_fd, dest_fd, limits or podfs.Limits(1 << 30))
    finally:
        os.close(source_fd)
        os.close(dest_fd)


@pytest.mark.parametrize(
    "raw,fragment",
    [
        ("opt/env", "must be an absolute path"),
        ("/opt/env/../../etc", "must not contain '.' or '..'"),
        ("/opt/./env", "must not contain '.' or '..'"),
        ("/opt", "is not among this node's pod targets (/opt/env)"),
        ("/opt/env/sub", "is not among"),
        (42, "must be an absolute path"),
    ],
)
def test_only_listed_targets_are_allowed(raw: object, fragment: str) -> None:
    with pytest.raises(podfs.PodPathError) as info:
        podfs.allowed_target(raw, ["/opt/env"])
    assert fragment in str(info.value)


def test_listed_targets_match_after_normalising() -> None:
    assert podfs.allowed_target("/opt//env/", ["/opt/env"]) == "/opt/env"
    assert validate_targets(["/opt/env/"]) == ["/opt/env"]
    for bad in ("/", "opt/env", "/opt/../etc"):
        with pytest.raises(PodConfigError):
            validate_targets([bad])


def test_pod_keys_are_apart_from_host_keys() -> None:
    key = "ab" * 32
    assert pod_key(key) != key and len(pod_key(key)) == 64 and pod_key(key) == pod_key(key)


def test_a_symlink_on_the_way_to_the_target_is_refused_and_named(tmp_path: Path) -> None:
    root = tmp_path / "pod-root"
    (root / "real").mkdir(parents=True)
    (root / "opt").symlink_to("/etc")
    (root / "real" / "env").symlink_to("../real")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(podfs.PodPathError, match=r"/opt in the pod is a symlink \(to '/etc'\)"):
            podfs.open_in_root(root_fd, "/opt/env")
        with pytest.raises(podfs.PodPathError, match=r"/real/env in the pod is a symlink"):
            podfs.open_in_root(root_fd, "/real/env")
        with pytest.raises(podfs.PodPathError, match="does not exist in the pod"):
            podfs.open_in_root(root_fd, "/missing/env")
        os.close(podfs.open_in_root(root_fd, "/real"))
    finally:
        os.close(root_fd)


def test_a_tree_is_copied_faithfully_and_links_are_never_followed(dirs: tuple[Path, Path]) -> None:
    source, dest = dirs
    (source / "pkg").mkdir(mode=0o750)
    (source / "pkg" / "mod.py").write_text("x = 1\n")
    os.chown(source / "pkg" / "mod.py", 1000, 1001)
    os.chmod(source / "pkg" / "mod.py", 0o4755)
    os.setxattr(source / "pkg" / "mod.py", "user.origin", b"pod")
    os.utime(source / "pkg" / "mod.py", ns=(1_000_000_123, 1_700_000_000_123_456_789))
    os.link(source / "pkg" / "mod.py", source / "pkg" / "alias.py")
    (source / "leak").symlink_to("/etc/shadow")
    (source / "pkg" / "up").symlink_to("../../..")

    copied = copy(source, dest)

    assert copied.files == 1 and copied.hardlinks == 1 and copied.symlinks == 2 and copied.dirs == 1
    mod = os.lstat(dest / "pkg" / "mod.py")
    assert (mod.st_uid, mod.st_gid, stat.S_IMODE(mod.st_mode)) == (1000, 1001, 0o4755)
    assert mod.st_mtime_ns == 1_700_000_000_123_456_789
    assert os.getxattr(dest / "pkg" / "mod.py", "user.origin") == b"pod"
    assert os.lstat(dest / "pkg" / "alias.py").st_ino == mod.st_ino
    assert stat.S_IMODE(os.lstat(dest / "pkg").st_mode) == 0o750
    assert os.readlink(dest / "leak") == "/etc/shadow"
    assert os.readlink(dest / "pkg" / "up") == "../../.."
    assert (dest / "pkg" / "mod.py").read_text() == "x = 1\n"


@pytest.mark.parametrize("kind", ["char", "block", "fifo", "socket"])
def test_devices_fifos_and_sockets_are_refused(dirs: tuple[Path, Path], kind: str) -> None:
    source, dest = dirs
    node = source / "node"
    if kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(node))
    elif kind == "fifo":
        os.mkfifo(node)
    else:
        os.mknod(node, 0o600 | (stat.S_IFCHR if kind == "char" else stat.S_IFBLK), os.makedev(7, 0))
    with pytest.raises(podfs.PodPathError, match="/node is a"):
        copy(source, dest)


def test_a_mount_inside_the_target_is_not_read(dirs: tuple[Path, Path]) -> None:
    source, dest = dirs
    (source / "volume").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "podfs-test", str(source / "volume")], check=True)
    (source / "volume" / "other.txt").write_text("another volume\n")
    with pytest.raises(podfs.PodPathError, match="/volume is on another mount"):
        copy(source, dest)


def test_size_entry_and_depth_caps(dirs: tuple[Path, Path]) -> None:
    source, dest = dirs
    with open(source / "sparse", "wb") as sparse:
        sparse.truncate(10 << 20)  # counts at its size, not its blocks
    with pytest.raises(podfs.PodPathError, match="more than 1048576 bytes"):
        copy(source, dest, podfs.Limits(1 << 20))
    (source / "sparse").unlink()
    for name in "abc":
        (source / name).write_text(name)
    (dest / "entries").mkdir()
    with pytest.raises(podfs.PodPathError, match="more than 2 entries"):
        copy(source, dest / "entries", podfs.Limits(1 << 20, max_entries=2))
    (source / "d1" / "d2" / "d3" / "d4").mkdir(parents=True)
    (dest / "depth").mkdir()
    with pytest.raises(podfs.PodPathError, match="levels deep"):
        copy(source, dest / "depth", podfs.Limits(1 << 20, max_depth=3))


def test_the_peer_is_identified_and_a_gone_one_is_refused(tmp_path: Path) -> None:
    a, b = socket.socketpair()
    with a, b:
        peer = linux.peer(a, linux.boottime())
        try:
            assert peer.pid == os.getpid() and peer.uid == os.getuid()
            assert linux.pidfd_alive(peer.pidfd)
        finally:
            peer.close()

    address = tmp_path / "peer.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(address))
        server.listen()
        connect = f"import socket; socket.socket(socket.AF_UNIX).connect({str(address)!r})"
        subprocess.run([sys.executable, "-c", connect], check=True)
        conn, _ = server.accept()
        with conn, pytest.raises(linux.PeerGone, match="exited"):
            linux.peer(conn, linux.boottime())
