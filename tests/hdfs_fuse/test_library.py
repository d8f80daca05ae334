"""The library against local files (file://, through pyarrow.fs, the code path
HDFS uses): every byte checked against the file itself."""

from __future__ import annotations

import errno
import io
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import hdfs_fuse
from hdfs_fuse.cache import DiskCache
from hdfs_fuse.copy import copy
from hdfs_fuse.reader import Client
from tests.hdfs_fuse.conftest import STRIPE, Tree, small_config


def uri(tree: Tree, name: str) -> str:
    return f"file://{tree.root}/{name}"


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with Client(small_config()) as c:
        yield c


def test_whole_files_read_back_exactly(tree: Tree, client: Client) -> None:
    for name, data in tree.files.items():
        with client.open(uri(tree, name)) as f:
            assert f.size == len(data)
            assert f.read() == data, name
            assert f.read() == b""  # EOF stays EOF


def test_random_offsets_and_sizes(tree: Tree, client: Client) -> None:
    rng = random.Random(1)
    data = tree.files["big.bin"]
    with client.open(uri(tree, "big.bin")) as f:
        for _ in range(300):
            offset = rng.randrange(0, len(data) + 10)
            size = rng.choice([1, 17, 4096, STRIPE - 1, STRIPE, STRIPE + 1, 3 * STRIPE + 5])
            assert f.pread(size, offset) == data[offset : offset + size], (offset, size)


def test_reads_crossing_stripe_boundaries(tree: Tree, client: Client) -> None:
    data = tree.files["odd.bin"]
    with client.open(uri(tree, "odd.bin")) as f:
        for boundary in (STRIPE, 2 * STRIPE, 3 * STRIPE):
            for before, after in ((1, 1), (100, 5000), (STRIPE, STRIPE)):
                f.seek(boundary - before)
                assert f.read(before + after) == data[boundary - before : boundary + after]


def test_file_object_protocol(tree: Tree, client: Client) -> None:
    data = tree.files["odd.bin"]
    with client.open(uri(tree, "odd.bin")) as f:
        assert f.readable() and f.seekable() and not f.writable()
        assert f.seek(-10, io.SEEK_END) == len(data) - 10
        assert f.read(100) == data[-10:]
        assert f.tell() == len(data)
        f.seek(5)
        f.seek(10, io.SEEK_CUR)
        buf = bytearray(20)
        assert f.readinto(buf) == 20 and bytes(buf) == data[15:35]
        assert f.pread(10, 0) == data[:10] and f.tell() == 35  # pread leaves the position
        f.seek(len(data) + 100)
        assert f.read(10) == b""
        with pytest.raises(ValueError):
            f.seek(-1)
        # BufferedReader on top works too (what many frameworks wrap files in).
    with io.BufferedReader(client.open(uri(tree, "odd.bin")), buffer_size=STRIPE // 3) as b:
        assert b.read(7) == data[:7] and b.read() == data[7:]
    with pytest.raises(ValueError):
        f.read(1)


def test_empty_file(tree: Tree, client: Client) -> None:
    with client.open(uri(tree, "empty.bin")) as f:
        assert f.size == 0 and f.read() == b"" and f.pread(10, 0) == b""
        assert f.stats.fetched_bytes == 0


def test_concurrent_readers_on_one_file(tree: Tree, client: Client) -> None:
    data = tree.files["big.bin"]
    with client.open(uri(tree, "big.bin")) as f:

        def check(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(60):
                offset = rng.randrange(0, len(data))
                size = rng.randrange(1, 2 * STRIPE)
                assert f.pread(size, offset) == data[offset : offset + size]

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(check, range(8)))


def test_concurrent_readers_on_many_files(tree: Tree, client: Client) -> None:
    names = [n for n in tree.files if tree.files[n]] * 3

    def read(name: str) -> bool:
        with client.open(uri(tree, name)) as f:
            chunks = []
            while chunk := f.read(STRIPE // 2 + 3):
                chunks.append(chunk)
        return b"".join(chunks) == tree.files[name]

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(read, names))


def test_random_access_fetches_only_the_stripes_it_touches(tree: Tree, client: Client) -> None:
    data = tree.files["big.bin"]
    stripes = list(range(1, 24, 3))  # never adjacent, never at the start
    random.Random(3).shuffle(stripes)
    touched: set[int] = set()
    with client.open(uri(tree, "big.bin")) as f:
        for stripe in stripes:
            offset = stripe * STRIPE + 1000
            size = STRIPE  # spills into the next stripe
            assert f.pread(size, offset) == data[offset : offset + size]
            touched |= {stripe, stripe + 1}
        assert sorted(f.stats.fetched_stripes) == sorted(touched)
        assert f.stats.readahead_waste_bytes == 0


def test_sequential_reads_are_served_by_readahead(tree: Tree, client: Client) -> None:
    data = tree.files["big.bin"]
    with client.open(uri(tree, "big.bin")) as f:
        out = b"".join(iter(lambda: f.read(64 * 1024), b""))
        stats = f.stats
    assert out == data
    assert sorted(stats.fetched_stripes) == list(range(25))  # each stripe once
    assert stats.readahead_hit_bytes > len(data) // 2
    assert stats.readahead_waste_bytes == 0


def test_memory_budget_bounds_buffered_stripes(tree: Tree) -> None:
    config = small_config(memory=4 * STRIPE, readahead=64 * STRIPE)
    with Client(config) as c:
        peak = 0
        with c.open(uri(tree, "big.bin")) as f:
            while f.read(STRIPE // 4):
                peak = max(peak, c.budget.used)
            assert f.stats.readahead_hit_bytes > 0
        # Read-ahead stops at the budget; demand may pass it by its own stripes.
        assert peak <= config.memory + STRIPE
        assert c.budget.used == 0


def test_missing_file_is_a_clear_error(tree: Tree, client: Client) -> None:
    with pytest.raises(FileNotFoundError):
        client.open(uri(tree, "nope.bin"))
    with pytest.raises(IsADirectoryError):
        client.open(uri(tree, "sub"))


def test_module_level_open(tree: Tree) -> None:
    with hdfs_fuse.open(uri(tree, "small.txt"), small_config()) as f:
        assert f.read() == tree.files["small.txt"]


def test_config_import_leaves_the_reader_unloaded() -> None:
    """Every CLI start imports bootseer.config, which holds `[hdfs_fuse]`
    settings: that must not load the reader, httpx, pyarrow or numpy."""
    heavy = ("hdfs_fuse.reader", "httpx", "pyarrow", "numpy")
    probe = f"import sys, bootseer.config; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    probe = "import hdfs_fuse; print(hdfs_fuse.open, hdfs_fuse.RemoteReadError.__mro__[1].__name__)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "function open" in result.stdout and "OSError" in result.stdout


def test_file_truncated_mid_read_is_eio_not_garbage(tmp_path: Path) -> None:
    path = tmp_path / "doomed.bin"
    data = random.Random(5).randbytes(8 * STRIPE)
    path.write_bytes(data)
    with Client(small_config(readahead=0)) as c, c.open(f"file://{path}") as f:
        assert f.read(STRIPE) == data[:STRIPE]
        with open(path, "r+b") as shrink:
            shrink.truncate(STRIPE + 10)
        with pytest.raises(hdfs_fuse.RemoteReadError) as caught:
            f.read(STRIPE)
        assert caught.value.errno == errno.EIO
        assert "doomed.bin" in str(caught.value)


def test_copy_directory_tree(tree: Tree, client: Client, tmp_path: Path) -> None:
    report = copy(client, f"file://{tree.root}", tmp_path / "out")
    assert report.files == len(tree.files)
    for name, data in tree.files.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    assert not list((tmp_path / "out").rglob(".*part*"))


def test_copy_single_file_into_a_directory(tree: Tree, client: Client, tmp_path: Path) -> None:
    copy(client, uri(tree, "odd.bin"), tmp_path)
    assert (tmp_path / "odd.bin").read_bytes() == tree.files["odd.bin"]


def test_disk_cache_serves_second_read_and_drops_corrupt_entries(tree: Tree, tmp_path: Path) -> None:
    config = small_config(cache_dir=str(tmp_path / "cache"))
    data = tree.files["odd.bin"]
    with Client(config) as c:
        with c.open(uri(tree, "odd.bin")) as f:
            assert f.read() == data
            assert f.stats.fetched_bytes == len(data)
        entries = sorted((tmp_path / "cache").glob("??/*"))
        assert len(entries) == 4
        # Flip a byte in one entry: it must be refetched, not served.
        victim = entries[0]
        blob = bytearray(victim.read_bytes())
        blob[-1] ^= 0xFF
        victim.write_bytes(bytes(blob))
        with c.open(uri(tree, "odd.bin")) as f:
            assert f.read() == data
            assert f.stats.cache_hit_bytes == len(data) - f.stats.fetched_bytes
            assert len(f.stats.fetched_stripes) == 1


def test_disk_cache_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=3 * 1100)
    for i in range(5):
        cache.put(f"{i:064x}", bytes(1000))
    kept = [i for i in range(5) if cache.get(f"{i:064x}", 1000) is not None]
    assert kept and kept == list(range(5 - len(kept), 5))
    assert sum(p.stat().st_size for p in tmp_path.glob("??/*")) <= 3 * 1100


def test_straggler_gets_a_second_read(tree: Tree) -> None:
    """A stripe read that hangs is raced by a second one, which wins."""
    data = tree.files["odd.bin"]
    with Client(small_config(stripe_timeout=0.2, readahead=0)) as c:
        reader = c.reader(uri(tree, "odd.bin"))
        real_read_at = reader.remote.read_at
        release = threading.Event()
        calls = []

        def first_call_hangs(offset: int, length: int) -> bytes | bytearray:
            calls.append(offset)
            if len(calls) == 1:
                release.wait(10)
            return real_read_at(offset, length)

        reader.remote.read_at = first_call_hangs  # type: ignore[method-assign]  # a stub for this one file's reads
        try:
            f = hdfs_fuse.StripedFile(reader)
            assert f.read(100) == data[:100]
            assert f.stats.hedges == 1
        finally:
            release.set()
            f.close()
