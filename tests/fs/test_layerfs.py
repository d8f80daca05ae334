"""The FUSE layer server over real mounts: the tree it shows, lazy block
fetches, verification, and a cache that outlives the server."""

from __future__ import annotations

import errno
import hashlib
import inspect
import os
import random
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from snapshotter.fs import fusewire
from snapshotter.fs.layerfs import LayerFS
from snapshotter.fs.layers import LayerStore
from snapshotter.layer.index import EntryType, LayerIndex
from snapshotter.layer.tree import ROOT
from tests.fs.conftest import Blob, Events, Mounted, add_layer, fill, make_layer, metric, unmount
from tests.harness.procs import wait_until
from tests.harness.tree import drop_page_cache

SPAN = 256 << 10


def info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, size: int = 0, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.size, ti.mtime = kind, mode, size, 1_700_000_000
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def rich_layer() -> tuple[bytes, dict[str, bytes]]:
    members, files = rich_members()
    return make_layer(members), files


def rich_members() -> tuple[list[tuple[tarfile.TarInfo, bytes | None]], dict[str, bytes]]:
    rng = random.Random(5)
    files = {
        "etc/config.json": b'{"a": 1}\n',
        "data/big.bin": rng.randbytes(3 << 20),
        "data/empty": b"",
        "data/\u00fcber-\u6a21\u578b.txt": b"non-ascii",
        "deep/" + "d/" * 20 + "x" * 200: b"long",
    }
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [
        (info("./", tarfile.DIRTYPE, 0o755), None),
        (info("etc", tarfile.DIRTYPE, 0o755), None),
        (info("data", tarfile.DIRTYPE, 0o1777), None),
        (info("bin", tarfile.DIRTYPE, 0o755), None),
    ]
    for name, data in files.items():
        members.append((info(name, size=len(data), uid=1000, gid=1000), data))
    members += [
        (info("bin/tool", mode=0o4755, size=4), b"\x7fELF"),
        (info("bin/tool-link", tarfile.LNKTYPE, mode=0o4755, linkname="bin/tool"), None),
        (info("bin/rel", tarfile.SYMTYPE, 0o777, linkname="tool"), None),
        (info("bin/dangling", tarfile.SYMTYPE, 0o777, linkname="/nope"), None),
        (info("etc/.wh.removed"), None),
        (info("opaque", tarfile.DIRTYPE, 0o755), None),
        (info("opaque/.wh..wh..opq"), None),
        (info("dev", tarfile.DIRTYPE, 0o755), None),
        (info("dev/null", tarfile.CHRTYPE, 0o666, devmajor=1, devminor=3), None),
    ]
    x = info("etc/xattr", size=1)
    x.pax_headers = {"SCHILY.xattr.user.team": "ml-infra"}
    members.append((x, b"x"))
    return members, files


def test_tree_matches_the_tar(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    blob, files = rich_layer()
    store_dir = tmp_path / "store"
    from snapshotter.fs.layers import LayerStore

    digest = add_layer(LayerStore(store_dir), tmp_path, blob, SPAN)
    m = mount_layers({digest: Blob(blob)}, store_dir)
    root = m.layer(digest)
    assert os.listdir(m.mountpoint) == [digest.split(":")[1]]
    for name, data in files.items():
        st = os.lstat(root / name)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o644)
        assert (root / name).read_bytes() == data
    assert stat.S_IMODE(os.stat(root / "data").st_mode) == 0o1777
    tool, link = os.stat(root / "bin/tool"), os.stat(root / "bin/tool-link")
    assert tool.st_ino == link.st_ino and tool.st_nlink == 2
    assert stat.S_IMODE(tool.st_mode) == 0o4755
    assert os.readlink(root / "bin/rel") == "tool"
    assert os.readlink(root / "bin/dangling") == "/nope"
    whiteout = os.lstat(root / "etc/removed")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(root / "opaque", "trusted.overlay.opaque") == b"y"
    assert os.listdir(root / "opaque") == []
    assert os.getxattr(root / "etc/xattr", "user.team") == b"ml-infra"
    null = os.lstat(root / "dev/null")
    assert stat.S_ISCHR(null.st_mode) and (os.major(null.st_rdev), os.minor(null.st_rdev)) == (1, 3)
    with pytest.raises(OSError) as exc:
        os.open(root / "etc/config.json", os.O_RDWR)
    assert exc.value.errno in (errno.EROFS, errno.EACCES)
    assert os.statvfs(root).f_bsize == os.statvfs(store_dir).f_bsize


def test_reads_fetch_only_the_blocks_they_touch(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    rng = random.Random(9)
    big = rng.randbytes(8 << 20)
    blob = make_layer([(info("small", size=5), b"hello"), (info("big", size=len(big)), big)])
    from snapshotter.fs.layers import LayerStore

    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    source = Blob(blob)
    m = mount_layers({digest: source}, tmp_path / "store")
    assert (m.layer(digest) / "small").read_bytes() == b"hello"
    assert 0 < source.bytes_fetched < len(blob) // 10
    with open(m.layer(digest) / "big", "rb") as f:
        f.seek(5 << 20)
        assert f.read(4096) == big[5 << 20 : (5 << 20) + 4096]
    assert source.bytes_fetched < len(blob) // 5
    assert hashlib.sha256((m.layer(digest) / "big").read_bytes()).digest() == hashlib.sha256(big).digest()


def test_read_ahead_stays_within_the_file(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    rng = random.Random(11)
    first, second = rng.randbytes(6 << 20), rng.randbytes(6 << 20)
    blob = make_layer([(info("first", size=len(first)), first), (info("second", size=len(second)), second)])
    from snapshotter.fs.layers import LayerStore

    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    index: LayerIndex = store.load(digest.split(":")[1])[0]
    first_entry = next(e for e in index.entries if e.name == "first")
    first_end = first_entry.offset + first_entry.size
    source = Blob(blob)
    m = mount_layers({digest: source}, tmp_path / "store")
    with open(m.layer(digest) / "first", "rb", buffering=0) as f:
        # One read at a time, in order, as the layer server's read-ahead expects.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        while f.read(128 << 10):
            pass
    # Sequential reads grew the read-ahead window; none of it went past the file.
    assert len(source.fetched) > 1
    last = max(n for n, b in enumerate(index.blocks) if b.ustart < first_end)
    assert last + 1 < len(index.blocks)
    assert max(end for _, end in source.fetched) <= index.blocks[last].cend
    assert (m.layer(digest) / "second").read_bytes() == second


def test_small_layers_are_fetched_whole(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    rng = random.Random(12)
    small = make_layer([(info(f"f{i}", size=200_000), rng.randbytes(200_000)) for i in range(8)])
    big = make_layer([(info("big", size=3 << 20), rng.randbytes(3 << 20))])
    from snapshotter.fs.layers import LayerStore

    store = LayerStore(tmp_path / "store")
    small_digest, big_digest = add_layer(store, tmp_path, small, SPAN), add_layer(store, tmp_path, big, SPAN)
    sources = {small_digest: Blob(small), big_digest: Blob(big)}
    m = mount_layers(sources, tmp_path / "store", whole_layer_bytes=len(small))
    assert m.layer(small_digest).is_dir() and m.layer(big_digest).is_dir()
    # Nothing was read; the small layer arrives whole, the big one stays lazy.
    wait_until(lambda: sources[small_digest].bytes_fetched >= len(small), 10, "the small layer fetched whole")
    assert sources[big_digest].bytes_fetched == 0
    fetched = len(sources[small_digest].fetched)
    assert (m.layer(small_digest) / "f3").stat().st_size == 200_000
    assert len((m.layer(small_digest) / "f5").read_bytes()) == 200_000
    assert len(sources[small_digest].fetched) == fetched


def test_a_small_layer_a_manifest_covers_is_not_fetched_whole(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    """Its prefetch brings what a start reads: the rest of the layer would
    be bytes no start was seen to need. A reader still gets every file, and
    what it reads is what is recorded."""
    rng = random.Random(13)
    files = {f"f{i}": rng.randbytes(200_000) for i in range(8)}
    small = make_layer([(info(name, size=len(data)), data) for name, data in files.items()])
    other = make_layer([(info("g", size=300_000), rng.randbytes(300_000))])
    store = LayerStore(tmp_path / "store")
    covered, uncovered = add_layer(store, tmp_path, small, SPAN), add_layer(store, tmp_path, other, SPAN)
    sources = {covered: Blob(small), uncovered: Blob(other)}
    m = mount_layers(sources, tmp_path / "store", whole_layer_bytes=len(small))
    events = Events({covered})
    m.ops.events = events
    assert m.layer(covered).is_dir() and m.layer(uncovered).is_dir()
    wait_until(lambda: sources[uncovered].bytes_fetched >= len(other), 10, "the uncovered layer fetched whole")
    assert sources[covered].bytes_fetched == 0
    assert (m.layer(covered) / "f5").read_bytes() == files["f5"]
    index = m.ops.layers_by_name[covered.split(":")[1]].reader.index
    entry = next(e for e in index.entries if e.name == "f5")
    read = set(index.block_range(entry.offset, entry.offset + entry.size))
    # Only the blocks holding f5 (the kernel reads no further than the file's end).
    assert {n for layer, n in events.accessed if layer == covered} == read
    assert sources[covered].fetched == [(index.blocks[min(read)].cstart, index.blocks[max(read)].cend)]


def test_corrupt_bytes_are_never_served_and_cache_survives_restart(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    rng = random.Random(11)
    a, b = rng.randbytes(1 << 20), rng.randbytes(1 << 20)
    blob = make_layer([(info("a", size=len(a)), a), (info("b", size=len(b)), b)])
    from snapshotter.fs.layers import LayerStore

    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    source = Blob(blob)
    m = mount_layers({digest: source}, tmp_path / "store")
    assert (m.layer(digest) / "a").read_bytes() == a
    source.corrupt = True
    with pytest.raises(OSError) as exc:
        (m.layer(digest) / "b").read_bytes()
    assert exc.value.errno == errno.EIO
    unmount(m)

    # A new server on the same store: what was cached is served with the
    # registry down; the rest is EIO until the registry is back.
    source.corrupt, source.down = False, True
    again = mount_layers({digest: source}, tmp_path / "store")
    assert (again.layer(digest) / "a").read_bytes() == a
    with pytest.raises(OSError) as exc:
        (again.layer(digest) / "b").read_bytes()
    assert exc.value.errno == errno.EIO
    source.down = False
    assert (again.layer(digest) / "b").read_bytes() == b


def test_background_fetch_caches_whole_layers(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    rng = random.Random(17)
    data = rng.randbytes(3 << 20)
    blob = make_layer([(info("small", size=2), b"hi"), (info("weights", size=len(data)), data)])
    from snapshotter.fs.layers import LayerStore

    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    source = Blob(blob)
    m = mount_layers({digest: source}, tmp_path / "store", background_bandwidth=1 << 30)
    assert (m.layer(digest) / "small").read_bytes() == b"hi"
    # Looking the layer up started the background fetch: the whole blob arrives.
    wait_until(lambda: source.bytes_fetched >= len(blob), 30, "the background fetch")
    source.down = True
    assert (m.layer(digest) / "weights").read_bytes() == data


def test_cached_block_lost_before_a_restart_is_fetched_again(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    data = random.Random(19).randbytes(1 << 20)
    blob = make_layer([(info("a", size=len(data)), data)])
    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, blob, SPAN)
    source = Blob(blob)
    m = mount_layers({digest: source}, tmp_path / "store")
    assert (m.layer(digest) / "a").read_bytes() == data
    unmount(m)
    # What a power cut can do: the block index says cached, the bytes are gone.
    with open(store.cache_path(digest.split(":")[1]), "r+b") as cache:
        cache.write(b"\0" * (2 * SPAN))
    fetched = source.bytes_fetched
    again = mount_layers({digest: source}, tmp_path / "store")
    assert (again.layer(digest) / "a").read_bytes() == data
    assert source.bytes_fetched > fetched


def _listing(directory: Path) -> dict[str, int]:
    """Names and inode numbers as `ls -a` shows them: "." and ".." included."""
    out = subprocess.run(["ls", "-1ai", str(directory)], check=True, capture_output=True, text=True).stdout
    return {name: int(ino) for ino, name in (line.split(maxsplit=1) for line in out.splitlines())}


def test_listings_show_dot_and_dotdot(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    # More entries than one readdir reply holds, in a layer directory and in
    # the mount root, so listings resume from the offsets they handed out.
    names = [f"file-{i:03}" for i in range(300)]
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [(info("sub", tarfile.DIRTYPE, 0o755), None)]
    members += [(info(f"sub/{name}"), b"") for name in names]
    store = LayerStore(tmp_path / "store")
    digest = add_layer(store, tmp_path, make_layer(members), SPAN)
    others = [add_layer(store, tmp_path, make_layer([(info(f"layer-{i}"), b"")]), SPAN) for i in range(30)]
    m = mount_layers({d: Blob(b"") for d in [digest, *others]}, tmp_path / "store")
    layer, sub = m.layer(digest), m.layer(digest) / "sub"

    assert _listing(sub) == {
        ".": os.stat(sub).st_ino,
        "..": os.stat(layer).st_ino,
        **{name: os.stat(sub / name).st_ino for name in names},
    }
    assert _listing(layer) == {".": os.stat(layer).st_ino, "..": fusewire.ROOT_INODE, "sub": os.stat(sub).st_ino}
    top = _listing(m.mountpoint)
    assert top["."] == fusewire.ROOT_INODE
    assert sorted(top) == sorted([".", "..", *(d.split(":")[1] for d in [digest, *others])])


def test_every_fuse_operation_is_guarded() -> None:
    handlers = [
        name
        for name, value in vars(LayerFS).items()
        if name in vars(fusewire.Operations) and inspect.iscoroutinefunction(value)
    ]
    assert {"lookup", "getattr", "readdir", "read", "forget", "statfs"} <= set(handlers)
    now = [name for name in vars(LayerFS) if name in vars(fusewire.Operations) and name.endswith("_now")]
    assert {
        "lookup_now",
        "getattr_now",
        "readlink_now",
        "getxattr_now",
        "listxattr_now",
        "statfs_now",
        "read_now",
    } == set(now)
    assert [name for name in handlers + now if not hasattr(getattr(LayerFS, name), "__wrapped__")] == []


@pytest.mark.parametrize(
    "hostile",
    [{"uid": 2**40}, {"mode": stat.S_IFREG | 2**40}, {"mtime": 1e300}],
    ids=["uid", "mode", "mtime"],
)
def test_a_request_that_fails_breaks_only_its_layer(
    mount_layers: Callable[..., Mounted], tmp_path: Path, hostile: dict[str, object]
) -> None:
    store = LayerStore(tmp_path / "store")
    good_blob = make_layer([(info("ok", size=5), b"hello")])
    good = add_layer(store, tmp_path, good_blob, SPAN)
    bad_blob = make_layer([(info("plain", size=4), b"fine"), (info("evil", size=4), b"evil")])
    bad = add_layer(store, tmp_path, bad_blob, SPAN)
    m = mount_layers({good: Blob(good_blob), bad: Blob(bad_blob)}, tmp_path / "store")
    with open(m.layer(bad) / "plain", "rb", buffering=0) as plain:
        # Index validation keeps values the kernel cannot take out of the
        # tree; the guard is for whatever gets past it. Here a node is made
        # hostile.
        node = m.ops.layers_by_name[bad.split(":")[1]].tree.lookup(ROOT, b"evil")
        assert node is not None
        for key, value in hostile.items():
            setattr(node, key, value)

        before = metric("bootseer_fs_handler_errors_total", op="lookup")
        with pytest.raises(OSError) as exc:
            os.lstat(m.layer(bad) / "evil")
        assert exc.value.errno == errno.EIO
        assert metric("bootseer_fs_handler_errors_total", op="lookup") == before + 1
        # The layer is broken from now on, even for a file opened before; no
        # further error is counted for it.
        with pytest.raises(OSError) as exc:
            plain.read()
        assert exc.value.errno == errno.EIO
    assert metric("bootseer_fs_handler_errors_total", op="lookup") == before + 1

    # The mount is up and the other layer serves as before.
    assert os.path.ismount(m.mountpoint)
    assert (m.layer(good) / "ok").read_bytes() == b"hello"
    assert os.listdir(m.mountpoint) == [good.split(":")[1]]


def _hardlink_to_nothing(store: LayerStore, name: str) -> None:
    # The decoder takes it today; no tree can be built from it.
    path = store.path(name) / "index"
    index = LayerIndex.decode(path.read_bytes())
    index.entries = [
        msgspec.structs.replace(e, type=EntryType.HARDLINK, linkname="missing") if e.name == "link" else e
        for e in index.entries
    ]
    path.write_bytes(index.encode())


def _cache_removed(store: LayerStore, name: str) -> None:
    store.cache_path(name).unlink()


@pytest.mark.parametrize("damage", [_hardlink_to_nothing, _cache_removed], ids=["hardlink-to-nothing", "cache-removed"])
def test_a_layer_that_cannot_be_loaded_answers_eio(
    mount_layers: Callable[..., Mounted], tmp_path: Path, damage: Callable[[LayerStore, str], None]
) -> None:
    store = LayerStore(tmp_path / "store")
    good_blob = make_layer([(info("ok", size=5), b"hello")])
    good = add_layer(store, tmp_path, good_blob, SPAN)
    bad_blob = make_layer([(info("target", size=1), b"t"), (info("link"), b"")])
    bad = add_layer(store, tmp_path, bad_blob, SPAN)
    damage(store, bad.split(":")[1])
    m = mount_layers({good: Blob(good_blob), bad: Blob(bad_blob)}, tmp_path / "store")

    before = metric("bootseer_fs_layer_load_errors_total")
    for _ in range(2):
        with pytest.raises(OSError) as exc:
            os.stat(m.layer(bad))
        assert exc.value.errno == errno.EIO
    # Refused once, then remembered: not loaded again on every lookup.
    assert metric("bootseer_fs_layer_load_errors_total") == before + 1
    assert os.listdir(m.mountpoint) == [good.split(":")[1]]
    assert (m.layer(good) / "ok").read_bytes() == b"hello"


def test_a_full_layer_store_loses_nothing(
    small_tmpfs: Callable[[int], Path], mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    disk = small_tmpfs(12 << 20)
    store_dir = disk / "store"
    data = random.Random(23).randbytes(8 << 20)
    blob = make_layer([(info("weights", size=len(data)), data)])
    digest = add_layer(LayerStore(store_dir), tmp_path, blob, 512 << 10)
    # tmpfs refuses RWF_NOWAIT: cached reads take the threaded path.
    with open(LayerStore(store_dir).cache_path(digest.split(":")[1]), "rb") as cache:
        with pytest.raises(OSError) as exc:
            os.preadv(cache.fileno(), [bytearray(4096)], 0, os.RWF_NOWAIT)
        assert exc.value.errno == errno.EOPNOTSUPP
    source = Blob(blob)
    m = mount_layers({digest: source}, store_dir)
    weights = m.layer(digest) / "weights"
    assert weights.stat().st_size == len(data)

    # Room for a block or two of the eight MiB read.
    filler = fill(disk, leave=1 << 20)
    before = metric("bootseer_fs_cache_write_errors_total")
    assert weights.read_bytes() == data
    assert metric("bootseer_fs_cache_write_errors_total") > before
    drop_page_cache()
    assert weights.read_bytes() == data

    # Space again: what could not be cached is cached now.
    filler.unlink()
    drop_page_cache()
    assert weights.read_bytes() == data
    drop_page_cache()
    source.down = True
    assert weights.read_bytes() == data

    # Every block the index records has its bytes on disk.
    unmount(m)
    again = mount_layers({digest: source}, store_dir)
    assert (again.layer(digest) / "weights").read_bytes() == data


def _statfs(path: Path) -> tuple[int, ...]:
    st = os.statvfs(path)
    return (
        st.f_bsize,
        st.f_frsize,
        st.f_blocks,
        st.f_bfree,
        st.f_bavail,
        st.f_files,
        st.f_ffree,
        st.f_favail,
        st.f_namemax,
    )


def test_statfs_is_the_layer_store_filesystem(
    small_tmpfs: Callable[[int], Path], mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    # A disk of its own: nothing else changes it between two statfs calls.
    disk = small_tmpfs(16 << 20)
    store_dir = disk / "store"
    blob = make_layer([(info("weights", size=1 << 20), random.Random(29).randbytes(1 << 20))])
    digest = add_layer(LayerStore(store_dir), tmp_path, blob, SPAN)
    m = mount_layers({digest: Blob(blob)}, store_dir)
    assert _statfs(m.mountpoint) == _statfs(disk)
    mounted = os.statvfs(m.mountpoint)
    assert mounted.f_blocks * mounted.f_frsize == 16 << 20 and mounted.f_bavail > 0
    # Less room on the store is less room on the mount: what kubelet's image
    # garbage collection goes by, within the second an answer is given again.
    filler = fill(disk, leave=1 << 20)
    wait_until(lambda: _statfs(m.mountpoint) == _statfs(disk), 10, "the mount to show the fuller disk")
    assert os.statvfs(m.mountpoint).f_bavail < mounted.f_bavail
    filler.unlink()
    wait_until(lambda: _statfs(m.mountpoint) == _statfs(disk), 10, "the mount to show the emptier disk")


def test_a_statfs_is_answered_again_in_the_read_loop(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    """Overlayfs asks each lower layer's statfs at every mount: right after
    one, the same answer comes from the read loop, no thread hop."""
    store_dir = tmp_path / "store"
    blob = make_layer([(info("ok", size=5), b"hello")])
    digest = add_layer(LayerStore(store_dir), tmp_path, blob, SPAN)
    m = mount_layers({digest: Blob(blob)}, store_dir)

    def answered_now() -> float:
        return metric("bootseer_fs_fuse_requests_answered_now_total", opcode="statfs")

    first = os.statvfs(m.layer(digest))
    before = answered_now()
    again = [os.statvfs(m.layer(digest)) for _ in range(5)]
    assert answered_now() - before >= 4
    assert all(st.f_blocks == first.f_blocks and st.f_namemax == first.f_namemax for st in again)


def test_statfs_follows_a_busy_disk(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    blob = make_layer([(info("ok", size=5), b"hello")])
    digest = add_layer(LayerStore(store_dir), tmp_path, blob, SPAN)
    m = mount_layers({digest: Blob(blob)}, store_dir)
    mounted, store = os.statvfs(m.mountpoint), os.statvfs(store_dir)
    # Other writers share this disk: its size is fixed, its free space is not.
    assert (mounted.f_bsize, mounted.f_frsize, mounted.f_blocks, mounted.f_files, mounted.f_namemax) == (
        store.f_bsize,
        store.f_frsize,
        store.f_blocks,
        store.f_files,
        store.f_namemax,
    )
    assert mounted.f_bavail > 0 and abs(mounted.f_bavail - store.f_bavail) <= store.f_blocks // 100


def test_statfs_answers_when_the_store_cannot(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    data = random.Random(31).randbytes(1 << 20)
    blob = make_layer([(info("weights", size=len(data)), data)])
    digest = add_layer(LayerStore(store_dir), tmp_path, blob, SPAN)
    m = mount_layers({digest: Blob(blob)}, store_dir)
    assert (m.layer(digest) / "weights").stat().st_size == len(data)
    # The store's directory is gone from under the server (its open files
    # stay); the last answer is given again for up to a second.
    store_dir.rename(tmp_path / "moved")
    try:
        wait_until(lambda: os.statvfs(m.mountpoint).f_bavail == 0, 10, "the mount's answer without its store")
        st = os.statvfs(m.mountpoint)
    finally:
        (tmp_path / "moved").rename(store_dir)
    # overlayfs needs an answer: what the served layers hold, no room left.
    assert st.f_bsize == 4096 and st.f_blocks >= len(data) // 4096
    assert st.f_bfree == st.f_bavail == 0
    # Back in place: the real filesystem again, at once (a fallback answer
    # is never given again).
    assert os.statvfs(m.mountpoint).f_blocks == os.statvfs(store_dir).f_blocks
