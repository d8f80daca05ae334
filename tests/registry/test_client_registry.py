"""RegistryClient against a real docker-registry 2.8, directly, through a
fault proxy in front of it, through hosts.toml, and with htpasswd auth."""

from __future__ import annotations

import hashlib
import io
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from snapshotter.registry import media
from snapshotter.registry.auth import Keychain
from snapshotter.registry.client import RegistryClient, referrers_tag
from snapshotter.registry.errors import DigestMismatch, NotFound, ServerError, Unauthorized, Unreachable
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.faultproxy import FaultProxy
from tests.harness.oci import File, ImageBuilder, PushedImage, write_layout
from tests.harness.procs import free_tcp_port
from tests.harness.registry import AuthRegistry, Registry, start_registry
from tests.registry.conftest import sample_layers

pytestmark = pytest.mark.integration


def _blob(pushed: PushedImage, digest: str) -> bytes:
    return (pushed.layout.directory / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()


def _client(*, retries: int = 4, docker_config: Path | None = None) -> RegistryClient:
    # A short backoff keeps retry tests quick; the schedule is the same.
    return RegistryClient(plain_http=True, backoff=0.01, retries=retries, keychain=Keychain(docker_config))


def _at(proxy: FaultProxy, pushed: PushedImage) -> str:
    """`pushed`'s reference, reached through the proxy."""
    return pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1)


def test_resolve_fetch_and_range(pushed: PushedImage) -> None:
    with _client() as client:
        image = client.resolve(parse_reference(pushed.ref))
        assert image.media_type == media.OCI_MANIFEST and image.index_digest is None
        assert len(image.manifest.layers) == 2
        big = image.manifest.layers[1]
        blob = _blob(pushed, big.digest)
        out = io.BytesIO()
        seen: list[int] = []
        client.fetch_blob(image.ref, big.digest, out, progress=seen.append)
        assert out.getvalue() == blob and sum(seen) == len(blob)
        assert client.fetch_range(image.ref, big.digest, 100, 5000) == blob[100:5000]
        assert client.fetch_range(image.ref, big.digest, len(blob) - 7, len(blob)) == blob[-7:]
        assert client.blob_exists(image.ref, big.digest)
        assert not client.blob_exists(image.ref, "sha256:" + "0" * 64)
        data, _, digest = client.fetch_manifest(image.ref.with_digest(image.manifest_digest))
        assert digest == image.manifest_digest and data == image.manifest_bytes


def test_range_reads_keep_their_connection(pushed: PushedImage, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range read to its last byte leaves its connection in the pool: a
    prefetch of a hundred ranges must not pay a hundred TCP (and TLS)
    handshakes."""
    opened: list[tuple[str, int]] = []
    real = socket.create_connection

    def counted(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        opened.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    with _client() as client:
        image = client.resolve(parse_reference(pushed.ref))
        big = image.manifest.layers[1]
        blob = _blob(pushed, big.digest)
        before = len(opened)
        for start in range(0, 40000, 4000):
            got: list[bytes] = []
            client.stream_range(image.ref, big.digest, start, start + 4000, got.append)
            assert b"".join(got) == blob[start : start + 4000]
        assert len(opened) - before <= 1


def test_not_found_names_host_and_repository(registry: Registry) -> None:
    with _client() as client, pytest.raises(NotFound) as info:
        client.resolve(parse_reference(f"{registry.host}/nope/missing:v1"))
    assert registry.host in str(info.value) and "nope/missing" in str(info.value)


def test_range_sent_and_whole_body_answer_sliced(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    with _client() as client:
        layer = client.resolve(ref).manifest.layers[1]
        blob = _blob(pushed, layer.digest)
        assert client.fetch_range(ref, layer.digest, 10, 20) == blob[10:20]
        assert proxy.requests("GET", "/blobs/")[-1].headers.get("Range") == "bytes=10-19"
        proxy.plan("strip_range", "/blobs/")
        assert client.fetch_range(ref, layer.digest, 4096, 70000) == blob[4096:70000]
        assert proxy.requests("GET", "/blobs/")[-1].fault == "strip_range"


def _ranges_of(client: RegistryClient, ref: Reference, digest: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    got: list[list[bytes]] = [[] for _ in ranges]
    client.stream_ranges(ref, digest, ranges, [out.append for out in got])
    return [b"".join(out) for out in got]


def _big_layer(client: RegistryClient, ref: Reference, pushed: PushedImage, proxy: FaultProxy) -> tuple[str, bytes]:
    """The image's big layer, its digest and bytes; the proxy's log starts
    after the resolve."""
    digest = client.resolve(ref).manifest.layers[1].digest
    proxy.reset()
    return digest, _blob(pushed, digest)


def _ranges_arrive(
    client: RegistryClient, ref: Reference, digest: str, blob: bytes, ranges: list[tuple[int, int]]
) -> bool:
    """Whether stream_ranges gives every range its own bytes of `blob`."""
    return _ranges_of(client, ref, digest, ranges) == [blob[s:e] for s, e in ranges]


RANGES = [(0, 10), (5000, 9000), (9000, 9001), (50000, 120000), (150000, 150100)]


def test_several_ranges_in_one_request(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    with _client() as client:
        digest, blob = _big_layer(client, ref, pushed, proxy)
        assert _ranges_arrive(client, ref, digest, blob, RANGES)
        sent = proxy.requests("GET", "/blobs/")
        assert [s.headers.get("Range") for s in sent] == ["bytes=0-9,5000-8999,9000-9000,50000-119999,150000-150099"]
        # Asked in another order (first access, not offset), served in it.
        assert _ranges_arrive(client, ref, digest, blob, RANGES[::-1])
        assert proxy.requests("GET", "/blobs/")[-1].headers.get("Range", "").startswith("bytes=150000-150099,")


def test_a_whole_blob_answer_to_several_ranges_goes_range_by_range(proxy: FaultProxy, pushed: PushedImage) -> None:
    """A host that ignores a multi-range request (S3 behind a redirect does)
    gets one request per range, then and for a while after."""
    ref = parse_reference(_at(proxy, pushed))
    with _client() as client:
        digest, blob = _big_layer(client, ref, pushed, proxy)
        proxy.plan("strip_range", "/blobs/")
        assert _ranges_arrive(client, ref, digest, blob, RANGES)
        sent = proxy.requests("GET", "/blobs/")
        assert sent[0].fault == "strip_range"
        assert [s.headers.get("Range") for s in sent[1:]] == [f"bytes={s}-{e - 1}" for s, e in RANGES]
        proxy.reset()
        assert _ranges_arrive(client, ref, digest, blob, RANGES)
        assert len(proxy.requests("GET", "/blobs/")) == len(RANGES)


def test_a_broken_multirange_answer_is_completed_range_by_range(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    with _client() as client:
        digest, blob = _big_layer(client, ref, pushed, proxy)
        proxy.plan("truncate", "/blobs/")
        assert _ranges_arrive(client, ref, digest, blob, RANGES)
        sent = proxy.requests("GET", "/blobs/")
        assert sent[0].fault == "truncate"
        # The first half of the answer held the first ranges whole: they are not asked again.
        asked = [s.headers.get("Range") for s in sent[1:]]
        assert "bytes=0-9" not in asked and "bytes=150000-150099" in asked


def test_retries_dropped_connections_and_503(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    proxy.plan("drop", "/manifests/", times=2)
    proxy.plan("status", "/blobs/", status=503)
    proxy.plan("status", "/blobs/", status=429)
    with _client() as client:
        image = client.resolve(ref)
        out = io.BytesIO()
        client.fetch_blob(ref, image.manifest.layers[0].digest, out)
    assert out.getvalue() == _blob(pushed, image.manifest.layers[0].digest)
    faults = [s.fault for s in proxy.requests("GET")]
    assert faults.count("drop") == 2 and "status" in faults


def test_truncated_body_resumes_with_range(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    with _client() as client:
        layer = client.resolve(ref).manifest.layers[1]
        proxy.plan("truncate", "/blobs/")
        out = io.BytesIO()
        client.fetch_blob(ref, layer.digest, out)
        assert out.getvalue() == _blob(pushed, layer.digest)
        resumed = proxy.requests("GET", "/blobs/")[-1]
        assert resumed.headers.get("Range", "").startswith("bytes=") and resumed.fault == ""
        proxy.plan("truncate", "/blobs/")
        assert client.fetch_range(ref, layer.digest, 0, 200000) == _blob(pushed, layer.digest)[:200000]


def test_flipped_bit_is_never_returned(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    with _client() as client:
        image = client.resolve(ref)
        layer = image.manifest.layers[1]
        proxy.plan("flip", "/blobs/")
        out = io.BytesIO()
        client.fetch_blob(ref, layer.digest, out)  # seekable: refetched after the mismatch
        assert out.getvalue() == _blob(pushed, layer.digest)
        proxy.plan("flip", "/blobs/", times=10)

        class Pipe(io.BytesIO):
            """A destination that cannot be rewound."""

            def seekable(self) -> bool:
                return False

        with pytest.raises(DigestMismatch, match=layer.digest):
            client.fetch_blob(ref, layer.digest, Pipe())
        proxy.plan("flip", "/manifests/", times=1)
        with pytest.raises(DigestMismatch):
            client.fetch_manifest(ref.with_digest(image.manifest_digest))


def test_gives_up_after_bounded_retries(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(_at(proxy, pushed))
    proxy.plan("drop", "/manifests/", times=100)
    with _client(retries=2) as client, pytest.raises(Unreachable) as info:
        client.resolve(ref)
    assert len(proxy.requests("GET", "/manifests/")) == 3
    assert proxy.host in str(info.value) and "regtest/sample" in str(info.value)
    proxy.reset()
    proxy.plan("status", "/manifests/", times=100, status=502)
    with _client(retries=1) as client, pytest.raises(ServerError, match="HTTP 502"):
        client.resolve(ref)
    with _client(retries=1) as client, pytest.raises(Unreachable):
        client.resolve(parse_reference(f"127.0.0.1:{free_tcp_port()}/a/b:v1"))


def test_plain_http_and_mirror_via_hosts_toml(
    tmp_path: Path, proxy: FaultProxy, pushed: PushedImage, registry: Registry
) -> None:
    ref = parse_reference(pushed.ref)
    with RegistryClient(certs_dir=tmp_path, retries=0) as client, pytest.raises(Unreachable):
        client.resolve(ref)  # https to a plain-http registry fails
    host_dir = tmp_path / registry.host
    host_dir.mkdir()
    (host_dir / "hosts.toml").write_text(f'server = "http://{registry.host}"\n')
    with RegistryClient(certs_dir=tmp_path) as client:
        assert client.resolve(ref).manifest_digest
    dead = free_tcp_port()
    (host_dir / "hosts.toml").write_text(
        f'server = "http://{registry.host}"\n'
        f'[host."http://127.0.0.1:{dead}"]\n  capabilities = ["pull", "resolve"]\n'
        f'[host."http://{proxy.host}"]\n  capabilities = ["pull", "resolve"]\n'
    )
    with RegistryClient(certs_dir=tmp_path, retries=0) as client:
        image = client.resolve(ref)
        assert client.fetch_range(ref, image.manifest.layers[0].digest, 0, 10)
    via_mirror = proxy.requests("GET")
    assert via_mirror and all(f"ns={registry.host}" in unquote(s.path) for s in via_mirror)


def _push_layout(client: RegistryClient, pushed: PushedImage, ref_text: str) -> str:
    """Push `pushed`'s blobs and manifest with our own client; returns the manifest digest."""
    blobs = pushed.layout.directory / "blobs" / "sha256"
    index = json.loads((pushed.layout.directory / "index.json").read_text())
    manifest_digest = str(index["manifests"][0]["digest"])
    manifest = (blobs / manifest_digest.removeprefix("sha256:")).read_bytes()
    ref = parse_reference(ref_text)
    for entry in [json.loads(manifest)["config"], *json.loads(manifest)["layers"]]:
        client.push_blob(ref, (blobs / entry["digest"].removeprefix("sha256:")).read_bytes(), entry["digest"])
    assert client.push_manifest(ref, manifest, media.OCI_MANIFEST, tag=ref.tag) == manifest_digest
    return manifest_digest


def test_basic_auth_from_docker_config(auth_registry: AuthRegistry, pushed: PushedImage) -> None:
    ref_text = f"{auth_registry.host}/private/sample:v1"
    with _client(docker_config=auth_registry.docker_config()) as client:
        digest = _push_layout(client, pushed, ref_text)
        image = client.resolve(parse_reference(ref_text))
        assert image.manifest_digest == digest
        out = io.BytesIO()
        client.fetch_blob(image.ref, image.manifest.layers[1].digest, out)
        assert hashlib.sha256(out.getvalue()).hexdigest() == image.manifest.layers[1].digest[7:]
    wrong = auth_registry.docker_config(password="wrong")
    with _client(docker_config=wrong) as client, pytest.raises(Unauthorized, match="refused the credentials"):
        client.resolve(parse_reference(ref_text))
    absent = auth_registry.workdir / "absent.json"
    with _client(docker_config=absent) as client, pytest.raises(Unauthorized, match="has none for"):
        client.resolve(parse_reference(ref_text))


def test_redirect_drops_credentials(auth_registry: AuthRegistry, registry: Registry, pushed: PushedImage) -> None:
    """Blob GETs redirected to "storage" (another origin) carry no Authorization."""
    ref_text = f"{auth_registry.host}/private/redirected:v1"
    with _client(docker_config=auth_registry.docker_config()) as client:
        _push_layout(client, pushed, ref_text)
    with faultproxy.running(auth_registry.port) as front, faultproxy.running(registry.port) as storage:
        front.plan("redirect", "/blobs/", times=2, redirect_to=f"http://{storage.host}")
        ref = parse_reference(ref_text.replace(auth_registry.host, front.host))
        config = auth_registry.docker_config()
        doc = json.loads(config.read_text())
        doc["auths"][front.host] = doc["auths"][auth_registry.host]
        config.write_text(json.dumps(doc))
        with _client(docker_config=config) as client:
            image = client.resolve(ref)
            layer = image.manifest.layers[1]
            # Redirected to the same repository path on a registry that holds the same blob.
            assert (
                client.fetch_range(ref.__class__(ref.domain, "regtest/sample", "v1"), layer.digest, 5, 50)
                == _blob(pushed, layer.digest)[5:50]
            )
        assert front.requests("GET", "/manifests/")[-1].headers.get("Authorization", "").startswith("Basic ")
        storage_gets = storage.requests("GET", "/blobs/")
        assert storage_gets and all("Authorization" not in s.headers for s in storage_gets)


def test_push_blob_skips_existing_and_checks_digest(registry: Registry) -> None:
    ref = parse_reference(f"{registry.host}/regtest/pushed:v1")
    data = b"some config bytes"
    with _client() as client:
        desc = client.push_blob(ref, data)
        assert desc.digest == media.digest_of(data) and client.blob_exists(ref, desc.digest)
        assert client.push_blob(ref, data).digest == desc.digest
        with pytest.raises(ValueError, match="hashes to"):
            client.push_blob(ref, data, "sha256:" + "1" * 64)


def test_referrers_tag_fallback(registry: Registry, pushed: PushedImage) -> None:
    subject_ref = parse_reference(pushed.ref)
    with _client() as client:
        subject = client.resolve(subject_ref)
        assert client.referrers(subject_ref, subject.manifest_digest) == []
        empty = client.push_blob(subject_ref, b"{}", media_type=media.OCI_EMPTY)
        index_blob = client.push_blob(subject_ref, b"layer index bytes")
        artifact = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": media.OCI_MANIFEST,
                "artifactType": "application/vnd.bootseer.layer-index.v1",
                "config": {"mediaType": media.OCI_EMPTY, "digest": empty.digest, "size": empty.size},
                "layers": [
                    {
                        "mediaType": "application/vnd.bootseer.layer-index.v1+cbor",
                        "digest": index_blob.digest,
                        "size": index_blob.size,
                    }
                ],
                "subject": subject.manifest_descriptor.to_json(),
                "annotations": {"org.bootseer.span": "4194304"},
            }
        ).encode()
        first = client.push_referrer(subject_ref, artifact, media.OCI_MANIFEST, subject.manifest_digest)
        again = client.push_referrer(subject_ref, artifact, media.OCI_MANIFEST, subject.manifest_digest)
        assert first == again == media.digest_of(artifact)
        found = client.referrers(subject_ref, subject.manifest_digest)
        assert [d.digest for d in found] == [first]  # no duplicate entry
        assert found[0].artifact_type == "application/vnd.bootseer.layer-index.v1"
        assert found[0].annotations == {"org.bootseer.span": "4194304"}
        assert client.referrers(subject_ref, subject.manifest_digest, "application/other") == []
        tag_ref = subject_ref.with_tag(referrers_tag(subject.manifest_digest))
        _, tag_type, _ = client.fetch_manifest(tag_ref)
        assert tag_type == media.OCI_INDEX
        with pytest.raises(ValueError, match="subject"):
            client.push_referrer(subject_ref, artifact, media.OCI_MANIFEST, "sha256:" + "2" * 64)


def _artifact(client: RegistryClient, ref: Reference, subject: Descriptor, payload: bytes) -> bytes:
    """An artifact manifest about `subject` whose one blob (`payload`) is in the registry."""
    empty = client.push_blob(ref, b"{}", media_type=media.OCI_EMPTY)
    blob = client.push_blob(ref, payload)
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media.OCI_MANIFEST,
            "artifactType": "application/vnd.bootseer.test.v1",
            "config": {"mediaType": media.OCI_EMPTY, "digest": empty.digest, "size": empty.size},
            "layers": [{"mediaType": "application/octet-stream", "digest": blob.digest, "size": blob.size}],
            "subject": subject.to_json(),
        }
    ).encode()


def test_a_mirror_holding_an_old_referrers_tag_is_not_believed(
    tmp_path: Path, registry: Registry, images: ImageBuilder, unique: str
) -> None:
    """A caching mirror may keep its first copy of the `sha256-<hex>` tag
    (docker-registry 2.8 in proxy mode does); here a second real registry
    holds that old copy. Listings come from the server, and a new entry is
    added to the server's index, not to the mirror's old one."""
    ref = parse_reference(images.push(f"regtest/referred-{unique}", [[File("/a", b"a")]]).ref)
    old_copy = start_registry()
    try:
        with _client() as direct:
            subject = direct.resolve(ref).manifest_descriptor
            first_manifest = _artifact(direct, ref, subject, b"first")
            first = direct.push_referrer(ref, first_manifest, media.OCI_MANIFEST, subject.digest)
            index = direct.fetch_manifest(ref.with_tag(referrers_tag(subject.digest)))[0]
            # The mirror's copy: the index as it was with one entry.
            at_mirror = Reference(old_copy.host, ref.repository, ref.tag)
            _artifact(direct, at_mirror, subject, b"first")
            direct.push_manifest(at_mirror, first_manifest, media.OCI_MANIFEST)
            direct.push_manifest(at_mirror, index, media.OCI_INDEX, tag=referrers_tag(subject.digest))
            second = direct.push_referrer(
                ref, _artifact(direct, ref, subject, b"second"), media.OCI_MANIFEST, subject.digest
            )
        with faultproxy.running(old_copy.port) as mirror:
            hosts = tmp_path / registry.host / "hosts.toml"
            hosts.parent.mkdir()
            cached = f'[host."http://{mirror.host}"]\n  capabilities = ["pull", "resolve"]\n'
            hosts.write_text(f'server = "http://{registry.host}"\n{cached}')
            with RegistryClient(certs_dir=tmp_path, backoff=0.01) as client:
                assert [d.digest for d in client.referrers(ref, subject.digest)] == [first, second]
                third = client.push_referrer(
                    ref, _artifact(client, ref, subject, b"third"), media.OCI_MANIFEST, subject.digest
                )
            assert not mirror.requests("GET", "/manifests/sha256-")
            # The server's index lost nothing to the mirror's old copy.
            with _client() as direct:
                assert [d.digest for d in direct.referrers(ref, subject.digest)] == [first, second, third]

            # A server that cannot be reached: the mirror's listing is better than none.
            dead = free_tcp_port()
            hosts.write_text(f'server = "http://127.0.0.1:{dead}"\n{cached}')
            with RegistryClient(certs_dir=tmp_path, backoff=0.01, retries=0) as client:
                assert [d.digest for d in client.referrers(ref, subject.digest)] == [first]
    finally:
        old_copy.stop()


def test_index_resolution_picks_the_platform(registry: Registry, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref)
    with _client() as client:
        image = client.resolve(ref)
        index = media.Index(
            media.OCI_INDEX,
            (
                media.Descriptor(
                    media.OCI_MANIFEST,
                    image.manifest_digest,
                    len(image.manifest_bytes),
                    platform=media.Platform("linux", "arm64", "v8"),
                ),
                media.Descriptor(
                    media.OCI_MANIFEST,
                    image.manifest_digest,
                    len(image.manifest_bytes),
                    platform=media.Platform("linux", "amd64"),
                ),
            ),
        )
        multi = ref.with_tag("multi")
        index_digest = client.push_manifest(multi, index.to_bytes(), media.OCI_INDEX, tag="multi")
        resolved = client.resolve(multi, "linux/amd64")
        assert resolved.index_digest == index_digest and resolved.manifest_digest == image.manifest_digest
        with pytest.raises(NotFound, match="--platform"):
            client.resolve(multi, "linux/s390x")


def test_sample_layers_are_what_was_pushed(pushed: PushedImage, tmp_path: Path) -> None:
    """Guard: the fixture image is the deterministic one the tests expect."""
    again = write_layout(tmp_path, sample_layers())
    assert again.diff_ids == pushed.layout.diff_ids
