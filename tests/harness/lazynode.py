"""A lazy-pulling node: the FUSE layer server, a bootseer snapshotter
configured to hand indexed layers to it, and a containerd using both, plus
the `bootseer index` and `bootseer pull` commands pointed at them."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.harness.containerd import Containerd, start_containerd
from tests.harness.layerserver import LayerServer, start_layer_server
from tests.harness.oci import File, ImageBuilder, busybox_layer
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
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"bootseer {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
                f"\n{self.snapshotter.daemon.log_tail()}\n{self.layers.logs()}"
            )
        return result

    def index(self, ref: str) -> str:
        return self.bootseer("index", "--quiet", ref).stdout

    def pull(self, ref: str) -> str:
        return self.try_pull(ref, check=True).stdout

    def try_pull(self, ref: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """`bootseer pull` into this node's containerd; by default its outcome,
        whatever it is, for tests of pulls that must fail."""
        c = self.containerd
        return self.bootseer(
            "pull",
            "--address",
            str(c.address),
            "--namespace",
            c.namespace,
            "--snapshotter",
            "bootseer",
            ref,
            check=check,
        )

    def fallbacks(self, reason: str, layer: str) -> list[str]:
        """The snapshotter's "layer takes the normal path" lines for `layer` with `reason`."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.snapshotter.daemon.log_path.read_text(errors="replace"))
        return [
            line
            for line in text.splitlines()
            if "layer takes the normal path" in line and f"reason={reason}" in line and layer in line
        ]

    @contextmanager
    def bystander(self, images: ImageBuilder, name: str) -> Iterator[Bystander]:
        """A container of another, lazily served image, running throughout."""
        image = images.push(f"bystander/{name}", [busybox_layer(), [File("/mine.txt", b"mine\n")]])
        self.index(image.ref)
        self.pull(image.ref)
        self.containerd.run(image.ref, name, "/bin/sleep", "600", detach=True)
        try:
            yield Bystander(self, name)
        finally:
            self.containerd.remove_container(name)


@dataclass
class Bystander:
    node: LazyNode
    container: str
    reads: int = 0

    def still_fine(self, case: str) -> None:
        """The node's daemons are up and the running container still reads its file."""
        node = self.node
        assert node.layers.daemon.alive(), (case, node.layers.logs())
        assert node.snapshotter.daemon.alive(), (case, node.snapshotter.daemon.log_tail())
        self.reads += 1
        shown = node.containerd.exec(self.container, f"{self.container}-read-{self.reads}", "/bin/cat", "/mine.txt")
        assert shown == "mine\n", case


def start_lazy_node(registry_host: str, **settings: Any) -> LazyNode:
    """One node: layer server, snapshotter configured for it, containerd;
    `settings`: the layer server's LazyConfig fields other than the tests' defaults."""
    started: list[LayerServer | Snapshotter | Containerd] = []
    try:
        layers = start_layer_server([registry_host], **settings)
        started.append(layers)
        snapshotter = start_snapshotter(["--config", str(layers.config.path)])
        started.append(snapshotter)
        containerd = start_containerd(snapshotter.address)
        started.append(containerd)
    except BaseException:
        _stop(started)
        raise
    return LazyNode(layers, snapshotter, containerd)


def _stop(parts: list[LayerServer | Snapshotter | Containerd]) -> list[str]:
    leftovers: list[str] = []
    for part in reversed(parts):
        leftovers += part.stop() if isinstance(part, Containerd) else part.teardown()
    return leftovers


def stop_lazy_node(node: LazyNode) -> None:
    leftovers = _stop([node.layers, node.snapshotter, node.containerd])
    assert not leftovers, f"mounts left behind: {leftovers}"
