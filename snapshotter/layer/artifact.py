"""The layer index artifact: one blob per indexed layer, annotated with the
digest of the layer it describes (see docs/layer-index.md)."""

from __future__ import annotations

from collections.abc import Sequence

from snapshotter.layer.index import LAYER_ANNOTATION
from snapshotter.registry.media import Descriptor, Manifest


def index_blobs(artifacts: Sequence[Manifest]) -> dict[str, Descriptor]:
    """{layer digest: index blob} over the artifacts, newer ones winning."""
    blobs: dict[str, Descriptor] = {}
    for manifest in artifacts:
        for desc in manifest.layers:
            if LAYER_ANNOTATION in desc.annotations:
                blobs[desc.annotations[LAYER_ANNOTATION]] = desc
    return blobs
