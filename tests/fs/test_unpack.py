"""A whole layer unpacked onto local disk (fs/unpack.py): the same tree the
layer mount shows, written without leaving its directory, and all or
nothing when it cannot finish."""

from __future__ import annotations

import errno
import os
import stat
import tarfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from snapshotter.fs.layers import TREE, LayerStore
from snapshotter.fs.unpack import UnpackError, unpack
from snapshotter.layer.build import build_index
from snapshotter.layer.tree import ROOT, LayerTree, Node, build_tree
from tests.fs.conftest import Blob, Mounted, add_layer, make_layer, metric
from tests.fs.test_layerfs import SPAN, info, rich_members
from tests.harness import tree
from tests.harness.procs import wait_until


def _with_escapes(outside: Path) -> bytes:
    """rich_layer's members, plus a symlink out of the layer with a file
    written through it, and a fifo: an unpacker that followed the link
    would write `outside`/pwned on the host."""
    members, _ = rich_members()
    members += [
        (info("esc", tarfile.SYMTYPE, 0o777, linkname=str(outside)), None),
        (info("esc/pwned", size=3), b"own"),
        (info("pipe", tarfile.FIFOTYPE, 0o640), None),
    ]
    return make_layer(members)


def test_a_whole_layer_is_unpacked_as_the_mount_shows_it(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    outside = Path("/tmp") / f"bootseer-outside-{uuid.uuid4().hex[:8]}"
    blob = _with_escapes(outside)
    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    name = digest.split(":")[1]
    done = metric("bootseer_fs_unpacked_layers_total", result="done")
    m = mount_layers({digest: Blob(blob)}, store.root, background_bandwidth=1 << 30, unpack_whole_layers=True)
    served = m.layer(digest)
    # Loading the layer starts its background fetch; once whole, it is unpacked.
    assert os.listdir(served)
    local = store.tree_path(name)
    wait_until(local.is_dir, 30, "the layer's local copy")
    assert metric("bootseer_fs_unpacked_layers_total", result="done") == done + 1
    shown, written = tree.walk(served), tree.walk(local)
    assert written == shown, tree.diff(written, shown, "unpacked", "mount")
    # tree.walk leaves out what legitimately differs between two unpacks of
    # an image; an unpack of the very tree the mount serves keeps them too.
    for path in shown.entries:
        rel = path.lstrip("/")
        assert os.lstat(local / rel).st_mtime_ns == os.lstat(served / rel).st_mtime_ns, path
    assert os.getxattr(local / "opaque", "trusted.overlay.opaque") == b"y"
    whiteout = os.lstat(local / "etc/removed")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert (local / outside.relative_to("/") / "pwned").read_bytes() == b"own"
    assert not outside.exists()
    assert [p.name for p in store.path(name).iterdir() if p.name.startswith(".")] == []


def _layer_dir(tmp_path: Path) -> tuple[LayerTree, Path, Path]:
    """A tree of one file over a cache file holding its bytes."""
    cache = tmp_path / "cache"
    cache.write_bytes(b"\xab" * (3 << 20))
    root = Node(ROOT, stat.S_IFDIR | 0o755, 0, 0, 0.0, children={b"f": 2})
    file = Node(2, stat.S_IFREG | 0o644, 0, 0, 0.0, size=3 << 20)
    layer_dir = tmp_path / "layer"
    layer_dir.mkdir()
    return LayerTree({ROOT: root, 2: file}), cache, layer_dir


def _left_in(layer_dir: Path) -> list[str]:
    return sorted(p.name for p in layer_dir.iterdir())


def test_a_name_that_is_no_path_component_is_refused(tmp_path: Path) -> None:
    layer, cache, layer_dir = _layer_dir(tmp_path)
    layer.nodes[ROOT].children = {b"../escape": 2}
    with pytest.raises(UnpackError, match="no single path component"):
        unpack(layer, cache, layer_dir, TREE, threading.Event())
    assert _left_in(layer_dir) == []
    assert not (tmp_path / "escape").exists()


def test_a_stopped_unpack_leaves_nothing(tmp_path: Path) -> None:
    layer, cache, layer_dir = _layer_dir(tmp_path)
    stop = threading.Event()
    stop.set()
    with pytest.raises(UnpackError, match="stopped"):
        unpack(layer, cache, layer_dir, TREE, stop)
    assert _left_in(layer_dir) == []


def test_a_full_disk_leaves_nothing(small_tmpfs: Callable[[int], Path], tmp_path: Path) -> None:
    layer, cache, _ = _layer_dir(tmp_path)
    layer_dir = small_tmpfs(1 << 20)
    with pytest.raises(OSError) as exc:
        unpack(layer, cache, layer_dir, TREE, threading.Event())
    assert exc.value.errno == errno.ENOSPC
    assert _left_in(layer_dir) == []
    # And the next try, with room, succeeds over what a crash would leave.
    (layer_dir / ".tree-leftover").mkdir()
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    (roomy / ".tree-leftover").mkdir()
    done = unpack(layer, cache, roomy, TREE, threading.Event())
    assert _left_in(roomy) == [TREE]
    assert (done.path / "f").read_bytes() == b"\xab" * (3 << 20)
    assert done.entries == 2 and done.bytes == 3 << 20


def test_the_tree_built_from_an_index_unpacks(tmp_path: Path) -> None:
    """Straight from the index, without a mount: a hardlink's names share one inode."""
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [
        (info("a", size=2, uid=7, gid=8, mode=0o2750), b"hi"),
        (info("b", tarfile.LNKTYPE, linkname="a"), None),
    ]
    raw = make_layer(members, compress=False)
    blob = tmp_path / "blob.gz"
    blob.write_bytes(make_layer(members))
    index = build_index(blob, "sha256:" + "0" * 64, span=SPAN)
    cache = tmp_path / "cache"
    cache.write_bytes(raw)
    layer_dir = tmp_path / "layer"
    layer_dir.mkdir()
    layer = build_tree(index.entries)
    done = unpack(layer, cache, layer_dir, TREE, threading.Event())
    a, b = os.lstat(done.path / "a"), os.lstat(done.path / "b")
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    # Whatever attributes the tree gives the inode (containerd's applier's rules).
    node = layer.lookup(ROOT, b"a")
    assert node is not None
    assert (a.st_uid, a.st_gid, a.st_mode) == (node.uid, node.gid, node.mode)
    assert (done.path / "b").read_bytes() == b"hi"


def test_no_layer_is_unpacked_onto_a_disk_it_would_nearly_fill(
    small_tmpfs: Callable[[int], Path], mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    data = os.urandom(4 << 20)
    blob = make_layer([(info("weights", size=len(data)), data)])
    store = LayerStore(small_tmpfs(8 << 20) / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    skipped = metric("bootseer_fs_unpacked_layers_total", result="no_room")
    m = mount_layers({digest: Blob(blob)}, store.root, unpack_whole_layers=True)
    # Read whole: every block cached, so the layer is whole; its copy would
    # leave less than a tenth of the tmpfs free.
    assert (m.layer(digest) / "weights").read_bytes() == data
    wait_until(
        lambda: metric("bootseer_fs_unpacked_layers_total", result="no_room") == skipped + 1,
        30,
        "the unpacker to give up for want of room",
    )
    assert not store.tree_path(digest.split(":")[1]).exists()
    assert (m.layer(digest) / "weights").read_bytes() == data


def test_whatever_an_unpack_raises_costs_only_the_local_copy(
    mount_layers: Callable[..., Mounted], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault no honest layer causes (here, an error the writer does not
    expect), injected: the layer stays on the mount, the server serves on."""

    def broken(*_: object) -> None:
        raise OverflowError("device number out of range")

    monkeypatch.setattr("snapshotter.fs.unpacker.unpack", broken)
    data = os.urandom(1 << 20)
    blob = make_layer([(info("weights", size=len(data)), data)])
    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    failed = metric("bootseer_fs_unpacked_layers_total", result="failed")
    m = mount_layers({digest: Blob(blob)}, store.root, unpack_whole_layers=True)
    assert (m.layer(digest) / "weights").read_bytes() == data
    wait_until(
        lambda: metric("bootseer_fs_unpacked_layers_total", result="failed") == failed + 1, 30, "the unpack to fail"
    )
    assert not store.tree_path(digest.split(":")[1]).exists()
    assert (m.layer(digest) / "weights").read_bytes() == data
    assert m.thread.is_alive()
