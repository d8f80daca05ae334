"""Artifacts attached to an image through the OCI referrers mechanism: an
image manifest with an `artifactType`, the empty config, some blobs and a
`subject` naming the image manifest. bootseer keeps its layer indexes and
hot-block manifests in the registry this way."""

from __future__ import annotations

import json
from collections.abc import Sequence

from snapshotter.registry import media
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor, Manifest
from snapshotter.registry.reference import Reference

EMPTY_CONFIG = b"{}"


def empty_config() -> Descriptor:
    return Descriptor(media.OCI_EMPTY, media.digest_of(EMPTY_CONFIG), len(EMPTY_CONFIG))


def build(subject: Descriptor, artifact_type: str, blobs: Sequence[Descriptor]) -> bytes:
    """Deterministic bytes: the same content gives the same digest, which
    keeps re-publishing idempotent."""
    doc = {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "artifactType": artifact_type,
        "config": empty_config().to_json(),
        "layers": [d.to_json() for d in blobs],
        "subject": Descriptor(subject.media_type, subject.digest, subject.size).to_json(),
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def push(
    client: RegistryClient, ref: Reference, subject: Descriptor, artifact_type: str, blobs: Sequence[Descriptor]
) -> str:
    """Push an artifact whose blobs are already in the registry; returns its digest."""
    client.push_blob(ref, EMPTY_CONFIG, media_type=media.OCI_EMPTY)
    return client.push_referrer(ref, build(subject, artifact_type, blobs), media.OCI_MANIFEST, subject.digest)


def referrers(client: RegistryClient, ref: Reference, subject_digest: str, artifact_type: str) -> list[Manifest]:
    """The artifacts of `artifact_type` attached to `subject_digest`, oldest
    first, each fetched by digest and checked to really name that subject."""
    return [parsed for _, parsed in listed(client, ref, subject_digest, artifact_type)]


def listed(
    client: RegistryClient, ref: Reference, subject_digest: str, artifact_type: str
) -> list[tuple[str, Manifest]]:
    """`referrers` with each artifact's manifest digest, which deleting or
    superseding it needs."""
    found = []
    for desc in client.referrers(ref, subject_digest, artifact_type=artifact_type):
        data, media_type, _ = client.fetch_manifest(ref.with_digest(desc.digest))
        parsed = media.parse(data, media_type)
        if isinstance(parsed, Manifest) and parsed.subject is not None and parsed.subject.digest == subject_digest:
            found.append((desc.digest, parsed))
    return found
