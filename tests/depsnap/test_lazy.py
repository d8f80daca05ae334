"""Lazy restore: an image read from the store through depsnap's FUSE server,
with real mounts (FUSE, erofs, overlay) and a real nginx for the store that
goes away."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from depsnap import image as image_mod
from depsnap import layout, lazy, snapshot
from depsnap.cache import Cache
from depsnap.format import Chunk, CorruptSnapshot, Manifest, header, pack
from depsnap.store import StoreUnavailable
from tests.depsnap.conftest import Work
from tests.harness.nginx import Nginx, remove, start_nginx
from tests.harness.procs import pid_alive, wait_until

KEY = "ab" * 32
CHUNK = 64 << 10


def manifest_of(sizes: list[int]) -> Manifest:
    chunks = [Chunk(length=10 + i, size=size, sha256="") for i, size in enumerate(sizes)]
    return Manifest(KEY, "env", sum(sizes), sizes[0], chunks)


def test_spans_place_every_chunk_in_the_image_and_the_file() -> None:
    found = lazy.spans(manifest_of([100, 100, 40]), data_offset=7)
    assert [(s.image_offset, s.size, s.stored_offset, s.length) for s in found] == [
        (0, 100, 7, 10),
        (100, 100, 17, 11),
        (200, 40, 28, 12),
    ]


def test_covering_names_the_chunks_a_read_touches() -> None:
    manifest = manifest_of([100, 100, 40])
    assert lazy.covering(manifest, 0, 1) == range(1)
    assert lazy.covering(manifest, 99, 2) == range(2)
    assert lazy.covering(manifest, 150, 1000) == range(1, 3)
    assert lazy.covering(manifest, 240, 10) == range(0)
    assert lazy.covering(manifest, 0, 0) == range(0)


def test_verified_refuses_a_frame_that_does_not_match() -> None:
    data = os.urandom(1000)
    frame = zstandard.ZstdCompressor().compress(data)
    span = lazy.Span(0, 0, 1000, 0, len(frame), hashlib.sha256(data).hexdigest())
    assert lazy.verified(frame, span) == data
    with pytest.raises(CorruptSnapshot):
        lazy.verified(zstandard.ZstdCompressor().compress(os.urandom(1000)), span)
    with pytest.raises(CorruptSnapshot):
        lazy.verified(frame[:-3], span)


@dataclass
class Published:
    store: Path
    image: bytes
    files: dict[str, bytes]

    def chunk_of(self, name: str) -> int:
        return self.image.index(self.files[name][:4096]) // CHUNK

    def corrupt_chunk(self, index: int) -> None:
        path = self.store / f"{KEY}.dsnap"
        with open(path, "rb") as f:
            manifest_length = int.from_bytes(f.read(16)[8:], "little")
            manifest = Manifest.from_bytes(f.read(manifest_length))
        offset = 16 + manifest_length + sum(c.length for c in manifest.chunks[:index])
        data = bytearray(path.read_bytes())
        data[offset + manifest.chunks[index].length // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def publish_tree(work: Work, middle: int = 300 << 10) -> Published:
    """A small tree as a snapshot of many chunks in a directory store."""
    tree = work.root / "tree"
    tree.mkdir()
    # Incompressible, so each file spans several chunks of its own; mkfs.erofs
    # lays files out in name order.
    sizes = {"1-first": 300 << 10, "2-middle": middle, "3-last": 300 << 10}
    files = {name: os.urandom(size) for name, size in sizes.items()}
    for name, data in files.items():
        (tree / name).write_bytes(data)
    image = work.root / "image.erofs"
    image_mod.build(tree, image)
    manifest = Manifest(KEY, "env", 0, CHUNK)
    body = work.root / "body"
    with open(image, "rb") as src, open(body, "wb") as out:
        pack(src, out, manifest)
    work.store.mkdir(exist_ok=True)
    (work.store / f"{KEY}.dsnap").write_bytes(header(manifest) + body.read_bytes())
    return Published(work.store, image.read_bytes(), files)


def server_pid(target: Path) -> int:
    return int((layout.side_dir(target) / "server.pid").read_text())


def server_log(target: Path) -> list[dict[str, object]]:
    """The lazy server's log file, one JSON record a line."""
    return [json.loads(line) for line in (layout.side_dir(target) / "server.log").read_text().splitlines()]


def logged(target: Path, event: str, level: str) -> bool:
    return any(r["event"] == event and r["level"] == level and "timestamp" in r for r in server_log(target))


def release_and_check(target: Path) -> None:
    pid = server_pid(target)
    snapshot.release(target)
    assert not target.exists() and not layout.side_dir(target).exists()
    assert not pid_alive(pid), "the lazy server outlived its mount"


def read_error(path: Path) -> int | None:
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno
    return None


def test_lazy_restore_serves_verified_bytes_and_fills_the_node_cache(work: Work) -> None:
    published = publish_tree(work)
    cache = Cache(work.cache, 1 << 30)
    target = work.root / "env"
    snapshot.restore_lazily(str(published.store), cache, target, KEY)
    for name, data in published.files.items():
        assert (target / name).read_bytes() == data
    wait_until(lambda: cache.lookup(KEY) is not None, 30, "the node cache to fill")
    image = cache.lookup(KEY)
    assert image is not None and image.read_bytes() == published.image
    wait_until(lambda: logged(target, "image complete, now in the node cache", "info"), 30, "the log line")
    release_and_check(target)
    assert list(cache.tmp.iterdir()) == []


def test_corrupt_chunk_is_never_served(work: Work) -> None:
    published = publish_tree(work)
    bad = published.chunk_of("3-last") + 1
    published.corrupt_chunk(bad)
    cache = Cache(work.cache, 1 << 30)
    target = work.root / "env"
    snapshot.restore_lazily(str(published.store), cache, target, KEY)
    remote_image = layout.side_dir(target) / "remote" / lazy.IMAGE_NAME
    with open(remote_image, "rb") as f:
        with pytest.raises(OSError) as caught:
            os.pread(f.fileno(), 4096, bad * CHUNK)
        assert caught.value.errno == errno.EIO
        # Its neighbours verify and read.
        assert (
            os.pread(f.fileno(), 4096, (bad - 1) * CHUNK)
            == published.image[(bad - 1) * CHUNK : (bad - 1) * CHUNK + 4096]
        )
    assert (target / "1-first").read_bytes() == published.files["1-first"]
    assert read_error(target / "3-last") == errno.EIO
    assert logged(target, "chunk unavailable, answering EIO", "error")
    # The background fill finds it too: the snapshot leaves the store, so the
    # next node installs and republishes, and the image never enters the cache.
    wait_until(lambda: not (published.store / f"{KEY}.dsnap").exists(), 30, "the delete")
    assert cache.lookup(KEY) is None
    release_and_check(target)
    assert list(cache.tmp.iterdir()) == [] and cache.lookup(KEY) is None


@pytest.fixture
def slow_store(work: Work) -> Iterator[tuple[str, Nginx]]:
    """nginx serving the store at 1 MB/s per connection: the fill takes seconds."""
    work.store.mkdir(exist_ok=True)
    server = start_nginx(work.store, limit_rate=1_000_000, access_log=False, autoindex=False, parent=work.root)
    try:
        yield server.url, server
    finally:
        remove(server)


def test_store_going_away_mid_restore_gives_eio_never_wrong_bytes(work: Work, slow_store: tuple[str, Nginx]) -> None:
    url, nginx = slow_store
    # "3-last" lies megabytes past "1-first": beyond what reading "1-first" fetches.
    published = publish_tree(work, middle=6 << 20)
    cache = Cache(work.cache, 1 << 30)
    target = work.root / "env"
    snapshot.restore_lazily(url, cache, target, KEY)
    assert (target / "1-first").read_bytes() == published.files["1-first"]
    nginx.stop()
    assert read_error(target / "3-last") == errno.EIO
    # What arrived before stays readable; the half image never enters the cache.
    assert (target / "1-first").read_bytes() == published.files["1-first"]
    assert cache.lookup(KEY) is None
    release_and_check(target)
    assert list(cache.tmp.iterdir()) == [] and cache.lookup(KEY) is None


def test_absent_snapshot_starts_no_server(work: Work) -> None:
    work.store.mkdir()
    target = work.root / "env"
    with pytest.raises(StoreUnavailable):
        snapshot.restore_lazily(str(work.store), Cache(work.cache, 1 << 30), target, KEY)
    assert not target.exists() and not layout.side_dir(target).exists()
    mounts = subprocess.run(["findmnt", "-rn", "-R", str(work.root)], capture_output=True, check=False)
    assert mounts.stdout == b""
