"""Hot-block manifests in the registry: find an image's published ones,
merge a node's manifest with them, push the result and prune what it
supersedes, so the registry holds a bounded number per image (one, unless
two publishers raced).

A published manifest is an OCI artifact (`artifactType`
application/vnd.bootseer.hot-blocks.v1) whose subject is the image
manifest; on a registry without the referrers API it is listed in the
`sha256-<hex>` tag's index, which layer indexes share. Pruning deletes each
superseded artifact manifest (where the registry allows DELETE) and drops
it from that index, keeping every other entry, then deletes the index
versions it replaced: distribution keeps an untagged copy of every version
of a tag otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import structlog

from recorder import manifest as hot
from recorder.manifest import HotManifest, ManifestError
from recorder.metrics import PRUNED
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.errors import RegistryError
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import Reference

log = structlog.get_logger("bootseer.hotblocks")

# A published manifest may be large; bound what is read of one.
MAX_MANIFEST_BYTES = 32 << 20
# Published manifests merged into a new one at most; older ones are pruned
# unmerged (a registry where every node used to push holds hundreds).
MAX_MERGED = 8


@dataclass(frozen=True)
class Published:
    """One hot-block artifact in the registry; `manifest` is None if its
    blob is missing, malformed or belongs to another image."""

    digest: str
    manifest: HotManifest | None


def find(client: RegistryClient, ref: Reference, image: str) -> list[Published]:
    """`image`'s hot-block artifacts, oldest first; the newest MAX_MERGED are read."""
    listed = artifact.listed(client, ref, image, hot.ARTIFACT_TYPE)
    found = []
    for i, (digest, art) in enumerate(listed):
        manifest = None
        if i >= len(listed) - MAX_MERGED and art.layers:
            try:
                manifest = HotManifest.decode(
                    client.fetch_blob_bytes(ref, art.layers[0].digest, limit=MAX_MANIFEST_BYTES)
                )
            except (ManifestError, RegistryError) as exc:
                log.warning("published hot-block manifest unreadable", image=image, artifact=digest, error=str(exc))
            if manifest is not None and manifest.image != image:
                log.warning("published hot-block manifest belongs to another image", image=image, artifact=digest)
                manifest = None
        found.append(Published(digest, manifest))
    return found


def combine(
    own: HotManifest | None,
    found: Sequence[Published],
    includes: Collection[str],
    check: Callable[[HotManifest], None],
) -> tuple[HotManifest | None, tuple[str, ...]]:
    """`own` merged with every published manifest it does not include yet
    and that `check` accepts (stale ones are left out, to be pruned), and
    the artifacts the result now includes."""
    merged = own
    included = list(includes)
    for published in found:
        if published.manifest is None or published.digest in included:
            continue
        try:
            check(published.manifest)
        except ManifestError as exc:
            log.warning(
                "published hot-block manifest is stale; replacing it", artifact=published.digest, reason=str(exc)
            )
            continue
        merged = published.manifest if merged is None else hot.merge(published.manifest, merged)
        included.append(published.digest)
    return merged, tuple(included)


def push(client: RegistryClient, ref: Reference, image: str, manifest: HotManifest) -> str:
    """Push `manifest` as `image`'s hot-block artifact; returns its digest."""
    data, media_type, digest = client.fetch_manifest(ref.with_digest(image))
    blob = client.push_blob(ref, manifest.encode(), media_type=hot.MEDIA_TYPE)
    subject = Descriptor(media_type, digest, len(data))
    return artifact.push(client, ref, subject, hot.ARTIFACT_TYPE, [Descriptor(hot.MEDIA_TYPE, blob.digest, blob.size)])


def prune(client: RegistryClient, ref: Reference, image: str, superseded: Collection[str], keep: str) -> int:
    """Remove the `superseded` artifacts (never `keep`) from the registry:
    delete them, and drop them from the tag fallback index (where a
    registry refusing deletes still lists them). Best effort; returns how
    many were deleted."""
    gone = [d for d in dict.fromkeys(superseded) if d != keep]
    if not gone:
        return 0
    deleted = 0
    for digest in gone:
        try:
            deleted += client.delete_manifest(ref, digest)
        except RegistryError as exc:
            log.warning("superseded hot-block manifest not deleted", artifact=digest, error=str(exc))
    try:
        client.remove_referrers(ref, image, gone)
    except RegistryError as exc:
        log.warning("superseded hot-block manifests not dropped from the referrers index", error=str(exc))
    PRUNED.inc(deleted)
    log.info("superseded hot-block manifests pruned", image=image, superseded=len(gone), deleted=deleted, kept=keep)
    return deleted


def publish(
    client: RegistryClient, ref: Reference, image: str, manifest: HotManifest, found: Sequence[Published]
) -> str:
    """Push `manifest` (already merged with what it supersedes), prune every
    other artifact in `found` (the registry's manifests for `image`) and
    the versions of the tag fallback index this replaced."""
    versions = [client.referrers_index_digest(ref, image)]
    digest = push(client, ref, image, manifest)
    versions.append(client.referrers_index_digest(ref, image))
    prune(client, ref, image, [p.digest for p in found], keep=digest)
    final = client.referrers_index_digest(ref, image)
    for old in dict.fromkeys(versions):
        if old is not None and old != final:
            try:
                client.delete_manifest(ref, old)
            except RegistryError as exc:
                log.debug("old referrers index not deleted", index=old, error=str(exc))
    return digest
