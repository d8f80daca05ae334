"""The registry client with credentials from the CRI store against a
registry that wants Bearer tokens (a token server in front of the real
docker-registry): tokens are fetched with them, fetched again when the
cached one expires or is refused, and a wrong password fails at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotter.cri.credentials import CriCredentialStore, PullSecret
from snapshotter.registry.config import client_from_config
from snapshotter.registry.errors import Unauthorized
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.settings import RegistryConfig
from tests.harness.oci import File, ImageBuilder, busybox_layer
from tests.harness.registry import Registry
from tests.registry import tokenfront

pytestmark = pytest.mark.integration


def test_tokens_come_from_cri_credentials_and_are_renewed(
    tmp_path: Path, registry: Registry, images: ImageBuilder, unique: str
) -> None:
    image = images.push(f"cri/token-{unique}", [busybox_layer(), [File("/x", b"x" * 100)]])
    with tokenfront.running(registry.port, login="trainer:pw") as front:
        ref = parse_reference(image.ref.replace(registry.host, front.host, 1))
        hosts = tmp_path / "certs.d" / front.host / "hosts.toml"
        hosts.parent.mkdir(parents=True)
        hosts.write_text(f'server = "http://{front.host}"\n')
        store = CriCredentialStore(tmp_path / "cri" / "credentials.json")
        cfg = RegistryConfig(
            config_path=tmp_path / "certs.d",
            docker_config=str(tmp_path / "absent.json"),
            cri_credentials=str(store.path),
        )
        with client_from_config(cfg) as client:
            with pytest.raises(Unauthorized, match="refused anonymous access"):
                client.resolve(ref)
            # Captured after the client was made: found at the next request.
            store.put(ref.domain, ref.repository, PullSecret("trainer", "pw"))
            layer = client.resolve(ref).manifest.layers[-1]
            asked = len(front.token_requests)
            assert client.fetch_range(ref, layer.digest, 0, 10)
            assert len(front.token_requests) == asked  # the cached token serves

            # The cached token expires (the registry's expires_in ran out).
            for token in client.transport.auth._tokens.tokens.values():
                token.expires_at = 0.0
            assert client.fetch_range(ref, layer.digest, 0, 10)
            assert len(front.token_requests) == asked + 1

            # The registry refuses a token it issued (revoked, or expired early).
            front.issued.clear()
            assert client.fetch_range(ref, layer.digest, 0, 10)
            assert len(front.token_requests) == asked + 2

            # A changed, wrong password: one refused token request, no retries.
            store.put(ref.domain, ref.repository, PullSecret("trainer", "wrong"))
            front.issued.clear()
            with pytest.raises(Unauthorized, match=f"refused the credentials from {store.path}"):
                client.fetch_range(ref, layer.digest, 0, 10)
            assert len(front.token_requests) == asked + 3
