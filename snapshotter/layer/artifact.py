"""The layer index artifact: one blob per indexed layer, annotated with the
digest of the layer it describes and, when signed, its signature (see
docs/layer-index.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from snapshotter.layer.index import LAYER_ANNOTATION
from snapshotter.registry.media import Descriptor, Manifest


def _any(layer_digest: str, blob: Descriptor) -> bool:
    return True


def index_blobs(
    artifacts: Sequence[Manifest], accept: Callable[[str, Descriptor], bool] = _any
) -> dict[str, Descriptor]:
    """{layer digest: index blob} over the artifacts (oldest first): for each
    layer, the newest blob `accept(layer digest, blob)` takes. A newer
    artifact someone else attached cannot hide an accepted one."""
    blobs: dict[str, Descriptor] = {}
    for manifest in artifacts:
        for desc in manifest.layers:
            layer = desc.annotations.get(LAYER_ANNOTATION)
            if layer is not None and accept(layer, desc):
                blobs[layer] = desc
    return blobs
