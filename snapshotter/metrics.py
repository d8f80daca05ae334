"""Prometheus metrics of the snapshotter daemon."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RPCS = Counter(
    "bootseer_snapshotter_rpcs",
    "Snapshots API calls served, by method and gRPC status code.",
    ["method", "code"],
)
RPC_SECONDS = Histogram(
    "bootseer_snapshotter_rpc_seconds",
    "Time to serve one Snapshots API call.",
    ["method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
LAYERS = Counter(
    "bootseer_snapshotter_layers",
    "Prepares that asked for a remote (lazily served) layer, by the path the layer took "
    "(lazy: served through the layer server; normal: downloaded and unpacked) and why.",
    ["path", "reason"],
)
