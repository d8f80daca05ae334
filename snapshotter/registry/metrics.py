"""Prometheus counters for registry traffic, shared by every RegistryClient
in the process (the FUSE layer server and `bootseer pull` alike)."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter(
    "bootseer_registry_requests_total",
    "HTTP requests sent to registries, by method and status code (or 'error')",
    ["method", "code"],
)
RETRIES = Counter(
    "bootseer_registry_retries_total",
    "Registry requests retried after a transient failure, by reason",
    ["reason"],
)
BYTES = Counter(
    "bootseer_registry_bytes_total",
    "Blob bytes received from registries, by kind of read",
    ["kind"],
)
