"""containerd's per-registry host configuration: `certs.d/<host>/hosts.toml`.

The pure part turns a hosts.toml text into an ordered list of endpoints
(mirrors first, in file order, then the server), as containerd's
`config.ConfigureHosts` does; `endpoints_for` adds the file lookup, and
`HostsFiles` keeps the result per host and reads the file again when it
changes, so an edit takes effect without restarting anything.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from snapshotter.registry.reference import DOCKER_HUB, DOCKER_HUB_API

log = structlog.get_logger("bootseer.registry")

DEFAULT_CERTS_DIR = Path("/etc/containerd/certs.d")
ALL_CAPABILITIES = frozenset({"pull", "resolve", "push"})


class HostsConfigError(ValueError):
    """A hosts.toml that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Endpoint:
    """One place to send registry API requests for a host."""

    base_url: str  # "https://mirror.example.com/v2", no trailing slash
    capabilities: frozenset[str] = ALL_CAPABILITIES
    skip_verify: bool = False
    ca: tuple[Path, ...] = ()
    client_cert: tuple[Path, Path | None] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Mirrors get `?ns=<registry>` so one mirror can serve several registries.
    mirror_of: str = ""
    # The server asked first, with the mirrors behind it, for an answer a
    # mirror may hold stale (Transport.server_first): tried as a mirror is.
    hurried: bool = False

    @property
    def one_try(self) -> bool:
        """Short timeouts and no retries: the next host can answer."""
        return bool(self.mirror_of) or self.hurried

    @property
    def scheme(self) -> str:
        return urlsplit(self.base_url).scheme

    @property
    def netloc(self) -> str:
        return urlsplit(self.base_url).netloc


def default_server(host: str, plain_http: bool) -> str:
    if host == DOCKER_HUB:
        host = DOCKER_HUB_API
    return f"{'http' if plain_http else 'https'}://{host}"


def _as_list(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise HostsConfigError(f"{what} must be a string or a list of strings, got {value!r}")


def _endpoint(url: str, table: Mapping[str, Any], base_dir: Path, mirror_of: str) -> Endpoint:
    parts = urlsplit(url if "://" in url else f"https://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise HostsConfigError(f"host {url!r}: want http://HOST[:PORT] or https://HOST[:PORT]")
    path = parts.path.rstrip("/")
    if not table.get("override_path", False) and not path.endswith("/v2"):
        path += "/v2"
    capabilities = frozenset(_as_list(table.get("capabilities", sorted(ALL_CAPABILITIES)), "capabilities"))
    unknown = capabilities - ALL_CAPABILITIES
    if unknown:
        raise HostsConfigError(f"host {url!r}: unknown capabilities {sorted(unknown)}")
    skip_verify = table.get("skip_verify", False)
    if not isinstance(skip_verify, bool):
        raise HostsConfigError(f"host {url!r}: skip_verify must be true or false")
    ca = tuple(_resolve(base_dir, p) for p in _as_list(table.get("ca", []), "ca"))
    client = table.get("client")
    client_cert: tuple[Path, Path | None] | None = None
    if isinstance(client, str):
        client_cert = (_resolve(base_dir, client), None)
    elif isinstance(client, list) and client:
        first = client[0]
        pair = first if isinstance(first, list) else client
        client_cert = (_resolve(base_dir, pair[0]), _resolve(base_dir, pair[1]) if len(pair) > 1 else None)
    headers = {str(k): ", ".join(_as_list(v, f"header {k}")) for k, v in (table.get("header") or {}).items()}
    return Endpoint(
        base_url=f"{parts.scheme}://{parts.netloc}{path}",
        capabilities=capabilities,
        skip_verify=skip_verify,
        ca=ca,
        client_cert=client_cert,
        headers=headers,
        mirror_of=mirror_of,
    )


def _resolve(base_dir: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else base_dir / p


def parse_hosts_toml(text: str, host: str, base_dir: Path, plain_http: bool = False) -> list[Endpoint]:
    """Endpoints for `host` from a hosts.toml text; relative paths resolve
    against `base_dir` (the file's directory)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HostsConfigError(f"not valid TOML: {exc}") from None
    hosts = doc.get("host") or {}
    if not isinstance(hosts, dict):
        raise HostsConfigError("[host] must be a table of tables")
    endpoints = [_endpoint(url, table, base_dir, mirror_of=host) for url, table in hosts.items()]
    server = doc.get("server") or default_server(host, plain_http)
    server_table = {k: v for k, v in doc.items() if k not in ("server", "host")}
    endpoints.append(_endpoint(server, server_table, base_dir, mirror_of=""))
    return endpoints


def hosts_file(host: str, certs_dir: Path) -> Path | None:
    """containerd's lookup: certs.d/<host>/hosts.toml, then certs.d/_default."""
    for directory in (host, "_default"):
        candidate = certs_dir / directory / "hosts.toml"
        if candidate.is_file():
            return candidate
    return None


def endpoints_for(host: str, certs_dir: Path | None = None, plain_http: bool = False) -> list[Endpoint]:
    """Where to send requests for registry `host` ("docker.io", "127.0.0.1:5000")."""
    path = hosts_file(host, certs_dir if certs_dir is not None else DEFAULT_CERTS_DIR)
    if path is None:
        return [_endpoint(default_server(host, plain_http), {}, Path("/"), mirror_of="")]
    try:
        return parse_hosts_toml(path.read_text(), host, path.parent, plain_http)
    except HostsConfigError as exc:
        raise HostsConfigError(f"{path}: {exc}") from None


# What identifies one version of a hosts.toml: (device, inode, size, mtime,
# ctime) in nanoseconds. An in-place edit changes the size or the times; a
# rename over it (what editors and config managers do) changes the inode.
Signature = tuple[int, int, int, int, int]

# Two same-size writes within one tick of the filesystem's clock (a few ms)
# have the same signature, so a version this young is compared by content
# too (git's "racy" check), until it is older than this.
RACY_S = 2.0


def _signature(path: Path) -> Signature | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _racy(signature: Signature | None) -> bool:
    return signature is not None and time.time_ns() - max(signature[3], signature[4]) < RACY_S * 1e9


@dataclass(frozen=True)
class _Loaded:
    path: Path | None
    signature: Signature | None
    text: str | None  # what `endpoints` were parsed from (None: no file)
    endpoints: list[Endpoint]
    racy: bool


class HostsFiles:
    """`endpoints_for`, kept per host and read again when the file changes.

    Every lookup stats the file (certs.d/<host>/hosts.toml, else
    certs.d/_default/hosts.toml: a microsecond or two, next to a registry
    round trip) and reads it again only when the stat differs from the
    version in use (or that version is under `RACY_S` old), so an edit, a
    new file or a removed one applies from the next request on, in every
    daemon, without a restart. A file that no longer parses (an edit caught
    half-written, a typo) is logged and the previous endpoints stay in use
    until the next change; with no previous version the error is raised, as
    at start. Files hosts.toml names (CAs, client certificates) are read
    when a connection pool is made for the endpoint, not watched.
    """

    def __init__(self, certs_dir: Path | None = None, plain_http: bool = False) -> None:
        self.certs_dir = certs_dir if certs_dir is not None else DEFAULT_CERTS_DIR
        self.plain_http = plain_http
        self._loaded: dict[str, _Loaded] = {}
        self._lock = threading.Lock()

    def _locate(self, host: str) -> tuple[Path | None, Signature | None]:
        for directory in (host, "_default"):
            candidate = self.certs_dir / directory / "hosts.toml"
            signature = _signature(candidate)
            if signature is not None:
                return candidate, signature
        return None, None

    def endpoints(self, host: str) -> list[Endpoint]:
        path, signature = self._locate(host)
        with self._lock:
            loaded = self._loaded.get(host)
        if loaded is not None and (loaded.path, loaded.signature) == (path, signature) and not loaded.racy:
            return loaded.endpoints
        # Read after the stat: a change racing with the read leaves a newer
        # file than `signature` says, and the next lookup reads it again.
        try:
            text = path.read_text() if path is not None else None
        except FileNotFoundError:
            text = None  # removed since the stat; the next lookup sees that
        except OSError as exc:
            return self._keep(host, loaded, path, signature, None, exc)
        if loaded is not None and loaded.path == path and loaded.text == text:
            endpoints = loaded.endpoints
        else:
            try:
                endpoints = self._parse(host, path, text)
            except HostsConfigError as exc:
                return self._keep(host, loaded, path, signature, text, exc)
            if loaded is not None:
                log.info(
                    "registry.hosts_reloaded", host=host, file=str(path), endpoints=[e.base_url for e in endpoints]
                )
        with self._lock:
            self._loaded[host] = _Loaded(path, signature, text, endpoints, _racy(signature))
        return endpoints

    def _keep(
        self,
        host: str,
        loaded: _Loaded | None,
        path: Path | None,
        signature: Signature | None,
        text: str | None,
        exc: Exception,
    ) -> list[Endpoint]:
        """The endpoints in use, after a version that cannot be used."""
        if loaded is None:
            raise exc
        log.warning(
            "registry.hosts_invalid",
            host=host,
            file=str(path),
            error=str(exc),
            keeping=[e.base_url for e in loaded.endpoints],
        )
        # Remembered as this version, so the warning comes once per bad version.
        with self._lock:
            self._loaded[host] = _Loaded(path, signature, text, loaded.endpoints, _racy(signature))
        return loaded.endpoints

    def _parse(self, host: str, path: Path | None, text: str | None) -> list[Endpoint]:
        if path is None or text is None:
            return [_endpoint(default_server(host, self.plain_http), {}, Path("/"), mirror_of="")]
        try:
            return parse_hosts_toml(text, host, path.parent, self.plain_http)
        except HostsConfigError as exc:
            raise HostsConfigError(f"{path}: {exc}") from None
