"""The one way every command and daemon makes its registry client: from the
`[registry]` section of the config file, with command-line flags on top."""

from __future__ import annotations

from pathlib import Path

from snapshotter.registry.client import RegistryClient
from snapshotter.registry.settings import RegistryConfig


def client_from_config(
    cfg: RegistryConfig,
    plain_http: bool = False,
    hosts_dir: Path | None = None,
    docker_config: Path | None = None,
) -> RegistryClient:
    return RegistryClient(
        plain_http=plain_http,
        certs_dir=hosts_dir or cfg.config_path,
        docker_config=docker_config or (Path(cfg.docker_config) if cfg.docker_config else None),
    )
