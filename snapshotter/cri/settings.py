"""The `[cri]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CriConfig:
    # Unix socket the CRI image-service proxy serves (kubelet's
    # --image-service-endpoint); empty turns the proxy off.
    address: str = ""
    # containerd's socket, where its CRI plugin serves runtime.v1.ImageService.
    containerd_address: Path = Path("/run/containerd/containerd.sock")
    # A pod annotated bootseer.io/prefetch has the files it names prefetched
    # when kubelet pulls its image: only files below these host directories,
    # on hdfs-fuse mounts (see snapshotter/cri/prefetch.py). Empty: off.
    prefetch_roots: list[str] = field(default_factory=list)
