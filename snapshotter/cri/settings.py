"""The `[cri]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class CriConfig:
    # Unix socket the CRI image-service proxy serves (kubelet's
    # --image-service-endpoint); empty turns the proxy off.
    address: str = ""
    # containerd's socket, where its CRI plugin serves runtime.v1.ImageService.
    containerd_address: Path = Path("/run/containerd/containerd.sock")
