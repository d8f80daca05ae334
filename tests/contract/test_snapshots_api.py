"""Contract tests of every Snapshots RPC over gRPC: results, error codes and
messages a person can act on."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import grpc
import pytest
from google.protobuf import field_mask_pb2

from proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from tests.contract.conftest import Client

_names = itertools.count()


def unique(prefix: str) -> str:
    # containerd namespaces keys before they reach us; mimic its shape.
    return f"default/{next(_names)}/{prefix}"


def prepare(c: Client, key: str, parent: str = "", **labels: str) -> pb.PrepareSnapshotResponse:
    return c.stub.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent, labels=labels))


def commit(c: Client, name: str, key: str, **labels: str) -> None:
    c.stub.Commit(pb.CommitSnapshotRequest(name=name, key=key, labels=labels))


def layer(c: Client, parent: str = "", content: dict[str, bytes] | None = None) -> str:
    """Prepare, write files into the snapshot's directory, commit: an unpacked layer."""
    key, name = unique("extract"), unique("sha256:layer")
    [mount] = prepare(c, key, parent).mounts
    upper = mount.source if mount.type == "bind" else _option(mount.options, "upperdir")
    for path, data in (content or {}).items():
        Path(upper, path).write_bytes(data)
    commit(c, name, key)
    return name


def _option(options: list[str], name: str) -> str:
    return next(o.split("=", 1)[1] for o in options if o.startswith(f"{name}="))


def code_of(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code(), info.value.details()


def test_prepare_without_parent_is_a_writable_bind(client: Client) -> None:
    key = unique("active")
    [mount] = prepare(client, key, team="ml").mounts
    assert (mount.type, list(mount.options)) == ("bind", ["rw", "rbind"])
    assert Path(mount.source).is_dir()
    info = client.stub.Stat(pb.StatSnapshotRequest(key=key)).info
    assert (info.name, info.kind, dict(info.labels)) == (key, pb.ACTIVE, {"team": "ml"})
    assert info.created_at.seconds > 0


def test_prepare_on_a_chain_is_an_overlay(client: Client) -> None:
    l1 = layer(client, content={"a": b"1"})
    l2 = layer(client, l1, content={"b": b"2"})
    [mount] = prepare(client, unique("ctr"), l2).mounts
    assert mount.type == "overlay"
    lowers = _option(list(mount.options), "lowerdir").split(":")
    assert [sorted(os.listdir(d)) for d in lowers] == [["b"], ["a"]]
    assert Path(_option(list(mount.options), "upperdir")).is_dir()
    assert Path(_option(list(mount.options), "workdir")).is_dir()


def test_views_are_read_only(client: Client) -> None:
    l1 = layer(client, content={"a": b"1"})
    [single] = client.stub.View(pb.ViewSnapshotRequest(key=unique("v"), parent=l1)).mounts
    assert single.type == "bind" and "ro" in single.options
    assert os.listdir(single.source) == ["a"]
    l2 = layer(client, l1)
    [multi] = client.stub.View(pb.ViewSnapshotRequest(key=unique("v"), parent=l2)).mounts
    assert multi.type == "overlay"
    assert not any(o.startswith(("upperdir=", "workdir=")) for o in multi.options)
    [empty] = client.stub.View(pb.ViewSnapshotRequest(key=unique("v"))).mounts
    assert empty.type == "bind" and "ro" in empty.options


def test_mounts_returns_the_prepared_mounts(client: Client) -> None:
    l1 = layer(client)
    key = unique("ctr")
    prepared = prepare(client, key, l1).mounts
    assert client.stub.Mounts(pb.MountsRequest(key=key)).mounts == prepared
    code, msg = code_of(lambda: client.stub.Mounts(pb.MountsRequest(key=l1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "committed" in msg


def test_commit_stores_labels_and_usage(client: Client) -> None:
    key, name = unique("extract"), unique("sha256:c")
    [mount] = prepare(client, key).mounts
    Path(mount.source, "weights.bin").write_bytes(os.urandom(64 * 1024))
    active_usage = client.stub.Usage(pb.UsageRequest(key=key))
    assert active_usage.inodes == 2 and active_usage.size >= 64 * 1024
    commit(client, name, key, **{"containerd.io/snapshot.ref": name})
    info = client.stub.Stat(pb.StatSnapshotRequest(key=name)).info
    assert info.kind == pb.COMMITTED
    assert dict(info.labels) == {"containerd.io/snapshot.ref": name}
    assert client.stub.Usage(pb.UsageRequest(key=name)) == active_usage
    code, _ = code_of(lambda: client.stub.Stat(pb.StatSnapshotRequest(key=key)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_error_codes(client: Client) -> None:
    l1 = layer(client)
    active = unique("active")
    prepare(client, active, l1)
    view = unique("view")
    client.stub.View(pb.ViewSnapshotRequest(key=view, parent=l1))
    cases = [
        (lambda: prepare(client, active, l1), grpc.StatusCode.ALREADY_EXISTS, "already exists"),
        (lambda: prepare(client, unique("x"), "nope"), grpc.StatusCode.NOT_FOUND, "'nope'"),
        (lambda: prepare(client, unique("x"), active), grpc.StatusCode.INVALID_ARGUMENT, "committed"),
        (lambda: prepare(client, ""), grpc.StatusCode.INVALID_ARGUMENT, "must not be empty"),
        (lambda: commit(client, unique("c"), view), grpc.StatusCode.FAILED_PRECONDITION, "only active"),
        (lambda: commit(client, unique("c"), l1), grpc.StatusCode.FAILED_PRECONDITION, "only active"),
        (lambda: commit(client, l1, active), grpc.StatusCode.ALREADY_EXISTS, "already exists"),
        (lambda: commit(client, unique("c"), "nope"), grpc.StatusCode.NOT_FOUND, "'nope'"),
        (lambda: commit(client, "", active), grpc.StatusCode.INVALID_ARGUMENT, "commit name"),
        (
            lambda: client.stub.Remove(pb.RemoveSnapshotRequest(key=l1)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "remove them first",
        ),
        (
            lambda: client.stub.Remove(pb.RemoveSnapshotRequest(key="nope")),
            grpc.StatusCode.NOT_FOUND,
            "does not exist",
        ),
        (lambda: client.stub.Stat(pb.StatSnapshotRequest(key="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: client.stub.Usage(pb.UsageRequest(key="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: client.stub.Mounts(pb.MountsRequest(key="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
        (
            lambda: list(client.stub.List(pb.ListSnapshotsRequest(filters=['labels."x']))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unterminated",
        ),
        (
            lambda: prepare(client, unique("x"), "", k="v" * 5000),
            grpc.StatusCode.INVALID_ARGUMENT,
            "4096",
        ),
    ]
    for call, code, fragment in cases:
        got_code, message = code_of(call)
        assert (got_code, fragment in message) == (code, True), message


def test_update_with_field_masks(client: Client) -> None:
    name = layer(client)

    def update(labels: dict[str, str], *paths: str) -> dict[str, str]:
        info = pb.Info(name=name, labels=labels)
        mask = field_mask_pb2.FieldMask(paths=list(paths))
        reply = client.stub.Update(pb.UpdateSnapshotRequest(info=info, update_mask=mask))
        stat = client.stub.Stat(pb.StatSnapshotRequest(key=name)).info
        assert reply.info.labels == stat.labels
        return dict(stat.labels)

    assert update({"a": "1", "b": "2"}, "labels") == {"a": "1", "b": "2"}
    assert update({"c": "3", "a": "x"}, "labels.c") == {"a": "1", "b": "2", "c": "3"}
    assert update({}, "labels.a") == {"b": "2", "c": "3"}
    assert update({"z": "9"}) == {"z": "9"}
    code, msg = code_of(lambda: update({}, "kind"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'kind'" in msg
    code, _ = code_of(lambda: client.stub.Update(pb.UpdateSnapshotRequest(info=pb.Info(name="nope"))))
    assert code == grpc.StatusCode.NOT_FOUND


def test_list_streams_everything_and_filters(client: Client) -> None:
    parent = layer(client)
    children = [unique("child") for _ in range(250)]
    for key in children:
        prepare(client, key, parent, batch="big")

    def listed(*filters: str) -> list[str]:
        replies = list(client.stub.List(pb.ListSnapshotsRequest(filters=list(filters))))
        return sorted(i.name for r in replies for i in r.info)

    replies = list(client.stub.List(pb.ListSnapshotsRequest(filters=[f"parent=={parent}"])))
    assert len(replies) == 3  # streamed in batches of 100
    assert listed(f"parent=={parent}") == sorted(children)
    assert listed("labels.batch==big,kind==active") == sorted(children)
    assert listed(f"name=={parent}", f"name=={children[0]}") == sorted([parent, children[0]])
    assert listed('labels."batch"==big,kind==committed') == []
    assert set(listed()) >= {parent, *children}
    for key in children:
        client.stub.Remove(pb.RemoveSnapshotRequest(key=key))
    assert listed(f"parent=={parent}") == []


def test_remove_and_cleanup_leave_no_directories(client: Client) -> None:
    before = client.process.snapshot_ids()
    l1 = layer(client, content={"a": b"x"})
    key = unique("ctr")
    prepare(client, key, l1)
    assert len(client.process.snapshot_ids() - before) == 2
    client.stub.Remove(pb.RemoveSnapshotRequest(key=key))
    client.stub.Remove(pb.RemoveSnapshotRequest(key=l1))
    assert client.process.snapshot_ids() == before
    orphan = client.process.snapshots_dir / "123456"
    (orphan / "fs").mkdir(parents=True)
    client.stub.Cleanup(pb.CleanupRequest())
    assert not orphan.exists()
    assert client.process.snapshot_ids() == before
