"""The `[registry]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class RegistryConfig:
    # containerd's hosts directory: certs.d/<host>/hosts.toml (mirrors, plain HTTP, CAs).
    config_path: Path = Path("/etc/containerd/certs.d")
    # Docker credentials file; empty means $DOCKER_CONFIG/config.json or ~/.docker/config.json.
    docker_config: str = ""
    # The credentials the CRI proxy captured from kubelet's PullImage calls
    # (snapshotter.cri.credentials), consulted before docker_config by host and
    # repository; every daemon on the node reads the same file. Empty: not used.
    cri_credentials: str = "/var/lib/bootseer/cri/credentials.json"
