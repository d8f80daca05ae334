"""Bounded disk and memory in the layer server, over real FUSE mounts: the
block cache's cap (LRU eviction by punched holes, unused layers first),
pruned layers closed so their space returns, and idle layers unloaded and
loaded again on their next request."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import struct
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.eviction import PAGE, BlockCache, hole
from snapshotter.fs.layers import LayerStore
from tests.fs.conftest import Blob, Mounted, add_layer, metric, unmount
from tests.harness.tree import drop_page_cache

SPAN = 1 << 20
MB = 1_000_000


def _gzip_layer(files: dict[str, bytes]) -> bytes:
    """A layer of regular files; level 1, because random bytes do not
    compress anyway and these layers are big."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), 1, mtime=0)


def _allocated(store: LayerStore) -> int:
    """Bytes the cache files take on disk (what `du` counts), every layer."""
    return sum(os.stat(store.cache_path(name)).st_blocks * 512 for name in store.names())


def _layers(store: LayerStore, tmp_path: Path, count: int, size: int, seed: int) -> list[tuple[str, bytes, bytes]]:
    """`count` layers of one random file of `size` bytes each: (digest, blob, data)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        data = rng.randbytes(size)
        blob = _gzip_layer({"weights.bin": data})
        out.append((add_layer(store, tmp_path, blob, SPAN), blob, data))
    return out


def _read_checked(path: Path, within: Callable[[], None]) -> str:
    """sha256 of the file read in 4 MiB pieces, `within()` after each."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
            within()
    return digest.hexdigest()


def test_holes_are_whole_pages_and_spare_cached_neighbours() -> None:
    # A block from 5000 to 20000: pages shared with cached neighbours stay.
    assert hole(5000, 15000, False, False) == (2 * PAGE, 2 * PAGE)
    assert hole(5000, 15000, True, True) == (PAGE, 4 * PAGE)
    assert hole(5000, 15000, True, False) == (PAGE, 3 * PAGE)
    # Inside one page with a cached neighbour either side: nothing punched.
    assert hole(100, 200, False, False)[1] == 0


def test_a_capped_cache_stays_under_its_cap_and_reads_stay_right(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    cap = 50 * MB
    store = LayerStore(tmp_path / "store")
    layers = _layers(store, tmp_path, 4, 50 * MB, seed=41)
    sources = {digest: Blob(blob) for digest, blob, _ in layers}
    m = mount_layers(sources, store.root, cache_max_bytes=cap)
    evicted_before = metric("bootseer_fs_evicted_blocks_total")
    peak = [0]

    def under_cap() -> None:
        used = _allocated(store)
        peak[0] = max(peak[0], used)
        assert used <= cap + SPAN, (used, cap)

    # 200 MB read through a 50 MB cache: every byte right, the disk never
    # above the cap plus one block.
    for digest, _, data in layers:
        assert _read_checked(m.layer(digest) / "weights.bin", under_cap) == hashlib.sha256(data).hexdigest()
    assert metric("bootseer_fs_evicted_blocks_total") - evicted_before >= (150 * MB) // SPAN
    assert metric("bootseer_fs_evicted_bytes_total") > 0
    assert metric("bootseer_fs_cache_bytes") <= cap
    assert metric("bootseer_fs_cache_max_bytes") == cap
    assert peak[0] > cap // 2

    # The first layer was evicted: read again, its blocks are fetched again.
    first_digest, _, first_data = layers[0]
    fetched = sources[first_digest].bytes_fetched
    drop_page_cache()
    path = m.layer(first_digest) / "weights.bin"
    assert _read_checked(path, under_cap) == hashlib.sha256(first_data).hexdigest()
    assert sources[first_digest].bytes_fetched - fetched > 40 * MB

    # What the block index records is what the cache files hold: a new
    # server on the store (crc-checking every recorded block on its first
    # read) serves those from the cache and fetches only the others.
    for digest, _, _ in layers:
        layer = m.ops.layers_by_name[digest.split(":")[1]]
        for n, record in m.ops.block_index.cached(layer.reader.cache_key).items():
            block = layer.reader.index.blocks[n]
            assert (record.offset, record.size) == (block.ustart, block.uend - block.ustart)
    unmount(m)
    for source in sources.values():
        source.fetched.clear()
    again = mount_layers(sources, store.root)
    assert metric("bootseer_fs_cache_bytes") <= cap
    recorded = 0
    for digest, _, data in layers:
        assert again.layer(digest).is_dir()
        reader = again.ops.layers_by_name[digest.split(":")[1]].reader
        cached = set(reader.cached)
        recorded += sum(reader.index.blocks[n].uend - reader.index.blocks[n].ustart for n in cached)
        assert (again.layer(digest) / "weights.bin").read_bytes() == data
        fetched = {
            n
            for n, b in enumerate(reader.index.blocks)
            for start, end in sources[digest].fetched
            if start <= b.cstart and b.cend <= end
        }
        assert not fetched & cached
    assert cap // 2 < recorded <= cap


def test_blocks_of_layers_no_mount_uses_are_evicted_first(
    mount_layers: Callable[..., Mounted], tmp_path: Path, bind_mounts: Callable[[Path], Path]
) -> None:
    cap = 24 * MB
    store = LayerStore(tmp_path / "store")
    (used, used_blob, used_data), (idle, idle_blob, idle_data), (new, new_blob, new_data) = _layers(
        store, tmp_path, 3, 10 * MB, seed=43
    )
    sources = {used: Blob(used_blob), idle: Blob(idle_blob), new: Blob(new_blob)}
    m = mount_layers(sources, store.root, cache_max_bytes=cap)
    # A view of one layer, as the snapshotter hands to containerd: a bind
    # mount of its directory in the layer mount.
    view = bind_mounts(m.layer(used))
    # The used layer is read first: the least recently read, yet kept.
    assert (view / "weights.bin").read_bytes() == used_data
    assert (m.layer(idle) / "weights.bin").read_bytes() == idle_data
    # Two sweeps with nothing read between: the idle layer is unloaded, the
    # bind-mounted one stays.
    m.sweep(unload_idle_s=1e-6)
    m.sweep(unload_idle_s=1e-6)
    assert set(m.ops.layers_by_name) == {used.split(":")[1]}
    used_cache = store.cache_path(used.split(":")[1])
    kept = os.stat(used_cache).st_blocks
    assert (m.layer(new) / "weights.bin").read_bytes() == new_data
    # Room for the new layer came from the layer nobody uses.
    assert os.stat(used_cache).st_blocks == kept
    assert os.stat(store.cache_path(idle.split(":")[1])).st_blocks * 512 < 5 * MB
    assert _allocated(store) <= cap + SPAN
    # And the idle layer still reads right, fetched again.
    fetched = sources[idle].bytes_fetched
    drop_page_cache()
    assert (m.layer(idle) / "weights.bin").read_bytes() == idle_data
    assert sources[idle].bytes_fetched > fetched


def _open_fds_on(name: str) -> int:
    """This process's descriptors on layer `name`'s cache file, removed or not."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if name in target and "/cache" in target:
                count += 1
        except OSError:
            continue
    return count


def test_an_idle_layer_is_unloaded_and_reloads_on_its_next_request(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    rng = random.Random(47)
    files = {f"dir/f{i}": rng.randbytes(300_000) for i in range(6)}
    blob = _gzip_layer(files)
    digest = add_layer(store, tmp_path, blob, 256 << 10)
    name = digest.split(":")[1]
    m = mount_layers({digest: Blob(blob)}, store.root)
    root = m.layer(digest)
    before = {path: os.stat(root / path).st_ino for path in files}
    with open(root / "dir/f3", "rb", buffering=0) as opened:
        assert opened.read(1000) == files["dir/f3"][:1000]
        assert metric("bootseer_fs_loaded_layers") == 1
        assert _open_fds_on(name) == 1
        unloads = metric("bootseer_fs_layer_unloads_total", reason="idle")

        m.sweep(unload_idle_s=1e-6)
        m.sweep(unload_idle_s=1e-6)
        # Gone from memory: tree, reader, the cache file's descriptor.
        assert name not in m.ops.layers_by_name and not m.ops.layers_by_slot
        assert metric("bootseer_fs_loaded_layers") == 0
        assert metric("bootseer_fs_layer_unloads_total", reason="idle") == unloads + 1
        assert _open_fds_on(name) == 0

        # The kernel kept the open file and its inode: reading on reloads
        # the layer into the same slot, so every inode means what it meant.
        drop_page_cache()
        assert opened.read() == files["dir/f3"][1000:]
        assert name in m.ops.layers_by_name
        assert {path: os.stat(root / path).st_ino for path in files} == before

    # Unloaded again; a fresh lookup by path loads it too.
    m.sweep(unload_idle_s=1e-6)
    m.sweep(unload_idle_s=1e-6)
    assert not m.ops.layers_by_slot
    drop_page_cache()
    for path, data in files.items():
        assert (root / path).read_bytes() == data
    assert sorted(os.listdir(root / "dir")) == sorted(p.split("/")[1] for p in files)


def test_a_pruned_layer_gives_its_space_back(
    small_tmpfs: Callable[[int], Path], mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    disk = small_tmpfs(64 << 20)
    store = LayerStore(disk / "store")
    data = random.Random(53).randbytes(16 << 20)
    blob = _gzip_layer({"weights.bin": data})
    m = mount_layers({}, store.root)
    baseline = os.statvfs(disk).f_bfree * os.statvfs(disk).f_frsize
    digest = add_layer(store, tmp_path, blob, SPAN)
    m.blobs[digest] = Blob(blob)
    name = digest.split(":")[1]
    assert (m.layer(digest) / "weights.bin").read_bytes() == data
    assert metric("bootseer_fs_cache_bytes") >= len(data)

    def free() -> int:
        st = os.statvfs(disk)
        return st.f_bfree * st.f_frsize

    # What the snapshotter's cleanup does once no snapshot uses the layer,
    # in a process of its own as there (LMDB opens an index once a process).
    pruned = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path; from snapshotter.fs.layers import LayerStore; "
            f"print(LayerStore(Path({str(store.root)!r})).prune(set(), 0))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert pruned.strip() == repr([name])
    # Removed, but the server still holds its cache file open.
    assert free() < baseline - len(data) // 2
    m.sweep()
    assert _open_fds_on(name) == 0
    # Back to where it started, but for the block index's pages.
    assert free() >= baseline - (256 << 10)
    assert not m.ops.layers_by_slot and os.listdir(m.mountpoint) == []
    assert metric("bootseer_fs_cache_bytes") < len(data)


@pytest.fixture
def bind_mounts(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """Read-only bind mounts, unmounted before the layer mounts go (request
    it after mount_layers)."""
    made: list[Path] = []

    def bind(source: Path) -> Path:
        target = tmp_path / f"view{len(made)}"
        target.mkdir()
        subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(target)], check=True)
        made.append(target)
        return target

    yield bind
    for target in reversed(made):
        subprocess.run(["umount", str(target)], check=True)


def test_records_of_earlier_versions_are_sized_from_the_layer_index(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    (digest, _, _), *_ = _layers(store, tmp_path, 1, 3 * SPAN, seed=59)
    name = digest.split(":")[1]
    index, source = store.load(name)
    block_index = BlockIndex(store.block_index_path)
    try:
        # What earlier versions wrote: state and crc only.
        with block_index._env.begin(write=True) as txn:
            for n in (0, 2):
                txn.put(bytes.fromhex(source.cache_key) + struct.pack(">I", n), struct.pack(">BI", 1, 7))
        cache = BlockCache(store, block_index, 0, trio.Lock())
        cache.load()
        sizes = {n: index.blocks[n].uend - index.blocks[n].ustart for n in (0, 2)}
        assert cache.total == sum(sizes.values())
        assert {n: (r.offset, r.size, r.crc32) for n, r in block_index.cached(source.cache_key).items()} == {
            n: (index.blocks[n].ustart, size, 7) for n, size in sizes.items()
        }
    finally:
        block_index.close()
