"""Connection pools for registry traffic: one httpx client (synchronous,
HTTP/1.1) per TLS configuration. Trust is the system store (not certifi's)
plus what hosts.toml adds for an endpoint: its CAs, a client certificate,
or skip_verify."""

from __future__ import annotations

import functools
import ssl
import threading
from pathlib import Path

import httpx

from snapshotter.registry.hosts import Endpoint


@functools.cache
def system_trust() -> ssl.SSLContext:
    """The system store's context, loaded once per process and shared by
    every pool that adds no trust of its own: a load takes 30-60 ms of CPU,
    which each pool of each client paid inside its first pull. Clients only
    set ALPN on a shared context, to HTTP/1.1 for all of them."""
    return ssl.create_default_context()


def _verify(endpoint: Endpoint | None) -> ssl.SSLContext | bool:
    if endpoint is None or endpoint.scheme != "https":
        return system_trust()
    if endpoint.skip_verify:
        return False
    if not endpoint.ca and endpoint.client_cert is None:
        return system_trust()
    context = ssl.create_default_context()
    for ca in endpoint.ca:
        context.load_verify_locations(cafile=str(ca))
    if endpoint.client_cert is not None:
        cert, key = endpoint.client_cert
        context.load_cert_chain(str(cert), str(key) if key else None)
    return context


class Pools:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._clients: dict[
            tuple[str, bool, tuple[Path, ...], tuple[Path, Path | None] | None] | None, httpx.Client
        ] = {}
        self._lock = threading.Lock()
        # The first client of a process imports httpcore (0.05-0.15 s of
        # CPU) and loads the system store: done here, where a daemon makes
        # its registry client at start, rather than under its first pull.
        self.get(None)

    def get(self, endpoint: Endpoint | None) -> httpx.Client:
        """The pool for `endpoint`; None is "plain system TLS" for redirect
        targets and token servers, which get no registry-specific trust."""
        # Keyed by everything TLS depends on: a hosts.toml edit that changes
        # an endpoint's CA or client certificate gets a new pool.
        key = (endpoint.base_url, endpoint.skip_verify, endpoint.ca, endpoint.client_cert) if endpoint else None
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = httpx.Client(
                    verify=_verify(endpoint),
                    timeout=httpx.Timeout(self.timeout),
                    # The transport follows redirects itself, so credentials stay on their origin.
                    follow_redirects=False,
                    trust_env=False,
                    # Blob bytes must arrive as stored: digests and ranges are over them.
                    headers={"Accept-Encoding": "identity"},
                )
                self._clients[key] = client
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
