"""The OCI artifact that carries an image's layer indexes through the
registry: an image manifest with artifactType ARTIFACT_TYPE, the empty
config, one blob per indexed layer (annotated with the layer digest it
describes) and `subject` = the image manifest. Discovered with the referrers
API or its `sha256-<hex>` tag fallback."""

from __future__ import annotations

import json
from collections.abc import Sequence

from snapshotter.layer.index import ARTIFACT_TYPE, LAYER_ANNOTATION
from snapshotter.registry import media
from snapshotter.registry.media import Descriptor, Manifest

EMPTY_CONFIG = b"{}"


def empty_config() -> Descriptor:
    return Descriptor(media.OCI_EMPTY, media.digest_of(EMPTY_CONFIG), len(EMPTY_CONFIG))


def build_manifest(subject: Descriptor, index_blobs: Sequence[Descriptor]) -> bytes:
    """Deterministic bytes: the same indexes give the same artifact digest,
    which keeps `bootseer index` idempotent."""
    doc = {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": empty_config().to_json(),
        "layers": [d.to_json() for d in index_blobs],
        "subject": Descriptor(subject.media_type, subject.digest, subject.size).to_json(),
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def index_blobs(manifest: Manifest, subject_digest: str) -> dict[str, str]:
    """{layer digest: index blob digest} of an artifact, after checking it
    belongs to `subject_digest`; raises ValueError otherwise."""
    if manifest.subject is None or manifest.subject.digest != subject_digest:
        found = manifest.subject.digest if manifest.subject else "no subject"
        raise ValueError(f"index artifact is for {found}, not {subject_digest}")
    return {
        d.annotations[LAYER_ANNOTATION]: d.digest
        for d in manifest.layers
        if LAYER_ANNOTATION in d.annotations
    }
