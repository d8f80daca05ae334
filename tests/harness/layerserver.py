"""The bootseer FUSE layer server as a process, plus the config file that
points it and the snapshotter at the same layer store, mount and registry
hosts directory."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bootseer.daemon import HEALTH_PATH
from snapshotter.fs.fusewire import handoff
from snapshotter.fs.settings import FsConfig
from tests.harness.procs import Daemon, DaemonError, free_tcp_port, pid_alive, start_daemon, wait_until
from tests.harness.snapshotter import BOOTSEER_BIN
from tests.harness.tree import unmount_under
from tests.harness.trust import signing_keys


@dataclass
class LazyConfig:
    """A bootseer config.toml for one node: layer store, mount, registry hosts."""

    workdir: Path
    plain_http_hosts: list[str] = field(default_factory=list)
    metrics_port: int = field(default_factory=free_tcp_port)
    # Tests let a recording settle quickly once the container stops reading.
    record_idle_s: float = 1.0
    record_max_s: float = 60.0
    hot_blocks: bool = True
    # Off in tests, which measure what reads alone fetch.
    whole_layer_bytes: int = 0
    blocks_after_miss: int = 0
    background_fetch: bool = False
    # Off in tests, which check what reads through the layer mount do; on in
    # those of the unpacked layers themselves.
    unpack_whole_layers: bool = False
    # [fs] hot_blocks_publish: "elected" (the code default), "designated", "never".
    hot_blocks_publish: str = "elected"
    # [fs] plain_mount: layers without xattrs served from the plain mount.
    plain_mount: bool = True
    # Tests prune a layer no snapshot uses at once.
    layer_gc_grace_s: float = 0.0
    # [events]: the node's records go to its own directory (events_dir), not
    # the host's; the product's bounds where these are None.
    events_max_bytes: int | None = None
    events_summary_interval_s: float | None = None

    @property
    def path(self) -> Path:
        return self.workdir / "config.toml"

    @property
    def store(self) -> Path:
        return self.workdir / "layers"

    @property
    def mountpoint(self) -> Path:
        return self.workdir / "m"

    @property
    def holder_socket(self) -> Path:
        """Where the layer server's descriptor holder keeps the mount's connection."""
        return self.workdir / "holder.sock"

    @property
    def fs(self) -> FsConfig:
        """The `[fs]` paths as the daemons derive the rest from them."""
        return FsConfig(store=self.store, mountpoint=self.mountpoint, holder_socket=self.holder_socket)

    @property
    def mountpoints(self) -> tuple[Path, ...]:
        """The layer mount and, unless turned off, its plain twin (no xattrs)."""
        return (self.mountpoint, self.fs.plain_mountpoint) if self.plain_mount else (self.mountpoint,)

    @property
    def holder_sockets(self) -> tuple[Path, Path]:
        return self.holder_socket, self.fs.plain_holder_socket

    @property
    def events_dir(self) -> Path:
        """Where the node's daemons and commands keep their event records."""
        return self.workdir / "events"

    @property
    def pull_socket(self) -> Path:
        """Where the node's snapshotter runs `bootseer pull` for the commands given this config."""
        return self.workdir / "pull.sock"

    @property
    def certs_dir(self) -> Path:
        return self.workdir / "certs.d"

    @property
    def docker_config(self) -> Path:
        """Registry credentials of this node (docker config.json format)."""
        return self.workdir / "docker" / "config.json"

    @property
    def cri_credentials(self) -> Path:
        """What this node's CRI proxy captured from PullImage calls."""
        return self.workdir / "cri" / "credentials.json"

    def allow_plain_http(self, host: str) -> None:
        """A hosts.toml saying `host` speaks plain HTTP, as an admin would write it."""
        hosts = self.certs_dir / host / "hosts.toml"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(
            f'server = "http://{host}"\n\n[host."http://{host}"]\n  capabilities = ["pull", "resolve", "push"]\n'
        )

    def write(self) -> Path:
        for host in self.plain_http_hosts:
            self.allow_plain_http(host)
        events = f'dir = "{self.events_dir}"\n'
        if self.events_max_bytes is not None:
            events += f"max_bytes = {self.events_max_bytes}\n"
        if self.events_summary_interval_s is not None:
            events += f"summary_interval_s = {self.events_summary_interval_s}\n"
        self.path.write_text(
            f"""[log]
level = "debug"
format = "console"

[events]
{events}
[snapshotter]
pull_address = "{self.pull_socket}"

[fs]
store = "{self.store}"
mountpoint = "{self.mountpoint}"
holder_socket = "{self.holder_socket}"
metrics_address = "127.0.0.1:{self.metrics_port}"
layer_gc_grace_s = {self.layer_gc_grace_s}
record_idle_s = {self.record_idle_s}
hot_blocks = {str(self.hot_blocks).lower()}
record_max_s = {self.record_max_s}
whole_layer_bytes = {self.whole_layer_bytes}
blocks_after_miss = {self.blocks_after_miss}
background_fetch = {str(self.background_fetch).lower()}
unpack_whole_layers = {str(self.unpack_whole_layers).lower()}
hot_blocks_publish = "{self.hot_blocks_publish}"
plain_mount = {str(self.plain_mount).lower()}

[registry]
config_path = "{self.certs_dir}"
docker_config = "{self.docker_config}"
cri_credentials = "{self.cri_credentials}"

{signing_keys().toml()}"""
        )
        return self.path


@dataclass
class LayerServer:
    config: LazyConfig
    incarnations: list[Daemon] = field(default_factory=list)

    @property
    def daemon(self) -> Daemon:
        return self.incarnations[-1]

    def start(self) -> None:
        argv = [str(BOOTSEER_BIN), "layer-server", "--config", str(self.config.path)]
        number = len(self.incarnations) + 1
        self.incarnations.append(
            start_daemon(
                f"bootseer layer-server #{number}",
                argv,
                self.config.workdir / f"layer-server.{number}.log",
                ready=self.healthy,
            )
        )

    def healthy(self) -> bool:
        """Ready, as systemd would be told (READY=1): every mount initialised
        and answering, which /healthz says with a 200."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.config.metrics_port}{HEALTH_PATH}", timeout=5):
                return True
        except OSError:
            return False

    def metric(self, name: str) -> float:
        """A counter or gauge from the server's Prometheus endpoint (0 if absent)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.config.metrics_port}/metrics").read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        """SIGTERM: the server hands the mount over and exits; the mount stays
        (its connection kept by the holder) for the next start to take over."""
        self.daemon.stop()

    def kill9(self) -> None:
        """SIGKILL, as the OOM killer does: the mount stays too."""
        self.daemon.kill9()

    def abandon(self) -> None:
        """The holder lets the connection go with no server to take it: the
        mounts stay and answer ENOTCONN, what a server that died and is
        never restarted leaves once its keepers give up."""
        for socket in self.config.holder_sockets:
            handoff.drop(socket)

    def release(self) -> None:
        """The final stop: `bootseer layer-server --release` unmounts and lets
        the holders go; then the holders the server started are waited for
        (and killed by their PIDs if they linger)."""
        holders = [pid for s in self.config.holder_sockets if (pid := handoff.holder_alive(s)) is not None]
        subprocess.run(
            [str(BOOTSEER_BIN), "layer-server", "--config", str(self.config.path), "--release"],
            check=False,
            capture_output=True,
            timeout=60,
        )
        for holder in holders:
            try:
                wait_until(functools.partial(_gone, holder), 10, "the descriptor holder to exit")
            except DaemonError:
                os.kill(holder, signal.SIGKILL)

    def logs(self) -> str:
        return "\n".join(f"--- {d.name} ---\n{d.log_tail()}" for d in self.incarnations)

    def teardown(self) -> list[str]:
        for daemon in self.incarnations:
            daemon.stop()
            daemon.kill_group()
        self.release()
        # A killed server's mount answers ENOTCONN, and ismount says False for it.
        for mountpoint in (self.config.mountpoint, self.config.fs.plain_mountpoint):
            if os.path.ismount(mountpoint) or _dead_mount(mountpoint):
                subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
        leftovers = unmount_under(self.config.workdir)
        if not leftovers:
            shutil.rmtree(self.config.workdir, ignore_errors=True)
        return leftovers


def _gone(pid: int) -> bool:
    return not pid_alive(pid)


def _dead_mount(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def start_layer_server(plain_http_hosts: list[str], **settings: Any) -> LayerServer:
    """`settings`: LazyConfig fields other than the tests' defaults."""
    config = LazyConfig(Path(tempfile.mkdtemp(prefix="bs-fs-", dir="/tmp")), plain_http_hosts, **settings)
    config.write()
    server = LayerServer(config)
    try:
        server.start()
    except BaseException:
        server.teardown()
        raise
    return server
