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
RANGE_IGNORED = Counter(
    "bootseer_registry_range_ignored_total",
    "Range requests a registry or mirror answered with the whole blob (200), by host; "
    "a mirror's further ranges of that blob go to the next host for a backoff period",
    ["host"],
)
MULTIRANGE_FALLBACKS = Counter(
    "bootseer_registry_multirange_fallbacks_total",
    "Multi-range requests (a prefetch's runs of a layer in one GET) whose ranges were "
    "then fetched one request each, by host and reason ('whole_blob': it answered "
    "200; 'broken': the answer broke off or did not parse); such a host is asked "
    "range by range for a backoff period",
    ["host", "reason"],
)
MIRROR_DOWN = Counter(
    "bootseer_registry_mirror_down_total",
    "Times a hosts.toml mirror failed (refused, timed out, kept breaking) and was "
    "skipped for a backoff period, by host",
    ["host"],
)
MIRROR_SKIPPED = Counter(
    "bootseer_registry_mirror_skipped_total",
    "Requests that went past a mirror without asking it, by host and reason "
    "('down': in its backoff period; 'range': it ignored Range for that blob)",
    ["host", "reason"],
)
MIRROR_MISMATCHES = Counter(
    "bootseer_registry_mirror_mismatches_total",
    "Answers of a hosts.toml mirror whose bytes did not match their digest (a "
    "cache racing a tag update upstream, or a corrupt copy); the next host was asked, by host",
    ["host"],
)
