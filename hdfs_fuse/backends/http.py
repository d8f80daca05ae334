"""The http(s):// backend: Range requests against one host.

Plain http without a proxy reads ranges straight into the stripe over
`hdfs_fuse.rangeconn`'s keep-alive connections; TLS, proxies and redirects go
through httpx. Directories are listed from nginx's JSON autoindex.
"""

from __future__ import annotations

import email.utils
import errno
import http.client
import urllib.request

import httpx

from hdfs_fuse.backends.interface import Entry, not_found
from hdfs_fuse.errors import PermanentError, TransientError
from hdfs_fuse.rangeconn import RangeConnections
from hdfs_fuse.settings import HdfsFuseConfig
from hdfs_fuse.uri import Location

_REDIRECTS = (301, 302, 303, 307, 308)


def _http_mtime(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return 0.0


def _raise_for(status: int, location: Location) -> None:
    if status == 404:
        raise not_found(location)
    if status in (408, 429) or status >= 500:
        raise TransientError(f"{location}: HTTP {status}")
    if status >= 400:
        raise PermanentError(f"{location}: HTTP {status}")


def _direct_connections(location: Location, config: HdfsFuseConfig) -> RangeConnections | None:
    """Connections for reading ranges straight into stripes: plain http
    without a proxy. TLS and proxies stay with httpx, as configured."""
    if location.scheme != "http" or {"http", "all"} & urllib.request.getproxies().keys():
        return None
    return RangeConnections(location.host, location.port or 80, config.io_timeout, keep=config.streams * 2 + 4)


class HttpBackend:
    """Range requests against one host. Directory listings are read from
    nginx's JSON autoindex (`autoindex on; autoindex_format json;`)."""

    def __init__(self, location: Location, config: HdfsFuseConfig) -> None:
        self.base = f"{location.scheme}://{location.authority}"
        self.direct = _direct_connections(location, config)
        # Room for every stream plus one straggler re-read each.
        connections = config.streams * 2 + 4
        self.client = httpx.Client(
            timeout=httpx.Timeout(config.io_timeout),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            follow_redirects=True,
        )

    def url(self, location: Location, directory: bool = False) -> str:
        path = str(location)[len(self.base) :] or "/"
        if directory and not path.endswith("/"):
            path += "/"
        return self.base + path

    def _request(self, method: str, url: str) -> httpx.Response:
        try:
            return self.client.request(method, url)
        except httpx.TransportError as exc:
            raise TransientError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc

    def stat(self, location: Location) -> Entry:
        response = self._request("HEAD", self.url(location))
        _raise_for(response.status_code, location)
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
        response = self._request("GET", url)
        _raise_for(response.status_code, location)
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
        if self.direct is not None:
            self.direct.close()


class HttpFile:
    """Range reads of one file. Each is checked to be exactly the bytes asked
    for: a 206 whose Content-Range is the range and whose body is its length.

    Ranges are read straight into a new buffer over `backend.direct`; a
    response that needs more than that (a redirect, a body without a
    Content-Length) sends this file's reads through httpx from then on.
    """

    def __init__(self, backend: HttpBackend, location: Location, size: int, version: str) -> None:
        self.backend = backend
        self.location = location
        self.url = backend.url(location)
        self.target = httpx.URL(self.url).raw_path.decode("ascii")
        self.size = size
        self.version = version
        self.direct = backend.direct

    def _headers(self, offset: int, last: int) -> dict[str, str]:
        headers = {"Range": f"bytes={offset}-{last}", "Accept-Encoding": "identity"}
        if self.version:
            # A changed file answers 200 with all of its new content instead
            # of mixing old and new bytes; rejected below.
            headers["If-Range"] = self.version
        return headers

    def _check(self, status: int, content_range: str, offset: int, last: int) -> None:
        if status == 200:
            raise PermanentError(f"{self.url} changed since it was opened, or the server ignores Range requests")
        _raise_for(status, self.location)
        expected = f"bytes {offset}-{last}/{self.size}"
        if status != 206 or content_range != expected:
            raise PermanentError(f"{self.url}: asked for {expected}, got HTTP {status} {content_range!r}")

    def _short(self, offset: int, last: int, filled: int) -> TransientError:
        return TransientError(f"GET {self.url} [{offset}-{last}]: short body {filled}/{last - offset + 1}")

    def read_at(self, offset: int, length: int) -> bytes | bytearray:
        if self.direct is not None:
            data = self._read_direct(self.direct, offset, length)
            if data is not None:
                return data
            self.direct = None
        return self._read_httpx(offset, length)

    def _read_direct(self, direct: RangeConnections, offset: int, length: int) -> bytearray | None:
        """The range, or None when the response is one for httpx."""
        last = offset + length - 1
        try:
            with direct.get(self.target, self._headers(offset, last)) as response:
                if response.status in _REDIRECTS or (response.status == 206 and response.length is None):
                    return None
                self._check(response.status, response.getheader("content-range", ""), offset, last)
                if response.length is not None and response.length > length:
                    raise PermanentError(f"{self.url}: more bytes than the range asked for")
                buffer = bytearray(length)
                filled = response.readinto(buffer)
        except (OSError, http.client.HTTPException) as exc:
            raise TransientError(f"GET {self.url} [{offset}-{last}]: {type(exc).__name__}: {exc}") from exc
        if filled != length:
            raise self._short(offset, last, filled)
        return buffer

    def _read_httpx(self, offset: int, length: int) -> bytearray:
        last = offset + length - 1
        try:
            with self.backend.client.stream("GET", self.url, headers=self._headers(offset, last)) as response:
                self._check(response.status_code, response.headers.get("content-range", ""), offset, last)
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
            raise self._short(offset, last, filled)
        return buffer

    def close(self) -> None:
        pass
