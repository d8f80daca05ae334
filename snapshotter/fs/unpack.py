"""A whole layer unpacked onto the layer store's disk from its block cache.

Once every block of a layer is cached, nothing about it needs the network
or the FUSE server any more, yet every start through the layer mount still
pays a FUSE request per lookup, xattr probe and read. So the layer server
writes the layer's tree out as a plain directory (STORE/<hex>/tree, the
layout containerd's overlayfs snapshotter gives a layer: whiteouts as 0/0
character devices, opaque directories marked with trusted.overlay.opaque),
and the snapshotter hands that directory to the mounts it makes from then
on (snapshots.py). Containers already running keep the layer mount.

The tree is the one the layer mount serves (layer/tree.py), so a container
sees the same files either way. The writer works from directory descriptors
it opened itself, without following symlinks, so no name in a hostile layer
can lead it outside the staging directory; the tree appears by rename, after
the filesystem is synced, complete or not at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from snapshotter.layer.tree import ROOT, LayerTree, Node

STAGING_PREFIX = ".tree-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_FALLBACK = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
_CHUNK = 1 << 20


class UnpackError(Exception):
    """The layer cannot be written out as it is served; it stays on the mount."""


@dataclass(frozen=True)
class Unpacked:
    path: Path
    entries: int
    bytes: int


def unpack(tree: LayerTree, cache: Path, layer_dir: Path, name: str, stop: threading.Event) -> Unpacked:
    """Write `tree`, whose file bytes are in the layer's `cache` file, to
    `layer_dir`/`name`; UnpackError as soon as `stop` is set. Leftovers of
    an earlier attempt (a crash, a full disk) are removed first."""
    _remove_staging(layer_dir)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=layer_dir))
    try:
        root = os.open(staging, _DIR_FLAGS)
        try:
            source = os.open(cache, os.O_RDONLY | os.O_CLOEXEC)
            try:
                entries, written = _Writer(tree, source, root, stop).write()
            finally:
                os.close(source)
            # A crash after the rename must not leave a tree whose files
            # were never written back.
            _syncfs(root)
        finally:
            os.close(root)
        final = layer_dir / name
        os.rename(staging, final)
        _fsync_dir(layer_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Unpacked(final, entries, written)


def _remove_staging(layer_dir: Path) -> None:
    for leftover in layer_dir.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


class _Writer:
    def __init__(self, tree: LayerTree, source: int, root: int, stop: threading.Event) -> None:
        self.nodes = tree.nodes
        self.source = source
        self.root = root
        self.stop = stop
        # Non-directories written so far, by inode, with their path from the
        # root: a hardlink's later names link to the first.
        self.written: dict[int, str] = {}
        self.bytes = 0

    def write(self) -> tuple[int, int]:
        # Depth first without recursion; a directory's attributes are set
        # once its children are in (adding them changes its mtime, and its
        # mode may deny writes to anyone but root).
        stack: list[tuple[Node, int, str, Iterator[tuple[bytes, int]]]] = []
        root = self.nodes[ROOT]
        assert root.children is not None
        stack.append((root, os.dup(self.root), "", iter(root.children.items())))
        entries = 1
        try:
            while stack:
                node, fd, path, children = stack[-1]
                step = next(children, None)
                if step is None:
                    stack.pop()
                    try:
                        _set_attributes(fd, node)
                    finally:
                        os.close(fd)
                    continue
                if self.stop.is_set():
                    raise UnpackError("stopped")
                name, ino = step
                _check_name(name)
                child = self.nodes[ino]
                entries += 1
                child_path = f"{path}/{os.fsdecode(name)}" if path else os.fsdecode(name)
                if child.is_dir:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    child_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    assert child.children is not None
                    stack.append((child, child_fd, child_path, iter(child.children.items())))
                elif ino in self.written:
                    os.link(self.written[ino], name, src_dir_fd=self.root, dst_dir_fd=fd, follow_symlinks=False)
                else:
                    self._write_leaf(child, fd, name)
                    self.written[ino] = child_path
        finally:
            for _, fd, _, _ in stack:
                os.close(fd)
        return entries, self.bytes

    def _write_leaf(self, node: Node, parent: int, name: bytes) -> None:
        kind = stat.S_IFMT(node.mode)
        if kind == stat.S_IFREG:
            fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=parent)
            try:
                self._copy(fd, node.offset, node.size)
                _set_attributes(fd, node)
            finally:
                os.close(fd)
            return
        if kind == stat.S_IFLNK:
            os.symlink(node.target, name, dir_fd=parent)
        elif kind in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
            os.mknod(name, kind | 0o600, node.rdev, dir_fd=parent)
        else:
            raise UnpackError(f"entry {os.fsdecode(name)!r} has file type {kind:o}, which a layer cannot hold")
        os.chown(name, node.uid, node.gid, dir_fd=parent, follow_symlinks=False)
        if kind != stat.S_IFLNK:
            # Not a symlink: this very call made it, in a directory only we write.
            os.chmod(name, stat.S_IMODE(node.mode), dir_fd=parent)
        if node.xattrs:
            at = f"/proc/self/fd/{parent}/{os.fsdecode(name)}"
            for key, value in node.xattrs.items():
                os.setxattr(at, key, value, follow_symlinks=False)
        os.utime(name, ns=(node.mtime_ns, node.mtime_ns), dir_fd=parent, follow_symlinks=False)

    def _copy(self, fd: int, offset: int, size: int) -> None:
        """The file's bytes from the cache file, in the kernel when it can."""
        done = 0
        while done < size:
            try:
                n = os.copy_file_range(self.source, fd, size - done, offset + done, done)
            except OSError as exc:
                if exc.errno not in _COPY_FALLBACK:
                    raise
                n = _copy_by_hand(self.source, fd, offset + done, done, min(_CHUNK, size - done))
            if n == 0:
                raise UnpackError("the cache file ends before the layer's last file does")
            done += n
        self.bytes += size


def _copy_by_hand(source: int, fd: int, src_offset: int, dst_offset: int, count: int) -> int:
    data = os.pread(source, count, src_offset)
    view = memoryview(data)
    while view:
        view = view[os.pwrite(fd, view, dst_offset + len(data) - len(view)) :]
    return len(data)


def _check_name(name: bytes) -> None:
    # layer/tree.py builds names as single path components; a tree that
    # holds another is refused rather than trusted.
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise UnpackError(f"the layer's tree holds the name {name!r}, which is no single path component")


def _set_attributes(fd: int, node: Node) -> None:
    """A written file's or a filled directory's attributes: owner before
    mode (chown clears setuid bits), xattrs after the owner (chown drops
    security.capability), times last (nothing changes them after)."""
    os.fchown(fd, node.uid, node.gid)
    os.fchmod(fd, stat.S_IMODE(node.mode))
    for key, value in node.xattrs.items():
        os.setxattr(fd, key, value)
    os.utime(fd, ns=(node.mtime_ns, node.mtime_ns))


def _syncfs(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        # The rename is done; a filesystem that cannot sync a directory
        # still has the tree, only less surely after a crash.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
