"""Remote file URIs: what the user types, parsed into a `Location`.

Pure: parsing never touches the network or loads a JVM, so a typo is
reported at once and the backend is only built when first used.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SCHEMES = ("file", "http", "https", "hdfs", "s3", "gs")


class URIError(ValueError):
    pass


@dataclass(frozen=True)
class Location:
    scheme: str
    # host[:port] for http(s) and hdfs, the bucket for s3/gs, "" for file.
    authority: str
    # Absolute, normalised, "/"-separated; "/" for the root of a bucket/host.
    path: str
    user: str = ""

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        path = quote(self.path) if self.scheme in ("http", "https") else self.path
        return f"{self.scheme}://{user}{self.authority}{path}"

    def child(self, name: str) -> Location:
        if not name or "/" in name or name in (".", ".."):
            raise URIError(f"invalid name {name!r} under {self}")
        return Location(self.scheme, self.authority, posixpath.join(self.path, name), self.user)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def host(self) -> str:
        return self.authority.rpartition(":")[0] if ":" in self.authority else self.authority

    @property
    def port(self) -> int:
        """The explicit port, or 0 (the scheme's default, or HA resolution for HDFS)."""
        _, sep, port = self.authority.rpartition(":")
        return int(port) if sep else 0

    @property
    def arrow_path(self) -> str:
        """The path as pyarrow.fs wants it: "bucket/key" for object stores."""
        if self.scheme in ("s3", "gs"):
            return self.authority + self.path.rstrip("/") if self.path != "/" else self.authority
        return self.path


def parse(uri: str) -> Location:
    """Parse `uri`; a bare absolute path means file://."""
    if uri.startswith("/"):
        uri = "file://" + uri
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise URIError(f"unsupported URI {uri!r}: scheme must be one of {known}")
    if parts.fragment:
        raise URIError(f"{uri!r}: fragments (#...) are not supported")
    if parts.query:
        raise URIError(f"{uri!r}: query strings (?...) are not supported")
    raw_path = unquote(parts.path) if scheme in ("http", "https") else parts.path
    path = posixpath.normpath("/" + raw_path.lstrip("/")) if raw_path else "/"
    if path.startswith("//"):
        # POSIX lets normpath keep a leading "//"; no backend gives it a meaning.
        path = "/" + path.lstrip("/")
    netloc = parts.netloc
    user, _, hostport = netloc.rpartition("@") if "@" in netloc else ("", "", netloc)
    if scheme == "file":
        if hostport not in ("", "localhost"):
            raise URIError(f"{uri!r}: file:// URIs name a local path (file:///abs/path)")
        return Location("file", "", path)
    if scheme in ("s3", "gs"):
        if not hostport:
            raise URIError(f"{uri!r}: missing bucket ({scheme}://BUCKET/key)")
        return Location(scheme, hostport, path)
    if scheme == "hdfs":
        _check_port(uri, hostport)
        # hdfs:///path means the cluster in core-site.xml's fs.defaultFS.
        return Location("hdfs", hostport or "default", path, user)
    if not hostport:
        raise URIError(f"{uri!r}: missing host")
    if user:
        raise URIError(f"{uri!r}: credentials in http URIs are not supported")
    _check_port(uri, hostport)
    return Location(scheme, hostport, path)


def _check_port(uri: str, hostport: str) -> None:
    if hostport.startswith("["):
        raise URIError(f"{uri!r}: IPv6 literals are not supported")
    _, sep, port = hostport.rpartition(":")
    if sep and not (port.isdigit() and 0 < int(port) < 65536):
        raise URIError(f"{uri!r}: bad port {port!r}")
