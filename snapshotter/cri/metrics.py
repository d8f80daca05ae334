"""Prometheus metrics of the CRI image-service proxy (served with the snapshotter's)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "bootseer_cri_requests",
    "ImageService calls forwarded to containerd, by method and gRPC status code.",
    ["method", "code"],
)
REQUEST_SECONDS = Histogram(
    "bootseer_cri_request_seconds",
    "Time to forward one ImageService call, containerd's work included.",
    ["method"],
    buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 1, 2.5, 10, 30, 120, 600),
)
CREDENTIALS = Counter(
    "bootseer_cri_credentials",
    "PullImage credentials seen: stored (new or changed), unchanged, refused "
    "(the registry rejected them; not stored), ignored (for another server, or malformed).",
    ["result"],
)
