"""One benchmark node: a layer server, a bootseer snapshotter and a containerd,
started fresh with the product's settings, the `bootseer` commands pointed at
them, and a teardown that stops them by PID and unmounts what they left."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from snapshotter.fs.settings import FsConfig
from tests.harness.containerd import Containerd, start_containerd
from tests.harness.layerserver import LayerServer, LazyConfig
from tests.harness.snapshotter import BOOTSEER_BIN, Snapshotter, start_snapshotter


@dataclass
class Node:
    """One machine's worth of daemons: layer server, bootseer snapshotter, containerd."""

    layers: LayerServer
    snapshotter: Snapshotter
    containerd: Containerd

    def command(self, name: str, *args: str) -> list[str]:
        """The argv of `bootseer NAME --config <this node's config> ARGS...`."""
        return [str(BOOTSEER_BIN), name, "--config", str(self.layers.config.path), *args]

    def pull_command(self, ref: str) -> list[str]:
        """The argv of `bootseer pull`: `ref` lazily into this node's containerd."""
        c = self.containerd
        return self.command(
            "pull", "--address", str(c.address), "--namespace", c.namespace, "--snapshotter", "bootseer", ref
        )

    def teardown(self) -> list[str]:
        """Stop all three; returns mounts that could not be removed."""
        return self.containerd.stop() + self.snapshotter.teardown() + self.layers.teardown()


def start_node(plain_http_hosts: list[str], hot_blocks: bool = False) -> Node:
    """A fresh node whose registry hosts in `plain_http_hosts` speak plain HTTP."""
    # The product's settings, not the tests': their 1 s idle window would end
    # a recording during the start's CPU-bound phases, before the shard is read.
    defaults = FsConfig()
    config = LazyConfig(
        Path(tempfile.mkdtemp(prefix="bs-bench-", dir="/tmp")),
        plain_http_hosts,
        hot_blocks=hot_blocks,
        record_idle_s=defaults.record_idle_s,
        record_max_s=defaults.record_max_s,
        whole_layer_bytes=defaults.whole_layer_bytes,
    )
    config.write()
    # Debug logging of every FUSE call would be part of what is measured.
    config.path.write_text(config.path.read_text().replace('level = "debug"', 'level = "info"', 1))
    layers = LayerServer(config)
    started: list[Callable[[], object]] = []
    try:
        # Registered first: a layer server that fails to start may still have
        # left its process group or mount behind.
        started.append(layers.teardown)
        layers.start()
        snapshotter = start_snapshotter(["--config", str(config.path), "--log-level", "info"])
        started.append(snapshotter.teardown)
        containerd = start_containerd(snapshotter.address)
        started.append(containerd.stop)
        containerd.wait_snapshotter()
    except BaseException:
        for stop in reversed(started):
            stop()
        raise
    return Node(layers, snapshotter, containerd)
