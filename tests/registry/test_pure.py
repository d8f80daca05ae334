"""Unit tests of the registry client's pure parts: references, hosts.toml,
credentials and challenges, manifests and platforms, errors, the retry
schedule, endpoint fallback, requests and resumable-body ranges."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import certifi
import httpx
import pytest

from snapshotter.registry import media
from snapshotter.registry.auth import (
    CredentialsError,
    Keychain,
    credentials_from_config,
    parse_challenges,
    parse_token_response,
)
from snapshotter.registry.client import referrers_tag
from snapshotter.registry.errors import NotFound, RegistryError, ServerError, Unauthorized, Unreachable
from snapshotter.registry.hosts import Endpoint, HostsConfigError, endpoints_for, parse_hosts_toml
from snapshotter.registry.pools import _verify, system_trust
from snapshotter.registry.reference import InvalidReference, Reference, parse
from snapshotter.registry.responses import content_range_start, next_link
from snapshotter.registry.resumable import BlobBody
from snapshotter.registry.retry import BACKOFF_CAP, Backoff
from snapshotter.registry.transport import Request, Transport

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "domain", "repository", "tag", "digest"),
    [
        ("ubuntu", "docker.io", "library/ubuntu", "latest", ""),
        ("ubuntu:22.04", "docker.io", "library/ubuntu", "22.04", ""),
        ("user/app", "docker.io", "user/app", "latest", ""),
        ("index.docker.io/library/ubuntu:x", "docker.io", "library/ubuntu", "x", ""),
        (f"docker.io/library/ubuntu@{DIGEST}", "docker.io", "library/ubuntu", "", DIGEST),
        (f"127.0.0.1:5000/demo/train:v1@{DIGEST}", "127.0.0.1:5000", "demo/train", "v1", DIGEST),
        ("127.0.0.1:5000/demo/train:v1", "127.0.0.1:5000", "demo/train", "v1", ""),
        ("localhost/a", "localhost", "a", "latest", ""),
        ("registry.example.com/a/b/c", "registry.example.com", "a/b/c", "latest", ""),
        ("localhost:5000/x", "localhost:5000", "x", "latest", ""),
    ],
)
def test_reference_parsing(text: str, domain: str, repository: str, tag: str, digest: str) -> None:
    ref = parse(text)
    assert (ref.domain, ref.repository, ref.tag, ref.digest) == (domain, repository, tag, digest)
    assert parse(str(ref)) == ref


@pytest.mark.parametrize("text", ["", "UPPER/case", "a//b", "host:5000/x:bad tag", "x@sha256:short", "x:"])
def test_invalid_references(text: str) -> None:
    with pytest.raises(InvalidReference):
        parse(text)


def test_reference_helpers() -> None:
    ref = parse("ubuntu")
    assert str(ref) == "docker.io/library/ubuntu:latest"
    assert ref.with_digest(DIGEST).object == DIGEST
    assert ref.with_tag("sha256-x").object == "sha256-x"


def test_hosts_toml_mirrors_first_then_server(tmp_path: Path) -> None:
    text = """
server = "http://10.0.0.1:5000"
skip_verify = false

[host."https://mirror.example.com"]
  capabilities = ["pull", "resolve"]
  ca = "mirror-ca.pem"
  skip_verify = true
  [host."https://mirror.example.com".header]
    x-team = "ml"

[host."http://plain.example.com:8080/prefix"]
  capabilities = ["pull"]
  override_path = true
"""
    endpoints = parse_hosts_toml(text, "registry.example.com", tmp_path)
    assert [e.base_url for e in endpoints] == [
        "https://mirror.example.com/v2",
        "http://plain.example.com:8080/prefix",
        "http://10.0.0.1:5000/v2",
    ]
    mirror, plain, server = endpoints
    assert mirror.capabilities == {"pull", "resolve"} and mirror.skip_verify
    assert mirror.ca == (tmp_path / "mirror-ca.pem",) and mirror.headers == {"x-team": "ml"}
    assert mirror.mirror_of == "registry.example.com" and server.mirror_of == ""
    assert plain.scheme == "http" and plain.capabilities == {"pull"}
    assert server.capabilities == {"pull", "resolve", "push"}


def test_pools_share_the_system_trust_unless_an_endpoint_adds_its_own() -> None:
    shared = system_trust()
    assert isinstance(shared, ssl.SSLContext)
    assert _verify(None) is shared
    assert _verify(Endpoint("http://10.0.0.1:5000/v2")) is shared
    assert _verify(Endpoint("https://registry.example.com/v2")) is shared
    assert _verify(Endpoint("https://mirror.example.com/v2", skip_verify=True)) is False
    own = _verify(Endpoint("https://mirror.example.com/v2", ca=(Path(certifi.where()),)))
    assert isinstance(own, ssl.SSLContext) and own is not shared
    assert _verify(Endpoint("https://mirror.example.com/v2", ca=(Path(certifi.where()),))) is not own


def test_hosts_toml_defaults_and_errors(tmp_path: Path) -> None:
    assert [e.base_url for e in parse_hosts_toml("", "docker.io", tmp_path)] == ["https://registry-1.docker.io/v2"]
    assert parse_hosts_toml("", "r:5000", tmp_path, plain_http=True)[0].base_url == "http://r:5000/v2"
    with pytest.raises(HostsConfigError, match="unknown capabilities"):
        parse_hosts_toml('[host."https://m"]\ncapabilities = ["fly"]', "r", tmp_path)
    with pytest.raises(HostsConfigError, match="not valid TOML"):
        parse_hosts_toml("server = ", "r", tmp_path)


def test_hosts_file_lookup(tmp_path: Path) -> None:
    (tmp_path / "r:5000").mkdir()
    (tmp_path / "r:5000" / "hosts.toml").write_text('server = "http://r:5000"\n')
    assert endpoints_for("r:5000", tmp_path)[0].base_url == "http://r:5000/v2"
    assert endpoints_for("other", tmp_path)[0].base_url == "https://other/v2"
    (tmp_path / "_default").mkdir()
    (tmp_path / "_default" / "hosts.toml").write_text('[host."http://mirror:1"]\n')
    assert [e.base_url for e in endpoints_for("other", tmp_path)] == ["http://mirror:1/v2", "https://other/v2"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "hosts.toml").write_text("server = ")
    with pytest.raises(HostsConfigError, match=str(tmp_path / "bad" / "hosts.toml")):
        endpoints_for("bad", tmp_path)


def test_credentials_from_config_json() -> None:
    encoded = base64.b64encode(b"alice:pa:ss").decode()
    doc: dict[str, object] = {
        "auths": {
            "https://reg.example.com": {"auth": encoded},
            "other:5000": {"username": "bob", "password": "pw"},
            "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:tok").decode()},
        }
    }
    alice = credentials_from_config(doc, "reg.example.com")
    assert alice is not None and (alice.username, alice.password) == ("alice", "pa:ss")
    bob = credentials_from_config(doc, "other:5000")
    assert bob is not None and bob.username == "bob"
    hub = credentials_from_config(doc, "docker.io")
    assert hub is not None and hub.username == "hub"
    assert credentials_from_config(doc, "nowhere") is None
    assert "pa:ss" not in repr(alice)
    assert alice.basic_header() == "Basic " + encoded
    with pytest.raises(CredentialsError, match="not base64"):
        credentials_from_config({"auths": {"h": {"auth": "!!"}}}, "h")


def test_keychain_reads_file_and_reports_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    assert Keychain(path).get("h", "team/app") is None  # no file: anonymous
    path.write_text(json.dumps({"auths": {"h": {"username": "u", "password": "p"}}}))
    creds = Keychain(path).get("h", "team/app")
    assert creds is not None and creds.password == "p"
    path.write_text("{")
    with pytest.raises(CredentialsError, match=str(path)):
        Keychain(path).get("h", "team/app")


def test_challenge_parsing() -> None:
    header = (
        'Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push"'
    )
    (bearer,) = parse_challenges(header)
    assert bearer.scheme == "bearer" and bearer.realm == "https://auth.example.com/token"
    assert bearer.params["scope"] == "repository:a/b:pull,push"
    assert [c.scheme for c in parse_challenges('Basic realm="x", Bearer realm="y"')] == ["basic", "bearer"]
    assert parse_challenges('Basic realm="Registry Realm"')[0].realm == "Registry Realm"


def test_token_response() -> None:
    token = parse_token_response(b'{"token": "t1", "expires_in": 300}', now=100.0)
    assert token.value == "t1" and token.valid(now=300.0) and not token.valid(now=400.0)
    assert parse_token_response(b'{"access_token": "t2"}', now=0).value == "t2"
    with pytest.raises(ValueError):
        parse_token_response(b"{}")


def _manifest_json(**extra: object) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media.OCI_MANIFEST,
            "config": {"mediaType": media.OCI_CONFIG, "digest": DIGEST, "size": 2},
            "layers": [{"mediaType": media.OCI_LAYER_GZIP, "digest": DIGEST, "size": 5}],
            **extra,
        }
    ).encode()


def test_manifest_parsing() -> None:
    parsed = media.parse(_manifest_json(), media.OCI_MANIFEST)
    assert isinstance(parsed, media.Manifest) and parsed.layers[0].size == 5 and parsed.subject is None
    with_subject = media.parse(
        _manifest_json(
            subject={"mediaType": media.OCI_MANIFEST, "digest": DIGEST, "size": 9},
            artifactType="application/x.bootseer.index",
        ),
        media.OCI_MANIFEST,
    )
    assert isinstance(with_subject, media.Manifest) and with_subject.subject is not None
    assert media.artifact_type_of(with_subject) == "application/x.bootseer.index"
    assert media.detect_media_type(b'{"schemaVersion":2,"manifests":[]}') == media.OCI_INDEX
    with pytest.raises(media.InvalidManifest, match="schema 1"):
        media.parse(b'{"schemaVersion": 1}', media.DOCKER_SCHEMA1)
    with pytest.raises(media.InvalidManifest, match="size"):
        media.parse(_manifest_json(layers=[{"mediaType": "x", "digest": DIGEST, "size": -1}]), media.OCI_MANIFEST)
    with pytest.raises(media.InvalidManifest, match="not JSON"):
        media.parse(b"<html>", media.OCI_MANIFEST)


def test_platform_selection() -> None:
    def entry(arch: str, variant: str = "", mt: str = media.OCI_MANIFEST) -> dict[str, object]:
        plat = {"os": "linux", "architecture": arch, **({"variant": variant} if variant else {})}
        return {"mediaType": mt, "digest": DIGEST, "size": 1, "platform": plat}

    index = media.parse(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [
                    entry("arm", "v7"),
                    entry("arm64"),
                    entry("amd64"),
                ],
            }
        ).encode(),
        media.OCI_INDEX,
    )
    assert isinstance(index, media.Index)
    amd64 = media.select_platform(index, media.Platform.parse("linux/amd64"))
    assert amd64.platform == media.Platform("linux", "amd64")
    arm64 = media.select_platform(index, media.Platform.parse("linux/arm64/v8"))
    assert arm64.platform == media.Platform("linux", "arm64")
    with pytest.raises(LookupError, match="linux/s390x"):
        media.select_platform(index, media.Platform.parse("linux/s390x"))
    with pytest.raises(ValueError):
        media.Platform.parse("amd64")
    rebuilt = media.parse(index.to_bytes(), media.OCI_INDEX)
    assert rebuilt == index


def test_referrers_tag_and_link_header() -> None:
    assert referrers_tag(DIGEST) == "sha256-" + "ab" * 32
    assert next_link('</v2/a/referrers/x?n=2>; rel="next"') == "/v2/a/referrers/x?n=2"
    assert next_link("") is None


def test_errors_name_the_reference() -> None:
    ref = parse("127.0.0.1:5000/demo/train:v1")
    error = NotFound.at(ref, "blob x not found")
    assert isinstance(error, NotFound) and str(error) == "127.0.0.1:5000/demo/train: blob x not found"
    assert (error.host, error.repository) == ("127.0.0.1:5000", "demo/train")
    assert str(RegistryError("no repository", host="h")) == "h: no repository"


def test_backoff_doubles_with_jitter_capped_and_stretched_by_retry_after() -> None:
    backoff = Backoff(retries=4, base=0.25)
    for attempt, full in enumerate([0.25, 0.5, 1.0, 2.0]):
        assert all(full / 2 <= backoff.delay(attempt) <= full for _ in range(50))
    assert backoff.delay(20) <= BACKOFF_CAP
    assert backoff.delay(0, httpx.Response(429, headers={"Retry-After": "3"})) == 3.0
    assert backoff.delay(0, httpx.Response(429, headers={"Retry-After": "3600"})) == BACKOFF_CAP
    assert backoff.delay(0, httpx.Response(503, headers={"Retry-After": "soon"})) <= 0.25


def _mirrored_transport(tmp_path: Path) -> tuple[Transport, Reference]:
    (tmp_path / "r:5000").mkdir()
    (tmp_path / "r:5000" / "hosts.toml").write_text(
        'server = "http://r:5000"\n[host."http://m1"]\n[host."http://m2"]\n  capabilities = ["pull"]\n'
    )
    return Transport(certs_dir=tmp_path), parse("r:5000/a/b:v1")


def test_over_endpoints_skips_failing_mirrors_until_the_server(tmp_path: Path) -> None:
    transport, ref = _mirrored_transport(tmp_path)
    tried: list[str] = []

    def fails_on_mirrors(endpoint: Endpoint) -> int:
        tried.append(endpoint.netloc)
        if endpoint.mirror_of:
            raise (NotFound if endpoint.netloc == "m1" else Unreachable).at(ref, "not here")
        return 7

    answer: int = transport.over_endpoints(ref, "pull", fails_on_mirrors)
    assert answer == 7 and tried == ["m1", "m2", "r:5000"]
    tried.clear()

    def fails_everywhere(endpoint: Endpoint) -> int:
        tried.append(endpoint.netloc)
        raise ServerError.at(ref, "broken")

    with pytest.raises(ServerError):
        transport.over_endpoints(ref, "resolve", fails_everywhere)
    assert tried == ["m1", "r:5000"]  # m2 cannot resolve; the server's error is final
    (tmp_path / "ro:1").mkdir()
    (tmp_path / "ro:1" / "hosts.toml").write_text('server = "http://ro:1"\ncapabilities = ["pull", "resolve"]\n')
    with pytest.raises(RegistryError, match=r"ro:1/a: no endpoint in hosts\.toml has the 'push' capability"):
        transport.endpoints(parse("ro:1/a"), "push")


def test_server_first_asks_the_mirrors_only_when_the_server_fails(tmp_path: Path) -> None:
    transport, ref = _mirrored_transport(tmp_path)
    tried: list[tuple[str, bool]] = []

    def answer(server_fails: type[RegistryError] | None) -> Callable[[Endpoint], str]:
        def call(endpoint: Endpoint) -> str:
            tried.append((endpoint.netloc, endpoint.one_try))
            if endpoint.netloc == "r:5000" and server_fails is not None:
                raise server_fails.at(ref, "down")
            if endpoint.netloc == "m1":
                raise NotFound.at(ref, "not here")
            return endpoint.netloc

        return call

    # With mirrors behind it, the server gets a mirror's one short try.
    assert transport.server_first(ref, "pull", answer(None)) == "r:5000" and tried == [("r:5000", True)]
    for failure in (Unreachable, ServerError):
        tried.clear()
        assert transport.server_first(ref, "pull", answer(failure)) == "m2"
        assert [netloc for netloc, _ in tried] == ["r:5000", "m1", "m2"]
    tried.clear()
    with pytest.raises(Unreachable, match="r:5000"):
        transport.server_first(ref, "resolve", answer(Unreachable))
    assert [netloc for netloc, _ in tried] == ["r:5000", "m1"]  # m2 cannot resolve
    # Without mirrors the server keeps its full retry budget.
    alone = Transport(certs_dir=tmp_path / "none")
    tried.clear()
    assert alone.server_first(ref, "pull", answer(None)) == "r:5000" and tried == [("r:5000", False)]


def test_over_endpoints_stays_on_a_pinned_endpoint(tmp_path: Path) -> None:
    transport, ref = _mirrored_transport(tmp_path)
    tried: list[str] = []

    def breaks(endpoint: Endpoint) -> None:
        tried.append(endpoint.netloc)
        raise Unreachable.at(ref, "dropped mid-body")

    with pytest.raises(Unreachable):
        transport.over_endpoints(ref, "pull", breaks, pinned=lambda: True)
    assert tried == ["m1"]
    # Other registry errors (a refused login, a range beyond the end) are final anywhere.
    with pytest.raises(Unauthorized):
        transport.over_endpoints(ref, "pull", lambda e: _fail(Unauthorized, ref))


def _fail(kind: type[RegistryError], ref: Reference) -> NoReturn:
    raise kind.at(ref, "failed")


def test_request_targets_and_origins() -> None:
    mirror = Endpoint("https://mirror.example.com/v2", mirror_of="registry.example.com")
    ref = parse("registry.example.com/a/b:v1")
    request = Request(mirror, ref, "GET", "/a/b/manifests/v1", params={"n": "2"})
    assert request.url == "https://mirror.example.com/v2/a/b/manifests/v1"
    assert request.query == {"n": "2", "ns": "registry.example.com"}
    assert request.on_registry("https://mirror.example.com/v2/x") and not request.on_registry("https://s3/x")
    upload = Request(Endpoint("http://r:5000/v2"), ref, "PUT", "http://r:5000/v2/a/b/blobs/uploads/u?_state=s")
    assert upload.url == upload.target and upload.query == {}


def test_blob_body_ranges() -> None:
    ref = parse("r:5000/a/b")
    whole = BlobBody(ref, DIGEST, lambda _: None)
    assert whole.range_header() == {} and whole.what == f"blob {DIGEST}" and whole.kind == "blob"
    whole.deliver(b"12345")
    assert whole.range_header() == {"Range": "bytes=5-"} and whole.started()
    part = BlobBody(ref, DIGEST, lambda _: None, 100, 200)
    assert part.range_header() == {"Range": "bytes=100-199"} and part.kind == "range"
    assert part.what == f"blob {DIGEST} range [100, 200)"
    part.deliver(b"x" * 40)
    assert part.range_header() == {"Range": "bytes=140-199"} and part.offset == 140


def test_content_range_start() -> None:
    assert content_range_start(httpx.Response(206, headers={"Content-Range": "bytes 10-19/100"})) == 10
    assert content_range_start(httpx.Response(206, headers={"Content-Range": "items 1-2/3"})) is None
    assert content_range_start(httpx.Response(200)) is None
