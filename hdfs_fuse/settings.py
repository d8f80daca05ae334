"""Tunables of the striped reader and the mount: the `[hdfs_fuse]` section of
the config file, and the defaults of the library and the CLI flags."""

from __future__ import annotations

import re
from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass
class HdfsFuseConfig:
    # Unit of fetch, retry and cache: one range read per stripe.
    stripe_size: int = 8 * MiB
    # Parallel range reads (connections) per mount or library client.
    streams: int = 16
    # How far ahead of a sequential reader stripes are fetched, at most.
    readahead: int = 256 * MiB
    # In-flight plus buffered stripes across all open files; read-ahead stops
    # at this bound, demand reads go past it rather than fail.
    memory: int = 512 * MiB
    # Attempts after the first for one stripe, spaced by exponential backoff.
    retries: int = 5
    backoff: float = 0.2
    backoff_max: float = 5.0
    # A stripe read still running after this long gets a second, parallel
    # read (a straggler on a slow datanode or connection); first one wins.
    stripe_timeout: float = 10.0
    # Per-request network timeout (connect and between bytes).
    io_timeout: float = 30.0
    # Local disk cache of stripes; empty turns it off.
    cache_dir: str = ""
    cache_size: int = 10 * 1024 * MiB
    # Directory listings and file attributes are trusted for this long.
    attr_ttl: float = 60.0
    # Kernel read-ahead on the mount's backing device, so sequential readers
    # send large, overlapping requests instead of 128 KiB ones.
    kernel_readahead: int = 32 * MiB
    # host:port for Prometheus metrics of the mount daemon; empty: off.
    metrics_address: str = ""
    # The mount pushes arriving stripes into the kernel's page cache.
    page_cache_push: bool = True

    def validate(self) -> None:
        for name in ("stripe_size", "streams", "memory"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hdfs_fuse.{name} must be positive")
        for name in ("readahead", "retries", "cache_size", "kernel_readahead"):
            if getattr(self, name) < 0:
                raise ValueError(f"hdfs_fuse.{name} must not be negative")
        for name in ("backoff", "backoff_max", "stripe_timeout", "io_timeout", "attr_ttl"):
            if getattr(self, name) < 0:
                raise ValueError(f"hdfs_fuse.{name} must not be negative")
        if self.memory < self.stripe_size:
            raise ValueError("hdfs_fuse.memory must hold at least one stripe")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """ "8M", "8MiB", "512k", "1.5G", "4096" -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512K, 8M, 2G)")
    number, unit = match.group(1), match.group(2).lower()
    return int(float(number) * _UNITS[unit])


def parse_bool(text: str) -> bool:
    """ "on"/"off", "true"/"false", "yes"/"no", "1"/"0" (any case) -> bool."""
    value = text.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"not a switch: {text!r} (on or off)")
