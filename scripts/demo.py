"""`make demo`: a local registry, containerd, the bootseer snapshotter and
layer server under temp dirs; build and push a training-like image, then
start it three ways and print where the time went:

1. containerd's overlayfs snapshotter: full pull, then run;
2. bootseer, lazily: only the blocks the start reads are fetched;
3. bootseer on a second node, after the first run published its hot blocks.

Everything is stopped and unmounted at the end."""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

from tests.harness.lazynode import LazyNode, start_lazy_node, stop_lazy_node
from tests.harness.oci import Dir, File, ImageBuilder, Layer, busybox_layer
from tests.harness.registry import start_registry

T = TypeVar("T")
WEIGHTS_MB = 192
timings: list[tuple[str, float]] = []


@contextmanager
def step(what: str) -> Iterator[None]:
    print(f"-> {what} ...", flush=True)
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    timings.append((what, elapsed))
    print(f"   {elapsed:.2f}s", flush=True)


def timed(what: str, fn: Callable[[], T]) -> T:
    with step(what):
        return fn()


def demo_layers() -> list[Layer]:
    rng = random.Random(7)
    deps: Layer = [Dir("/opt"), Dir("/opt/deps")] + [
        File(f"/opt/deps/lib{i:02d}.so", rng.randbytes(1 << 20), mode=0o755) for i in range(24)
    ]
    model: Layer = [
        Dir("/model"),
        File("/model/config.json", b'{"model": "tiny", "layers": 4}\n'),
        *[File(f"/model/shard-{i}.bin", rng.randbytes(WEIGHTS_MB // 4 << 20)) for i in range(4)],
    ]
    app: Layer = [
        Dir("/app"),
        File(
            "/app/start.sh",
            b"#!/bin/sh\ncat /model/config.json >/dev/null\ncat /opt/deps/lib00.so >/dev/null\n"
            b"head -c 4194304 /model/shard-0.bin | sha256sum >/dev/null\necho READY\n",
            mode=0o755,
        ),
    ]
    return [busybox_layer(), deps, model, app]


def fetched_mb(node: LazyNode) -> float:
    return node.layers.metric("bootseer_fs_fetched_bytes_total") / 1e6


def main() -> int:
    if os.geteuid() != 0:
        print("make demo needs root (containerd, runc, FUSE and overlay mounts)", file=sys.stderr)
        return 1
    with ExitStack() as stack:
        registry = timed("start docker-registry on 127.0.0.1", start_registry)
        stack.callback(registry.stop)
        node1 = timed("start node 1: layer server, snapshotter, containerd", lambda: start_lazy_node(registry.host))
        stack.callback(stop_lazy_node, node1)
        node2 = timed("start node 2 (same registry)", lambda: start_lazy_node(registry.host))
        stack.callback(stop_lazy_node, node2)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bs-demo-", dir="/tmp")))
        builder = ImageBuilder(registry.host, workdir)
        image = timed(
            f"build and push a 4-layer image with {WEIGHTS_MB} MB of weights",
            lambda: builder.push("demo/train", demo_layers(), cmd=["/app/start.sh"]),
        )
        size_mb = sum(image.layout.layer_sizes) / 1e6
        timed("bootseer index (once per image)", lambda: node1.index(image.ref))

        c1 = node1.containerd
        with step("overlayfs: ctr images pull + ctr run until READY"):
            c1.ctr("images", "pull", "--plain-http", "--snapshotter", "overlayfs", image.ref)
            out = c1.run(image.ref, "demo-overlayfs", snapshotter="overlayfs")
        print(f"   container said {out.strip()!r}; fetched {size_mb:.0f} MB")

        before = fetched_mb(node1)
        with step("bootseer lazy: bootseer pull + ctr run until READY"):
            node1.pull(image.ref)
            out = c1.run(image.ref, "demo-lazy")
        print(f"   container said {out.strip()!r}; fetched {fetched_mb(node1) - before:.1f} MB of {size_mb:.0f} MB")

        with step("node 1 records the blocks that run read and publishes them"):
            deadline = time.monotonic() + 60
            while node1.bootseer("record", "show", image.ref, check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("node 1 published no hot-block manifest")
                time.sleep(0.5)

        with step("bootseer on node 2, prefetching the hot blocks: bootseer pull + ctr run until READY"):
            node2.pull(image.ref)
            out = node2.containerd.run(image.ref, "demo-prefetch")
        print(f"   container said {out.strip()!r}; fetched {fetched_mb(node2):.1f} MB of {size_mb:.0f} MB")

        print("\ntimings:")
        for what, seconds in timings:
            print(f"  {seconds:8.2f}s  {what}")
    print("cleaned up: every process stopped by PID, every mount removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
