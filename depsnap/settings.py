"""The `[depsnap]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class DepsnapConfig:
    # Where snapshots are shared between nodes: a directory or a pyarrow.fs
    # URI (hdfs://, s3://, file://). Empty: the node cache only.
    store: str = ""
    # The node-local cache of images, shared by every container on the node.
    cache_dir: Path = Path("/var/cache/bootseer/depsnap")
    # Least recently used images go once the cache holds more than this.
    cache_max_bytes: int = 50 << 30
    # The node daemon's unix socket; the CLI uses the daemon when it answers here.
    socket: Path = Path("/run/bootseer/depsnap.sock")
    # A mount restore from the store reads images at least this large lazily
    # (through a FUSE server, `depsnap.lazy`) instead of fetching them whole
    # first; negative: never.
    lazy_min_bytes: int = 256 << 20
    # host:port for the daemon's Prometheus metrics; empty turns them off.
    metrics_address: str = ""
    # Paths (as a pod sees them) on which the daemon mounts environments for
    # unprivileged pods, and from which it captures what they installed.
    # Exact paths only; empty: the daemon serves pods nothing.
    pod_targets: list[str] = field(default_factory=list)
    # A capture from a pod larger than this is refused (nothing published),
    # so a pod cannot fill the host's disk through the daemon.
    pod_capture_max_bytes: int = 32 << 30
