"""The snapshot semantics on a real LMDB store and real directories (no
mounts), as containerd's overlayfs snapshotter defines them."""

from __future__ import annotations

import errno
import fcntl
import gzip
import io
import itertools
import os
import resource
import struct
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import prometheus_client
import pytest
from structlog.testing import capture_logs

from snapshotter import labels as label_keys
from snapshotter.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from snapshotter.fs.layers import LayerStore
from snapshotter.labels import RemoteLayerLabels
from snapshotter.layer.build import build_index
from snapshotter.layer.index import IndexFormatError
from snapshotter.model import Kind, Snapshot
from snapshotter.registry import errors as registry_errors
from snapshotter.registry.auth import CredentialsError
from snapshotter.remote import LazyLayer, NotLazy, Reason, RemoteLayers
from snapshotter.snapshots import Snapshotter
from snapshotter.store import MetadataStore
from snapshotter.usage import Usage
from tests.contract.deep_tree import build_deep_tree, remove_deep_tree
from tests.harness.trust import index_trust


@pytest.fixture
def snaps(tmp_path: Path) -> Iterator[Snapshotter]:
    s = Snapshotter(tmp_path / "root")
    yield s
    s.close()
    remove_deep_tree(tmp_path / "root")


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


@contextmanager
def few_descriptors(spare: int) -> Iterator[None]:
    """Allow only `spare` file descriptors beyond those open now: a walk that
    kept one open per level of a deep tree fails with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + spare, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# linux/fs.h: the flags chattr sets, read and written as an int.
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x10


def _set_immutable(fd: int, on: bool) -> None:
    flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
    flags = flags | _FS_IMMUTABLE_FL if on else flags & ~_FS_IMMUTABLE_FL
    fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags))


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """Make a file immutable (chattr +i): nobody, root included, can unlink
    it. It stays open, to be made mutable again wherever a rename took it."""
    marked: list[int] = []

    def mark(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            _set_immutable(fd, True)
        except OSError as exc:
            os.close(fd)
            pytest.skip(f"cannot make files immutable here: {exc}")
        marked.append(fd)

    yield mark
    for fd in marked:
        _set_immutable(fd, False)
        os.close(fd)


def test_deep_tree_is_measured_committed_and_removed(snaps: Snapshotter) -> None:
    snaps.prepare("a", "", {})
    counted = build_deep_tree(snaps.fs_path(snaps.stat("a")))
    want = Usage(size=counted.size, inodes=counted.inodes)
    with few_descriptors(spare=40):
        assert snaps.usage("a") == want
        snaps.commit("c", "a", {})
        assert snaps.usage("c") == want
        snaps.remove("c")
    assert os.listdir(snaps.snapshots_dir) == []


def test_remove_stands_when_its_directory_cannot_go(snaps: Snapshotter, immutable: Callable[[Path], None]) -> None:
    snaps.prepare("a", "", {})
    fs = snaps.fs_path(snaps.stat("a"))
    build_deep_tree(fs)
    (fs / "pinned").write_text("cannot be unlinked\n")
    immutable(fs / "pinned")
    with capture_logs() as logs:
        snaps.remove("a")
    with pytest.raises(NotFound):
        snaps.stat("a")
    doomed = fs.parent.with_name(f"rm-{fs.parent.name}")
    # Everything else went, the deep tree included.
    assert os.listdir(doomed) == ["fs"] and os.listdir(doomed / "fs") == ["pinned"]
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert "Operation not permitted" in warning["reason"] and "pinned" in warning["reason"]


def _no_registry() -> NoReturn:
    raise AssertionError("cleanup must not talk to a registry")


@pytest.fixture
def lazy_snaps(tmp_path: Path) -> Iterator[Snapshotter]:
    """A snapshotter with a layer store to prune (and no registry to reach)."""
    s = Snapshotter(
        tmp_path / "root", RemoteLayers(LayerStore(tmp_path / "layers"), tmp_path / "m", _no_registry, 0, index_trust())
    )
    yield s
    s.close()
    remove_deep_tree(tmp_path / "root")


def test_cleanup_goes_on_past_a_directory_it_cannot_remove(
    lazy_snaps: Snapshotter, immutable: Callable[[Path], None]
) -> None:
    snaps = lazy_snaps
    stuck = snaps.snapshots_dir / "rm-7"
    (stuck / "fs").mkdir(parents=True)
    (stuck / "fs" / "pinned").write_text("cannot be unlinked\n")
    immutable(stuck / "fs" / "pinned")
    # Orphans sorted before and after it, one of them too deep for a recursive walk.
    (snaps.snapshots_dir / "99" / "fs").mkdir(parents=True)
    (snaps.snapshots_dir / "rm-8" / "fs").mkdir(parents=True)
    build_deep_tree(snaps.snapshots_dir / "rm-8" / "fs")
    assert snaps.remote is not None
    unused = snaps.remote.store.path("ab" * 32)
    unused.mkdir(parents=True)
    (unused / "index").write_bytes(b"")

    with capture_logs() as logs:
        assert snaps.cleanup() == ["99", "rm-8", f"layer {unused.name}"]
    assert sorted(os.listdir(snaps.snapshots_dir)) == ["rm-7"]
    assert not unused.exists()
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["directory"] == str(stuck)
    assert "Operation not permitted" in warning["reason"]
    # Later calls do not fail on it either.
    assert snaps.cleanup() == []


def test_full_metadata_store_says_so(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "metadata.lmdb", map_size=64 * 1024)
    try:
        with pytest.raises(FailedPrecondition, match="size limit of 65536 bytes; remove unused images"):
            for n in itertools.count(1):
                with store.write() as txn:
                    txn.put(Snapshot(key=f"k{n}", id=n, kind=Kind.COMMITTED, labels={"l": "v" * 1000}))
    finally:
        store.close()


# -- the remote Prepare path: which path a layer takes, and why -------------

LAYER = "sha256:" + "1" * 64


def _remote_labels(target: str) -> dict[str, str]:
    return {
        label_keys.TARGET_REF: target,
        label_keys.IMAGE_REF: "registry.example.com/team/train:v3",
        label_keys.LAYER_DIGEST: LAYER,
        label_keys.MANIFEST_DIGEST: "sha256:" + "2" * 64,
    }


def _layers(path: str, reason: str) -> float:
    sample = prometheus_client.REGISTRY.get_sample_value(
        "bootseer_snapshotter_layers_total", {"path": path, "reason": reason}
    )
    assert sample is not None, f"no series for path={path} reason={reason}"
    return sample


class _FailingRemote(RemoteLayers):
    """The remote path failing the way a registry or the layer server would."""

    error: Exception = RuntimeError("unset")

    def prepare(self, wanted: RemoteLayerLabels) -> LazyLayer:
        raise self.error


_AT = {"host": "registry.example.com", "repository": "team/train"}


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NotLazy(Reason.NO_INDEX, "image has no bootseer index"), "no_index"),
        (NotLazy(Reason.LAYER_REFUSED, "the layer server refused layer"), "layer_refused"),
        (registry_errors.Unauthorized("answered 401", **_AT), "unauthorized"),
        (CredentialsError("config.json: cannot read docker config"), "unauthorized"),
        (registry_errors.Unreachable("connection refused", **_AT), "registry_unreachable"),
        (registry_errors.DeadlineExceeded("no time left", **_AT), "registry_unreachable"),
        (registry_errors.NotFound("manifest unknown", **_AT), "not_found"),
        (registry_errors.ServerError("answered 503", **_AT), "registry_error"),
        (registry_errors.DigestMismatch("bytes do not match", **_AT), "registry_error"),
        (IndexFormatError("truncated"), "index_refused"),
        (OSError(errno.ENOSPC, "No space left on device"), "error"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_a_layer_that_falls_back_is_counted_and_warned_about_with_its_reason(
    tmp_path: Path, error: Exception, reason: str
) -> None:
    remote = _FailingRemote(LayerStore(tmp_path / "layers"), tmp_path / "m", _no_registry, 0, index_trust())
    remote.error = error
    snaps = Snapshotter(tmp_path / "root", remote)
    try:
        before = _layers("normal", reason)
        with capture_logs() as logs:
            mounts = snaps.prepare("default/1/extract", "", _remote_labels("chain-1"))
        # The layer takes the normal path: an active snapshot for containerd to unpack into.
        assert mounts and snaps.stat("default/1/extract").kind == Kind.ACTIVE
    finally:
        snaps.close()
    assert _layers("normal", reason) == before + 1
    [warning] = [e for e in logs if e["event"] == "layer takes the normal path"]
    assert warning["log_level"] == "warning"
    assert warning["reason"] == reason
    assert warning["layer"] == LAYER and str(error) in warning["error"]


def test_no_layer_server_is_its_own_reason(tmp_path: Path) -> None:
    # Nothing is mounted at the layer server's mountpoint.
    remote = RemoteLayers(LayerStore(tmp_path / "layers"), tmp_path / "m", _no_registry, 0, index_trust())
    snaps = Snapshotter(tmp_path / "root", remote)
    try:
        before = _layers("normal", "layer_server_down")
        with capture_logs() as logs:
            snaps.prepare("default/1/extract", "", _remote_labels("chain-1"))
    finally:
        snaps.close()
    assert _layers("normal", "layer_server_down") == before + 1
    [warning] = [e for e in logs if e["event"] == "layer takes the normal path"]
    assert warning["log_level"] == "warning" and "not mounted" in warning["error"]


def test_lazy_off_counts_remote_layers_as_normal_without_a_warning(snaps: Snapshotter) -> None:
    before = _layers("normal", "lazy_disabled")
    with capture_logs() as logs:
        snaps.prepare("default/1/extract", "", _remote_labels("chain-1"))
        # An ordinary Prepare is not a remote layer at all.
        snaps.prepare("default/2/extract", "", {})
    assert _layers("normal", "lazy_disabled") == before + 1
    assert [e for e in logs if e["log_level"] == "warning"] == []


def test_every_reason_has_a_series_from_the_start() -> None:
    for reason in Reason:
        assert _layers(reason.path, reason.value) >= 0
    assert {r.path for r in Reason} == {"lazy", "normal"}
    assert [r.value for r in Reason if r.path == "lazy"] == ["served"]


class _ServingRemote(RemoteLayers):
    """The remote path finding the layer's index and the layer server showing it."""

    lazy: LazyLayer | None = None

    def prepare(self, wanted: RemoteLayerLabels) -> LazyLayer:
        assert self.lazy is not None
        return self.lazy


def test_a_layer_served_lazily_is_counted_as_lazy(tmp_path: Path) -> None:
    blob = tmp_path / "layer.tar.gz"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("hello")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"hello\n"))
    blob.write_bytes(gzip.compress(raw.getvalue(), mtime=0))
    remote = _ServingRemote(LayerStore(tmp_path / "layers"), tmp_path / "m", _no_registry, 0, index_trust())
    remote.lazy = LazyLayer(path=tmp_path / "m" / LAYER.split(":")[1], index=build_index(blob, LAYER))
    snaps = Snapshotter(tmp_path / "root", remote)
    try:
        before = {reason: _layers(reason.path, reason.value) for reason in Reason}
        with capture_logs() as logs, pytest.raises(AlreadyExists, match="served lazily"):
            snaps.prepare("default/1/extract", "", _remote_labels("chain-1"))
        # containerd asks again (a retry): still lazy.
        with pytest.raises(AlreadyExists, match="already served lazily"):
            snaps.prepare("default/2/extract", "", _remote_labels("chain-1"))
        after = {reason: _layers(reason.path, reason.value) for reason in Reason}
    finally:
        snaps.close()
    assert {r: after[r] - before[r] for r in Reason if after[r] != before[r]} == {Reason.SERVED: 2}
    assert [e for e in logs if e["log_level"] == "warning"] == []
