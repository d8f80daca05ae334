"""The `[registry]` section of the config file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from snapshotter.registry.auth import default_docker_config
from snapshotter.registry.health import (
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_BACKOFF_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RESPONSE_TIMEOUT_S,
)


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
    # Mirrors (hosts.toml [host] entries, not the server): how long one may
    # take to connect, and to answer (headers, or the next body bytes), before
    # the next host is asked; how long it is then skipped, doubling on each
    # failed retry up to the max (snapshotter.registry.health).
    mirror_connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    mirror_response_timeout_s: float = DEFAULT_RESPONSE_TIMEOUT_S
    mirror_backoff_s: float = DEFAULT_BACKOFF_S
    mirror_backoff_max_s: float = DEFAULT_BACKOFF_MAX_S

    def credentials_file(self, flag: Path | None = None) -> Path:
        """The docker credentials file: a command's flag, else `docker_config`,
        else where docker looks ($DOCKER_CONFIG, ~/.docker)."""
        return flag or (Path(self.docker_config) if self.docker_config else default_docker_config())
