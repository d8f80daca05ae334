"""The layer server's memory (RSS) with 1, 10 and 50 images' layers served,
and after those layers are unloaded (`[fs] unload_idle_s`).

Each image has LAYERS layers of FILES files each (a Python environment's
worth of small files: what a layer costs in memory is its index and tree,
entry by entry, not its bytes). The layers go straight into a fresh layer
store; the real `bootseer layer-server` process serves them, and a stat of
each layer's root in the mount loads it (index, tree, reader, cache file),
as a Prepare's lookup does. RSS is the server's own metric,
process_resident_memory_bytes, once every layer is loaded, and again once
the server has unloaded them all (no mount uses them, no request came for
`unload_idle_s`). Nothing is fetched: no registry is needed.

Run: `.venv/bin/python -m bench.layer_rss` (`--images 1,10` for a quicker
run); writes bench/results/layer_rss.json.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import tarfile
import tempfile
import time
from pathlib import Path

from bench import report
from bench.report import log
from snapshotter.fs.layers import LayerSource, LayerStore
from snapshotter.layer.build import build_index
from snapshotter.layer.index import LayerIndex
from tests.harness.layerserver import LayerServer, LazyConfig
from tests.harness.procs import wait_until

NAME = "layer_rss"
LAYERS = 4
FILES = 2500
UNLOAD_IDLE_S = 60.0


def _layer(seed: int, work: Path) -> tuple[LayerIndex, bytes]:
    """One layer of FILES small files in a site-packages-like tree."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(FILES):
            data = f"# module {seed}-{i}\n".encode() * 8
            info = tarfile.TarInfo(f"usr/lib/python3/site-packages/pkg{seed}_{i // 100}/mod_{i}.py")
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    blob = gzip.compress(buf.getvalue(), 6, mtime=0)
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    path = work / digest.split(":")[1]
    path.write_bytes(blob)
    index = build_index(path, digest)
    path.unlink()
    return index, index.encode()


def _served(layers: list[tuple[LayerIndex, bytes]], count: int) -> dict[str, float]:
    config = LazyConfig(Path(tempfile.mkdtemp(prefix="bs-bench-rss-", dir="/tmp")), hot_blocks=False)
    config.write()
    text = config.path.read_text().replace('level = "debug"', 'level = "info"', 1)
    config.path.write_text(text.replace("\n[registry]\n", f"unload_idle_s = {UNLOAD_IDLE_S}\n\n[registry]\n", 1))
    store = LayerStore(config.store)
    for index, encoded in layers[: count * LAYERS]:
        store.add(index.header, LayerSource(ref="127.0.0.1:1/bench/rss", digest=index.layer_digest), encoded)
    server = LayerServer(config)
    try:
        server.start()
        empty = server.metric("process_resident_memory_bytes")
        began = time.monotonic()
        for index, _ in layers[: count * LAYERS]:
            os.stat(config.mountpoint / index.layer_digest.split(":")[1])
        load_s = time.monotonic() - began
        assert server.metric("bootseer_fs_loaded_layers") == count * LAYERS
        loaded = server.metric("process_resident_memory_bytes")
        wait_until(
            lambda: server.metric("bootseer_fs_loaded_layers") == 0,
            UNLOAD_IDLE_S * 2 + 30,
            "the layer server to unload the idle layers",
        )
        unloaded = server.metric("process_resident_memory_bytes")
    finally:
        leftovers = server.teardown()
        assert not leftovers, leftovers
    return {
        "images": count,
        "layers": count * LAYERS,
        "entries": count * LAYERS * FILES,
        "rss_empty_mb": empty / 1e6,
        "rss_loaded_mb": loaded / 1e6,
        "rss_after_unload_mb": unloaded / 1e6,
        "load_s": load_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", default="1,10,50", help="image counts, comma-separated")
    args = parser.parse_args()
    counts = [int(c) for c in args.images.split(",")]
    with tempfile.TemporaryDirectory(prefix="bs-bench-rss-layers-", dir="/tmp") as work:
        log(f"building {max(counts) * LAYERS} layer indexes of {FILES} files each")
        layers = [_layer(seed, Path(work)) for seed in range(max(counts) * LAYERS)]
    runs = []
    for count in counts:
        log(f"serving {count} images ({count * LAYERS} layers)")
        run = _served(layers, count)
        log(
            f"  RSS {run['rss_empty_mb']:.0f} MB empty, {run['rss_loaded_mb']:.0f} MB with every layer loaded, "
            f"{run['rss_after_unload_mb']:.0f} MB after unloading"
        )
        runs.append(run)
    path = report.write(NAME, {"layers_per_image": LAYERS, "files_per_layer": FILES, "runs": runs})
    log(f"wrote {path}")
    print("| images | layers | entries | RSS empty | RSS loaded | RSS after unload |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['images']} | {r['layers']} | {r['entries']} | {r['rss_empty_mb']:.0f} MB | "
            f"{r['rss_loaded_mb']:.0f} MB | {r['rss_after_unload_mb']:.0f} MB |"
        )


if __name__ == "__main__":
    main()
