"""A pod's files, read on its behalf by a root daemon that trusts none of them.

Everything a pod shows the daemon can be a trap: a symlink at or above the
target that points at a host path, a directory swapped for a symlink between
two system calls, a device node that would open a host disk, a file that
grows without end. The rules here:

- Paths are never handed to the kernel whole. The target is opened with
  openat2 under the pod's root (RESOLVE_IN_ROOT: `..` and absolute links
  cannot leave it) and RESOLVE_NO_SYMLINKS: a symlink anywhere on the way
  is refused and named, not followed.
- Below the target, every entry is opened by a single name relative to its
  parent's descriptor with O_PATH|O_NOFOLLOW, which opens a symlink or a
  device as itself (opening a device node with O_PATH does not open the
  device). Its type is read from that descriptor, and only a regular file or
  a directory is then reopened for reading, through the descriptor (the same
  inode, whatever the name points at by then). Symlinks are copied as text.
  Devices, FIFOs and sockets are refused.
- Every entry must be on the target's own mount (statx mount id), so a
  volume mounted inside the target is not read either.
- Sizes, entry counts and depth are capped, so a hostile tree cannot fill
  the host's disk or exhaust the daemon's descriptors.

A pod can still race the copy and get a garbled copy of its own files;
it can never get a byte from outside its target.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from depsnap import linux

# A virtual environment is 10-15 levels deep; this leaves room and bounds
# the descriptors one capture holds (two per level).
MAX_DEPTH = 64
# A large environment (torch with CUDA) has ~60,000 entries.
MAX_ENTRIES = 1_000_000
_CHUNK = 8 << 20


class PodPathError(Exception):
    """A pod's path or tree that the daemon refuses to touch; says why."""


def allowed_target(raw: object, allowed: Sequence[str]) -> str:
    """`raw` as an allowed pod target, or PodPathError saying why not.

    Only exact entries of the allow-list count (no prefixes, no `.`/`..`),
    so what a pod may name is exactly what the node's admin wrote down.
    """
    if not isinstance(raw, str) or not raw.startswith("/") or "\0" in raw:
        raise PodPathError(f"target {raw!r} must be an absolute path")
    if any(part in (".", "..") for part in raw.split("/")):
        raise PodPathError(f"target {raw!r} must not contain '.' or '..'")
    target = posixpath.normpath(raw)
    if target not in allowed:
        listed = ", ".join(allowed) if allowed else "none"
        raise PodPathError(
            f"target {target} is not among this node's pod targets ({listed}); "
            "the node's [depsnap] pod_targets lists the paths pods may ask for"
        )
    return target


def _explain_symlink(root_fd: int, path: str) -> str:
    """Which component of `path` under `root_fd` is a symlink, and to what."""
    current = os.dup(root_fd)
    walked = ""
    try:
        for part in path.strip("/").split("/"):
            walked += "/" + part
            st = os.stat(part, dir_fd=current, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                link = os.readlink(part, dir_fd=current)
                return f"{walked} in the pod is a symlink (to {link!r})"
            following = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
            os.close(current)
            current = following
    except OSError:
        pass
    finally:
        os.close(current)
    return f"{path} in the pod passes through a symlink"


def open_in_root(root_fd: int, path: str, flags: int = os.O_RDONLY | os.O_DIRECTORY) -> int:
    """Open the pod's `path` (absolute, as the pod sees it) under its root
    `root_fd`, following no symlink."""
    resolve = linux.RESOLVE_IN_ROOT | linux.RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS
    try:
        return linux.openat2(root_fd, path.lstrip("/") or ".", flags, resolve)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PodPathError(
                f"refused: {_explain_symlink(root_fd, path)}; depsnap follows no symlink in a pod, "
                "so nothing outside the pod's target is read or mounted on its behalf"
            ) from None
        if exc.errno == errno.ENOENT:
            raise PodPathError(f"{path} does not exist in the pod (the client creates it first)") from None
        if exc.errno == errno.ENOTDIR:
            raise PodPathError(f"{path} in the pod is not a directory") from None
        raise


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_entries: int = MAX_ENTRIES
    max_depth: int = MAX_DEPTH


@dataclass
class Copied:
    """What a copy took: counts for the log and the reply."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    bytes: int = 0
    _seen: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)

    @property
    def entries(self) -> int:
        return self.files + self.dirs + self.symlinks + self.hardlinks


def _reopen(path_fd: int, flags: int) -> int:
    # The /proc/self/fd magic link reopens exactly the inode of `path_fd`.
    return os.open(f"/proc/self/fd/{path_fd}", flags | os.O_CLOEXEC)


def _copy_xattrs(source_fd: int, dest_fd: int) -> None:
    try:
        names = os.listxattr(source_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        raise
    for name in names:
        try:
            os.setxattr(dest_fd, name, os.getxattr(source_fd, name))
        except OSError as exc:
            # LSM labels and the like that this filesystem or policy will not
            # take are not the environment's content.
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENODATA, errno.EACCES):
                raise


def _copy_metadata(st: os.stat_result, source_fd: int, dest_fd: int) -> None:
    os.fchown(dest_fd, st.st_uid, st.st_gid)
    # After the chown, which clears set-id bits.
    os.fchmod(dest_fd, stat.S_IMODE(st.st_mode))
    _copy_xattrs(source_fd, dest_fd)


def _copy_content(source_fd: int, dest_fd: int, size: int) -> None:
    """At most `size` bytes (the size the entry had when it was measured, so
    a file growing meanwhile cannot push the copy past the cap)."""
    offset = 0
    while offset < size:
        try:
            sent = os.sendfile(dest_fd, source_fd, offset, min(_CHUNK, size - offset))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            data = os.pread(source_fd, min(_CHUNK, size - offset), offset)
            sent = os.write(dest_fd, data) if data else 0
        if sent == 0:
            break  # truncated meanwhile: the pod's own garbled copy
        offset += sent


class _Copier:
    def __init__(self, limits: Limits, mount: int, dest_root_fd: int) -> None:
        self.limits = limits
        self.mount = mount
        self.dest_root_fd = dest_root_fd
        self.copied = Copied()

    def _count(self, rel: str, size: int = 0) -> None:
        if self.copied.entries >= self.limits.max_entries:
            raise PodPathError(f"the target holds more than {self.limits.max_entries} entries; not captured")
        self.copied.bytes += size
        if self.copied.bytes > self.limits.max_bytes:
            raise PodPathError(
                f"the target holds more than {self.limits.max_bytes} bytes (at {rel}); not captured "
                "([depsnap] pod_capture_max_bytes)"
            )

    def directory(self, source_fd: int, dest_fd: int, rel: str, depth: int) -> None:
        if depth > self.limits.max_depth:
            raise PodPathError(f"{rel} is more than {self.limits.max_depth} levels deep; not captured")
        for name in sorted(os.listdir(source_fd)):
            self.entry(source_fd, dest_fd, name, f"{rel}/{name}", depth)

    def entry(self, parent_fd: int, dest_parent_fd: int, name: str, rel: str, depth: int) -> None:
        try:
            path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except FileNotFoundError:
            return  # deleted since it was listed
        try:
            st = os.fstat(path_fd)
            if linux.mount_id(path_fd) != self.mount:
                raise PodPathError(f"{rel} is on another mount than the target; not captured")
            kind = stat.S_IFMT(st.st_mode)
            if kind == stat.S_IFDIR:
                self._directory(path_fd, st, dest_parent_fd, name, rel, depth)
            elif kind == stat.S_IFREG:
                self._file(path_fd, st, dest_parent_fd, name, rel)
            elif kind == stat.S_IFLNK:
                self._symlink(parent_fd, st, dest_parent_fd, name, rel)
            else:
                what = {stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFIFO: "a FIFO"}
                raise PodPathError(f"{rel} is {what.get(kind, 'a socket')}; an environment holds none, not captured")
        finally:
            os.close(path_fd)

    def _directory(
        self, path_fd: int, st: os.stat_result, dest_parent_fd: int, name: str, rel: str, depth: int
    ) -> None:
        self._count(rel)
        self.copied.dirs += 1
        source_fd = _reopen(path_fd, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.mkdir(name, 0o700, dir_fd=dest_parent_fd)
            dest_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dest_parent_fd)
            try:
                self.directory(source_fd, dest_fd, rel, depth + 1)
                _copy_metadata(st, source_fd, dest_fd)
                # Last: creating the children moved it.
                os.utime(dest_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(dest_fd)
        finally:
            os.close(source_fd)

    def _file(self, path_fd: int, st: os.stat_result, dest_parent_fd: int, name: str, rel: str) -> None:
        inode = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and inode in self.copied._seen:
            self._count(rel)
            self.copied.hardlinks += 1
            os.link(self.copied._seen[inode], name, src_dir_fd=self.dest_root_fd, dst_dir_fd=dest_parent_fd)
            return
        self._count(rel, st.st_size)
        self.copied.files += 1
        source_fd = _reopen(path_fd, os.O_RDONLY)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            dest_fd = os.open(name, flags, 0o600, dir_fd=dest_parent_fd)
            try:
                _copy_content(source_fd, dest_fd, st.st_size)
                _copy_metadata(st, source_fd, dest_fd)
                os.utime(dest_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(dest_fd)
        finally:
            os.close(source_fd)
        if st.st_nlink > 1:
            self.copied._seen[inode] = rel.lstrip("/")

    def _symlink(self, parent_fd: int, st: os.stat_result, dest_parent_fd: int, name: str, rel: str) -> None:
        self._count(rel, st.st_size)
        self.copied.symlinks += 1
        try:
            # Text only: the link is recreated, never followed.
            link = os.readlink(name, dir_fd=parent_fd)
        except OSError:
            raise PodPathError(f"{rel} changed while it was captured; not captured") from None
        os.symlink(link, name, dir_fd=dest_parent_fd)
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dest_parent_fd, follow_symlinks=False)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dest_parent_fd, follow_symlinks=False)


def copy_tree(source_fd: int, dest_fd: int, limits: Limits) -> Copied:
    """Copy the pod's directory `source_fd` (its target, opened by
    `open_in_root`) into the host directory `dest_fd`, which the daemon
    alone can reach: contents, modes, owners, mtimes, xattrs, symlinks (as
    links) and hardlinks."""
    copier = _Copier(limits, linux.mount_id(source_fd), dest_fd)
    copier.directory(source_fd, dest_fd, "", 1)
    st = os.fstat(source_fd)
    _copy_metadata(st, source_fd, dest_fd)
    os.utime(dest_fd, ns=(st.st_atime_ns, st.st_mtime_ns))
    return copier.copied
