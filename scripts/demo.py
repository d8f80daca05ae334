"""`make demo`: a local registry, containerd and the bootseer snapshotter
under one temp dir; build and push an image, pull it and run it through
bootseer, print where the time went, clean everything up."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from tests.harness.containerd import start_containerd
from tests.harness.oci import Dir, File, ImageBuilder, busybox_layer
from tests.harness.registry import start_registry
from tests.harness.snapshotter import start_snapshotter

T = TypeVar("T")
timings: list[tuple[str, float]] = []


@contextmanager
def step(what: str) -> Iterator[None]:
    print(f"-> {what} ...", flush=True)
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    timings.append((what, elapsed))
    print(f"   done in {elapsed:.2f}s", flush=True)


def timed(what: str, fn: Callable[[], T]) -> T:
    with step(what):
        return fn()


def demo_layers() -> list[list[object]]:
    rng = random.Random(7)
    deps = [Dir("/opt"), Dir("/opt/deps")] + [
        File(f"/opt/deps/lib{i:02d}.so", rng.randbytes(1 << 20), mode=0o755) for i in range(24)
    ]
    app = [
        Dir("/app"),
        File("/app/config.json", b'{"model": "tiny", "layers": 4}\n'),
        File("/app/weights.bin", rng.randbytes(8 << 20)),
        File(
            "/app/start.sh",
            b"#!/bin/sh\ncat /app/config.json >/dev/null\n"
            b"head -c 1048576 /app/weights.bin | sha256sum >/dev/null\necho READY\n",
            mode=0o755,
        ),
    ]
    return [busybox_layer(), deps, app]


def main() -> int:
    if os.geteuid() != 0:
        print("make demo needs root (containerd, runc and mounts)", file=sys.stderr)
        return 1
    stack = []
    try:
        registry = timed("start docker-registry on 127.0.0.1", start_registry)
        stack.append(registry.stop)
        snapshotter = timed("start bootseer snapshotter", start_snapshotter)
        stack.append(snapshotter.teardown)
        containerd = timed(
            "start containerd with the bootseer proxy plugin",
            lambda: start_containerd(snapshotter.address),
        )
        stack.append(containerd.stop)
        containerd.wait_snapshotter()
        workdir = Path(tempfile.mkdtemp(prefix="bs-demo-", dir="/tmp"))
        stack.append(lambda: subprocess.run(["rm", "-rf", str(workdir)], check=False))
        builder = ImageBuilder(registry.host, workdir)
        image = timed("build and push a 3-layer, 33 MB image", lambda: builder.push("demo/train", demo_layers(), cmd=["/app/start.sh"]))
        timed(
            "ctr images pull --snapshotter bootseer",
            lambda: containerd.ctr("images", "pull", "--plain-http", "--snapshotter", "bootseer", image.ref),
        )
        run = timed(
            "ctr run --snapshotter bootseer (until the script prints READY)",
            lambda: containerd.ctr("run", "--rm", "--snapshotter", "bootseer", image.ref, "demo-1"),
        )
        print("   container said:", run.stdout.strip())
        listing = containerd.ctr("snapshots", "--snapshotter", "bootseer", "ls").stdout
        print("\nsnapshots bootseer holds for the image:\n" + listing)
        print("timings:")
        for what, seconds in timings:
            print(f"  {seconds:8.2f}s  {what}")
        return 0
    finally:
        for stop in reversed(stack):
            stop()
        print("cleaned up: every process stopped by PID, every mount removed")


if __name__ == "__main__":
    sys.exit(main())
