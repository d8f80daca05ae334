"""The layer server's metrics for alerts, over real mounts and readers: FUSE
request times by operation, reads waiting on the registry, and fetched
bytes by image."""

from __future__ import annotations

import hashlib
import os
import random
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import prometheus_client
import trio

from snapshotter.fs import control, metrics
from snapshotter.fs.blockindex import BlockIndex
from snapshotter.fs.layers import LayerStore
from snapshotter.fs.reader import LayerReader, Origin
from tests.fs.conftest import Blob, Mounted, add_layer, make_layer, metric
from tests.harness.procs import wait_until

SPAN = 256 << 10
# Not "open": the kernel sends OPEN once a connection (answered ENOSYS), then opens files itself.
OPS = ("lookup", "getattr", "read", "statfs")


def _layer(name: str, size: int, seed: int) -> tuple[bytes, bytes]:
    data = random.Random(seed).randbytes(size)
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime = len(data), 1_700_000_000
    return make_layer([(ti, data)]), data


def _image(seed: str) -> str:
    return "sha256:" + hashlib.sha256(seed.encode()).hexdigest()


def _announce(m: Mounted, image: str, layers: list[str]) -> None:
    """What the snapshotter's Prepare does: write the image's request, then poke the server."""
    control.write_request(m.store, control.ImageRequest(ref="127.0.0.1:1/test/image", image=image, layers=layers))
    control.notify(m.mountpoint, image.split(":")[1])


def _image_bytes(image: str, prefetched: bool = False) -> float:
    name = "bootseer_fs_image_prefetched_bytes_total" if prefetched else "bootseer_fs_image_fetched_bytes_total"
    return metric(name, image=image)


def _sample(name: str, **labels: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_every_request_is_timed_by_operation(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    blob, data = _layer("weights", 1 << 20, 41)
    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    m = mount_layers({digest: Blob(blob)}, tmp_path / "store")
    before = {op: metric("bootseer_fs_op_seconds_count", op=op) for op in OPS}
    sums = {op: metric("bootseer_fs_op_seconds_sum", op=op) for op in OPS}
    assert (m.layer(digest) / "weights").read_bytes() == data
    os.statvfs(m.mountpoint)
    for op in OPS:
        assert metric("bootseer_fs_op_seconds_count", op=op) > before[op], op
        assert metric("bootseer_fs_op_seconds_sum", op=op) > sums[op], op
    # A histogram: every request lands in the +Inf bucket, and the buckets add up.
    count = metric("bootseer_fs_op_seconds_count", op="read")
    assert metric("bootseer_fs_op_seconds_bucket", op="read", le="+Inf") == count
    assert metric("bootseer_fs_op_seconds_bucket", op="read", le="30.0") <= count


@dataclass
class GatedBlob(Blob):
    """A blob whose fetches wait until the gate opens."""

    gate: threading.Event = field(default_factory=threading.Event)

    def fetch(self, start: int, end: int) -> bytes:
        self.gate.wait()
        return super().fetch(start, end)


def test_reads_waiting_on_the_registry_are_counted(mount_layers: Callable[..., Mounted], tmp_path: Path) -> None:
    blob, data = _layer("weights", 1 << 20, 43)
    digest = add_layer(LayerStore(tmp_path / "store"), tmp_path, blob, SPAN)
    source = GatedBlob(blob)
    m = mount_layers({digest: source}, tmp_path / "store")
    waited = metric("bootseer_fs_read_wait_seconds_count")
    path = m.layer(digest) / "weights"
    assert path.stat().st_size == len(data)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(path.read_bytes()))
    reader.start()
    try:
        wait_until(lambda: metric("bootseer_fs_read_waits") >= 1, 10, "a read waiting on the registry")
    finally:
        source.gate.set()
        reader.join(timeout=30)
    assert got == [data]
    wait_until(lambda: metric("bootseer_fs_read_waits") == 0, 10, "no read waiting any more")
    assert metric("bootseer_fs_read_wait_seconds_count") > waited
    # Cached now: reading again waits on nothing.
    waited = metric("bootseer_fs_read_wait_seconds_count")
    assert path.read_bytes() == data
    assert metric("bootseer_fs_read_wait_seconds_count") == waited


def test_fetched_bytes_count_for_the_image_last_prepared_with_the_layer(
    mount_layers: Callable[..., Mounted], tmp_path: Path
) -> None:
    store = LayerStore(tmp_path / "store")
    base_blob, base = _layer("base", 1 << 20, 47)
    top_blob, top = _layer("top", 1 << 20, 53)
    base_digest, top_digest = add_layer(store, tmp_path, base_blob, SPAN), add_layer(store, tmp_path, top_blob, SPAN)
    sources = {base_digest: Blob(base_blob), top_digest: Blob(top_blob)}
    m = mount_layers(sources, tmp_path / "store")
    one, two = _image(f"one-{tmp_path}"), _image(f"two-{tmp_path}")

    _announce(m, one, [base_digest, top_digest])
    assert (m.layer(top_digest) / "top").read_bytes() == top
    wait_until(
        lambda: _image_bytes(one) == sources[top_digest].bytes_fetched > 0, 10, "image one's bytes to be counted"
    )
    # A second image with the same base: the base's fetches are its own now.
    _announce(m, two, [base_digest])
    assert (m.layer(base_digest) / "base").read_bytes() == base
    wait_until(
        lambda: _image_bytes(two) == sources[base_digest].bytes_fetched > 0, 10, "image two's bytes to be counted"
    )
    assert _image_bytes(one) == sources[top_digest].bytes_fetched
    assert _image_bytes(one, prefetched=True) == _image_bytes(two, prefetched=True) == 0


def test_a_prefetch_counts_for_its_image(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    blob, _ = _layer("weights", 2 << 20, 59)
    digest = add_layer(store, tmp_path, blob, 64 << 10)
    name = digest.split(":")[1]
    index, source = store.load(name)
    images = metrics.ImageBytes()
    mine, other = _image(f"mine-{tmp_path}"), _image(f"other-{tmp_path}")
    images.announce(mine, [digest])
    images.announce(other, [digest])
    source_blob = Blob(blob)
    block_index = BlockIndex(store.block_index_path)
    reader = LayerReader(
        name,
        source.cache_key,
        index,
        store.cache_path(name),
        block_index,
        source_blob.fetch,
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(4),
        trio.CapacityLimiter(1),
        trio.CapacityLimiter(4),
        on_fetched=images.fetched,
    )
    try:
        _prefetch_then_read(reader, source_blob, mine, other)
    finally:
        reader.close()
        block_index.close()


def _prefetch_then_read(reader: LayerReader, source_blob: Blob, mine: str, other: str) -> None:
    index = reader.index
    hot = [1, 2, 3, 7]
    trio.run(reader.ensure, hot, Origin.HOT, None, mine)
    size = sum(index.blocks[n].cend - index.blocks[n].cstart for n in hot)
    # The prefetch's own image, not the one announced last with the layer.
    assert _image_bytes(mine, prefetched=True) == size
    # Counted by block like bootseer_fs_prefetched_bytes_total; fetched, by Range request.
    assert _image_bytes(mine) == source_blob.bytes_fetched > 0
    assert _image_bytes(other) == _image_bytes(other, prefetched=True) == 0
    # A reader's miss knows no image: the layer's last announced one.
    prefetched = source_blob.bytes_fetched
    trio.run(reader.read, index.blocks[5].ustart, index.blocks[5].ustart + 10)
    assert _image_bytes(other) == source_blob.bytes_fetched - prefetched > 0
    assert _image_bytes(other, prefetched=True) == 0


def test_only_the_latest_images_keep_series(tmp_path: Path) -> None:
    images = metrics.ImageBytes(max_images=2)
    layer, shared = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    first, second, third = (_image(f"{n}-{tmp_path}") for n in ("first", "second", "third"))
    images.announce(first, [layer, shared])
    images.fetched(layer, 100)
    assert _image_bytes(first) == 100
    images.announce(second, [shared])
    images.announce(third, [shared])
    # The oldest image's series are gone; its layers count for no one, or
    # for the latest image that still has them.
    assert _sample("bootseer_fs_image_fetched_bytes_total", image=first) is None
    assert _sample("bootseer_fs_image_prefetched_bytes_total", image=first) is None
    images.fetched(layer, 100)
    images.fetched(shared, 10)
    assert _image_bytes(third) == 10 and _image_bytes(second) == 0
    # A prefetch for a forgotten image counts for the layer's image instead.
    images.fetched(shared, 5, image=first, prefetched=True)
    assert _image_bytes(third, prefetched=True) == 5
    assert _sample("bootseer_fs_image_fetched_bytes_total", image=first) is None
