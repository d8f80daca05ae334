"""containerd's labels, in one place: every key bootseer reads or writes,
containerd's size cap, the writer (`bootseer pull` sets what containerd's
CRI plugin sets on a Prepare) and the typed reader the remote Prepare path
uses.

Snapshot labels on a Prepare of an image layer, as the CRI plugin (and
`bootseer pull`) set them:

    containerd.io/snapshot.ref                  the chainID to commit under
    containerd.io/snapshot/cri.image-ref        host/repo:tag or @digest
    containerd.io/snapshot/cri.layer-digest     the layer blob's digest
    containerd.io/snapshot/cri.manifest-digest  the image manifest (newer CRI only)
    containerd.io/snapshot/cri.image-layers     this layer and those above it,
                                                comma-separated, truncated to fit

plus the layer descriptor's own annotations under `containerd.io/snapshot/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from snapshotter.registry.media import Descriptor

# containerd rejects a label whose key and value together exceed this.
MAX_LABEL_BYTES = 4096

TARGET_REF = "containerd.io/snapshot.ref"
SNAPSHOT_PREFIX = "containerd.io/snapshot/"
IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"
IMAGE_LAYERS = "containerd.io/snapshot/cri.image-layers"
# Marks the snapshots the remote path created, as stargz does.
REMOTE = "containerd.io/snapshot/remote"

# Content labels containerd's own fetcher sets on a layer blob.
UNCOMPRESSED = "containerd.io/uncompressed"
DISTRIBUTION_SOURCE_PREFIX = "containerd.io/distribution.source."

# Garbage-collection references: what a manifest, a config or a lease keeps alive.
GC_REF_CONFIG = "containerd.io/gc.ref.content.config"
GC_REF_LAYER_PREFIX = "containerd.io/gc.ref.content.l."
GC_REF_SNAPSHOT_PREFIX = "containerd.io/gc.ref.snapshot."
GC_EXPIRE = "containerd.io/gc.expire"


def label_bytes(key: str, value: str) -> int:
    """What containerd counts against MAX_LABEL_BYTES."""
    return len(key.encode()) + len(value.encode())


# -- writer ------------------------------------------------------------------


def image_layers_value(layer_digests: Sequence[str]) -> str:
    """Comma-separated digests, dropping the tail until key and value fit the cap."""
    value = ""
    for digest in layer_digests:
        candidate = f"{value},{digest}" if value else digest
        if label_bytes(IMAGE_LAYERS, candidate) > MAX_LABEL_BYTES:
            break
        value = candidate
    return value


def remote_snapshot_labels(
    image_ref: str, manifest_digest: str, layers: Sequence[Descriptor], index: int, chain_id: str
) -> dict[str, str]:
    """Labels for Prepare of layer `index`: what a remote snapshotter needs
    to find and serve it, as containerd's CRI plugin sets them."""
    layer = layers[index]
    labels = {
        key: value
        for key, value in layer.annotations.items()
        if key.startswith(SNAPSHOT_PREFIX) and label_bytes(key, value) <= MAX_LABEL_BYTES
    }
    labels.update(
        {
            TARGET_REF: chain_id,
            IMAGE_REF: image_ref,
            LAYER_DIGEST: layer.digest,
            MANIFEST_DIGEST: manifest_digest,
        }
    )
    layer_list = image_layers_value([d.digest for d in layers[index:]])
    if layer_list:
        labels[IMAGE_LAYERS] = layer_list
    return labels


def distribution_source(domain: str, repository: str) -> tuple[str, str]:
    """containerd.io/distribution.source.<host> = <repository>, as containerd's fetcher sets it."""
    return f"{DISTRIBUTION_SOURCE_PREFIX}{domain}", repository


# -- reader ------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteLayerLabels:
    """A Prepare that asks for a remote (lazy) layer."""

    target: str  # the chainID
    image_ref: str
    layer_digest: str
    # Empty when containerd's CRI does not set it (older versions).
    manifest_digest: str
    # The layers above this one that come next, bottom first.
    upcoming: tuple[str, ...]

    @classmethod
    def parse(cls, labels: dict[str, str]) -> RemoteLayerLabels | None:
        """The remote-layer labels of a Prepare, or None if it is an ordinary one."""
        if not all(key in labels for key in (TARGET_REF, IMAGE_REF, LAYER_DIGEST)):
            return None
        layer = labels[LAYER_DIGEST]
        above = labels.get(IMAGE_LAYERS, "").split(",")
        return cls(
            target=labels[TARGET_REF],
            image_ref=labels[IMAGE_REF],
            layer_digest=layer,
            manifest_digest=labels.get(MANIFEST_DIGEST, ""),
            upcoming=tuple(d for d in above if d and d != layer),
        )
