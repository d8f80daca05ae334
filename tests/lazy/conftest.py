"""A lazy-pulling node: the FUSE layer server, a bootseer snapshotter
configured to hand indexed layers to it, and a containerd using both, plus
the `bootseer index` and `bootseer pull` commands pointed at them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.harness.containerd import Containerd, start_containerd
from tests.harness.layerserver import LayerServer, start_layer_server
from tests.harness.registry import Registry
from tests.harness.snapshotter import BOOTSEER_BIN, Snapshotter, start_snapshotter


@dataclass
class LazyNode:
    layers: LayerServer
    snapshotter: Snapshotter
    containerd: Containerd

    def bootseer(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(BOOTSEER_BIN), *args[:1], "--config", str(self.layers.config.path), *args[1:]],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"bootseer {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
                f"\n{self.snapshotter.logs()}\n{self.layers.logs()}"
            )
        return result

    def index(self, ref: str) -> str:
        return self.bootseer("index", "--quiet", ref).stdout

    def pull(self, ref: str) -> str:
        c = self.containerd
        return self.bootseer(
            "pull", "--address", str(c.address), "--namespace", c.namespace, "--snapshotter", "bootseer", ref
        ).stdout


@pytest.fixture(scope="module")
def lazy_node(registry: Registry) -> Iterator[LazyNode]:
    layers = start_layer_server([registry.host])
    started: list[object] = [layers]
    try:
        snapshotter = start_snapshotter(["--config", str(layers.config.path)])
        started.append(snapshotter)
        containerd = start_containerd(snapshotter.address)
        started.append(containerd)
        yield LazyNode(layers, snapshotter, containerd)
    finally:
        leftovers: list[str] = []
        for part in reversed(started):
            if isinstance(part, Containerd):
                leftovers += part.stop()
            elif isinstance(part, (Snapshotter, LayerServer)):
                leftovers += part.teardown()
        assert not leftovers, f"mounts left behind: {leftovers}"
