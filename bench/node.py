"""One benchmark node: a layer server, a bootseer snapshotter and a containerd,
started fresh with the product's settings, the `bootseer` commands pointed at
them, and a teardown that stops them by PID and unmounts what they left."""

from __future__ import annotations

import subprocess
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

    @property
    def hosts_dir(self) -> Path:
        """This node's `certs.d` (containerd's hosts directory, which bootseer reads too)."""
        return self.layers.config.certs_dir

    def use_mirror(self, registry_host: str, mirror_host: str) -> None:
        """A hosts.toml sending pulls for `registry_host` to the plain-HTTP
        mirror `mirror_host` first, the registry itself last (and the only
        one with `push`), as an admin would point a node at a rack cache.
        Written by rename, so no reader sees half of it."""
        hosts = self.hosts_dir / registry_host / "hosts.toml"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        fresh = hosts.with_name("hosts.toml.new")
        fresh.write_text(
            f'server = "http://{registry_host}"\n\n'
            f'[host."http://{mirror_host}"]\n  capabilities = ["pull", "resolve"]\n\n'
            f'[host."http://{registry_host}"]\n  capabilities = ["pull", "resolve", "push"]\n'
        )
        fresh.rename(hosts)

    def daemon_pids(self) -> dict[str, int]:
        """The PID of each of this node's daemons, by role (for CPU accounting)."""
        return {
            "containerd": self.containerd.daemon.pid,
            "snapshotter": self.snapshotter.daemon.pid,
            "layer_server": self.layers.daemon.pid,
        }

    def index(self, ref: str, timeout: float = 900.0) -> None:
        index_image(self.layers.config.path, ref, timeout)

    def teardown(self) -> list[str]:
        """Stop all three; returns mounts that could not be removed."""
        return self.containerd.stop() + self.snapshotter.teardown() + self.layers.teardown()


def start_node(
    plain_http_hosts: list[str],
    hot_blocks: bool = False,
    namespace: str | None = None,
    extra_config: Callable[[Path], str] | None = None,
    record_idle_s: float | None = None,
    background_fetch: bool | None = None,
    unpack_whole_layers: bool | None = None,
    events_summary_interval_s: float | None = None,
) -> Node:
    """A fresh node whose registry hosts in `plain_http_hosts` speak plain HTTP;
    `namespace`: the containerd namespace its `ctr` and `bootseer pull`
    commands use (containers' cgroups are named after it); `extra_config`:
    more sections for its config file, given the node's work directory;
    `record_idle_s`, `background_fetch`, `unpack_whole_layers`: [fs]
    settings, if not the product's; `events_summary_interval_s`: [events]'s.
    The node's event records stay in its work directory."""
    # The product's settings, not the tests': their 1 s idle window would end
    # a recording during the start's CPU-bound phases, before the shard is read.
    defaults = FsConfig()
    workdir = Path(tempfile.mkdtemp(prefix="bs-bench-", dir="/tmp"))
    config = LazyConfig(
        workdir,
        plain_http_hosts,
        hot_blocks=hot_blocks,
        record_idle_s=defaults.record_idle_s if record_idle_s is None else record_idle_s,
        record_max_s=defaults.record_max_s,
        whole_layer_bytes=defaults.whole_layer_bytes,
        blocks_after_miss=defaults.blocks_after_miss,
        background_fetch=defaults.background_fetch if background_fetch is None else background_fetch,
        unpack_whole_layers=defaults.unpack_whole_layers if unpack_whole_layers is None else unpack_whole_layers,
        events_summary_interval_s=events_summary_interval_s,
        layer_gc_grace_s=defaults.layer_gc_grace_s,
    )
    config.write()
    # Debug logging of every FUSE call would be part of what is measured.
    text = config.path.read_text().replace('level = "debug"', 'level = "info"', 1)
    config.path.write_text(text + (extra_config(workdir) if extra_config else ""))
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
        if namespace is not None:
            containerd.namespace = namespace
        containerd.wait_snapshotter()
    except BaseException:
        for stop in reversed(started):
            stop()
        raise
    return Node(layers, snapshotter, containerd)


def index_image(config: Path, ref: str, timeout: float = 900.0) -> None:
    """`bootseer index` of `ref`, signed with the key `config` names."""
    done = subprocess.run(
        [str(BOOTSEER_BIN), "index", "--config", str(config), "--quiet", ref],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bootseer index {ref} failed:\n{done.stdout}\n{done.stderr}")
