"""Asking an hdfs-fuse mount to prefetch files, and reading how far it got:
the two extended attributes the mount answers (see `prefetch`), and their
status text. Standard library only, like the way a pod asks:
`os.getxattr(path, "user.bootseer.prefetch")`."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Reading it starts the file's prefetch (unless one runs) and answers its status.
XATTR = "user.bootseer.prefetch"
# Reading it only answers the status ("none" before any prefetch).
STATUS_XATTR = "user.bootseer.prefetch.status"

RUNNING = "running"


@dataclass(frozen=True)
class Status:
    state: str  # running, done, handed-over, stopped, failed, or none
    pushed_bytes: int = 0
    size: int = 0
    detail: str = ""

    @property
    def ended(self) -> bool:
        return self.state != RUNNING

    @classmethod
    def parse(cls, text: str) -> Status:
        """`<state> <pushed>/<size>[: detail]`, or `none`."""
        head, _, detail = text.partition(": ")
        state, _, counts = head.partition(" ")
        pushed, _, size = counts.partition("/")
        if not state or (counts and not (pushed.isdigit() and size.isdigit())):
            raise ValueError(f"not a prefetch status: {text!r}")
        return cls(state, int(pushed or 0), int(size or 0), detail)

    def text(self) -> str:
        """What the mount answers: the form `parse` reads."""
        counts = f"{self.state} {self.pushed_bytes}/{self.size}"
        return f"{counts}: {self.detail}" if self.detail else counts

    def line(self) -> str:
        text = f"{self.state} {self.pushed_bytes}/{self.size} bytes"
        return f"{text}: {self.detail}" if self.detail else text


class NotPrefetchable(OSError):
    """The path is not a file of an hdfs-fuse mount."""


def _read(path: Path, name: str) -> Status:
    try:
        return Status.parse(os.getxattr(path, name).decode())
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOSYS):
            raise NotPrefetchable(exc.errno, f"{path} is not on an hdfs-fuse mount (no {name} attribute)") from None
        raise


def request(path: Path) -> Status:
    """Start prefetching `path` (a file of the mount); its status."""
    return _read(path, XATTR)


def status(path: Path) -> Status:
    return _read(path, STATUS_XATTR)


def files_under(paths: Iterable[Path]) -> Iterator[Path]:
    """The files named, and every file below the directories named, in
    name order (a checkpoint's shards in the order a loader reads them)."""
    for path in paths:
        if path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs.sort()
                for name in sorted(names):
                    yield Path(root) / name
        else:
            yield path
