"""A pod's `bootseer.io/prefetch` annotation, seen by the CRI proxy in
kubelet's PullImage: the checkpoint it names, on the node's hdfs-fuse
mount, is prefetched while the image is pulled; paths outside the allowed
roots or off hdfs-fuse mounts are refused, and the pull goes ahead."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from hdfs_fuse import prefetch_client
from proto.k8s.cri.runtime.v1 import api_pb2 as cri
from snapshotter.cri.prefetch import ANNOTATION
from tests.harness.cri import CriNode
from tests.harness.nginx import Nginx
from tests.harness.oci import ImageBuilder, busybox_layer
from tests.harness.procs import wait_until
from tests.hdfs_fuse.conftest import Mount, Tree, mount, nginx, tree  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration


def _sandbox(name: str, annotation: str) -> cri.PodSandboxConfig:
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=name, namespace="default"),
        annotations={ANNOTATION: annotation},
    )


def test_an_annotated_pods_checkpoint_is_prefetched_when_its_image_is_pulled(
    cri_node: CriNode,
    images: ImageBuilder,
    tree: Tree,  # noqa: F811
    nginx: Nginx,  # noqa: F811
    mount: Callable[..., Mount],  # noqa: F811
    tmp_path: Path,
) -> None:
    ckpt = mount(f"{nginx.url}/")
    image = images.push("cri-prefetch/pod", [busybox_layer()])
    outside = tmp_path / "not-a-mount.bin"
    outside.write_bytes(b"local")
    wanted = ckpt.path / "big.bin"
    annotation = f"{wanted}, /etc/passwd {outside}"
    assert cri_node.kubelet().pull(image.ref, sandbox=_sandbox("prefetcher", annotation))
    wait_until(lambda: prefetch_client.status(wanted).state == "done", 60, "the checkpoint's prefetch")
    assert (ckpt.path / "big.bin").read_bytes() == tree.files["big.bin"]
    # Only the named file: the mount's other files were not asked for.
    assert prefetch_client.status(ckpt.path / "odd.bin").state == "none"
    logs = cri_node.snapshotter_logs()
    assert re.search(r"cri.prefetch_refused.*/etc/passwd.*not below \[cri\] prefetch_roots", logs), logs[-3000:]
    assert re.search(rf"cri.prefetch_refused.*{outside.name}.*not on an hdfs-fuse mount", logs), logs[-3000:]
