"""Thin backends: stat, list and positional reads of one remote store.

Every scheme maps to one of two backends, and `backend_for` (here) picks it:
pyarrow.fs for hdfs://, s3://, gs:// and file://, plain Range requests over
pools of keep-alive connections for http(s)://. Backends know nothing of
stripes; they read what they are asked, or raise TransientError /
PermanentError.

- `interface`: what a backend is (`Backend`, `RemoteFile`) and what it
  returns (`Entry`, `not_found`).
- `http`: `HttpBackend` and `HttpFile`, Range requests over
  `hdfs_fuse.rangeconn` or httpx.
- `arrow`: `ArrowBackend` and `ArrowFile`, over pyarrow.fs; imported only
  when one of its schemes is opened.
"""

from __future__ import annotations

from hdfs_fuse.backends.http import HttpBackend
from hdfs_fuse.backends.interface import Backend
from hdfs_fuse.settings import HdfsFuseConfig
from hdfs_fuse.uri import Location


def backend_for(location: Location, config: HdfsFuseConfig) -> Backend:
    """The backend serving `location`'s store; nothing is contacted yet."""
    if location.scheme in ("http", "https"):
        return HttpBackend(location, config)
    # pyarrow (and numpy) load only when a file needs them.
    from hdfs_fuse.backends import arrow

    return arrow.backend(location)
