"""A registry that stops answering holds a registry call for a bounded
time: a range fetch gives up by its deadline whatever the per-try timeout
and the retries, and without a deadline the retries of every loop of one
call share one count instead of multiplying. Real docker-registry behind a
fault proxy that accepts requests and never answers, or answers the headers
and half the body and then nothing."""

from __future__ import annotations

import time

import pytest

from snapshotter.registry.client import RegistryClient
from snapshotter.registry.errors import DeadlineExceeded, RegistryError, Unreachable
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.faultproxy import FaultProxy
from tests.harness.oci import PushedImage

pytestmark = pytest.mark.integration

# Far beyond the test's own timeout: a stalled try that ends at all was ended
# by the deadline, never by this.
PATIENT_TIMEOUT_S = 3600.0
DEADLINE_S = 1.0
# Short enough that a handful of stalled tries take seconds.
SHORT_TIMEOUT_S = 0.5


def _client(*, timeout: float = PATIENT_TIMEOUT_S, retries: int = 4) -> RegistryClient:
    return RegistryClient(plain_http=True, timeout=timeout, retries=retries, backoff=0.01)


def _through(proxy: FaultProxy, pushed: PushedImage) -> Reference:
    return parse_reference(pushed.ref.replace(pushed.ref.split("/")[0], proxy.host, 1))


def _big_layer(client: RegistryClient, ref: Reference) -> str:
    return client.resolve(ref).manifest.layers[1].digest


@pytest.mark.parametrize("stall", ["stall", "stall_body"])
def test_a_stalled_registry_fails_a_range_by_its_deadline(proxy: FaultProxy, pushed: PushedImage, stall: str) -> None:
    ref = _through(proxy, pushed)
    with _client() as client:
        digest = _big_layer(client, ref)
        proxy.plan(stall, "/blobs/", times=100)
        with pytest.raises(DeadlineExceeded) as info:
            client.fetch_range(ref, digest, 0, 400000, deadline=time.monotonic() + DEADLINE_S)
    assert isinstance(info.value, RegistryError)
    assert (info.value.host, info.value.repository) == (proxy.host, "regtest/sample")
    assert "not done by the caller's deadline" in str(info.value)
    # The one try waited only the time left, and no retry starts past the deadline.
    assert [s.fault for s in proxy.requests("GET", "/blobs/")] == [stall]


def test_quick_failures_are_still_retried_within_a_deadline(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = _through(proxy, pushed)
    with _client() as client:
        digest = _big_layer(client, ref)
        whole = client.fetch_range(ref, digest, 0, 400000)
        proxy.reset()
        proxy.plan("drop", "/blobs/", times=2)
        assert client.fetch_range(ref, digest, 0, 400000, deadline=time.monotonic() + 60) == whole
    assert [s.fault for s in proxy.requests("GET", "/blobs/")] == ["drop", "drop", ""]


def test_resumes_and_retries_of_one_range_share_one_count(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = _through(proxy, pushed)
    with _client(timeout=SHORT_TIMEOUT_S, retries=2) as client:
        digest = _big_layer(client, ref)
        # Bodies that stall (resumed by the body loop) and requests that are
        # never answered (retried by the transport), by turns.
        for _ in range(5):
            proxy.plan("stall_body", "/blobs/")
            proxy.plan("stall", "/blobs/")
        with pytest.raises(Unreachable, match="transfer kept breaking"):
            client.fetch_range(ref, digest, 0, 400000)
    assert [s.fault for s in proxy.requests("GET", "/blobs/")] == ["stall_body", "stall", "stall_body"]


def test_a_stalled_registry_bounds_resolve(proxy: FaultProxy, pushed: PushedImage) -> None:
    ref = _through(proxy, pushed)
    proxy.plan("stall", "/manifests/", times=100)
    with _client(timeout=SHORT_TIMEOUT_S, retries=2) as client, pytest.raises(Unreachable, match="after 3 attempts"):
        client.resolve(ref)
    assert len(proxy.requests("GET", "/manifests/")) == 3
    proxy.reset()
    # A manifest whose body stalls is the registry's error, not the HTTP library's.
    proxy.plan("stall_body", "/manifests/", times=100)
    with _client(timeout=SHORT_TIMEOUT_S, retries=2) as client, pytest.raises(Unreachable, match="transfer broke"):
        client.resolve(ref)
