"""A bootseer snapshotter process per test module, reached over real gRPC on
its unix socket exactly as containerd's proxy client reaches it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from tests.harness.snapshotter import Snapshotter, start_snapshotter


@dataclass
class Client:
    process: Snapshotter
    channel: grpc.Channel
    stub: pb_grpc.SnapshotsStub

    def reconnect(self) -> None:
        self.channel.close()
        self.channel = grpc.insecure_channel(f"unix://{self.process.address}")
        self.stub = pb_grpc.SnapshotsStub(self.channel)


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    if os.geteuid() != 0:
        pytest.skip("the snapshotter creates root-owned directories; run as root")
    process = start_snapshotter()
    channel = grpc.insecure_channel(f"unix://{process.address}")
    c = Client(process, channel, pb_grpc.SnapshotsStub(channel))
    try:
        yield c
    finally:
        c.channel.close()
        leftovers = process.teardown()
        assert not leftovers, f"mounts left behind: {leftovers}"
