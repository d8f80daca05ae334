"""A real FUSE mount of the layer server, run in a thread of the test process
so tests can give it a blob source of their choosing and count what it
fetches. (The registry path is covered end to end in tests/lazy.)"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import subprocess
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import prometheus_client
import pytest
import trio

from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.fusewire.mount import MountOptions
from snapshotter.fs.fusewire.mount import mount as fuse_mount
from snapshotter.fs.fusewire.session import Session, SessionConfig
from snapshotter.fs.layerfs import LayerFS
from snapshotter.fs.layers import LayerSource, LayerStore
from snapshotter.fs.reader import LayerReader, RangeFetcher
from snapshotter.layer.build import build_index
from tests.harness.procs import wait_until


@dataclass
class Blob:
    """A layer blob served to the FUSE server from memory, with a fault switch."""

    data: bytes
    fetched: list[tuple[int, int]] = field(default_factory=list)
    corrupt: bool = False
    down: bool = False

    def fetch(self, start: int, end: int) -> bytes:
        if self.down:
            raise ConnectionError("registry unreachable")
        self.fetched.append((start, end))
        chunk = self.data[start:end]
        if self.corrupt:
            chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
        return chunk

    @property
    def bytes_fetched(self) -> int:
        return sum(e - s for s, e in self.fetched)


@dataclass
class Events:
    """The hot-block tracker as LayerFS sees it (layerfs.BlockEvents): every
    block read, and manifests that cover the layers in `covered`."""

    covered: set[str] = field(default_factory=set)
    accessed: set[tuple[str, int]] = field(default_factory=set)

    def access(self, layer: str, block: int, extent: int) -> None:
        self.accessed.add((layer, block))

    def records(self, layer: str) -> bool:
        return False

    async def notify(self, name: str, request: object = None) -> None:
        pass

    async def covers(self, layer: str) -> bool:
        return layer in self.covered


@dataclass
class Mounted:
    mountpoint: Path
    store: LayerStore
    blobs: dict[str, Blob]
    thread: threading.Thread
    ops: LayerFS
    # The server's trio loop, for calls into it from the test (a sweep, say).
    token: trio.lowlevel.TrioToken

    def layer(self, digest: str) -> Path:
        return self.mountpoint / digest.split(":")[1]

    def sweep(self, unload_idle_s: float | None = None) -> None:
        """One sweep of the server now, as its maintenance loop would do."""
        trio.from_thread.run(self.ops.sweep, unload_idle_s, trio_token=self.token)


def make_layer(members: list[tuple[tarfile.TarInfo, bytes | None]], compress: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    raw = buf.getvalue()
    return gzip.compress(raw, 6, mtime=0) if compress else raw


def add_layer(store: LayerStore, tmp: Path, blob: bytes, span: int) -> str:
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    path = tmp / digest.split(":")[1]
    path.write_bytes(blob)
    index = build_index(path, digest, span=span)
    store.add(index.header, LayerSource(ref="127.0.0.1:1/test/layer", digest=digest), index.encode())
    return digest


def make_reader(
    tmp_path: Path,
    blob: bytes,
    fetch: RangeFetcher,
    span: int,
    store_dir: Path | None = None,
    block_index_path: Path | None = None,
) -> LayerReader:
    """A LayerReader over `blob`, indexed at `span` into a layer store (at
    `store_dir`, else under tmp_path), fetching through `fetch`; no FUSE."""
    store = LayerStore(store_dir or tmp_path / "store")
    name = add_layer(store, tmp_path, blob, span).split(":")[1]
    index, source = store.load(name)
    return LayerReader(
        name,
        source.cache_key,
        index,
        store.cache_path(name),
        BlockIndex(block_index_path or store.block_index_path),
        fetch,
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(1),
        trio.CapacityLimiter(4),
    )


def metric(name: str, **labels: str) -> float:
    """The layer server's metric in this process (it runs in a thread here)."""
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the filesystem of `directory` up, but for `leave` bytes."""
    filler = directory / "filler"
    chunk = b"\xff" * (64 << 10)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    os.truncate(filler, max(filler.stat().st_size - leave, 0))
    return filler


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """tmpfs mounts of a given size under tmp_path: a disk that fills up,
    and a filesystem without RWF_NOWAIT. Request it before mount_layers, so
    the layer servers using it stop before it is unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        path = tmp_path / f"tmpfs{len(mounted)}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def mount_layers(tmp_path: Path) -> Iterator[Callable[..., Mounted]]:
    if os.geteuid() != 0:
        pytest.skip("FUSE mounts need root here")
    mounted: list[Mounted] = []

    def mount(
        blobs: dict[str, Blob],
        store_dir: Path | None = None,
        background_bandwidth: int = 0,
        whole_layer_bytes: int = 0,
        cache_max_bytes: int = 0,
        unload_idle_s: float = 0.0,
        maintain: bool = False,
        unpack_whole_layers: bool = False,
        blocks_after_miss: int = 0,
        getxattr: bool = True,
    ) -> Mounted:
        store = LayerStore(store_dir or tmp_path / "store")
        block_index = BlockIndex(store.block_index_path)
        mountpoint = tmp_path / f"m{len(mounted)}"
        mountpoint.mkdir()
        ops = LayerFS(
            store,
            block_index,
            lambda source: blobs[source.digest].fetch,
            background_bandwidth=background_bandwidth,
            whole_layer_bytes=whole_layer_bytes,
            cache_max_bytes=cache_max_bytes,
            unload_idle_s=unload_idle_s,
            mountpoints=[mountpoint],
            unpack_whole_layers=unpack_whole_layers,
            blocks_after_miss=blocks_after_miss,
        )
        if ops.unpacker is not None:
            # Tests read nothing once the layer is whole: no need to wait long.
            ops.unpacker.quiet_s = 0.2
        fd = fuse_mount(mountpoint, MountOptions(fsname="bootseer-test", subtype="bootseer-test"))
        session = Session(ops, fd, SessionConfig(getxattr=getxattr))

        tokens: list[trio.lowlevel.TrioToken] = []

        async def serve() -> None:
            tokens.append(trio.lowlevel.current_trio_token())
            async with trio.open_nursery() as nursery:
                if ops.background is not None:
                    nursery.start_soon(ops.background.run)
                if ops.unpacker is not None:
                    nursery.start_soon(ops.unpacker.run)
                if maintain:
                    nursery.start_soon(ops.maintain)
                await session.serve()
                nursery.cancel_scope.cancel()

        def run() -> None:
            try:
                trio.run(serve)
            finally:
                os.close(fd)
                ops.close()
                block_index.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_until(lambda: os.path.ismount(mountpoint), 10, "the FUSE mount")
        m = Mounted(mountpoint, store, blobs, thread, ops, tokens[0])
        mounted.append(m)
        return m

    yield mount
    for m in mounted:
        unmount(m)


def unmount(m: Mounted) -> None:
    # os.path.ismount cannot tell a mount whose server died (ENOTCONN): it
    # must go too.
    with open("/proc/self/mountinfo") as mountinfo:
        mounted = str(m.mountpoint) in {line.split()[4] for line in mountinfo}
    if mounted:
        subprocess.run(["fusermount3", "-u", str(m.mountpoint)], check=True)
    m.thread.join(timeout=10)
