"""The `[snapshotter]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class SnapshotterConfig:
    root: Path = Path("/var/lib/bootseer/snapshotter")
    address: Path = Path("/run/bootseer/snapshotter.sock")
    # host:port for Prometheus metrics; empty turns them off.
    metrics_address: str = ""
    # Serve indexed layers lazily through the FUSE layer server.
    lazy: bool = True
    # Unix socket on which the daemon runs `bootseer pull` for its clients
    # (snapshotter.pullwire); empty: off, every pull runs in its own process.
    pull_address: str = "/run/bootseer/pull.sock"
