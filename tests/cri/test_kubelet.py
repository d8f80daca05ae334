"""Kubernetes end to end, the tests playing kubelet: PullImage of a private
image through bootseer's CRI proxy with the credentials only in the
AuthConfig, a host-network pod whose container reads a small file of the
large layer, lazily; wrong credentials; removal and garbage collection;
both bootseer daemons restarted between pulls."""

from __future__ import annotations

import stat

import grpc
import pytest

from proto.k8s.cri.runtime.v1 import api_pb2 as cri
from snapshotter.cri.credentials import CriCredentialStore, PullSecret
from tests.cri.conftest import SMALL_CONTENT, SMALL_FILE, PrivateImage, PrivateImages, kubelet_auth
from tests.harness.cri import CriNode, Kubelet, Pod
from tests.harness.registry import PASSWORD, USER

pytestmark = pytest.mark.integration

FETCHED = "bootseer_fs_fetched_bytes_total"
PREFETCHED = "bootseer_fs_prefetched_bytes_total"
REMOTE_LABEL = "containerd.io/snapshot/remote"


def run_to_completion(kubelet: Kubelet, pod: Pod, name: str, image: str, command: list[str]) -> str:
    """Create and start a container, wait for it to exit 0; its stdout."""
    container = kubelet.start_container(pod, name, image, command)
    status = kubelet.wait_exited(container)
    assert status.exit_code == 0, (status.exit_code, status.reason, status.message, kubelet.stdout(pod, name))
    out = kubelet.stdout(pod, name)
    kubelet.remove_container(container)
    return out


def assert_lazy(node: CriNode, image: PrivateImage) -> None:
    """The large layer is served by bootseer: never in containerd's content store."""
    c = node.containerd
    assert c.namespace == "k8s.io"
    assert image.layout.layer_digests[-1] not in c.ctr("content", "ls", "-q").stdout
    info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", image.layout.chain_ids[-1]).stdout
    assert f'"{REMOTE_LABEL}": "true"' in info, info


def assert_gone(node: CriNode, image: PrivateImage) -> None:
    """No snapshot of the image in bootseer and none of its layers in the layer store."""
    left = set(image.layout.chain_ids) & set(node.containerd.snapshots())
    assert not left, left
    stored = [d for d in image.layout.layer_digests if (node.config.store / d.split(":")[1]).exists()]
    assert not stored, stored


def daemon_logs(node: CriNode) -> str:
    daemons = [*node.snapshotter.incarnations, *node.layers.incarnations]
    return "\n".join(d.log_path.read_text(errors="replace") for d in daemons)


def test_private_image_pulled_through_the_proxy_starts_lazily(
    cri_node: CriNode, private_images: PrivateImages, unique: str
) -> None:
    image = private_images.push(f"private/cri-{unique}", 64 << 20, seed=1)
    private_images.index(cri_node, image)
    assert not cri_node.config.docker_config.exists()  # the node has no credentials of its own
    kubelet = cri_node.kubelet()
    try:
        assert kubelet.version().runtime_api_version == "v1"
        before = cri_node.layers.metric(FETCHED)
        image_id = kubelet.pull(image.ref, kubelet_auth())
        assert image_id.startswith("sha256:")

        credentials = cri_node.config.cri_credentials
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        assert stat.S_IMODE(credentials.parent.stat().st_mode) == 0o700
        ref = image.reference
        assert CriCredentialStore(credentials).get(ref.domain, ref.repository) == PullSecret(USER, PASSWORD)

        pod = kubelet.run_pod(f"lazy-{unique}")
        assert run_to_completion(kubelet, pod, "reader", image.ref, ["/bin/cat", SMALL_FILE]) == SMALL_CONTENT.decode()
        assert_lazy(cri_node, image)
        fetched = cri_node.layers.metric(FETCHED) - before
        big = image.layout.layer_sizes[-1]
        assert 0 < fetched < big * 0.05, (fetched, big)
        assert PASSWORD not in daemon_logs(cri_node)

        kubelet.remove_pod(pod)
        kubelet.remove_image(image.ref)  # containerd collects garbage synchronously on the last name
        status = kubelet.images.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=image.ref)))
        assert not status.HasField("image")
        assert_gone(cri_node, image)
    finally:
        kubelet.close()


def test_wrong_password_fails_the_pull_and_keeps_what_worked(
    cri_node: CriNode, private_images: PrivateImages, unique: str
) -> None:
    image = private_images.push(f"private/wrong-{unique}", 1 << 20, seed=2)
    store = CriCredentialStore(cri_node.config.cri_credentials)
    host, repository = image.reference.domain, image.reference.repository
    kubelet = cri_node.kubelet()
    try:
        with pytest.raises(grpc.RpcError) as info:
            kubelet.pull(image.ref, kubelet_auth("not-the-password"))
        error = info.value
        assert isinstance(error, grpc.Call) and error.code() != grpc.StatusCode.OK
        assert "401" in (error.details() or ""), error.details()
        assert store.get(host, repository) is None  # refused credentials are never kept

        kubelet.pull(image.ref, kubelet_auth())
        assert store.get(host, repository) == PullSecret(USER, PASSWORD)
        with pytest.raises(grpc.RpcError):
            kubelet.pull(image.ref, kubelet_auth("not-the-password"))
        assert store.get(host, repository) == PullSecret(USER, PASSWORD)
        assert "not-the-password" not in daemon_logs(cri_node)
        kubelet.remove_image(image.ref)
    finally:
        kubelet.close()


def test_proxy_answers_as_containerd_does(cri_node: CriNode, private_images: PrivateImages, unique: str) -> None:
    """The same calls through the proxy and straight to containerd's CRI."""
    kubelet = cri_node.kubelet()
    direct = Kubelet(cri_node.containerd.address, cri_node.containerd.address, kubelet.pods_dir, kubelet.cgroup_parent)
    try:
        missing = f"{private_images.builder.registry_host}/private/none-{unique}:v1"
        errors: list[tuple[grpc.StatusCode, str | None]] = []
        for client in (kubelet, direct):
            with pytest.raises(grpc.RpcError) as info:
                client.pull(missing, kubelet_auth())
            assert isinstance(info.value, grpc.Call)
            errors.append((info.value.code(), info.value.details()))
        assert errors[0] == errors[1]
        fs_infos = [c.images.ImageFsInfo(cri.ImageFsInfoRequest(), timeout=30) for c in (kubelet, direct)]
        assert [f.image_filesystems[0].fs_id.mountpoint for f in fs_infos] == [
            fs_infos[1].image_filesystems[0].fs_id.mountpoint
        ] * 2
    finally:
        direct.close()
        kubelet.close()


def test_restarted_daemons_keep_the_credentials(cri_node: CriNode, private_images: PrivateImages, unique: str) -> None:
    image = private_images.push(f"private/restart-{unique}", 32 << 20, seed=3)
    private_images.index(cri_node, image)
    kubelet = cri_node.kubelet()
    try:
        kubelet.pull(image.ref, kubelet_auth())
        pod = kubelet.run_pod(f"before-{unique}")
        assert run_to_completion(kubelet, pod, "reader", image.ref, ["/bin/cat", SMALL_FILE]) == SMALL_CONTENT.decode()
        kubelet.remove_pod(pod)

        cri_node.restart_bootseer()
        # No PullImage since the restart (the image is present, as with
        # imagePullPolicy IfNotPresent): the new layer server fetches blocks
        # it never had with the credentials it finds on disk.
        pod = kubelet.run_pod(f"after-{unique}")
        out = run_to_completion(kubelet, pod, "sum", image.ref, ["/bin/sha256sum", "/data/weights-a.bin"])
        assert out.split()[0] == image.sha256["/data/weights-a.bin"]
        kubelet.remove_pod(pod)
        kubelet.remove_image(image.ref)
        assert_gone(cri_node, image)

        # kubelet pulls again with the same secret: nothing new to keep, and
        # the pod starts lazily again.
        credentials = cri_node.config.cri_credentials
        kept = credentials.stat()
        before = cri_node.layers.metric(FETCHED) - cri_node.layers.metric(PREFETCHED)
        kubelet.pull(image.ref, kubelet_auth())
        assert (credentials.stat().st_ino, credentials.stat().st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
        pod = kubelet.run_pod(f"again-{unique}")
        assert run_to_completion(kubelet, pod, "reader", image.ref, ["/bin/cat", SMALL_FILE]) == SMALL_CONTENT.decode()
        assert_lazy(cri_node, image)
        # What the pod's reads fetched; the hot-block prefetch of an earlier run's
        # recording may add its blocks on top.
        on_demand = cri_node.layers.metric(FETCHED) - cri_node.layers.metric(PREFETCHED) - before
        assert on_demand < image.layout.layer_sizes[-1] * 0.1
        kubelet.remove_pod(pod)
        kubelet.remove_image(image.ref)
    finally:
        kubelet.close()
