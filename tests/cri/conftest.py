"""A Kubernetes node played over the CRI: containerd's real CRI plugin, the
bootseer snapshotter serving the image-service proxy, the layer server;
images in the registry that wants a login, indexed by "CI" (its own
credentials, never the node's)."""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proto.k8s.cri.runtime.v1 import api_pb2 as cri
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.cri import CriNode, push_pause_image, start_cri_node, stop_cri_node
from tests.harness.oci import Dir, File, ImageBuilder, ImageLayout, PushedImage, busybox_layer
from tests.harness.registry import PASSWORD, USER, AuthRegistry, Registry
from tests.harness.trust import signing_keys

# Blocks of 1 MiB (uncompressed) instead of the default 4 MiB, so reading one
# small file costs a small share of a layer of a few tens of MB.
SPAN = 1 << 20
SMALL_FILE = "/data/config.json"
SMALL_CONTENT = b'{"lr": 0.001}\n'


def kubelet_auth(password: str = PASSWORD) -> cri.AuthConfig:
    """What kubelet sends for an imagePullSecret of the private registry."""
    return cri.AuthConfig(username=USER, password=password)


@dataclass(frozen=True)
class PrivateImage:
    pushed: PushedImage
    # sha256 (hex) of the large layer's files, by path.
    sha256: dict[str, str]

    @property
    def ref(self) -> str:
        return self.pushed.ref

    @property
    def layout(self) -> ImageLayout:
        return self.pushed.layout

    @property
    def reference(self) -> Reference:
        return parse_reference(self.ref)


@dataclass
class PrivateImages:
    """Builds images in the registry that wants a login and indexes them
    the way a CI job would, with its own docker config."""

    builder: ImageBuilder
    ci_config: Path

    def push(self, name: str, big_bytes: int, seed: int) -> PrivateImage:
        """One small layer (busybox and a marker, unique to this image) and one
        large layer: a small file first, then `big_bytes` that do not compress."""
        small = [*busybox_layer(), File(f"/etc/image-{name.replace('/', '-')}", name.encode())]
        rng = random.Random(seed)
        files = [
            File(SMALL_FILE, SMALL_CONTENT),
            File("/data/weights-a.bin", rng.randbytes(big_bytes // 2)),
            File("/data/weights-b.bin", rng.randbytes(big_bytes - big_bytes // 2)),
        ]
        pushed = self.builder.push(name, [small, [Dir("/data"), *files]], cmd=["/bin/cat", SMALL_FILE])
        return PrivateImage(pushed, {f.path: hashlib.sha256(f.data).hexdigest() for f in files})

    def index(self, node: CriNode, image: PrivateImage) -> None:
        node.bootseer("index", "--quiet", "--span", str(SPAN), image.ref, config=self.ci_config)


@pytest.fixture(scope="session")
def cri_node(registry: Registry, auth_registry: AuthRegistry, images: ImageBuilder) -> Iterator[CriNode]:
    pause = push_pause_image(images)
    node = start_cri_node([registry.host, auth_registry.host], pause.ref)
    try:
        yield node
    finally:
        stop_cri_node(node)


@pytest.fixture(scope="session")
def private_images(auth_registry: AuthRegistry, cri_node: CriNode) -> Iterator[PrivateImages]:
    workdir = Path(tempfile.mkdtemp(prefix="bs-img-", dir="/tmp"))
    ci_config = workdir / "ci.toml"
    ci_config.write_text(
        f"""[log]
level = "warning"

[registry]
config_path = "{cri_node.config.certs_dir}"
docker_config = "{auth_registry.docker_config()}"
cri_credentials = ""

{signing_keys().toml()}"""
    )
    try:
        yield PrivateImages(ImageBuilder(auth_registry.host, workdir, creds=f"{USER}:{PASSWORD}"), ci_config)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
