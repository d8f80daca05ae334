"""Where snapshots live between nodes: a local directory, any pyarrow.fs URI
(`file://`, `hdfs://`, `s3://`, ...) or an HTTP server that takes PUT
(nginx's dav module, say), one file per key.

Publishing writes a temporary name and then moves it into place, so a reader
sees either no snapshot or a whole one. Two nodes publishing one key at once
each write their own temporary file; whichever move lands last wins, and both
snapshots are valid for the key, so either outcome is correct.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol, Self

import httpx
import pyarrow.fs as pafs

_SUFFIX = ".dsnap"


class StoreUnavailable(Exception):
    """The store could not be reached or read (as opposed to: the key is not there)."""


class Stream(Protocol):
    """A snapshot being read from a store, front to back; leaving its `with`
    block closes it."""

    def read(self, size: int = -1, /) -> bytes: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None, /
    ) -> None: ...


class SnapshotStore(Protocol):
    uri: str

    def get(self, key: str) -> Stream | None: ...

    def object_uri(self, key: str) -> str: ...

    def publish(self, key: str, header: bytes, body: BinaryIO) -> None: ...

    def delete(self, key: str) -> None: ...


def open_store(uri: str) -> SnapshotStore:
    """The store for `uri`: HTTP(S), a pyarrow.fs URI, or a plain directory path."""
    if uri.startswith(("http://", "https://")):
        return HttpStore(uri.rstrip("/"))
    return Store.open(uri)


@dataclass
class Store:
    """A store on any pyarrow filesystem."""

    uri: str
    fs: pafs.FileSystem
    root: str

    @classmethod
    def open(cls, uri: str) -> Store:
        """A store for `uri`; a plain path is a local directory."""
        try:
            if "://" not in uri:
                return cls(uri, pafs.LocalFileSystem(), str(Path(uri).resolve()))
            fs, root = pafs.FileSystem.from_uri(uri)
        except (OSError, ValueError) as exc:
            raise StoreUnavailable(f"cannot open store {uri}: {exc}") from None
        return cls(uri, fs, root.rstrip("/"))

    def path(self, key: str) -> str:
        return f"{self.root}/{key}{_SUFFIX}"

    def object_uri(self, key: str) -> str:
        """The snapshot's URI for `hdfs_fuse`'s range reads."""
        if isinstance(self.fs, pafs.LocalFileSystem):
            return self.path(key)
        return f"{self.uri.rstrip('/')}/{key}{_SUFFIX}"

    def get(self, key: str) -> Stream | None:
        """A stream of the snapshot for `key`, or None if the store lacks it."""
        try:
            if self.fs.get_file_info(self.path(key)).type == pafs.FileType.NotFound:
                return None
            # pyarrow has no type hints; its input streams are binary files.
            stream: Stream = self.fs.open_input_stream(self.path(key))
            return stream
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {self.uri}: {exc}") from None

    def publish(self, key: str, header: bytes, body: BinaryIO) -> None:
        """Write `header` then `body` as the snapshot of `key`, atomically."""
        final = self.path(key)
        temp = f"{self.root}/.tmp-{uuid.uuid4().hex}-{key}{_SUFFIX}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(temp) as out:
                out.write(header)
                shutil.copyfileobj(body, out, 8 << 20)
            try:
                self.fs.move(temp, final)
            except OSError:
                # Filesystems that refuse to replace (HDFS) fail here when
                # another node published first; its snapshot serves as well.
                if self.fs.get_file_info(final).type == pafs.FileType.NotFound:
                    raise
                self.fs.delete_file(temp)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.fs.delete_file(temp)
            raise StoreUnavailable(f"cannot publish to {self.uri}: {exc}") from None

    def delete(self, key: str) -> None:
        """Remove a snapshot found corrupt, so the next miss republishes it."""
        try:
            self.fs.delete_file(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable(f"cannot delete from {self.uri}: {exc}") from None


class _HttpStream:
    """A streamed GET body with the file-like `read(n)` the unpacker wants."""

    def __init__(self, client: httpx.Client, response: httpx.Response) -> None:
        self._client = client
        self._response = response
        self._chunks = response.iter_raw(1 << 20)
        self._buffer = bytearray()

    def read(self, n: int = -1) -> bytes:
        try:
            while n < 0 or len(self._buffer) < n:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._buffer += chunk
        except httpx.HTTPError as exc:
            raise StoreUnavailable(f"reading {self._response.url} failed: {exc}") from None
        size = len(self._buffer) if n < 0 else min(n, len(self._buffer))
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def close(self) -> None:
        self._response.close()
        self._client.close()

    def __enter__(self) -> _HttpStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class HttpStore:
    """Snapshots as files under an HTTP base URL. A PUT that the server
    writes to a temporary file and renames when complete (as nginx does)
    publishes atomically."""

    uri: str

    def _url(self, key: str) -> str:
        return f"{self.uri}/{key}{_SUFFIX}"

    def object_uri(self, key: str) -> str:
        return self._url(key)

    def get(self, key: str) -> Stream | None:
        client = httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0))
        try:
            response = client.send(client.build_request("GET", self._url(key)), stream=True)
        except httpx.HTTPError as exc:
            client.close()
            raise StoreUnavailable(f"cannot read {self.uri}: {exc}") from None
        if response.status_code == 404:
            response.close()
            client.close()
            return None
        if response.status_code != 200:
            response.close()
            client.close()
            raise StoreUnavailable(f"{self._url(key)} answered {response.status_code}")
        return _HttpStream(client, response)

    def publish(self, key: str, header: bytes, body: BinaryIO) -> None:
        def content() -> Iterator[bytes]:
            yield header
            while data := body.read(8 << 20):
                yield data

        try:
            response = httpx.put(self._url(key), content=content(), timeout=60.0)
        except httpx.HTTPError as exc:
            raise StoreUnavailable(f"cannot publish to {self.uri}: {exc}") from None
        if response.status_code not in (200, 201, 204):
            raise StoreUnavailable(f"PUT {self._url(key)} answered {response.status_code}")

    def delete(self, key: str) -> None:
        try:
            response = httpx.delete(self._url(key), timeout=30.0)
        except httpx.HTTPError as exc:
            raise StoreUnavailable(f"cannot delete from {self.uri}: {exc}") from None
        if response.status_code not in (200, 204, 404):
            raise StoreUnavailable(f"DELETE {self._url(key)} answered {response.status_code}")
