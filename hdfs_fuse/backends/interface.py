"""What every backend is and returns: a `Backend` stats, lists and opens
the paths of one store; a `RemoteFile` reads ranges of one file.

Reads raise `TransientError` for what a retry may fix and `PermanentError`
for what it cannot (`hdfs_fuse.errors`); a missing path is `not_found`.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Protocol

from hdfs_fuse.uri import Location


@dataclass(frozen=True)
class Entry:
    name: str
    is_dir: bool
    size: int
    mtime: float
    # Changes whenever the content may have: ETag, or mtime in ns.
    version: str = ""


class RemoteFile(Protocol):
    location: Location
    size: int
    version: str

    def read_at(self, offset: int, length: int) -> bytes | bytearray: ...

    def close(self) -> None: ...


class Backend(Protocol):
    def stat(self, location: Location) -> Entry: ...

    def list(self, location: Location) -> list[Entry]: ...

    def open(self, location: Location) -> RemoteFile: ...

    def close(self) -> None: ...


def not_found(location: Location) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "no such remote file or directory", str(location))
