"""Mirrors that fail well, against a real docker-registry: a mirror that
refuses connections, one that never completes them, one that accepts and
never answers, and one whose bodies stall cost one wait, are skipped for
their backoff period and used again once it ends; hosts.toml edits apply
to a running client; a mirror that ignores Range is counted and gets no
more ranges of that blob, so no block is read by streaming the blob from
byte 0; a manifest a mirror answers with bytes that do not match its
digest is asked of the next host; and a real pull-through cache (docker-registry in proxy mode)
serves every node after the first without the upstream serving a block
again.

Timing is never asserted. Where a bound is the point, every other timeout
in play is a minute long, so a read that completes at all was cut short
by the mirror bound under test."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from snapshotter.registry.client import RegistryClient
from snapshotter.registry.health import MirrorPolicy
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.resumable import RANGE_SKIP_LIMIT
from tests.harness import faultproxy
from tests.harness.faultproxy import FaultProxy
from tests.harness.oci import File, ImageBuilder, PushedImage
from tests.harness.procs import free_tcp_port, wait_until
from tests.harness.registry import Registry, cached_blob, start_pull_through_cache

pytestmark = pytest.mark.integration

# The server's per-try timeout: far longer than any mirror bound under test.
PATIENT_S = 60.0
SHORT_S = 0.5
# A backoff period longer than any test: a skipped mirror stays skipped.
FOREVER_S = 3600.0
BLOCK = 128 << 10


@pytest.fixture(scope="module")
def big(images: ImageBuilder) -> PushedImage:
    """An image whose one layer is a 4 MiB blob (random bytes: gzip keeps its size)."""
    return images.push("regtest/mirrors", [[File("/big.bin", random.Random(15).randbytes(4 << 20))]])


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    return tmp_path / "certs.d"


def _hosts(certs: Path, registry: str, server: str, *mirrors: str) -> None:
    """certs.d/<registry>/hosts.toml, replaced by a rename as config managers do."""
    directory = certs / registry
    directory.mkdir(parents=True, exist_ok=True)
    text = f'server = "http://{server}"\n' + "".join(
        f'[host."http://{m}"]\n  capabilities = ["pull", "resolve"]\n' for m in mirrors
    )
    (directory / "hosts.toml.new").write_text(text)
    (directory / "hosts.toml.new").rename(directory / "hosts.toml")


def _client(
    certs: Path, *, connect_s: float = SHORT_S, response_s: float = SHORT_S, backoff_s: float = FOREVER_S
) -> RegistryClient:
    return RegistryClient(
        certs_dir=certs,
        timeout=PATIENT_S,
        backoff=0.01,
        mirrors=MirrorPolicy(connect_s, response_s, backoff_s, max(backoff_s, FOREVER_S)),
    )


def _blob(pushed: PushedImage, digest: str) -> bytes:
    return (pushed.layout.directory / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()


def _layer(client: RegistryClient, pushed: PushedImage) -> tuple[Reference, str, bytes]:
    ref = parse_reference(pushed.ref)
    digest = client.resolve(ref).manifest.layers[-1].digest
    return ref, digest, _blob(pushed, digest)


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _read_blocks(client: RegistryClient, ref: Reference, digest: str, blob: bytes, starts: Iterable[int]) -> int:
    """Read each block at `starts`, checking its bytes; returns how many."""
    n = 0
    for start in starts:
        end = min(start + BLOCK, len(blob))
        assert client.fetch_range(ref, digest, start, end) == blob[start:end], start
        n += 1
    return n


def _blob_gets(proxy: FaultProxy, digest: str) -> list[faultproxy.Seen]:
    return proxy.requests("GET", f"/blobs/{digest}")


def test_a_refused_mirror_costs_nothing_and_is_skipped_for_its_backoff(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    dead = f"127.0.0.1:{free_tcp_port()}"
    _hosts(certs, registry.host, registry.host, dead)
    down = _metric("bootseer_registry_mirror_down_total", host=dead)
    skipped = _metric("bootseer_registry_mirror_skipped_total", host=dead, reason="down")
    with _client(certs) as client:
        ref, digest, blob = _layer(client, big)
        reads = _read_blocks(client, ref, digest, blob, range(0, 8 * BLOCK, BLOCK))
    # Failed once; every later request of the backoff period went past it.
    assert _metric("bootseer_registry_mirror_down_total", host=dead) - down == 1
    assert _metric("bootseer_registry_mirror_skipped_total", host=dead, reason="down") - skipped >= reads


def test_a_mirror_that_never_connects_costs_one_connect_timeout(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    with faultproxy.blackhole() as dead:
        _hosts(certs, registry.host, registry.host, dead)
        down = _metric("bootseer_registry_mirror_down_total", host=dead)
        # Answers may take a minute, connecting only SHORT_S: reads complete,
        # so the connect that never completes was given up after SHORT_S.
        with _client(certs, connect_s=SHORT_S, response_s=PATIENT_S) as client:
            ref, digest, blob = _layer(client, big)
            _read_blocks(client, ref, digest, blob, range(0, 4 * BLOCK, BLOCK))
        assert _metric("bootseer_registry_mirror_down_total", host=dead) - down == 1


def test_a_mirror_that_accepts_and_never_answers_costs_one_response_timeout(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    with faultproxy.running(registry.port) as mirror:
        mirror.plan("stall", "", times=1000)
        _hosts(certs, registry.host, registry.host, mirror.host)
        with _client(certs, connect_s=PATIENT_S, response_s=SHORT_S) as client:
            ref, digest, blob = _layer(client, big)
            _read_blocks(client, ref, digest, blob, range(0, 4 * BLOCK, BLOCK))
        # One request waited for it (the manifest); then it was skipped.
        assert [s.fault for s in mirror.requests()] == ["stall"]


def test_a_mirror_whose_body_stalls_hands_the_rest_to_the_next_host(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    with faultproxy.running(registry.port) as mirror, faultproxy.running(registry.port) as server:
        _hosts(certs, registry.host, server.host, mirror.host)
        with _client(certs, connect_s=PATIENT_S, response_s=SHORT_S) as client:
            ref, digest, blob = _layer(client, big)
            mirror.plan("stall_body", "/blobs/", times=1000)
            assert client.fetch_range(ref, digest, 0, 400000) == blob[:400000]
            # The server continues from the bytes the mirror delivered.
            ranges = [s.headers.get("Range") for s in _blob_gets(server, digest)]
            assert ranges == ["bytes=200000-399999"]
            assert client.fetch_range(ref, digest, 400000, 500000) == blob[400000:500000]
        assert len(_blob_gets(mirror, digest)) == 1


def test_a_mirror_that_comes_back_is_used_again(certs: Path, registry: Registry, big: PushedImage) -> None:
    port = free_tcp_port()
    _hosts(certs, registry.host, registry.host, f"127.0.0.1:{port}")
    with _client(certs, backoff_s=0.2) as client:
        ref, digest, blob = _layer(client, big)  # refused: the registry served it
        with faultproxy.running(registry.port, port=port) as mirror:

            def via_mirror() -> bool:
                _read_blocks(client, ref, digest, blob, range(0, BLOCK, BLOCK))
                return bool(_blob_gets(mirror, digest))

            wait_until(via_mirror, 60, "reads to go to the mirror again once it is back")


def test_hosts_toml_edits_apply_without_a_restart(certs: Path, registry: Registry, big: PushedImage) -> None:
    with faultproxy.running(registry.port) as first, faultproxy.running(registry.port) as second:
        _hosts(certs, registry.host, registry.host, first.host)
        with _client(certs) as client:
            ref, digest, blob = _layer(client, big)
            _read_blocks(client, ref, digest, blob, [0])
            assert _blob_gets(first, digest) and not second.requests()
            _hosts(certs, registry.host, registry.host, second.host)
            _read_blocks(client, ref, digest, blob, [BLOCK])
            assert len(_blob_gets(first, digest)) == 1 and len(_blob_gets(second, digest)) == 1
            # A broken edit (caught half-written, say) keeps the hosts in use.
            hosts = certs / registry.host / "hosts.toml"
            hosts.write_text('server = "http://')
            _read_blocks(client, ref, digest, blob, [2 * BLOCK])
            assert len(_blob_gets(second, digest)) == 2
            # Edited in place: no mirror any more.
            hosts.write_text(f'server = "http://{registry.host}"\n')
            _read_blocks(client, ref, digest, blob, [3 * BLOCK])
            # Removed: the default endpoint, https.
            hosts.unlink()
            assert [e.base_url for e in client.endpoints(ref, "pull")] == [f"https://{registry.host}/v2"]
        assert len(_blob_gets(first, digest)) == 1 and len(_blob_gets(second, digest)) == 2


def test_a_mirror_that_ignores_range_is_not_asked_for_ranges_of_that_blob(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    with faultproxy.running(registry.port) as mirror, faultproxy.running(registry.port) as server:
        mirror.plan("strip_range", "/blobs/", times=1000)
        _hosts(certs, registry.host, server.host, mirror.host)
        ignored = _metric("bootseer_registry_range_ignored_total", host=mirror.host)
        with _client(certs) as client:
            ref, digest, blob = _layer(client, big)
            blocks = _read_blocks(client, ref, digest, blob, range(0, len(blob), BLOCK))
        # The first block came from the whole-body answer (it starts at 0);
        # the mirror got no other request for the blob, the server got the rest.
        assert [s.fault for s in _blob_gets(mirror, digest)] == ["strip_range"]
        assert _metric("bootseer_registry_range_ignored_total", host=mirror.host) - ignored == 1
        ranges = [s.headers.get("Range") for s in _blob_gets(server, digest)]
        assert len(ranges) == blocks - 1 == len(set(ranges))
        # One whole body at most, where slicing each block out of one would
        # have been `blocks` of them.
        assert mirror.bytes_sent(digest) <= len(blob)

        # A fresh client whose first range lies past RANGE_SKIP_LIMIT: the
        # whole body is dropped at once and the server serves the range.
        far = 3 << 20
        assert far > RANGE_SKIP_LIMIT
        with _client(certs) as client:
            _read_blocks(client, ref, digest, blob, [far, far + BLOCK, 0])
        assert len(_blob_gets(mirror, digest)) == 2
        assert _metric("bootseer_registry_range_ignored_total", host=mirror.host) - ignored == 2
        assert [s.headers.get("Range") for s in _blob_gets(server, digest)][-3:] == [
            f"bytes={far}-{far + BLOCK - 1}",
            f"bytes={far + BLOCK}-{far + 2 * BLOCK - 1}",
            f"bytes=0-{BLOCK - 1}",
        ]
        assert mirror.bytes_sent(digest) <= 2 * len(blob)


def test_a_mirror_whose_manifest_does_not_match_its_digest_hands_it_to_the_next_host(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    """What a pull-through cache answers while a tag changes upstream: a
    body that does not hash to the digest it names (here a flipped bit)."""
    with faultproxy.running(registry.port) as mirror, faultproxy.running(registry.port) as server:
        mirror.plan("flip", "/manifests/", times=1000)
        _hosts(certs, registry.host, server.host, mirror.host)
        before = _metric("bootseer_registry_mirror_mismatches_total", host=mirror.host)
        ref = parse_reference(big.ref)
        with RegistryClient(plain_http=True) as direct:
            truth = direct.resolve(ref).manifest_digest
        with _client(certs) as client:
            assert client.resolve(ref).manifest_digest == truth
            # By digest too, and the mirror is asked again each time: it is
            # up, only that answer was wrong.
            assert client.fetch_manifest(ref.with_digest(truth))[2] == truth
        assert [s.fault for s in mirror.requests("GET", "/manifests/")] == ["flip", "flip"]
        assert len(server.requests("GET", "/manifests/")) == 2
        assert _metric("bootseer_registry_mirror_mismatches_total", host=mirror.host) - before == 2


def test_a_pull_through_cache_serves_every_node_after_the_first(
    certs: Path, registry: Registry, big: PushedImage
) -> None:
    with faultproxy.running(registry.port) as upstream:
        cache = start_pull_through_cache(f"http://{upstream.host}")
        try:
            _hosts(certs, registry.host, upstream.host, cache.host)
            # A period that outlasts the fill: each range asked of the cache
            # meanwhile would make it open the blob upstream once more.
            with _client(certs, response_s=PATIENT_S) as node:
                ref, digest, blob = _layer(node, big)
                _read_blocks(node, ref, digest, blob, range(0, len(blob), BLOCK))
            wait_until(lambda: cached_blob(cache, digest), 60, "the cache to store the blob")
            before = len(_blob_gets(upstream, digest))
            for _ in range(2):  # two more nodes
                with _client(certs, response_s=PATIENT_S) as node:
                    _read_blocks(node, ref, digest, blob, range(0, len(blob), BLOCK))
                    _read_blocks(node, ref, digest, blob, range(BLOCK // 2, len(blob), 3 * BLOCK))
            # The later nodes' blocks all came from the cache.
            assert len(_blob_gets(upstream, digest)) == before
        finally:
            cache.stop()
    ours = [s for s in _blob_gets(upstream, digest) if "python-httpx" in s.headers.get("User-Agent", "")]
    fills = [s for s in _blob_gets(upstream, digest) if "python-httpx" not in s.headers.get("User-Agent", "")]
    # The first node's ranges while the cache filled, each block once; the
    # cache's own fill (distribution 2.8 opens the blob upstream twice on a
    # miss: once to answer, once to store).
    ranges = [s.headers.get("Range") for s in ours]
    assert len(ranges) == len(set(ranges)) and all(ranges)
    assert 1 <= len(fills) <= 2 and not any(s.headers.get("Range") for s in fills)
