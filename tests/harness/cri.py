"""A Kubernetes node without kubelet: the tests play kubelet over the CRI.

`start_cri_node` starts a lazy node whose containerd has its CRI plugin on
(snapshotter "bootseer", snapshot annotations on, registry hosts from the
node's certs.d, which bootseer's `[registry] config_path` names too) and
whose bootseer snapshotter serves the CRI image-service proxy.
`Kubelet` talks to them as kubelet does: RuntimeService calls go to
containerd's socket (kubelet's --container-runtime-endpoint), ImageService
calls to bootseer's proxy (--image-service-endpoint). Pods use the host
network, so no CNI is needed; their processes live under one cgroup
parent per node, which containerd's teardown empties (see containerd.py).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto.k8s.cri.runtime.v1 import api_pb2 as cri
from proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from tests.harness.containerd import Containerd, CriSettings, new_workdir, start_containerd
from tests.harness.layerserver import LayerServer, LazyConfig
from tests.harness.oci import BUSYBOX, Dir, Entry, File, ImageBuilder, PushedImage, Symlink
from tests.harness.procs import wait_until
from tests.harness.snapshotter import BOOTSEER_BIN, Snapshotter, start_snapshotter

# Generous: a PullImage of a normal-path layer or a first lazy Prepare on a loaded 2-core VM.
CALL_TIMEOUT = 120.0


def push_pause_image(builder: ImageBuilder) -> PushedImage:
    """The pod sandbox image: a static busybox that sleeps until killed."""
    layer: list[Entry] = [
        Dir("/bin"),
        File("/bin/busybox", BUSYBOX.read_bytes(), mode=0o755),
        Symlink("/bin/sleep", "busybox"),
    ]
    return builder.push("pause", [layer], cmd=["/bin/sleep", "2147483647"], tag="3.9")


@dataclass
@dataclass
class CriNode:
    layers: LayerServer
    snapshotter: Snapshotter
    containerd: Containerd

    @property
    def config(self) -> LazyConfig:
        return self.layers.config

    @property
    def cri_socket(self) -> Path:
        return self.config.workdir / "cri.sock"

    def kubelet(self) -> Kubelet:
        return Kubelet(self.containerd.address, self.cri_socket, self.config.workdir / "pods", self.cgroup_parent)

    @property
    def cgroup_parent(self) -> str:
        assert self.containerd.cri is not None
        return self.containerd.cri.cgroup_parent

    def restart_bootseer(self) -> None:
        """Stop and start both bootseer daemons (no container may be using lazy layers)."""
        self.snapshotter.stop()
        self.layers.stop()
        self.layers.start()
        self.snapshotter.start()
        self.containerd.wait_snapshotter()

    def logs(self) -> str:
        return f"{self.snapshotter_logs()}\n{self.layers.logs()}"

    def snapshotter_logs(self) -> str:
        return "\n".join(f"--- {d.name} ---\n{d.log_tail(80)}" for d in self.snapshotter.incarnations)

    def bootseer(self, *args: str, config: Path | None = None) -> str:
        """`bootseer SUBCOMMAND --config CONFIG ARGS...` (the node's config by default); its stdout."""
        result = subprocess.run(
            [str(BOOTSEER_BIN), *args[:1], "--config", str(config or self.config.path), *args[1:]],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"bootseer {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result.stdout


def start_cri_node(plain_http_hosts: list[str], sandbox_image: str) -> CriNode:
    """Layer server, snapshotter with the CRI proxy, CRI-enabled containerd."""
    config = LazyConfig(Path(tempfile.mkdtemp(prefix="bs-fs-", dir="/tmp")), plain_http_hosts)
    config.write()
    layers = LayerServer(config)
    started: list[LayerServer | Snapshotter | Containerd] = []
    containerd_dir = new_workdir()
    try:
        layers.start()
        started.append(layers)
        snapshotter = start_snapshotter(
            [
                "--config",
                str(config.path),
                "--cri-address",
                str(config.workdir / "cri.sock"),
                "--cri-containerd-address",
                str(containerd_dir / "containerd.sock"),
                # Where tests mount the hdfs-fuse checkpoints pods ask to have prefetched.
                "--cri-prefetch-root",
                "/tmp",
            ]
        )
        started.append(snapshotter)
        settings = CriSettings(sandbox_image, config.certs_dir, f"/bs-cri-{uuid.uuid4().hex[:8]}")
        containerd = start_containerd(snapshotter.address, cri=settings, workdir=containerd_dir)
        started.append(containerd)
    except BaseException:
        stop_parts(started)
        shutil.rmtree(containerd_dir, ignore_errors=True)
        raise
    return CriNode(layers, snapshotter, containerd)


def stop_parts(parts: list[LayerServer | Snapshotter | Containerd]) -> list[str]:
    leftovers: list[str] = []
    for part in reversed(parts):
        leftovers += part.stop() if isinstance(part, Containerd) else part.teardown()
    return leftovers


def stop_cri_node(node: CriNode) -> None:
    leftovers = stop_parts([node.layers, node.snapshotter, node.containerd])
    assert not leftovers, f"mounts left behind: {leftovers}"


@dataclass
class Pod:
    id: str
    config: cri.PodSandboxConfig
    log_directory: Path


@dataclass
class Kubelet:
    """kubelet's CRI calls, and what it created, so `close` can remove it."""

    runtime_socket: Path
    image_socket: Path
    pods_dir: Path
    cgroup_parent: str
    pods: list[Pod] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._runtime_channel = grpc.insecure_channel(f"unix://{self.runtime_socket}")
        self._image_channel = grpc.insecure_channel(f"unix://{self.image_socket}")
        self.runtime = cri_grpc.RuntimeServiceStub(self._runtime_channel)
        self.images = cri_grpc.ImageServiceStub(self._image_channel)

    def version(self) -> cri.VersionResponse:
        return self.runtime.Version(cri.VersionRequest(version="v1"), timeout=CALL_TIMEOUT)

    def pull(
        self,
        image: str,
        auth: cri.AuthConfig | None = None,
        timeout: float = CALL_TIMEOUT,
        sandbox: cri.PodSandboxConfig | None = None,
    ) -> str:
        """PullImage through the image endpoint (bootseer's proxy), for the
        pod `sandbox` if given, as kubelet sends it; the image ID."""
        request = cri.PullImageRequest(image=cri.ImageSpec(image=image), auth=auth, sandbox_config=sandbox)
        return self.images.PullImage(request, timeout=timeout).image_ref

    def remove_image(self, image: str) -> None:
        self.images.RemoveImage(cri.RemoveImageRequest(image=cri.ImageSpec(image=image)), timeout=CALL_TIMEOUT)

    def run_pod(self, name: str) -> Pod:
        """RunPodSandbox with the host's network (and a pod PID and IPC namespace)."""
        uid = uuid.uuid4().hex
        log_directory = self.pods_dir / f"default_{name}_{uid}"
        log_directory.mkdir(parents=True)
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
            log_directory=str(log_directory),
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=f"{self.cgroup_parent}/pod{uid}",
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
                ),
            ),
        )
        pod_id = self.runtime.RunPodSandbox(
            cri.RunPodSandboxRequest(config=config), timeout=CALL_TIMEOUT
        ).pod_sandbox_id
        pod = Pod(pod_id, config, log_directory)
        self.pods.append(pod)
        return pod

    def start_container(self, pod: Pod, name: str, image: str, command: list[str]) -> str:
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name),
            image=cri.ImageSpec(image=image),
            command=command,
            log_path=f"{name}/0.log",
            linux=cri.LinuxContainerConfig(),
        )
        request = cri.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config)
        container_id = self.runtime.CreateContainer(request, timeout=CALL_TIMEOUT).container_id
        self.containers.append(container_id)
        self.runtime.StartContainer(cri.StartContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT)
        return container_id

    def status(self, container_id: str) -> cri.ContainerStatus:
        request = cri.ContainerStatusRequest(container_id=container_id)
        return self.runtime.ContainerStatus(request, timeout=CALL_TIMEOUT).status

    def wait_exited(self, container_id: str, timeout: float = CALL_TIMEOUT) -> cri.ContainerStatus:
        """Poll ContainerStatus, as kubelet's PLEG does, until the container exited."""
        status: list[cri.ContainerStatus] = []

        def exited() -> bool:
            status[:] = [self.status(container_id)]
            return status[0].state == cri.CONTAINER_EXITED

        wait_until(exited, timeout, f"container {container_id[:12]} to exit")
        return status[0]

    @staticmethod
    def stdout(pod: Pod, container: str) -> str:
        """The container's stdout from its CRI log file ("<time> stdout F <line>")."""
        lines = (pod.log_directory / container / "0.log").read_text().splitlines()
        return "".join(line.split(" ", 3)[3] + "\n" for line in lines if line.split(" ", 3)[1:2] == ["stdout"])

    def remove_container(self, container_id: str) -> None:
        self.runtime.StopContainer(cri.StopContainerRequest(container_id=container_id, timeout=0), timeout=CALL_TIMEOUT)
        self.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=container_id), timeout=CALL_TIMEOUT)
        self.containers.remove(container_id)

    def remove_pod(self, pod: Pod) -> None:
        self.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=CALL_TIMEOUT)
        self.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=CALL_TIMEOUT)
        self.pods.remove(pod)

    def close(self) -> None:
        """Remove what is left (a failed test's pods), then close the channels."""
        for container_id in list(self.containers):
            with contextlib.suppress(grpc.RpcError):
                self.remove_container(container_id)
        for pod in list(self.pods):
            with contextlib.suppress(grpc.RpcError):
                self.remove_pod(pod)
        self._runtime_channel.close()
        self._image_channel.close()
