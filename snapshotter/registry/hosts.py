"""containerd's per-registry host configuration: `certs.d/<host>/hosts.toml`.

The pure part turns a hosts.toml text into an ordered list of endpoints
(mirrors first, in file order, then the server), as containerd's
`config.ConfigureHosts` does; `endpoints_for` adds the file lookup.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from snapshotter.registry.reference import DOCKER_HUB, DOCKER_HUB_API

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
