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
