"""Checkpoints in a pod: the host's hdfs-fuse mount, seen by a container
through a hostPath-style bind mount with no added capability, reads
byte-identical; with HostToContainer propagation (rslave) a mount the host
makes after the container started shows inside it too; and a pod has a
file prefetched by reading its attribute (the host's /usr, bind-mounted,
gives the pod a Python)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hdfs_fuse import prefetch_client
from tests.harness.containerd import BindMount, Containerd, start_containerd
from tests.harness.nginx import Nginx
from tests.harness.oci import Dir, Symlink, busybox_layer, write_layout
from tests.hdfs_fuse.conftest import Mount, Tree
from tests.hdfs_fuse.test_prefetch import metric

pytestmark = pytest.mark.integration

IMAGE = "bootseer.test/ckpt-reader:v1"


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    scratch = Path(tempfile.mkdtemp(prefix="bs-ckpt-pod-", dir="/tmp"))
    layer = [*busybox_layer(), Symlink("/lib", "usr/lib"), Symlink("/lib64", "usr/lib64"), Dir("/usr")]
    layout = write_layout(scratch / "layout", [layer], tag="v1")
    node = start_containerd(scratch / "no-proxy-snapshotter.sock")
    try:
        node.import_layout(layout.directory, IMAGE.rsplit(":", 1)[0])
        yield node
    finally:
        leftovers = node.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        assert not leftovers, leftovers


def _sha256_in_pod(containerd: Containerd, name: str, script: str, *mounts: BindMount) -> str:
    result = containerd.run_with_mounts(IMAGE, name, "/bin/sh", "-euc", script, mounts=mounts, snapshotter="overlayfs")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()[0]


def test_a_pod_reads_a_checkpoint_through_the_hosts_mount(
    tree: Tree, nginx: Nginx, mount: Callable[..., Mount], containerd: Containerd, tmp_path: Path
) -> None:
    ckpt = mount(f"{nginx.url}/", "--allow-other")
    want = hashlib.sha256(tree.files["big.bin"]).hexdigest()
    volume = BindMount(ckpt.path, "/ckpt", read_only=True)
    assert _sha256_in_pod(containerd, f"ckpt-{tmp_path.name}", "sha256sum /ckpt/big.bin", volume) == want


# What a job's entry point runs first: ask for the checkpoint, wait for it.
_PREFETCH = f"""
import os, sys, time
path = sys.argv[1]
print(os.getxattr(path, "{prefetch_client.XATTR}").decode())
while (status := os.getxattr(path, "{prefetch_client.STATUS_XATTR}").decode()).startswith("running"):
    time.sleep(0.05)
print(status)
"""


def test_a_pod_has_a_checkpoint_prefetched_through_the_hosts_mount(
    tree: Tree, nginx: Nginx, mount: Callable[..., Mount], containerd: Containerd, tmp_path: Path
) -> None:
    ckpt = mount(f"{nginx.url}/", "--allow-other")
    data = tree.files["big.bin"]
    script = f"/usr/bin/python3 -I -c '{_PREFETCH}' /ckpt/big.bin >&2; sha256sum /ckpt/big.bin"
    volumes = (BindMount(ckpt.path, "/ckpt", read_only=True), BindMount(Path("/usr"), "/usr", read_only=True))
    assert _sha256_in_pod(containerd, f"pf-{tmp_path.name}", script, *volumes) == hashlib.sha256(data).hexdigest()
    assert metric(ckpt, "bootseer_hdfs_fuse_prefetched_bytes_total") == len(data)
    # The pod's read found every page in the cache, but for the few the
    # kernel's proactive reclaim (DAMON, on these VMs) may have taken back.
    assert metric(ckpt, "bootseer_hdfs_fuse_fuse_read_request_bytes_sum") <= len(data) // 100


@pytest.fixture
def shared_volume(tmp_path: Path) -> Iterator[Path]:
    """A hostPath directory the host mounts checkpoints under later: a
    shared mount, as / is on a systemd host. Set up before (so torn down
    after) the mounts made in it."""
    volume = tmp_path / "ckpts"
    volume.mkdir()
    subprocess.run(["mount", "--bind", str(volume), str(volume)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(volume)], check=True)
        yield volume
    finally:
        subprocess.run(["umount", str(volume)], check=False)


def test_a_mount_made_after_the_pod_started_shows_with_host_to_container_propagation(
    tree: Tree, nginx: Nginx, shared_volume: Path, mount: Callable[..., Mount], containerd: Containerd, tmp_path: Path
) -> None:
    volume = BindMount(shared_volume, "/ckpts", read_only=True, propagation="rslave")
    started = tmp_path / "started"
    # The pod says it runs (through a second, writable volume), then waits
    # for the checkpoint to appear, at most 60 s.
    script = (
        "touch /signal/started; i=0; "
        "while [ ! -e /ckpts/mnt0/big.bin ]; do i=$((i+1)); [ $i -lt 600 ] || exit 3; sleep 0.1; done; "
        "sha256sum /ckpts/mnt0/big.bin"
    )
    signal = BindMount(tmp_path, "/signal")
    outcome: dict[str, subprocess.CompletedProcess[str]] = {}

    def run() -> None:
        outcome["pod"] = containerd.run_with_mounts(
            IMAGE, f"late-{tmp_path.name}", "/bin/sh", "-euc", script, mounts=(volume, signal), snapshotter="overlayfs"
        )

    pod = threading.Thread(target=run)
    pod.start()
    try:
        for _ in range(600):
            if started.exists() or not pod.is_alive():
                break
            pod.join(0.1)
        assert started.exists(), outcome
        mount(f"{nginx.url}/", "--allow-other", directory=shared_volume)
    finally:
        pod.join(120)
    result = outcome["pod"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split()[0] == hashlib.sha256(tree.files["big.bin"]).hexdigest()
