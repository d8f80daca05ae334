"""Snapshot errors, one class per gRPC status code containerd understands.

containerd maps the status code of a proxy plugin's answer back to its own
error kinds (errdefs.FromGRPC), so the code matters more than the class name:
NOT_FOUND makes containerd fall through to creating a snapshot, ALREADY_EXISTS
makes it skip a layer, and so on.
"""

from __future__ import annotations

import errno

import grpc


class SnapshotError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class NotFound(SnapshotError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SnapshotError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SnapshotError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(SnapshotError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unavailable(SnapshotError):
    """Something the snapshotter depends on is down or exhausted for now;
    containerd (and a person) may try again once it is back."""

    code = grpc.StatusCode.UNAVAILABLE


# What each errno the node's filesystems give means for whoever runs it.
_OS_ERRORS: dict[int, tuple[type[SnapshotError], str]] = {
    errno.ENOSPC: (
        FailedPrecondition,
        "the filesystem is full: free space on it (remove unused images and containers so "
        "containerd's garbage collector removes their snapshots) and try again",
    ),
    errno.EDQUOT: (FailedPrecondition, "the disk quota is used up: raise it or free space, then try again"),
    errno.EROFS: (
        FailedPrecondition,
        "the filesystem is read-only: see the kernel log (dmesg) for why, and remount it read-write",
    ),
    errno.EIO: (FailedPrecondition, "the disk answers with I/O errors: check the kernel log (dmesg) and the disk"),
    errno.ENOTCONN: (
        Unavailable,
        "a FUSE filesystem there has lost its server; if it is the bootseer layer mount, "
        "start bootseer-layer-server (systemctl start bootseer-layer-server) and try again",
    ),
    errno.EMFILE: (
        Unavailable,
        "the snapshotter has run out of file descriptors: raise LimitNOFILE= in bootseer-snapshotter.service",
    ),
    errno.ENFILE: (Unavailable, "the node has run out of file descriptors: raise fs.file-max"),
    errno.ENOMEM: (Unavailable, "the node is out of memory"),
}


def from_os_error(exc: OSError, doing: str) -> SnapshotError | None:
    """The error to answer for `exc`, met while `doing` something, when its
    errno is one a person can do something about; None otherwise."""
    known = _OS_ERRORS.get(exc.errno or 0)
    if known is None:
        return None
    kind, advice = known
    where = f" at {exc.filename}" if exc.filename else ""
    return kind(f"{doing}: {exc.strerror}{where}; {advice}")
