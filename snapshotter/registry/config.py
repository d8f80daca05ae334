"""The one way every command and daemon makes its registry client: from the
`[registry]` section of the config file, with command-line flags on top.

Credentials: the CRI credentials file (`cri_credentials`, what kubelet's
PullImage calls carried, by host and repository) first, then the docker
config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from snapshotter.cri.credentials import CriCredentialStore
from snapshotter.registry.auth import Credentials, CredentialSource, Keychain
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.health import MirrorPolicy
from snapshotter.registry.reference import Reference
from snapshotter.registry.settings import RegistryConfig


def client_from_config(
    cfg: RegistryConfig,
    plain_http: bool = False,
    hosts_dir: Path | None = None,
    docker_config: Path | None = None,
) -> RegistryClient:
    sources: Sequence[CredentialSource] = [CriCredentialStore(Path(cfg.cri_credentials))] if cfg.cri_credentials else []
    keychain = Keychain(cfg.credentials_file(docker_config), sources)
    return RegistryClient(
        plain_http=plain_http, certs_dir=hosts_dir or cfg.config_path, keychain=keychain, mirrors=mirror_policy(cfg)
    )


def mirror_policy(cfg: RegistryConfig) -> MirrorPolicy:
    return MirrorPolicy(
        connect_timeout_s=cfg.mirror_connect_timeout_s,
        response_timeout_s=cfg.mirror_response_timeout_s,
        backoff_s=cfg.mirror_backoff_s,
        backoff_max_s=cfg.mirror_backoff_max_s,
    )


class _Only:
    """A credential source holding one repository's credentials."""

    def __init__(self, ref: Reference, creds: Credentials, path: Path) -> None:
        self._ref, self._creds, self._path = ref, creds, path

    @property
    def path(self) -> Path:
        return self._path

    def lookup(self, host: str, repository: str) -> Credentials | None:
        return self._creds if (host, repository) == (self._ref.domain, self._ref.repository) else None


def client_with_credentials(
    cfg: RegistryConfig,
    ref: Reference,
    creds: Credentials,
    *,
    source: Path,
    timeout: float = 10.0,
    retries: int = 1,
) -> RegistryClient:
    """A client that authenticates to `ref`'s repository with `creds`, ahead
    of any other source (the hosts.toml of `cfg` still apply): to check
    credentials before keeping them. `source` names them in error messages."""
    keychain = Keychain(cfg.credentials_file(), [_Only(ref, creds, source)])
    return RegistryClient(
        certs_dir=cfg.config_path,
        keychain=keychain,
        timeout=timeout,
        retries=retries,
        backoff=0.1,
        mirrors=mirror_policy(cfg),
    )
