"""The daemon's Prometheus endpoint counts the calls it served, by code."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from tests.harness.procs import free_tcp_port, tcp_port_answers, wait_until
from tests.harness.snapshotter import Snapshotter, start_snapshotter

pytestmark = pytest.mark.integration


@pytest.fixture
def with_metrics() -> Iterator[tuple[Snapshotter, int]]:
    port = free_tcp_port()
    process = start_snapshotter(extra_args=["--metrics-address", f"127.0.0.1:{port}"])
    try:
        wait_until(lambda: tcp_port_answers("127.0.0.1", port), 10, "metrics endpoint")
        yield process, port
    finally:
        process.teardown()


def test_metrics_count_rpcs_by_code(with_metrics: tuple[Snapshotter, int]) -> None:
    process, port = with_metrics
    with grpc.insecure_channel(f"unix://{process.address}") as channel:
        stub = pb_grpc.SnapshotsStub(channel)
        stub.Prepare(pb.PrepareSnapshotRequest(key="a"))
        with pytest.raises(grpc.RpcError):
            stub.Stat(pb.StatSnapshotRequest(key="missing"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'bootseer_snapshotter_rpcs_total{code="OK",method="Prepare"} 1.0' in text
    assert 'bootseer_snapshotter_rpcs_total{code="NOT_FOUND",method="Stat"} 1.0' in text
    assert 'bootseer_snapshotter_rpc_seconds_count{method="Prepare"} 1.0' in text
