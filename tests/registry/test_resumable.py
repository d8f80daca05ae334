"""The one resumable-body loop, for whole blobs and ranges alike: resuming
after a dropped connection with a Range from where the bytes stopped, a
whole-body 200 to a resumed request, the retry budget, and handing a
broken transfer over to the next endpoint (only while nothing reached the
caller's stream). Real docker-registry behind fault proxies."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from snapshotter.registry.client import RegistryClient
from snapshotter.registry.errors import RegistryError, Unreachable
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.faultproxy import FaultProxy
from tests.harness.oci import PushedImage
from tests.harness.registry import Registry

pytestmark = pytest.mark.integration


def _client(*, retries: int = 4, certs_dir: Path | None = None) -> RegistryClient:
    return RegistryClient(plain_http=True, backoff=0.01, retries=retries, certs_dir=certs_dir)


def _blob(pushed: PushedImage, digest: str) -> bytes:
    return (pushed.layout.directory / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()


def _ranges(proxy: FaultProxy) -> list[str]:
    return [s.headers.get("Range", "") for s in proxy.requests("GET", "/blobs/")]


def _big_layer(client: RegistryClient, ref: Reference) -> str:
    return client.resolve(ref).manifest.layers[1].digest


def test_whole_blob_resumes_from_where_each_drop_stopped(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1))
    with _client() as client:
        digest = _big_layer(client, ref)
        blob = _blob(pushed, digest)
        proxy.plan("truncate", "/blobs/", times=2)
        out = io.BytesIO()
        seen: list[int] = []
        client.fetch_blob(ref, digest, out, progress=seen.append)
    assert out.getvalue() == blob and sum(seen) == len(blob)
    first, second, third = _ranges(proxy)
    # The proxy sends half of what it was asked for before hanging up.
    assert first == "" and second == f"bytes={len(blob) // 2}-"
    resumed_at = len(blob) // 2 + (len(blob) - len(blob) // 2) // 2
    assert third == f"bytes={resumed_at}-"


def test_range_resumes_within_its_bounds(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1))
    with _client() as client:
        digest = _big_layer(client, ref)
        blob = _blob(pushed, digest)
        proxy.plan("truncate", "/blobs/")
        assert client.fetch_range(ref, digest, 1000, 201000) == blob[1000:201000]
    assert _ranges(proxy) == ["bytes=1000-200999", "bytes=101000-200999"]


def test_whole_body_answer_to_a_resumed_range_is_skipped_to_the_offset(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1))
    with _client() as client:
        digest = _big_layer(client, ref)
        blob = _blob(pushed, digest)
        proxy.plan("truncate", "/blobs/")
        proxy.plan("strip_range", "/blobs/")
        assert client.fetch_range(ref, digest, 5000, 65000) == blob[5000:65000]
        proxy.plan("truncate", "/blobs/")
        proxy.plan("strip_range", "/blobs/")
        out = io.BytesIO()
        client.fetch_blob(ref, digest, out)
        assert out.getvalue() == blob
    faults = [s.fault for s in proxy.requests("GET", "/blobs/")]
    assert faults == ["truncate", "strip_range", "truncate", "strip_range"]


def test_budget_spent_names_the_reference(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1))
    with _client(retries=2) as client:
        digest = _big_layer(client, ref)
        proxy.plan("truncate", "/blobs/", times=100)
        with pytest.raises(Unreachable) as whole:
            client.fetch_blob(ref, digest, io.BytesIO())
        assert len(proxy.requests("GET", "/blobs/")) == 3
        with pytest.raises(Unreachable) as ranged:
            client.fetch_range(ref, digest, 0, 300000)
    for info in (whole, ranged):
        message = str(info.value)
        assert message.startswith(f"{proxy.host}/regtest/sample: blob {digest}")
        assert "transfer kept breaking (RemoteProtocolError)" in message
        assert (info.value.host, info.value.repository) == (proxy.host, "regtest/sample")
    assert "range [0, 300000)" in str(ranged.value)
    assert re.search(r"after \d+ bytes", str(whole.value))


def test_range_beyond_the_end(registry: Registry, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref)
    with _client() as client:
        digest = _big_layer(client, ref)
        size = len(_blob(pushed, digest))
        with pytest.raises(RegistryError, match=r"range \[\d+, \d+\) lies beyond its end") as info:
            client.fetch_range(ref, digest, size + 10, size + 20)
    assert str(info.value).startswith(f"{registry.host}/regtest/sample: ")


def _mirrored(tmp_path: Path, registry: Registry, mirror: FaultProxy, server: FaultProxy) -> Path:
    host_dir = tmp_path / registry.host
    host_dir.mkdir()
    (host_dir / "hosts.toml").write_text(
        f'server = "http://{server.host}"\n[host."http://{mirror.host}"]\n  capabilities = ["pull", "resolve"]\n'
    )
    return tmp_path


def test_broken_range_hands_over_to_the_next_endpoint(tmp_path: Path, registry: Registry, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref)
    with faultproxy.running(registry.port) as mirror, faultproxy.running(registry.port) as server:
        with _client(retries=1, certs_dir=_mirrored(tmp_path, registry, mirror, server)) as client:
            digest = _big_layer(client, ref)
            blob = _blob(pushed, digest)
            mirror.plan("truncate", "/blobs/", times=100)
            assert client.fetch_range(ref, digest, 0, 400000) == blob[:400000]
        assert _ranges(mirror) == ["bytes=0-399999", "bytes=200000-399999"]
        # The server continues from what the mirror delivered.
        assert _ranges(server) == ["bytes=300000-399999"]


def test_broken_blob_stream_stays_with_its_endpoint(tmp_path: Path, registry: Registry, pushed: PushedImage) -> None:
    ref = parse_reference(pushed.ref)
    with faultproxy.running(registry.port) as mirror, faultproxy.running(registry.port) as server:
        with _client(retries=1, certs_dir=_mirrored(tmp_path, registry, mirror, server)) as client:
            digest = _big_layer(client, ref)
            mirror.plan("truncate", "/blobs/", times=100)
            with pytest.raises(Unreachable, match="transfer kept breaking"):
                client.fetch_blob(ref, digest, io.BytesIO())
            assert _ranges(server) == []
            # Before any byte arrived, a failing mirror is skipped.
            mirror.reset()
            mirror.plan("status", "/blobs/", times=100, status=503)
            out = io.BytesIO()
            client.fetch_blob(ref, digest, out)
            assert out.getvalue() == _blob(pushed, digest)
        assert _ranges(server) == [""]
