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
