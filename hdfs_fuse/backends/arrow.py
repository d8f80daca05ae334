"""The pyarrow.fs backend: hdfs:// (libhdfs and a JVM, loaded only when first
used), s3://, gs:// and file://, so the striping tested on local files runs
the exact code path HDFS uses.

`backend_for` imports this module only when one of these schemes is opened,
so that pyarrow (and numpy, which it loads) stays out of the CLI and the
HTTP backend.
"""

from __future__ import annotations

import errno
import queue
import threading
from collections.abc import Callable

import pyarrow
import pyarrow.fs as pafs

from hdfs_fuse.backends.interface import Entry, not_found
from hdfs_fuse.errors import PermanentError, TransientError
from hdfs_fuse.uri import Location


class ArrowBackend:
    """A pyarrow FileSystem, built by `factory` on first use.

    Building an HadoopFileSystem starts a JVM and connects to the namenode,
    so it waits until a file is actually wanted; a failure there is
    permanent and names what is missing.
    """

    def __init__(self, kind: str, factory: Callable[[], pafs.FileSystem]) -> None:
        self.kind = kind
        self.factory = factory
        self._fs: pafs.FileSystem | None = None
        self._lock = threading.Lock()

    @property
    def fs(self) -> pafs.FileSystem:
        with self._lock:
            if self._fs is None:
                try:
                    self._fs = self.factory()
                except (OSError, pyarrow.ArrowException) as exc:
                    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    hint = (
                        " (hdfs:// needs libhdfs and a JVM: set JAVA_HOME, HADOOP_HOME "
                        "and CLASSPATH=$(hadoop classpath --glob))"
                        if self.kind == "hdfs"
                        else ""
                    )
                    raise PermanentError(f"cannot use {self.kind}: {first_line}{hint}") from exc
            return self._fs

    def _info(self, info: pafs.FileInfo) -> Entry:
        mtime_ns = info.mtime_ns or 0
        is_dir = info.type == pafs.FileType.Directory
        return Entry(
            name=info.base_name,
            is_dir=is_dir,
            size=0 if is_dir else int(info.size or 0),
            mtime=mtime_ns / 1e9,
            version=str(mtime_ns),
        )

    def stat(self, location: Location) -> Entry:
        try:
            info = self.fs.get_file_info(location.arrow_path)
        except OSError as exc:
            raise TransientError(f"stat {location}: {exc}") from exc
        if info.type == pafs.FileType.NotFound:
            raise not_found(location)
        return self._info(info)

    def list(self, location: Location) -> list[Entry]:
        selector = pafs.FileSelector(location.arrow_path, recursive=False)
        try:
            infos = self.fs.get_file_info(selector)
        except FileNotFoundError:
            raise not_found(location) from None
        except OSError as exc:
            raise TransientError(f"list {location}: {exc}") from exc
        return [self._info(i) for i in infos if i.type != pafs.FileType.NotFound]

    def open(self, location: Location) -> ArrowFile:
        entry = self.stat(location)
        if entry.is_dir:
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(location))
        return ArrowFile(self.fs, location, entry.size, entry.version)

    def close(self) -> None:
        self._fs = None


class ArrowFile:
    """Positional reads through a pool of pyarrow file handles.

    One handle per concurrent read: an HDFS input stream talks to one
    datanode over one connection, so parallel stripes need parallel handles.
    """

    def __init__(self, fs: pafs.FileSystem, location: Location, size: int, version: str) -> None:
        self.fs = fs
        self.location = location
        self.size = size
        self.version = version
        self._idle: queue.SimpleQueue[pyarrow.NativeFile] = queue.SimpleQueue()
        self._closed = False

    def read_at(self, offset: int, length: int) -> bytes | bytearray:
        try:
            handle = self._idle.get_nowait()
        except queue.Empty:
            handle = None
        try:
            if handle is None:
                handle = self.fs.open_input_file(self.location.arrow_path)
            data: bytes = handle.read_at(length, offset)
        except FileNotFoundError as exc:
            raise PermanentError(f"{self.location} disappeared: {exc}") from exc
        except OSError as exc:
            # A broken handle is dropped rather than pooled: its connection
            # to the datanode may be the thing that failed.
            handle = None
            raise TransientError(f"read {self.location} at {offset}: {exc}") from exc
        finally:
            if handle is not None and not self._closed:
                self._idle.put(handle)
        return data

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


def backend(location: Location) -> ArrowBackend:
    """The pyarrow backend for `location`'s scheme; nothing is contacted yet."""
    if location.scheme == "file":
        return ArrowBackend("file", pafs.LocalFileSystem)
    if location.scheme == "hdfs":
        host, port, user = location.host, location.port, location.user or None
        return ArrowBackend("hdfs", lambda: pafs.HadoopFileSystem(host, port, user=user))
    if location.scheme == "s3":
        return ArrowBackend("s3", pafs.S3FileSystem)
    if location.scheme == "gs":
        return ArrowBackend("gs", pafs.GcsFileSystem)
    raise ValueError(f"no pyarrow backend for {location.scheme}://")
