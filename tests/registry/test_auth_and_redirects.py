"""The transport's auth and redirect layers against the real registry: a
Bearer token exchange (a token server in front of docker-registry), tokens
cached per scope, refusals that say what to do, and the redirect bound."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from snapshotter.registry.auth import Credentials, Keychain
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.errors import ServerError, Unauthorized
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.faultproxy import FaultProxy
from tests.harness.oci import PushedImage
from tests.harness.registry import Registry
from tests.registry import tokenfront

pytestmark = pytest.mark.integration


def _client(docker_config: Path | None = None) -> RegistryClient:
    return RegistryClient(plain_http=True, backoff=0.01, retries=1, keychain=Keychain(docker_config))


def _docker_config(tmp_path: Path, host: str, login: str) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(login.encode()).decode()}}}))
    return path


def test_bearer_token_fetched_once_per_scope(tmp_path: Path, registry: Registry, pushed: PushedImage) -> None:
    with tokenfront.running(registry.port) as front:
        ref = parse_reference(pushed.ref.replace(registry.host, front.host, 1))
        with _client(docker_config=tmp_path / "absent.json") as client:
            image = client.resolve(ref)
            client.fetch_blob(ref, image.manifest.layers[0].digest, io.BytesIO())
            assert client.fetch_range(ref, image.manifest.layers[1].digest, 0, 10)
            assert len(front.token_requests) == 1  # the pull token serves every later pull request
            client.push_blob(ref, b"pushed through a bearer token")
        scopes = [q["scope"] for q in front.token_requests]
        assert scopes == [["repository:regtest/sample:pull"], ["repository:regtest/sample:pull,push"]]
        assert all(q["service"] == [tokenfront.SERVICE] for q in front.token_requests)


def test_token_server_wants_credentials(tmp_path: Path, registry: Registry, pushed: PushedImage) -> None:
    with tokenfront.running(registry.port, login="trainer:pw") as front:
        ref = parse_reference(pushed.ref.replace(registry.host, front.host, 1))
        with (
            _client(docker_config=tmp_path / "absent.json") as client,
            pytest.raises(Unauthorized, match="refused anonymous access; log in first") as info,
        ):
            client.resolve(ref)
        assert str(info.value).startswith(f"{front.host}/regtest/sample: token server http://{front.host}/token")
        wrong = _docker_config(tmp_path, front.host, "trainer:nope")
        with _client(docker_config=wrong) as client, pytest.raises(Unauthorized, match=f"credentials from {wrong}"):
            client.resolve(ref)
        right = _docker_config(tmp_path, front.host, "trainer:pw")
        with _client(docker_config=right) as client:
            assert client.resolve(ref).manifest_digest


class _RegistryToken:
    """A credential source holding a CRI registry token for one host."""

    def __init__(self, path: Path, host: str, token: str) -> None:
        self.path, self._host, self._token = path, host, token

    def lookup(self, host: str, repository: str) -> Credentials | None:
        return Credentials("", "", registry_token=self._token) if host == self._host else None


def test_a_registry_token_is_sent_as_it_is(tmp_path: Path, registry: Registry, pushed: PushedImage) -> None:
    """CRI's AuthConfig.registry_token is a bearer token for the registry
    itself: used without a token exchange, and refused cleanly once the
    registry no longer takes it (it cannot be renewed)."""
    with tokenfront.running(registry.port, login="trainer:pw") as front:
        ref = parse_reference(pushed.ref.replace(registry.host, front.host, 1))
        front.issued.append("kubelet-given")
        keychain = Keychain(
            tmp_path / "absent.json", [_RegistryToken(tmp_path / "cri.json", front.host, "kubelet-given")]
        )
        with RegistryClient(plain_http=True, backoff=0.01, retries=1, keychain=keychain) as client:
            assert client.resolve(ref).manifest_digest
            assert front.token_requests == []
            front.issued.remove("kubelet-given")
            with pytest.raises(Unauthorized, match="refused the credentials"):
                client.resolve(ref)
        assert front.token_requests == []


def test_redirects_are_bounded(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1))
    proxy.plan("redirect", "/manifests/", times=100, redirect_to=f"http://{proxy.host}")
    with _client() as client, pytest.raises(ServerError, match="more than 5 redirects for GET /regtest/sample/"):
        client.resolve(ref)
    assert len(proxy.requests("GET", "/manifests/")) == 6


def test_redirect_to_another_origin_skips_endpoint_headers_and_query(
    tmp_path: Path, registry: Registry, pushed: PushedImage
) -> None:
    """A mirror's `ns` query and hosts.toml headers stay on the mirror's origin."""
    with faultproxy.running(registry.port) as mirror, faultproxy.running(registry.port) as storage:
        host_dir = tmp_path / registry.host
        host_dir.mkdir()
        (host_dir / "hosts.toml").write_text(
            f'server = "http://{registry.host}"\n'
            f'[host."http://{mirror.host}"]\n  capabilities = ["pull", "resolve"]\n'
            f'  [host."http://{mirror.host}".header]\n    x-team = "ml"\n'
        )
        mirror.plan("redirect", "/blobs/", redirect_to=f"http://{storage.host}")
        ref = parse_reference(pushed.ref)
        with RegistryClient(certs_dir=tmp_path, retries=0) as client:
            layer = client.resolve(ref).manifest.layers[0]
            assert len(client.fetch_range(ref, layer.digest, 0, 10)) == 10
        assert all({k.lower(): v for k, v in s.headers.items()}.get("x-team") == "ml" for s in mirror.requests())
        assert all("ns=" in s.path for s in mirror.requests())
        (redirected,) = storage.requests()
        # The Location keeps the mirror's query; nothing is added to it.
        assert "x-team" not in {k.lower() for k in redirected.headers} and redirected.path.count("ns=") == 1
