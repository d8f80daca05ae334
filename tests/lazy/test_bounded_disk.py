"""Bounded disk end to end: a node whose layer store has a filesystem of its
own (a tmpfs) and a capped block cache, containers reading lazily served
layers from a real registry through containerd and runc."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.containerd import start_containerd
from tests.harness.layerserver import LayerServer, LazyConfig
from tests.harness.lazynode import LazyNode, stop_lazy_node
from tests.harness.oci import File, ImageBuilder, busybox_layer
from tests.harness.procs import wait_until
from tests.harness.registry import Registry
from tests.harness.snapshotter import Snapshotter, start_snapshotter
from tests.harness.tree import drop_page_cache

pytestmark = pytest.mark.integration

CAP = 16 << 20
# At least the most a block takes: bootseer index's default span is 1 MiB
# (DEFAULT_SPAN), and a block is its span plus at most one deflate block.
BLOCK = 4 << 20
STORE_SIZE = 256 << 20
# What the layer store keeps of a removed image: the block index's pages,
# the image's request file.
KEPT = 1 << 20


@dataclass
class CappedConfig(LazyConfig):
    cache_max_bytes: int = CAP
    # Layers stay loaded: this test is about disk.
    unload_idle_s: float = 0.0

    def write(self) -> Path:
        path = super().write()
        extra = f"cache_max_bytes = {self.cache_max_bytes}\nunload_idle_s = {self.unload_idle_s}\n"
        path.write_text(path.read_text().replace("\n[registry]\n", f"{extra}\n[registry]\n", 1))
        return path


@pytest.fixture(scope="module")
def capped_node(registry: Registry) -> Iterator[LazyNode]:
    config = CappedConfig(Path(tempfile.mkdtemp(prefix="bs-fs-", dir="/tmp")), [registry.host], hot_blocks=False)
    config.store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_SIZE}", "tmpfs", str(config.store)], check=True)
    config.write()
    layers = LayerServer(config)
    snapshotter: Snapshotter | None = None
    try:
        layers.start()
        snapshotter = start_snapshotter(["--config", str(config.path)])
        containerd = start_containerd(snapshotter.address)
    except BaseException:
        if snapshotter is not None:
            snapshotter.teardown()
        # Unmounts the store's tmpfs too.
        layers.teardown()
        raise
    node = LazyNode(layers, snapshotter, containerd)
    yield node
    # The layer server's teardown unmounts everything under its workdir, the tmpfs included.
    stop_lazy_node(node)


def _free(store: Path) -> int:
    st = os.statvfs(store)
    return st.f_bfree * st.f_frsize


def _cache_allocated(store: Path) -> int:
    total = 0
    for cache in store.glob("*/cache"):
        try:
            total += os.stat(cache).st_blocks * 512
        except FileNotFoundError:
            continue
    return total


class _Peak:
    """The most the cache files took on disk while it ran (sampled)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _cache_allocated(self.store))

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _cache_allocated(self.store))


def test_a_capped_cache_serves_more_than_it_holds_and_image_removal_frees_the_disk(
    capped_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    node, store = capped_node, capped_node.layers.config.store
    baseline = _free(store)
    weights = random.Random(61).randbytes(48 << 20)
    image = images.push(
        f"lazy/capped-{unique}", [busybox_layer(), [File("/weights.bin", weights)]], cmd=["/bin/sleep", "600"]
    )
    node.index(image.ref)
    node.pull(image.ref)
    c = node.containerd
    expected = hashlib.sha256(weights).hexdigest()

    # Three times the cap, read in a container: every byte right, the cache
    # never above the cap plus a block, evicted blocks fetched again.
    with _Peak(store) as peak:
        out = c.run(image.ref, f"capped-{unique}", "/bin/sha256sum", "/weights.bin")
    assert out.split()[0] == expected
    assert peak.peak <= CAP + BLOCK, peak.peak
    assert node.layers.metric("bootseer_fs_evicted_blocks_total") > 0
    assert node.layers.metric("bootseer_fs_cache_bytes") <= CAP
    fetched = node.layers.metric("bootseer_fs_fetched_bytes_total")
    # A new container's page cache is the same files': drop it, so the
    # second read reaches the layer server.
    drop_page_cache()
    with _Peak(store) as peak:
        out = c.run(image.ref, f"capped2-{unique}", "/bin/sha256sum", "/weights.bin")
    assert out.split()[0] == expected
    assert peak.peak <= CAP + BLOCK, peak.peak
    assert node.layers.metric("bootseer_fs_fetched_bytes_total") - fetched > len(weights) // 2

    # Removing the image: containerd's GC removes its snapshots, the
    # snapshotter's cleanup its stored layers, the layer server closes
    # them, and the store's filesystem is back where it started.
    assert _free(store) < baseline - CAP // 2
    c.ctr("images", "rm", "--sync", image.ref)
    wait_until(lambda: _free(store) >= baseline - KEPT, 30, "the removed image's cache space to come back")
    assert not list(store.glob("*/cache"))
    assert node.layers.metric("bootseer_fs_layer_unloads_total") >= 1
