"""`bootseer index IMAGE`: read each layer of an image once, build its layer
index and push the indexes as an OCI artifact whose subject is the image
manifest, each index signed with the `[trust] signing_key` if there is one.
Idempotent: layers already indexed (with this index format version, and
signed by this key when there is one) are not read again."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from snapshotter.layer.artifact import index_blobs
from snapshotter.layer.build import UnsupportedLayer, build_index
from snapshotter.layer.index import (
    ARTIFACT_TYPE,
    DEFAULT_SPAN,
    FORMAT_VERSION,
    LAYER_ANNOTATION,
    MEDIA_TYPE,
    VERSION_ANNOTATION,
    LayerIndex,
)
from snapshotter.layer.signature import Signature, Verifier, key_id, sign
from snapshotter.registry import artifact, media
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import Reference

log = structlog.get_logger("bootseer.index")

# Layer media types the index can describe; others (zstd) take the normal path.
INDEXABLE = (media.OCI_LAYER, media.OCI_LAYER_GZIP, media.DOCKER_LAYER_GZIP)


@dataclass
class IndexReport:
    manifest_digest: str
    artifact_digest: str = ""
    signer: str = ""  # key_id the new indexes are signed with; "" unsigned
    indexed: list[str] = field(default_factory=list)  # layers indexed by this run
    reused: list[str] = field(default_factory=list)  # layers an earlier run indexed
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why not lazily servable


def index_image(
    client: RegistryClient,
    ref: Reference,
    platform: str | None = None,
    span: int | None = None,
    show_progress: bool = True,
    signing_key: Ed25519PrivateKey | None = None,
) -> IndexReport:
    image = client.resolve(ref, platform)
    report = IndexReport(manifest_digest=image.manifest_digest)
    if signing_key is not None:
        report.signer = key_id(signing_key.public_key())
    existing = index_blobs(artifact.referrers(client, ref, image.manifest_digest, ARTIFACT_TYPE), _current(signing_key))
    blobs: list[Descriptor] = []
    for layer in image.manifest.layers:
        if layer.digest in existing:
            report.reused.append(layer.digest)
            blobs.append(existing[layer.digest])
            continue
        if layer.media_type not in INDEXABLE:
            report.skipped[layer.digest] = f"media type {layer.media_type} cannot be indexed"
            continue
        try:
            encoded = _index_layer(client, ref, layer, span, show_progress)
        except UnsupportedLayer as exc:
            report.skipped[layer.digest] = str(exc)
            log.warning("layer cannot be served lazily", layer=layer.digest, reason=str(exc))
            continue
        desc = client.push_blob(ref, encoded, media_type=MEDIA_TYPE)
        annotations = {LAYER_ANNOTATION: layer.digest, VERSION_ANNOTATION: str(FORMAT_VERSION)}
        if signing_key is not None:
            annotations |= sign(signing_key, layer.digest, desc.digest).annotations()
        blobs.append(Descriptor(MEDIA_TYPE, desc.digest, desc.size, annotations=annotations))
        report.indexed.append(layer.digest)
    if not report.indexed:
        # Nothing new: whatever artifact exists already says all we know.
        return report
    report.artifact_digest = artifact.push(client, ref, image.manifest_descriptor, ARTIFACT_TYPE, blobs)
    return report


def _current(signing_key: Ed25519PrivateKey | None) -> Callable[[str, Descriptor], bool]:
    """Which existing index blobs stand: one of this format version (one an
    older bootseer built, without the version annotation, is format 1 without
    a diff_id), and signed by this run's key if it has one. Anything else is
    built again, so that running `bootseer index` upgrades an image or signs
    its indexes; this run never vouches for an index it did not build."""
    verifier = Verifier([signing_key.public_key()]) if signing_key is not None else None

    def current(layer_digest: str, blob: Descriptor) -> bool:
        if blob.annotations.get(VERSION_ANNOTATION) != str(FORMAT_VERSION):
            return False
        if verifier is None:
            return True
        return verifier.verify(Signature.from_annotations(blob.annotations), layer_digest, blob.digest)

    return current


def _index_layer(
    client: RegistryClient, ref: Reference, layer: Descriptor, span: int | None, show_progress: bool
) -> bytes:
    short = layer.digest.split(":")[1][:12]
    with tempfile.TemporaryDirectory(prefix="bootseer-index-") as tmp:
        blob = Path(tmp) / "blob"
        with (
            tqdm(
                total=layer.size,
                unit="B",
                unit_scale=True,
                desc=f"fetch {short}",
                disable=not show_progress,
                leave=False,
            ) as bar,
            open(blob, "wb") as out,
        ):
            client.fetch_blob(ref, layer.digest, out, progress=_advance(bar))
        with tqdm(
            total=layer.size,
            unit="B",
            unit_scale=True,
            desc=f"index {short}",
            disable=not show_progress,
            leave=False,
        ) as bar:
            try:
                # A span asked for is every block's; the default's blocks are
                # merged where the data does not compress (build.coarsen).
                index = build_index(
                    blob, layer.digest, span=span or DEFAULT_SPAN, progress=_advance(bar), coarse=span is None
                )
                encoded = index.encode()
                # Exactly what the snapshotter will decode: never push an
                # index it refuses.
                LayerIndex.decode(encoded)
            except UnsupportedLayer:
                raise
            except Exception as exc:
                # Whatever this layer holds that the builder cannot take (a
                # corrupt gzip stream, a value out of range) is this layer's
                # problem, not the image's: the other layers are indexed.
                log.warning("could not index a layer", layer=layer.digest, exc_info=exc)
                raise UnsupportedLayer(f"its index could not be built: {exc!r}") from exc
    log.info(
        "layer indexed",
        layer=layer.digest,
        blocks=len(index.blocks),
        entries=len(index.entries),
        uncompressed=index.uncompressed_size,
    )
    return encoded


def _advance(bar: tqdm[Any]) -> Callable[[int], None]:
    def advance(n: int) -> None:
        bar.update(n)

    return advance
