"""kill -9 the snapshotter at arbitrary moments of a busy workload; every
restart must open the store without loss and leave it consistent."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc

from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from tests.contract.conftest import Client

ROUNDS = 6


def _workload(c: Client, round_no: int, stop: threading.Event, committed: dict[str, bytes]) -> None:
    """Build layer chains until the daemon dies; record what was committed."""
    rng = random.Random(round_no)
    parent = ""
    step = 0
    while not stop.is_set():
        step += 1
        key, name = f"r{round_no}/extract-{step}", f"r{round_no}/layer-{step}"
        payload = rng.randbytes(rng.randint(0, 200_000))
        try:
            [mount] = c.stub.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent)).mounts
            upper = (
                mount.source
                if mount.type == "bind"
                else next(o.split("=", 1)[1] for o in mount.options if o.startswith("upperdir="))
            )
            Path(upper, "payload").write_bytes(payload)
            c.stub.Commit(pb.CommitSnapshotRequest(name=name, key=key))
            committed[name] = payload
            parent = name
            if step % 3 == 0:
                scratch = f"r{round_no}/scratch-{step}"
                c.stub.Prepare(pb.PrepareSnapshotRequest(key=scratch, parent=parent))
                c.stub.Remove(pb.RemoveSnapshotRequest(key=scratch))
        except (grpc.RpcError, OSError):
            # The daemon was killed mid-call: whether that call took effect is
            # unknown, which is exactly what the checks below must tolerate.
            return


def _check_consistent(c: Client, committed: dict[str, bytes]) -> None:
    infos = [i for r in c.stub.List(pb.ListSnapshotsRequest()) for i in r.info]
    names = {i.name for i in infos}
    for info in infos:
        if info.parent:
            assert info.parent in names, f"{info.name} lost its parent {info.parent}"
        if info.kind == pb.ACTIVE:
            for mount in c.stub.Mounts(pb.MountsRequest(key=info.name)).mounts:
                for opt in mount.options:
                    if opt.startswith(("upperdir=", "workdir=", "lowerdir=")):
                        for d in opt.split("=", 1)[1].split(":"):
                            assert Path(d).is_dir(), f"{info.name}: {d} is missing"
    for name, payload in committed.items():
        assert name in names, f"committed snapshot {name} was lost"
        view = f"check/{name}"
        [mount] = c.stub.View(pb.ViewSnapshotRequest(key=view, parent=name)).mounts
        # The nearest lower dir (or the bound one) is the layer's own directory.
        own = (
            mount.source
            if mount.type == "bind"
            else next(o.split("=", 1)[1].split(":")[0] for o in mount.options if o.startswith("lowerdir="))
        )
        assert Path(own, "payload").read_bytes() == payload
        c.stub.Remove(pb.RemoveSnapshotRequest(key=view))
    c.stub.Cleanup(pb.CleanupRequest())
    assert len(c.process.snapshot_ids()) == len(infos), "directories owned by no snapshot"


def test_kill9_during_writes_loses_nothing_committed(client: Client) -> None:
    committed: dict[str, bytes] = {}
    rng = random.Random(42)
    for round_no in range(ROUNDS):
        stop = threading.Event()
        worker = threading.Thread(target=_workload, args=(client, round_no, stop, committed))
        worker.start()
        time.sleep(rng.uniform(0.05, 0.6))
        client.process.kill9()
        stop.set()
        worker.join(timeout=30)
        assert not worker.is_alive()
        client.process.start()
        client.reconnect()
        _check_consistent(client, committed)
    assert len(committed) > ROUNDS, "the workload never got going; the test proves nothing"
