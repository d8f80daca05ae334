"""What a remote read can fail with.

Backends raise `TransientError` for what a retry may fix (connection reset,
server restarting, 5xx) and `PermanentError` for what it cannot (no such file,
the file changed under us, no range support). The striped reader turns either,
once its budget is spent, into `RemoteReadError`: an OSError with errno EIO,
which the FUSE mount hands to the kernel unchanged.
"""

from __future__ import annotations

import errno


class TransientError(Exception):
    pass


class PermanentError(Exception):
    pass


class RemoteReadError(OSError):
    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)
