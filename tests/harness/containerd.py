"""A private containerd, wired to a proxy snapshotter, driven through `ctr`.

Root, state and sockets live in one short temp dir: containerd's own
overlayfs snapshotter puts per-layer paths into the overlay `lowerdir=`
option, which must fit in one page.

By default containerd's CRI plugin is off. `start_containerd(..., cri=CriSettings(...))`
starts the CRI-enabled variant a kubelet would talk to (tests/harness/cri.py
plays kubelet): its images and containers live in the `k8s.io` namespace,
it pulls and unpacks into the proxy snapshotter with the snapshot
annotations a remote snapshotter needs, and pods put their processes under
one cgroup parent per containerd so teardown can find them by cgroup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.harness.procs import Daemon, kill_pid, start_daemon, unix_socket_answers, wait_until
from tests.harness.tree import unmount_under

CONTAINERD_BIN = "containerd"
CTR_BIN = "ctr"
NAMESPACE = "bootseer-test"
# The namespace containerd's CRI plugin keeps kubelet's images and containers in.
CRI_NAMESPACE = "k8s.io"
CRI_PLUGIN = "io.containerd.grpc.v1.cri"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROXY_NAME = "bootseer"
# ctr commands are short; this only bounds a hung daemon.
CTR_TIMEOUT = 180.0

# Plugins that cannot work here (or are not needed) and only add start-up
# time and log noise.
DISABLED_PLUGINS = (
    "io.containerd.grpc.v1.cri",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
)


class CtrError(RuntimeError):
    """A `ctr` command failed; carries the command line and its stderr."""

    def __init__(self, result: subprocess.CompletedProcess[str]) -> None:
        self.result = result
        super().__init__(
            f"`{' '.join(result.args)}` exited with {result.returncode}\n"
            f"stdout: {result.stdout.strip()}\nstderr: {result.stderr.strip()}"
        )


@dataclass(frozen=True)
class CriSettings:
    """What the CRI-enabled containerd is configured with."""

    # The pod sandbox ("pause") image, pulled by containerd itself on RunPodSandbox.
    sandbox_image: str
    # containerd's hosts directory (certs.d/<host>/hosts.toml), the one bootseer's
    # `[registry] config_path` names too.
    hosts_dir: Path
    # Pods' cgroup parent (cgroupfs syntax); teardown kills what is left in it.
    cgroup_parent: str
    snapshotter: str = PROXY_NAME


def _cri_toml(cri: CriSettings, cni_dir: Path) -> str:
    plugin = f'plugins."{CRI_PLUGIN}"'
    return f"""
[{plugin}]
  sandbox_image = "{cri.sandbox_image}"
  # CRI asks runc for oom_score_adj -998 on sandboxes; without CAP_SYS_RESOURCE
  # (these VMs' root) only values at or above containerd's own are allowed.
  restrict_oom_score_adj = true
  systemd_cgroup = false
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_tcp_service = true

  [{plugin}.containerd]
    snapshotter = "{cri.snapshotter}"
    # The cri.* labels on Prepare: what a remote snapshotter needs to find the layer.
    disable_snapshot_annotations = false
    default_runtime_name = "runc"

    [{plugin}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [{plugin}.containerd.runtimes.runc.options]
        SystemdCgroup = false

  # Host-network pods need no CNI; an empty directory keeps the plugin quiet.
  [{plugin}.cni]
    bin_dir = "{cni_dir}/bin"
    conf_dir = "{cni_dir}/net.d"

  [{plugin}.registry]
    config_path = "{cri.hosts_dir}"
"""


def config_toml(
    root: Path, state: Path, address: Path, snapshotter_address: Path, cri: CriSettings | None = None
) -> str:
    """containerd's config; `cri` turns its CRI plugin on (off by default)."""
    disabled = ", ".join(f'"{p}"' for p in DISABLED_PLUGINS if cri is None or p != CRI_PLUGIN)
    text = f"""version = 2
root = "{root}"
state = "{state}"
disabled_plugins = [{disabled}]

[grpc]
  address = "{address}"

[ttrpc]
  address = "{address}.ttrpc"

[debug]
  address = ""
  level = "debug"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[proxy_plugins.{PROXY_NAME}]
  type = "snapshot"
  address = "{snapshotter_address}"
"""
    if cri is not None:
        text += _cri_toml(cri, root.parent / "cni")
    return text


@dataclass(frozen=True)
class BindMount:
    """A host path bind-mounted into a container (`ctr run --mount`), the way
    a pod's hostPath volume is."""

    source: Path
    destination: str
    read_only: bool = False
    # Mount propagation, as a pod's volumeMounts mountPropagation sets it:
    # "rslave" is HostToContainer (mounts made on the host later show).
    propagation: str = ""

    def ctr_arg(self) -> str:
        options = ["rbind", "ro" if self.read_only else "rw", *([self.propagation] if self.propagation else [])]
        return f"type=bind,src={self.source},dst={self.destination},options={':'.join(options)}"


@dataclass(frozen=True)
class SnapshotRow:
    parent: str  # "" for a bottom layer
    kind: str  # "Committed", "Active" or "View"


@dataclass
class Containerd:
    daemon: Daemon
    workdir: Path
    namespace: str = NAMESPACE
    cri: CriSettings | None = None

    @property
    def root(self) -> Path:
        return self.workdir / "root"

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    @property
    def address(self) -> Path:
        return self.workdir / "containerd.sock"

    def ctr(self, *args: str, check: bool = True, timeout: float = CTR_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """`ctr --address SOCK --namespace NS ARGS...`; raises CtrError on failure if `check`."""
        result = subprocess.run(
            [CTR_BIN, "--address", str(self.address), "--namespace", self.namespace, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise CtrError(result)
        return result

    def task_rootfs(self, container_id: str) -> Path:
        """Where the runc shim mounted a running task's rootfs, seen from the host."""
        bundle = self.state / "io.containerd.runtime.v2.task" / self.namespace / container_id
        return bundle / "rootfs"

    def pull(self, ref: str, snapshotter: str = PROXY_NAME) -> None:
        """`ctr images pull` over plain HTTP, unpacking into `snapshotter`."""
        self.ctr("images", "pull", "--plain-http", "--snapshotter", snapshotter, ref)

    def run(
        self,
        image: str,
        container_id: str,
        *argv: str,
        detach: bool = False,
        snapshotter: str = PROXY_NAME,
    ) -> str:
        """`ctr run --rm` (or `-d` if `detach`) of `argv`; returns its stdout."""
        mode = "-d" if detach else "--rm"
        args = ("run", mode, "--snapshotter", snapshotter, image, container_id, *argv)
        return self.ctr(*args).stdout

    def run_with_mounts(
        self,
        image: str,
        container_id: str,
        *argv: str,
        mounts: tuple[BindMount, ...] = (),
        env: dict[str, str] | None = None,
        snapshotter: str = PROXY_NAME,
        timeout: float = CTR_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        """`ctr run --rm` of `argv` with bind mounts and environment variables,
        and no capability beyond ctr's defaults; the result is returned
        whatever the container's exit status (ctr exits with it)."""
        args = ["run", "--rm", "--snapshotter", snapshotter]
        for mount in mounts:
            args += ["--mount", mount.ctr_arg()]
        for name, value in (env or {}).items():
            args += ["--env", f"{name}={value}"]
        return self.ctr(*args, image, container_id, *argv, check=False, timeout=timeout)

    def import_layout(self, layout_dir: Path, base_name: str) -> None:
        """`ctr images import` of an OCI image layout directory (tests/harness/oci.py
        writes them), named `base_name:TAG`; no registry needed."""
        archive = layout_dir.with_suffix(".tar")
        with tarfile.open(archive, "w") as tar:
            tar.add(layout_dir, arcname=".")
        try:
            self.ctr("images", "import", "--base-name", base_name, str(archive))
        finally:
            archive.unlink(missing_ok=True)

    def exec(self, container_id: str, exec_id: str, *argv: str) -> str:
        """`ctr tasks exec` in a running container; returns its stdout."""
        return self.ctr("tasks", "exec", "--exec-id", exec_id, container_id, *argv).stdout

    def wait_snapshotter(self, name: str = PROXY_NAME, timeout: float = 30.0) -> None:
        """Wait until containerd can reach the snapshotter `name` again.

        containerd's gRPC client to a proxy plugin fails calls fast while it
        backs off after losing the connection, so a restarted snapshotter is
        not usable through containerd the moment its socket answers. The
        probe is a real round trip (Prepare + Remove of a scratch snapshot):
        `ctr snapshots ls` only reads containerd's own metadata.
        """
        probe = f"readiness-probe-{uuid.uuid4().hex[:8]}"

        def reachable() -> bool:
            prepare = self.ctr("snapshots", "--snapshotter", name, "prepare", probe, check=False)
            if prepare.returncode != 0:
                return False
            self.ctr("snapshots", "--snapshotter", name, "rm", probe)
            return True

        wait_until(reachable, timeout, f"containerd to reach snapshotter {name}", self.daemon)

    def snapshots(self, snapshotter: str = PROXY_NAME) -> dict[str, SnapshotRow]:
        """`ctr snapshots ls` parsed: key -> (parent, kind)."""
        rows: dict[str, SnapshotRow] = {}
        listing = self.ctr("snapshots", "--snapshotter", snapshotter, "ls").stdout
        for line in listing.splitlines()[1:]:
            fields = line.split()
            # A snapshot without parent leaves the middle column blank.
            key, parent, kind = fields if len(fields) == 3 else (fields[0], "", fields[1])
            rows[key] = SnapshotRow(parent=parent, kind=kind)
        return rows

    def remove_container(self, container_id: str, check: bool = True) -> None:
        """Kill its task if any, delete the task, remove the container (and its snapshot)."""
        # A container may have no task (never started, or already deleted),
        # so only the final removal is checked.
        self.ctr("tasks", "kill", "-s", "SIGKILL", container_id, check=False)
        # --force deletes the task even if the kill has not been reaped yet.
        self.ctr("tasks", "delete", "--force", container_id, check=False)
        self.ctr("containers", "rm", container_id, check=check)

    def _remove_all_containers(self) -> None:
        for container_id in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.remove_container(container_id, check=False)

    def _kill_leftover_shims(self) -> None:
        """Kill shims (and their containers) containerd no longer manages.

        They outlive containerd by design; their PIDs are in the task
        bundles, so they can be stopped by PID rather than by name.
        """
        tasks = self.state / "io.containerd.runtime.v2.task"
        for pid_file in [*tasks.glob("*/*/init.pid"), *tasks.glob("*/*/shim.pid")]:
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            kill_pid(pid, grace=2.0)

    def _cgroups(self) -> list[Path]:
        """The pods' cgroup directories, every hierarchy, deepest first."""
        if self.cri is None:
            return []
        relative = self.cri.cgroup_parent.strip("/")
        found: list[Path] = []
        for hierarchy in CGROUP_ROOT.iterdir():
            top = hierarchy / relative
            if top.is_dir():
                found += [Path(d) for d, _, _ in os.walk(top)]
        return sorted(found, key=lambda p: len(p.parts), reverse=True)

    def _kill_pod_cgroups(self) -> None:
        """Kill whatever still runs in the pods' cgroup parent, then remove it.

        Containers and shims are not children of containerd's process group;
        the cgroup is where the CRI put them, so that is where they are found.
        """
        cgroups = self._cgroups()
        deadline = time.monotonic() + 10.0
        while True:
            pids = set()
            for cgroup in cgroups:
                with contextlib.suppress(OSError):
                    pids |= {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
            if not pids or time.monotonic() > deadline:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for cgroup in cgroups:
            with contextlib.suppress(OSError):
                cgroup.rmdir()

    def stop(self) -> list[str]:
        """Tear everything down; returns mounts that could not be removed."""
        if self.daemon.alive():
            self._remove_all_containers()
        self.daemon.stop()
        self.daemon.kill_group()
        self._kill_leftover_shims()
        self._kill_pod_cgroups()
        leftovers = unmount_under(self.workdir)
        # rmtree would descend into a mount that is still there and delete
        # what it serves; leave the dir for a human instead.
        if not leftovers:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return leftovers


def new_workdir() -> Path:
    """A fresh short directory for one containerd (its socket is `workdir/containerd.sock`),
    for callers that must know the socket before containerd starts."""
    return Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))


def start_containerd(
    snapshotter_address: Path, cri: CriSettings | None = None, workdir: Path | None = None
) -> Containerd:
    """containerd wired to the proxy snapshotter at `snapshotter_address`; with `cri`,
    its CRI plugin on (namespace `k8s.io`) as a kubelet's node runs it."""
    workdir = workdir or new_workdir()
    root, state, address = workdir / "root", workdir / "state", workdir / "containerd.sock"
    config = workdir / "config.toml"
    config.write_text(config_toml(root, state, address, snapshotter_address, cri))

    def ready() -> bool:
        if not unix_socket_answers(address):
            return False
        version = subprocess.run(
            [CTR_BIN, "--address", str(address), "version"], capture_output=True, timeout=10, check=False
        )
        return version.returncode == 0

    try:
        argv = [CONTAINERD_BIN, "--config", str(config)]
        daemon = start_daemon("containerd", argv, workdir / "containerd.log", ready)
    except BaseException:
        if not unmount_under(workdir):
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Containerd(daemon=daemon, workdir=workdir, namespace=CRI_NAMESPACE if cri else NAMESPACE, cri=cri)
