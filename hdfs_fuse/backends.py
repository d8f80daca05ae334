"""Thin backends: stat, list and positional reads of one remote store.

Every scheme maps to one of two backends. pyarrow.fs covers hdfs:// (libhdfs
and a JVM, loaded only when first used), s3://, gs:// and file://, so the
striping tested on local files runs the exact code path HDFS uses.
http(s):// is plain Range requests over a pool of keep-alive connections.
Backends know nothing of stripes; they read what they are asked, or raise
TransientError / PermanentError.
"""

from __future__ import annotations

import email.utils
import errno
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pyarrow
import pyarrow.fs as pafs

from hdfs_fuse.errors import PermanentError, TransientError
from hdfs_fuse.settings import HdfsFuseConfig
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


def _not_found(location: Location) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "no such remote file or directory", str(location))


# --- pyarrow.fs: hdfs, s3, gs, file --------------------------------------------------


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
            raise _not_found(location)
        return self._info(info)

    def list(self, location: Location) -> list[Entry]:
        selector = pafs.FileSelector(location.arrow_path, recursive=False)
        try:
            infos = self.fs.get_file_info(selector)
        except FileNotFoundError:
            raise _not_found(location) from None
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
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False

    def read_at(self, offset: int, length: int) -> bytes | bytearray:
        try:
            handle = self._idle.get_nowait()
        except queue.Empty:
            handle = None
        try:
            if handle is None:
                handle = self.fs.open_input_file(self.location.arrow_path)
            data = handle.read_at(length, offset)
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


# --- http(s) -------------------------------------------------------------------------


def _http_mtime(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return 0.0


def _raise_for(response: httpx.Response, location: Location) -> None:
    status = response.status_code
    if status == 404:
        raise _not_found(location)
    if status in (408, 429) or status >= 500:
        raise TransientError(f"{location}: HTTP {status}")
    if status >= 400:
        raise PermanentError(f"{location}: HTTP {status}")


class HttpBackend:
    """Range requests against one host. Directory listings are read from
    nginx's JSON autoindex (`autoindex on; autoindex_format json;`)."""

    def __init__(self, scheme: str, authority: str, config: HdfsFuseConfig) -> None:
        self.base = f"{scheme}://{authority}"
        # Room for every stream plus one straggler re-read each.
        connections = config.streams * 2 + 4
        self.client = httpx.Client(
            timeout=httpx.Timeout(config.io_timeout),
            limits=httpx.Limits(
                max_connections=connections, max_keepalive_connections=connections
            ),
            follow_redirects=True,
        )

    def url(self, location: Location, directory: bool = False) -> str:
        path = str(location)[len(self.base) :] or "/"
        if directory and not path.endswith("/"):
            path += "/"
        return self.base + path

    def _request(self, method: str, url: str, location: Location, **kw: Any) -> httpx.Response:
        try:
            return self.client.request(method, url, **kw)
        except httpx.TransportError as exc:
            raise TransientError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    def stat(self, location: Location) -> Entry:
        response = self._request("HEAD", self.url(location), location)
        _raise_for(response, location)
        # Servers redirect a directory's URL to its form with a trailing slash.
        is_dir = response.url.path.endswith("/")
        return Entry(
            name=location.name,
            is_dir=is_dir,
            size=0 if is_dir else int(response.headers.get("content-length", 0)),
            mtime=_http_mtime(response.headers.get("last-modified")),
            version=response.headers.get("etag", response.headers.get("last-modified", "")),
        )

    def list(self, location: Location) -> list[Entry]:
        url = self.url(location, directory=True)
        response = self._request("GET", url, location)
        _raise_for(response, location)
        try:
            items = response.json()
            return [
                Entry(
                    name=str(item["name"]),
                    is_dir=item["type"] == "directory",
                    size=int(item.get("size", 0)),
                    mtime=_http_mtime(item.get("mtime")),
                    version=str(item.get("mtime", "")),
                )
                for item in items
                if item.get("type") in ("file", "directory")
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise PermanentError(
                f"{url}: not a JSON directory listing; serve directories with nginx "
                "`autoindex on; autoindex_format json;` or mount a single file"
            ) from exc

    def open(self, location: Location) -> HttpFile:
        entry = self.stat(location)
        if entry.is_dir:
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(location))
        return HttpFile(self, location, entry.size, entry.version)

    def close(self) -> None:
        self.client.close()


class HttpFile:
    def __init__(self, backend: HttpBackend, location: Location, size: int, version: str) -> None:
        self.backend = backend
        self.location = location
        self.url = backend.url(location)
        self.size = size
        self.version = version

    def read_at(self, offset: int, length: int) -> bytes | bytearray:
        last = offset + length - 1
        headers = {"Range": f"bytes={offset}-{last}", "Accept-Encoding": "identity"}
        if self.version:
            # A changed file answers 200 with all of its new content instead
            # of mixing old and new bytes; rejected below.
            headers["If-Range"] = self.version
        try:
            with self.backend.client.stream("GET", self.url, headers=headers) as response:
                if response.status_code == 200:
                    raise PermanentError(
                        f"{self.url} changed since it was opened, or the server ignores Range requests"
                    )
                _raise_for(response, self.location)
                expected = f"bytes {offset}-{last}/{self.size}"
                got = response.headers.get("content-range", "")
                if response.status_code != 206 or got != expected:
                    raise PermanentError(
                        f"{self.url}: asked for {expected}, got HTTP {response.status_code} {got!r}"
                    )
                buffer = bytearray(length)
                view = memoryview(buffer)
                filled = 0
                for chunk in response.iter_raw():
                    end = filled + len(chunk)
                    if end > length:
                        raise PermanentError(f"{self.url}: more bytes than the range asked for")
                    view[filled:end] = chunk
                    filled = end
        except httpx.TransportError as exc:
            raise TransientError(f"GET {self.url} [{offset}-{last}]: {type(exc).__name__}: {exc}") from exc
        if filled != length:
            raise TransientError(f"GET {self.url} [{offset}-{last}]: short body {filled}/{length}")
        return buffer

    def close(self) -> None:
        pass


# --- selection -----------------------------------------------------------------------


def backend_for(location: Location, config: HdfsFuseConfig) -> Backend:
    """The backend serving `location`'s store; nothing is contacted yet."""
    if location.scheme in ("http", "https"):
        return HttpBackend(location.scheme, location.authority, config)
    if location.scheme == "file":
        return ArrowBackend("file", pafs.LocalFileSystem)
    if location.scheme == "hdfs":
        host, port, user = location.host, location.port, location.user or None
        return ArrowBackend("hdfs", lambda: pafs.HadoopFileSystem(host, port, user=user))
    if location.scheme == "s3":
        return ArrowBackend("s3", pafs.S3FileSystem)
    if location.scheme == "gs":
        return ArrowBackend("gs", pafs.GcsFileSystem)
    raise ValueError(f"no backend for {location.scheme}://")
