"""Read-only filesystem images (erofs) and the mounts that expose them.

An erofs image keeps modes, owners, nanosecond mtimes, symlinks, hardlinks
and xattrs. On kernels with file-backed erofs (6.12+) the image file is
mounted directly: no loop device, well under a millisecond. Older kernels get
a loop device through mount(8).
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
from pathlib import Path

from depsnap import linux

_MS_RDONLY = 1
_libc = ctypes.CDLL(None, use_errno=True)


class ImageError(Exception):
    """Building or mounting an image failed; the message says which and why."""


def build(source: Path, image: Path) -> None:
    """Write an erofs image of the tree under `source` to `image`.

    Uncompressed on purpose: the store already holds it zstd-compressed, and
    an uncompressed image reads at page-cache speed once mounted.
    """
    result = subprocess.run(
        ["mkfs.erofs", "--quiet", str(image), str(source)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ImageError(f"mkfs.erofs {source} failed: {result.stderr.strip()}")


def _mount(source: str, target: Path, fstype: str, flags: int, data: str | None) -> None:
    rc = _libc.mount(
        source.encode(),
        os.fsencode(target),
        fstype.encode(),
        flags,
        data.encode() if data is not None else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} {source} on {target}: {os.strerror(err)}")


def mount_image(image: Path, target: Path) -> None:
    """Mount the erofs `image` read-only on `target`."""
    try:
        _mount(str(image), target, "erofs", _MS_RDONLY, None)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTBLK, errno.EINVAL):
            raise ImageError(str(exc)) from None
    result = subprocess.run(
        ["mount", "-t", "erofs", "-o", "ro,loop", str(image), str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ImageError(f"mount erofs {image} on {target}: {result.stderr.strip()}")


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """A writable overlay of `lower` on `target`; writes land in `upper`."""
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    try:
        _mount("overlay", target, "overlay", 0, options)
    except OSError as exc:
        raise ImageError(str(exc)) from None


def unmount(target: Path) -> None:
    """Unmount `target`; lazily if it is busy, so a stray open file cannot
    keep an environment's mounts alive forever."""
    if subprocess.run(["umount", str(target)], capture_output=True, check=False).returncode == 0:
        return
    result = subprocess.run(["umount", "--lazy", str(target)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ImageError(f"umount {target}: {result.stderr.strip()}")


def is_mount_point(path: Path) -> bool:
    return os.path.ismount(path)


def _detached(fstype: str, options: dict[str, str], attributes: int) -> int:
    fs_fd = linux.fsopen(fstype)
    try:
        for key, value in options.items():
            linux.fsconfig_string(fs_fd, key, value)
        linux.fsconfig_create(fs_fd)
        return linux.fsmount(fs_fd, attributes)
    finally:
        os.close(fs_fd)


def detached_environment(image: Path) -> int:
    """The erofs `image` under a writable overlay, as one detached mount: a
    descriptor for move_mount, in no mount table on the host meanwhile.

    Built with the new mount API (fsopen/fsmount): the erofs image, a tmpfs
    for the overlay's upper and work dirs, and the overlay, whose layers are
    handed over as descriptors (FSCONFIG_SET_FD, Linux 6.13+; older kernels
    get /proc/self/fd paths). The overlay keeps private references to its
    layers, so once it exists, closing every other descriptor leaves it the
    only owner: the environment lives exactly as long as its mount does.

    The tmpfs upper means writes into the environment after a restore live
    in memory, charged to whoever writes them (the pod's memory cgroup), and
    go with the mount, like an emptyDir of medium Memory.
    """
    nosuid_nodev = linux.MOUNT_ATTR_NOSUID | linux.MOUNT_ATTR_NODEV
    opened: list[int] = []
    try:
        image_fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
        opened.append(image_fd)
        lower = _detached("erofs", {"source": f"/proc/self/fd/{image_fd}"}, linux.MOUNT_ATTR_RDONLY | nosuid_nodev)
        opened.append(lower)
        scratch = _detached("tmpfs", {"mode": "0700"}, nosuid_nodev)
        opened.append(scratch)
        root = os.stat(lower)
        for name in ("upper", "work"):
            os.mkdir(name, 0o700, dir_fd=scratch)
        # The overlay's root takes the upper dir's metadata: give it the image root's.
        os.chown("upper", root.st_uid, root.st_gid, dir_fd=scratch)
        os.chmod("upper", root.st_mode & 0o7777, dir_fd=scratch)
        os.utime("upper", ns=(root.st_atime_ns, root.st_mtime_ns), dir_fd=scratch)
        upper = os.open("upper", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=scratch)
        opened.append(upper)
        work = os.open("work", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=scratch)
        opened.append(work)
        layers = {"lowerdir+": lower, "upperdir": upper, "workdir": work}
        overlay = linux.fsopen("overlay")
        opened.append(overlay)
        try:
            for key, fd in layers.items():
                linux.fsconfig_fd(overlay, key, fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            os.close(opened.pop())
            overlay = linux.fsopen("overlay")
            opened.append(overlay)
            for key, fd in layers.items():
                linux.fsconfig_string(overlay, key, f"/proc/self/fd/{fd}")
        linux.fsconfig_create(overlay)
        return linux.fsmount(overlay, nosuid_nodev)
    except OSError as exc:
        raise ImageError(f"building the environment's mount of {image}: {exc}") from None
    finally:
        for fd in opened:
            os.close(fd)
