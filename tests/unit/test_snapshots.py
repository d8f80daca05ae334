"""The snapshot semantics on a real LMDB store and real directories (no
mounts), as containerd's overlayfs snapshotter defines them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from snapshotter.model import Kind
from snapshotter.snapshots import Snapshotter


@pytest.fixture
def snaps(tmp_path: Path) -> Iterator[Snapshotter]:
    s = Snapshotter(tmp_path / "root")
    yield s
    s.close()


def committed_chain(s: Snapshotter, *names: str) -> None:
    parent = ""
    for name in names:
        s.prepare(f"extract {name}", parent, {})
        s.commit(name, f"extract {name}", {})
        parent = name


def test_prepare_commit_and_chain(snaps: Snapshotter) -> None:
    committed_chain(snaps, "l1", "l2")
    info = snaps.stat("l2")
    assert (info.kind, info.parent) == (Kind.COMMITTED, "l1")
    mounts = snaps.prepare("ctr", "l2", {"a": "b"})
    [overlay] = mounts
    lowers = next(o for o in overlay.options if o.startswith("lowerdir=")).split("=", 1)[1]
    assert lowers.split(":") == [
        str(snaps.fs_path(snaps.stat("l2"))),
        str(snaps.fs_path(snaps.stat("l1"))),
    ]
    assert snaps.stat("ctr").labels == {"a": "b"}
    assert snaps.mounts("ctr") == mounts


def test_errors_carry_the_right_kind(snaps: Snapshotter) -> None:
    committed_chain(snaps, "l1")
    snaps.prepare("active", "l1", {})
    snaps.view("view", "l1", {})
    with pytest.raises(AlreadyExists):
        snaps.prepare("active", "", {})
    with pytest.raises(NotFound, match="parent snapshot 'nope' does not exist"):
        snaps.prepare("x", "nope", {})
    with pytest.raises(InvalidArgument, match="only committed snapshots can be parents"):
        snaps.prepare("x", "active", {})
    with pytest.raises(InvalidArgument):
        snaps.prepare("", "", {})
    with pytest.raises(FailedPrecondition, match="only active snapshots can be committed"):
        snaps.commit("c", "view", {})
    with pytest.raises(FailedPrecondition):
        snaps.commit("c", "l1", {})
    with pytest.raises(AlreadyExists):
        snaps.commit("l1", "active", {})
    with pytest.raises(NotFound):
        snaps.commit("c", "missing", {})
    with pytest.raises(FailedPrecondition, match="child"):
        snaps.remove("l1")
    with pytest.raises(FailedPrecondition, match="committed"):
        snaps.mounts("l1")
    with pytest.raises(InvalidArgument, match="4096"):
        snaps.prepare("big", "", {"k": "v" * 4096})


def test_failed_commit_leaves_active_intact(snaps: Snapshotter) -> None:
    committed_chain(snaps, "l1")
    snaps.prepare("a", "", {})
    with pytest.raises(AlreadyExists):
        snaps.commit("l1", "a", {})
    assert snaps.stat("a").kind == Kind.ACTIVE


def test_usage_measured_for_active_and_stored_at_commit(snaps: Snapshotter) -> None:
    snaps.prepare("a", "", {})
    fs = snaps.fs_path(snaps.stat("a"))
    (fs / "data").write_bytes(b"x" * 100_000)
    os.link(fs / "data", fs / "hardlink")
    (fs / "dir").mkdir()
    live = snaps.usage("a")
    assert live.inodes == 3  # root, data (once for both links), dir
    assert live.size >= 100_000
    snaps.commit("c", "a", {})
    (snaps.fs_path(snaps.stat("c")) / "more").write_bytes(b"y" * 50_000)
    assert snaps.usage("c") == live


def test_update_labels_with_field_mask(snaps: Snapshotter) -> None:
    committed_chain(snaps, "l1")
    snaps.update("l1", {"a": "1", "b": "2"}, ["labels"])
    assert snaps.stat("l1").labels == {"a": "1", "b": "2"}
    snaps.update("l1", {"c": "3", "a": "ignored"}, ["labels.c"])
    assert snaps.stat("l1").labels == {"a": "1", "b": "2", "c": "3"}
    snaps.update("l1", {}, ["labels.a"])
    assert snaps.stat("l1").labels == {"b": "2", "c": "3"}
    snaps.update("l1", {"only": "this"}, [])
    assert snaps.stat("l1").labels == {"only": "this"}
    with pytest.raises(InvalidArgument, match="only 'labels'"):
        snaps.update("l1", {}, ["parent"])
    with pytest.raises(NotFound):
        snaps.update("nope", {}, ["labels"])
    before = snaps.stat("l1")
    assert before.updated_ns >= before.created_ns


def test_list_with_filters(snaps: Snapshotter) -> None:
    committed_chain(snaps, "l1", "l2")
    snaps.update("l2", {"containerd.io/snapshot.ref": "l2"}, ["labels"])
    snaps.prepare("a", "l2", {})

    def names(*filters: str) -> list[str]:
        return sorted(s.key for s in snaps.list(list(filters)))

    assert names() == ["a", "l1", "l2"]
    assert names("kind==committed") == ["l1", "l2"]
    assert names("parent==l2") == ["a"]
    assert names('parent==""') == ["l1"]
    assert names('labels."containerd.io/snapshot.ref"==l2,parent==l1') == ["l2"]
    assert names('labels."containerd.io/snapshot.ref"') == ["l2"]
    assert names("name==l1", "kind==active") == ["a", "l1"]
    with pytest.raises(InvalidArgument):
        names("name==a,,kind==view")


def test_remove_deletes_directory_and_cleanup_removes_orphans(snaps: Snapshotter) -> None:
    committed_chain(snaps, "l1")
    snaps.prepare("a", "l1", {})
    a_dir = snaps.fs_path(snaps.stat("a")).parent
    snaps.remove("a")
    assert not a_dir.exists()
    with pytest.raises(NotFound):
        snaps.stat("a")
    # What a crash can leave: a staged dir, a half-removed one, an unrecorded id.
    for orphan in ("new-0123456789ab", "rm-7", "99"):
        (snaps.snapshots_dir / orphan / "fs").mkdir(parents=True)
    assert sorted(snaps.cleanup()) == ["99", "new-0123456789ab", "rm-7"]
    assert os.listdir(snaps.snapshots_dir) == [str(snaps.stat("l1").id)]
    snaps.remove("l1")
    assert os.listdir(snaps.snapshots_dir) == []


def test_reopen_keeps_everything_and_never_reuses_ids(tmp_path: Path) -> None:
    first = Snapshotter(tmp_path / "root")
    committed_chain(first, "l1")
    first.prepare("a", "l1", {"x": "y"})
    removed_id = first.stat("a").id
    first.remove("a")
    first.close()

    again = Snapshotter(tmp_path / "root")
    assert again.stat("l1").kind == Kind.COMMITTED
    again.prepare("b", "l1", {})
    assert again.stat("b").id > removed_id
    again.close()


def test_stale_directory_of_an_unrecorded_id_is_replaced(snaps: Snapshotter) -> None:
    # A kill -9 after the rename but before the transaction commits leaves a
    # directory under the id the next Prepare will be given.
    stale = snaps.snapshots_dir / "1" / "fs"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a crash")
    snaps.prepare("a", "", {})
    assert snaps.stat("a").id == 1
    assert list(snaps.fs_path(snaps.stat("a")).iterdir()) == []
