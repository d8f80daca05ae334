"""What the kernel keeps of the layer mount, so a warm start costs few FUSE
requests: negative lookups inside layers, listings (with each entry's
attributes), file opens; and what it must never keep: the mount root, where
layers come and go, and the control names. Counted by opcode with
bootseer_fs_fuse_requests_total, over a real mount."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snapshotter.fs.control import CONTROL_PREFIX
from snapshotter.fs.layerfs import SLOT_SHIFT
from snapshotter.fs.layers import LayerStore
from tests.fs.conftest import Blob, Mounted, add_layer, make_layer, metric
from tests.harness.tree import drop_page_cache

SPAN = 64 << 10
OPCODES = ("lookup", "getattr", "open", "release", "flush", "opendir", "readdir", "readdirplus", "read")


def _requests() -> dict[str, float]:
    return {op: metric("bootseer_fs_fuse_requests_total", opcode=op) for op in OPCODES}


def _since(before: dict[str, float]) -> dict[str, float]:
    """Requests by opcode since `before`, only those that came."""
    now = _requests()
    return {op: now[op] - before[op] for op in OPCODES if now[op] != before[op]}


def _answered_now(before: dict[str, float] | None = None) -> dict[str, float]:
    """Requests by opcode answered in the session's read loop (a `*_now`
    method, no task); since `before`, only those that came."""
    now = {op: metric("bootseer_fs_fuse_requests_answered_now_total", opcode=op) for op in (*OPCODES, "getxattr")}
    if before is None:
        return now
    return {op: now[op] - before[op] for op in now if now[op] != before[op]}


def _exists(directory: int, name: str) -> bool:
    """Whether `name` is in the directory open as `directory`: the walk
    starts there, as overlayfs's does from the layer it holds, not from the
    mount root (whose entries the kernel asks again on every walk)."""
    try:
        os.stat(name, dir_fd=directory)
    except FileNotFoundError:
        return False
    return True


@pytest.fixture
def opened() -> Iterator[Callable[[Path], int]]:
    """Directories opened for _exists, closed after the test."""
    fds: list[int] = []

    def open_dir(path: Path) -> int:
        fds.append(os.open(path, os.O_RDONLY | os.O_DIRECTORY))
        return fds[-1]

    yield open_dir
    for fd in fds:
        os.close(fd)


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.size, ti.mtime = kind, 0o755 if kind == tarfile.DIRTYPE else 0o644, size, 1_700_000_000
    return ti


def _layer(store: LayerStore, tmp: Path, files: dict[str, bytes]) -> tuple[str, Blob]:
    """A layer of `files` (and their directories) added to `store`: its
    digest, and its blob for the mount to fetch from."""
    dirs = sorted({str(Path(p).parent) for p in files} - {"."})
    members: list[tuple[tarfile.TarInfo, bytes | None]] = [(_info(d, tarfile.DIRTYPE), None) for d in dirs]
    members += [(_info(p, size=len(data)), data) for p, data in files.items()]
    blob = make_layer(members)
    return add_layer(store, tmp, blob, SPAN), Blob(blob)


def _prune_all(store: LayerStore) -> list[str]:
    """The snapshotter's cleanup, in a process of its own as there (LMDB
    opens an index once a process)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from pathlib import Path; from snapshotter.fs.layers import LayerStore; "
            f"print(json.dumps(LayerStore(Path({str(store.root)!r})).prune(set(), 0)))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names: list[str] = json.loads(out)
    return names


def test_a_missing_name_in_a_layer_is_asked_once(
    mount_layers: Callable[..., Mounted], opened: Callable[[Path], int], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    digest, digest_blob = _layer(store, tmp_path, {"lib/there.py": b"x = 1\n"})
    m = mount_layers({digest: digest_blob}, store.root)
    lib = opened(m.layer(digest) / "lib")
    assert _exists(lib, "there.py")

    before = _requests()
    assert not _exists(lib, "missing.py")
    assert _since(before) == {"lookup": 1}
    # The kernel answers the second time itself: overlayfs asks every layer
    # above the one holding a name, and Python asks for many names that
    # are not there.
    before = _requests()
    for _ in range(3):
        assert not _exists(lib, "missing.py")
    assert _since(before) == {}
    # Nothing else is hidden: the name next to it is still found.
    assert (m.layer(digest) / "lib/there.py").read_bytes() == b"x = 1\n"


def test_the_root_is_asked_every_time(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    m = mount_layers({}, store.root)
    # Not a layer (yet): each lookup reaches the server, so a layer is
    # found as soon as the store holds it.
    root = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = _requests()
        for _ in range(3):
            assert not _exists(root, "ab" * 32)
        # (and GETATTR: the root's attributes are never kept either)
        assert _since(before).get("lookup") == 3
        # Control names: each lookup is an image request the server must see.
        before = _requests()
        for _ in range(3):
            assert not _exists(root, f"{CONTROL_PREFIX}some-image")
        assert _since(before).get("lookup") == 3
    finally:
        os.close(root)
    added, added_blob = _layer(store, tmp_path, {"hello": b"hello\n"})
    m.blobs[added] = added_blob
    assert (m.layer(added) / "hello").exists()
    # The root's listing follows the store: kept by the kernel only until a
    # layer comes or goes.
    assert os.listdir(m.mountpoint) == [added.split(":")[1]]
    before = _requests()
    assert os.listdir(m.mountpoint) == [added.split(":")[1]]
    assert "readdirplus" not in _since(before)
    other, other_blob = _layer(store, tmp_path, {"other": b"other\n"})
    m.blobs[other] = other_blob
    assert sorted(os.listdir(m.mountpoint)) == sorted(d.split(":")[1] for d in (added, other))
    assert _prune_all(store) == sorted(d.split(":")[1] for d in (added, other))
    assert os.listdir(m.mountpoint) == []


def test_opening_files_costs_no_requests(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    files = {f"pkg/mod{i}.py": f"value = {i}\n".encode() * 50 for i in range(6)}
    digest, digest_blob = _layer(store, tmp_path, files)
    m = mount_layers({digest: digest_blob}, store.root)
    root = m.layer(digest)
    # The connection's first open and close: OPEN and FLUSH answer ENOSYS
    # once (counted all the same), and the kernel stops sending them (and RELEASE).
    before = _requests()
    assert (root / "pkg/mod0.py").read_bytes() == files["pkg/mod0.py"]
    came = _since(before)
    assert (came.get("open"), came.get("flush"), came.get("release")) == (1, 1, None), came
    for path in files:
        (root / path).stat()

    before = _requests()
    for path, data in files.items():
        for _ in range(2):
            assert (root / path).read_bytes() == data
    came = _since(before)
    assert "open" not in came and "release" not in came and "flush" not in came, came
    # Pages stay cached across opens: each file not read before was read
    # from the server once, the second time not at all.
    assert 1 <= came.get("read", 0) <= len(files) - 1, came
    # And the cache goes with the page cache, not with correctness.
    drop_page_cache()
    assert all((root / path).read_bytes() == data for path, data in files.items())


def test_a_listing_answers_the_lookups_of_its_names(
    mount_layers: Callable[..., Mounted], opened: Callable[[Path], int], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    files = {f"site/pkg{i}.py": b"" for i in range(40)}
    digest, digest_blob = _layer(store, tmp_path, files)
    m = mount_layers({digest: digest_blob}, store.root)
    site = opened(m.layer(digest) / "site")
    before = _requests()
    assert sorted(os.listdir(site)) == sorted(Path(p).name for p in files)
    came = _since(before)
    assert came.get("readdirplus", 0) >= 1 and "readdir" not in came, came
    # Every listed name's entry and attributes came with the listing.
    before = _requests()
    inodes = {os.stat(Path(p).name, dir_fd=site).st_ino for p in files}
    assert len(inodes) == len(files)
    assert _since(before) == {}
    # A layer's directory never changes: the kernel keeps its listing, and
    # opens it without asking (OPENDIR answered ENOSYS the first time).
    before = _requests()
    assert sorted(os.listdir(site)) == sorted(Path(p).name for p in files)
    assert _since(before) == {}


def test_what_the_kernel_keeps_survives_an_unload_and_never_names_another_layer(
    mount_layers: Callable[..., Mounted], opened: Callable[[Path], int], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    first, first_blob = _layer(store, tmp_path, {"etc/only-first": b"first\n"})
    m = mount_layers({first: first_blob}, store.root)
    etc = opened(m.layer(first) / "etc")
    before = _requests()
    assert not _exists(etc, "only-second")
    inode = os.stat("only-first", dir_fd=etc).st_ino
    assert _since(before) == {"lookup": 2}

    # Unloaded (idle, no mount uses it): the kernel still holds the entries,
    # positive and negative, under the layer's inode numbers. They stay true:
    # the copy comes back into the same slot with the same tree.
    m.sweep(unload_idle_s=1e-6)
    m.sweep(unload_idle_s=1e-6)
    assert not m.ops.layers_by_slot
    before = _requests()
    assert not _exists(etc, "only-second")
    assert os.stat("only-first", dir_fd=etc).st_ino == inode
    assert _since(before) == {}
    drop_page_cache()
    assert (m.layer(first) / "etc/only-first").read_bytes() == b"first\n"
    assert os.stat("only-first", dir_fd=etc).st_ino == inode

    # Pruned, then another layer holding the name the first one lacked: it
    # gets a slot of its own (slots are never reused), so no entry the
    # kernel kept for the first layer's inodes can stand for it.
    assert _prune_all(store) == [first.split(":")[1]]
    m.sweep()
    assert not m.ops.layers_by_slot
    second, second_blob = _layer(store, tmp_path, {"etc/only-second": b"second\n"})
    m.blobs[second] = second_blob
    assert (m.layer(second) / "etc/only-second").read_bytes() == b"second\n"
    assert os.stat(m.layer(second) / "etc/only-second").st_ino >> SLOT_SHIFT != inode >> SLOT_SHIFT
    # The first layer is gone from the root, which the kernel always asks.
    assert not m.layer(first).exists()

    # The same layer added back is a new copy in a new slot: reached through
    # the root, never through what the kernel kept of the old copy.
    again, _ = _layer(store, tmp_path, {"etc/only-first": b"first\n"})
    assert again == first
    assert (m.layer(first) / "etc/only-first").read_bytes() == b"first\n"
    assert os.stat(m.layer(first) / "etc/only-first").st_ino >> SLOT_SHIFT not in (
        inode >> SLOT_SHIFT,
        os.stat(m.layer(second) / "etc").st_ino >> SLOT_SHIFT,
    )
    assert not (m.layer(first) / "etc/only-second").exists()


def test_a_loaded_layer_answers_in_the_read_loop_and_an_unloaded_one_loads_first(
    mount_layers: Callable[..., Mounted], opened: Callable[[Path], int], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    digest, blob = _layer(store, tmp_path, {"etc/a": b"a\n", "etc/b": b"b\n"})
    m = mount_layers({digest: blob}, store.root)
    etc = opened(m.layer(digest) / "etc")
    a = f"/proc/self/fd/{etc}/a"

    # overlayfs's probes of a lower file: a lookup, then an xattr it lacks.
    now, before = _answered_now(), _requests()
    assert _exists(etc, "a")
    with pytest.raises(OSError) as exc:
        os.getxattr(a, "trusted.overlay.metacopy")
    assert exc.value.errno == errno.ENODATA
    assert _since(before) == {"lookup": 1}
    assert _answered_now(now) == {"lookup": 1, "getxattr": 1}

    # Unloaded: the same requests go to a task, which loads the layer again
    # and answers the same; the next ones are answered in the loop again.
    m.sweep(unload_idle_s=1e-6)
    m.sweep(unload_idle_s=1e-6)
    assert not m.ops.layers_by_slot
    now, before = _answered_now(), _requests()
    assert _exists(etc, "b")
    assert _since(before) == {"lookup": 1}
    assert _answered_now(now) == {}
    assert m.ops.layers_by_slot
    with pytest.raises(OSError) as exc:
        os.getxattr(a, "trusted.overlay.metacopy")
    assert exc.value.errno == errno.ENODATA
    assert _answered_now(now) == {"getxattr": 1}
    assert (m.layer(digest) / "etc/b").read_bytes() == b"b\n"


def test_a_plain_connection_answers_no_getxattr_and_the_kernel_stops_asking(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    """The plain mount's session answers GETXATTR ENOSYS once; the kernel
    then fails every later one on the connection by itself, as overlayfs's
    probes of every lower file it looks up are then. A listing of a file's
    xattrs is still answered: none, as overlayfs on a disk shows."""
    store = LayerStore(tmp_path / "store")
    digest, blob = _layer(store, tmp_path, {"etc/a": b"a\n", "etc/b": b"b\n"})
    m = mount_layers({digest: blob}, store.root, getxattr=False)
    etc = m.layer(digest) / "etc"

    def asked() -> float:
        return metric("bootseer_fs_fuse_requests_total", opcode="getxattr")

    before = asked()
    for name in ("a", "b", "a"):
        for xattr in ("trusted.overlay.metacopy", "user.anything"):
            with pytest.raises(OSError) as exc:
                os.getxattr(etc / name, xattr)
            assert exc.value.errno == errno.EOPNOTSUPP
        assert os.listxattr(etc / name) == []
    assert asked() - before == 1
    assert (etc / "a").read_bytes() == b"a\n"


def test_a_read_of_cached_bytes_in_the_page_cache_is_answered_in_the_read_loop(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    data = os.urandom(3 * SPAN)
    digest, blob = _layer(store, tmp_path, {"data.bin": data})
    m = mount_layers({digest: blob}, store.root)
    path = m.layer(digest) / "data.bin"

    # Fetched: a read that finds its block missing waits for the registry
    # in a task (the kernel's read-ahead may send another once blocks are in).
    now, before = _answered_now(), _requests()
    assert path.read_bytes() == data
    assert _answered_now(now).get("read", 0) < _since(before)["read"]

    # Cached, and in the page cache (read here just before, so that no
    # reclaim of idle pages can take them in between): answered at once.
    # Only the layer mount's own pages are dropped, so that the reads reach it.
    store.cache_path(digest.split(":")[1]).read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        now, before = _answered_now(), _requests()
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    reads = _since(before)["read"]
    assert reads >= 1
    assert _answered_now(now) == {"read": reads}
