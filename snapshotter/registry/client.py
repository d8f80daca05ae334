"""`RegistryClient`: the one OCI distribution client every part uses.

The OCI distribution API (manifests, image resolution, blobs, ranges,
pushes, referrers) over a `Transport`, which picks the endpoints and
handles auth, redirects and retries. Manifests and blobs are checked
against their digests, a mismatch is an error and never a result; ranges
carry no digest, their caller checks them.

How long a registry that stops answering can hold a call: on each endpoint
tried (mirrors, then the server) one request (a manifest) or one body with
its resumes (a blob, a range) gets `retries + 1` tries in all, each waiting
at most `timeout` for any one connect or read, plus the backoff between
them (`backoff * (2**retries - 1)` at most, unless a Retry-After stretches
a wait, to 10 s at most); with the defaults 5 x 30 s + 3.75 s. A
bearer-token exchange can add as much once (`Authenticator`). `fetch_range`
takes a deadline that caps all of it. A mirror costs less: a refused
connection nothing, a connect or an answer that does not come one
`mirrors.connect_timeout_s` or `mirrors.response_timeout_s`, a retryable
status one round trip, and it is then skipped for its backoff period
(`health`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urljoin

import httpx
import structlog

from snapshotter.registry import media, multirange, resumable
from snapshotter.registry.auth import Keychain
from snapshotter.registry.errors import DigestMismatch, NotFound, RegistryError, ServerError, Unreachable
from snapshotter.registry.health import MirrorPolicy
from snapshotter.registry.hosts import Endpoint
from snapshotter.registry.media import Descriptor, Index, Manifest, Platform
from snapshotter.registry.metrics import RETRIES
from snapshotter.registry.reference import Reference
from snapshotter.registry.responses import MAX_MANIFEST_BYTES, next_link, read_small, unexpected
from snapshotter.registry.resumable import BlobBody
from snapshotter.registry.transport import Request, Transport

log = structlog.get_logger("bootseer.registry")

# Pages of a referrers listing followed; bounded against a Link loop.
MAX_REFERRER_PAGES = 100


@dataclass(frozen=True)
class ResolvedImage:
    ref: Reference
    manifest_digest: str
    manifest_bytes: bytes
    media_type: str
    manifest: Manifest
    platform: Platform
    index_digest: str | None = None

    @property
    def manifest_descriptor(self) -> Descriptor:
        return Descriptor(self.media_type, self.manifest_digest, len(self.manifest_bytes))


def _small_body(response: httpx.Response, what: str, ref: Reference) -> bytes:
    """A manifest-sized body; a transfer that breaks or stalls midway is the
    registry's failure like any other, not an HTTP library's exception."""
    try:
        return read_small(response, what, ref)
    except httpx.TransportError as exc:
        raise Unreachable.at(
            ref, f"{what}: the transfer broke ({type(exc).__name__}); check the network to the registry"
        ) from None


def referrers_tag(digest: str) -> str:
    """The OCI referrers tag schema: "sha256:abc..." -> "sha256-abc..."."""
    algorithm, _, hex_part = media.check_digest(digest).partition(":")
    return f"{algorithm}-{hex_part}"[:128]


class RegistryClient:
    def __init__(
        self,
        *,
        plain_http: bool = False,
        certs_dir: Path | None = None,
        keychain: Keychain | None = None,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.25,
        mirrors: MirrorPolicy | None = None,
    ) -> None:
        self.transport = Transport(
            plain_http=plain_http,
            certs_dir=certs_dir,
            keychain=keychain,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            mirrors=mirrors,
        )
        # Also the budget for fetching a blob again after a digest mismatch.
        self.retries = retries

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def endpoints(self, ref: Reference, capability: str) -> list[Endpoint]:
        return self.transport.endpoints(ref, capability)

    # -- manifests ----------------------------------------------------------

    def fetch_manifest(
        self, ref: Reference, *, capability: str | None = None, fresh: bool = False
    ) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of the manifest or index `ref` names.
        A digest in `ref` is verified; for a tag, the registry's
        Docker-Content-Digest (if any) must match what we received.
        `capability="push"` reads from the hosts that take pushes (the
        registry itself, never a caching mirror): what a read-modify-write
        of a tag must see. `fresh` asks the server first, the mirrors only if
        it fails: a tag that lists what others publish."""
        capability = capability or ("pull" if ref.digest else "resolve")

        def call(endpoint: Endpoint) -> tuple[bytes, str, str]:
            response = self.transport.send(
                Request(
                    endpoint,
                    ref,
                    "GET",
                    f"/{ref.repository}/manifests/{ref.object}",
                    headers={"Accept": ", ".join(media.MANIFEST_ACCEPT)},
                )
            )
            if response.status_code != 200:
                raise unexpected(response, f"manifest {ref.object}", ref)
            data = _small_body(response, f"manifest {ref.object}", ref)
            algorithm = ref.digest.partition(":")[0] if ref.digest else "sha256"
            digest = media.digest_of(data, algorithm)
            expected = ref.digest or response.headers.get("Docker-Content-Digest", "")
            if expected and expected.partition(":")[0] == algorithm and expected != digest:
                raise DigestMismatch.at(
                    ref, f"manifest {ref.object}: got {digest}, expected {expected}; a proxy or mirror altered it"
                )
            try:
                media_type = media.detect_media_type(data, response.headers.get("Content-Type", ""))
            except media.InvalidManifest as exc:
                raise ServerError.at(ref, f"manifest {ref.object}: {exc}") from None
            return data, media_type, digest

        if fresh:
            return self.transport.server_first(ref, capability, call)
        return self.transport.over_endpoints(ref, capability, call)

    def resolve(self, ref: Reference, platform: str | None = None) -> ResolvedImage:
        """The image manifest for `ref` on `platform` ("linux/amd64"; default: this host's)."""
        wanted = Platform.parse(platform) if platform else Platform.host()
        data, media_type, digest = self.fetch_manifest(ref)
        index_digest: str | None = None
        try:
            parsed = media.parse(data, media_type)
            if isinstance(parsed, Index):
                index_digest = digest
                try:
                    chosen = media.select_platform(parsed, wanted)
                except LookupError as exc:
                    raise NotFound.at(ref, f"{exc}; pick one with --platform") from None
                data, media_type, digest = self.fetch_manifest(ref.with_digest(chosen.digest))
                parsed = media.parse(data, media_type)
        except media.InvalidManifest as exc:
            raise ServerError.at(ref, f"{ref.object}: {exc}") from None
        if not isinstance(parsed, Manifest) or media_type not in media.IMAGE_MANIFESTS:
            raise ServerError.at(ref, f"{ref.object} is a {media_type}, not an image manifest")
        return ResolvedImage(ref, digest, data, media_type, parsed, wanted, index_digest)

    def _put_manifest(self, ref: Reference, data: bytes, media_type: str, target: str) -> tuple[str, httpx.Headers]:
        digest = media.digest_of(data)

        def call(endpoint: Endpoint) -> tuple[str, httpx.Headers]:
            response = self.transport.send(
                Request(
                    endpoint,
                    ref,
                    "PUT",
                    f"/{ref.repository}/manifests/{target}",
                    actions="pull,push",
                    headers={"Content-Type": media_type},
                    content=data,
                )
            )
            if response.status_code not in (200, 201, 202):
                raise unexpected(response, f"pushing manifest {target}", ref)
            response.close()
            return digest, response.headers

        return self.transport.over_endpoints(ref, "push", call)

    def push_manifest(self, ref: Reference, data: bytes, media_type: str, tag: str | None = None) -> str:
        """Push a manifest under `tag`, or by digest when `tag` is None; returns its digest."""
        return self._put_manifest(ref, data, media_type, tag or media.digest_of(data))[0]

    def delete_manifest(self, ref: Reference, digest: str) -> bool:
        """Delete manifest `digest` (and, in distribution, the tags naming it).
        True once it is gone (a 404 included); False if the registry does
        not allow deletes (distribution without `storage: delete: enabled`
        answers 405 UNSUPPORTED; a 403 is an account without delete rights)."""
        media.check_digest(digest)

        def call(endpoint: Endpoint) -> bool:
            response = self.transport.send(
                Request(endpoint, ref, "DELETE", f"/{ref.repository}/manifests/{digest}", actions="pull,push,delete")
            )
            if response.status_code in (200, 202, 204, 404):
                response.close()
                return True
            if response.status_code in (403, 405):
                response.close()
                return False
            raise unexpected(response, f"deleting manifest {digest}", ref)

        return self.transport.over_endpoints(ref, "push", call)

    # -- blobs --------------------------------------------------------------

    def blob_exists(self, ref: Reference, digest: str) -> bool:
        def call(endpoint: Endpoint) -> bool:
            response = self.transport.send(Request(endpoint, ref, "HEAD", f"/{ref.repository}/blobs/{digest}"))
            response.close()
            if response.status_code == 200:
                return True
            if response.status_code == 404:
                raise NotFound.at(ref, f"blob {digest} not found")
            raise unexpected(response, f"blob {digest}", ref)

        try:
            return self.transport.over_endpoints(ref, "pull", call)
        except NotFound:
            return False

    def fetch_blob(
        self,
        ref: Reference,
        digest: str,
        dest: BinaryIO,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Stream blob `digest` into `dest`, verifying it. A broken transfer
        resumes where it stopped (a Range request); on a digest mismatch a
        seekable `dest` is rewound and the blob fetched again, up to the retry
        budget, else DigestMismatch is raised and `dest` holds rejected bytes."""
        media.check_digest(digest)
        start = dest.tell() if dest.seekable() else None
        for attempt in range(self.retries + 1):
            got, delivered = self._stream_blob(ref, digest, dest, progress)
            if got == digest:
                return
            RETRIES.labels("digest").inc()
            if start is None or attempt == self.retries:
                raise DigestMismatch.at(
                    ref, f"blob {digest}: received bytes hash to {got}; the registry or a proxy corrupted it"
                )
            log.warning("registry.digest_mismatch", host=ref.domain, repository=ref.repository, digest=digest)
            dest.seek(start)
            dest.truncate()
            if progress is not None:
                progress(-delivered)

    def _stream_blob(
        self, ref: Reference, digest: str, dest: BinaryIO, progress: Callable[[int], None] | None
    ) -> tuple[str, int]:
        """One pass of blob `digest` into `dest`: (the digest of what came, its size)."""
        algorithm = digest.partition(":")[0]
        hasher = hashlib.new(algorithm)

        def sink(chunk: bytes) -> None:
            dest.write(chunk)
            hasher.update(chunk)
            if progress is not None:
                progress(len(chunk))

        body = BlobBody(ref, digest, sink)
        # Bytes in `dest` cannot be taken back: once some arrived, their
        # endpoint's failure is final instead of handing over to the next one.
        self.transport.over_endpoints(ref, "pull", partial(resumable.read, self.transport, body), body.started)
        return f"{algorithm}:{hasher.hexdigest()}", body.delivered

    def fetch_blob_bytes(self, ref: Reference, digest: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """A small blob (a config) in memory, verified."""
        buffer = io.BytesIO()
        self.fetch_blob(ref, digest, buffer)
        if buffer.tell() > limit:
            raise ServerError.at(ref, f"blob {digest} is larger than {limit} bytes")
        return buffer.getvalue()

    def fetch_range(self, ref: Reference, digest: str, start: int, end: int, *, deadline: float | None = None) -> bytes:
        """Bytes [start, end) of blob `digest`: exactly end - start of them, or
        an exception. The caller verifies them (ranges carry no digest).

        By `deadline` (a time.monotonic() value) the bytes are in or
        DeadlineExceeded is raised: each try waits at most the time left, and
        no try starts past it. A socket read under way then can outlast it
        by at most the time that was left when its request was sent."""
        buffer = bytearray()
        self.stream_range(ref, digest, start, end, buffer.extend, deadline=deadline)
        return bytes(buffer)

    def stream_range(
        self,
        ref: Reference,
        digest: str,
        start: int,
        end: int,
        sink: Callable[[bytes], None],
        *,
        deadline: float | None = None,
    ) -> None:
        """fetch_range, its bytes handed to `sink` as they arrive: in order,
        each once, end - start of them in all unless an exception ends it."""
        media.check_digest(digest)
        if not 0 <= start < end:
            raise ValueError(f"bad range [{start}, {end})")
        body = BlobBody(ref, digest, sink, start, end, deadline)
        # A mirror that fails mid-range hands over to the next endpoint, which
        # continues from what `sink` already has; one that ignored Range for
        # this blob is not asked for a while.
        self.transport.over_endpoints(ref, "pull", partial(resumable.read, self.transport, body), ranges_of=digest)

    def stream_ranges(
        self,
        ref: Reference,
        digest: str,
        ranges: Sequence[tuple[int, int]],
        sinks: Sequence[Callable[[bytes], None]],
        *,
        deadline: float | None = None,
    ) -> None:
        """stream_range for each of several ranges of one blob, `sinks[i]`
        getting `ranges[i]`'s bytes: asked in one request where the host
        serves multipart/byteranges, and what that does not bring, one
        request per range."""
        media.check_digest(digest)
        if len(ranges) != len(sinks) or any(not 0 <= start < end for start, end in ranges):
            raise ValueError(f"bad ranges {list(ranges)}")
        pairs = zip(ranges, sinks, strict=True)
        bodies = [BlobBody(ref, digest, sink, start, end, deadline) for (start, end), sink in pairs]
        if len(bodies) > 1:
            try:
                self.transport.over_endpoints(
                    ref, "pull", partial(multirange.read_many, self.transport, bodies), ranges_of=digest
                )
            except RegistryError as exc:
                # The requests one range each say what is wrong, with their own retries.
                log.info("registry.multirange_failed", digest=digest, reason=str(exc))
        for body in bodies:
            if not body.done:
                read = partial(resumable.read, self.transport, body)
                self.transport.over_endpoints(ref, "pull", read, ranges_of=digest)

    def push_blob(
        self, ref: Reference, data: bytes, digest: str | None = None, media_type: str = "application/octet-stream"
    ) -> Descriptor:
        """Upload `data` (POST then PUT); nothing is sent if the blob exists."""
        actual = media.digest_of(data)
        if digest is not None and digest != actual:
            raise ValueError(f"push_blob: data hashes to {actual}, not {digest}")
        descriptor = Descriptor(media_type, actual, len(data))
        if self.blob_exists(ref, actual):
            return descriptor

        def call(endpoint: Endpoint) -> None:
            response = self.transport.send(
                Request(endpoint, ref, "POST", f"/{ref.repository}/blobs/uploads/", actions="pull,push")
            )
            if response.status_code != 202 or "Location" not in response.headers:
                raise unexpected(response, "starting a blob upload", ref)
            response.close()
            location = httpx.URL(urljoin(str(response.url), response.headers["Location"]))
            upload = location.copy_merge_params({"digest": actual})
            put = self.transport.send(
                Request(
                    endpoint,
                    ref,
                    "PUT",
                    str(upload),
                    actions="pull,push",
                    headers={"Content-Type": "application/octet-stream"},
                    content=data,
                )
            )
            if put.status_code not in (201, 204):
                raise unexpected(put, f"uploading blob {actual}", ref)
            put.close()

        self.transport.over_endpoints(ref, "push", call)
        return descriptor

    # -- referrers ----------------------------------------------------------

    def referrers(self, ref: Reference, subject_digest: str, artifact_type: str | None = None) -> list[Descriptor]:
        """Manifests whose `subject` is `subject_digest`: the referrers API, or
        (on a 404 from a registry without it) the `sha256-<hex>` tag's index.
        A listing grows as artifacts are published: read from the server
        (the mirrors only if it fails); the artifacts it names are content,
        fetched by digest through the mirrors."""
        media.check_digest(subject_digest)
        found = self._referrers_api(ref, subject_digest, artifact_type)
        if found is None:
            try:
                data, media_type, _ = self.fetch_manifest(ref.with_tag(referrers_tag(subject_digest)), fresh=True)
            except NotFound:
                return []
            parsed = media.parse(data, media_type)
            if not isinstance(parsed, Index):
                raise ServerError.at(ref, f"tag {referrers_tag(subject_digest)} is not an image index")
            found = list(parsed.manifests)
        if artifact_type:
            found = [d for d in found if d.artifact_type == artifact_type]
        return found

    def _referrers_api(self, ref: Reference, subject_digest: str, artifact_type: str | None) -> list[Descriptor] | None:
        """None when the registry has no referrers API."""

        def call(endpoint: Endpoint) -> list[Descriptor] | None:
            found: list[Descriptor] = []
            url = f"/{ref.repository}/referrers/{subject_digest}"
            params = {"artifactType": artifact_type} if artifact_type else {}
            for _ in range(MAX_REFERRER_PAGES):
                response = self.transport.send(
                    Request(endpoint, ref, "GET", url, params=params, headers={"Accept": media.OCI_INDEX})
                )
                if response.status_code == 404:
                    response.close()
                    return None
                if response.status_code != 200:
                    raise unexpected(response, f"referrers of {subject_digest}", ref)
                link = response.headers.get("Link", "")
                data = _small_body(response, "referrers index", ref)
                try:
                    parsed = media.parse(data, media.OCI_INDEX)
                except media.InvalidManifest as exc:
                    raise ServerError.at(ref, f"referrers of {subject_digest}: {exc}") from None
                assert isinstance(parsed, Index)
                found.extend(parsed.manifests)
                next_url = next_link(link)
                if next_url is None:
                    return found
                url, params = urljoin(str(response.url), next_url), {}
            return found

        try:
            return self.transport.server_first(ref, "pull", call)
        except NotFound:
            return None

    def push_referrer(self, ref: Reference, artifact_manifest: bytes, media_type: str, subject_digest: str) -> str:
        """Push a manifest whose `subject` is `subject_digest` (by digest) and
        make it listable: a registry without the referrers API (no OCI-Subject
        header in its answer) gets the `sha256-<hex>` tag index updated, once
        per artifact however often this is called."""
        parsed = media.parse(artifact_manifest, media_type)
        if not isinstance(parsed, Manifest) or parsed.subject is None or parsed.subject.digest != subject_digest:
            raise ValueError(f"push_referrer: the manifest's subject must be {subject_digest}")
        digest, headers = self._put_manifest(ref, artifact_manifest, media_type, media.digest_of(artifact_manifest))
        if headers.get("OCI-Subject") == subject_digest:
            return digest
        tag = referrers_tag(subject_digest)
        try:
            data, index_type, _ = self.fetch_manifest(ref.with_tag(tag), capability="push")
            existing = media.parse(data, index_type)
            if not isinstance(existing, Index):
                raise ServerError.at(ref, f"tag {tag} exists but is not an image index; it cannot hold referrers")
        except NotFound:
            existing = Index(media.OCI_INDEX, ())
        if any(d.digest == digest for d in existing.manifests):
            return digest
        entry = Descriptor(
            media_type=media_type,
            digest=digest,
            size=len(artifact_manifest),
            annotations=parsed.annotations,
            artifact_type=media.artifact_type_of(parsed),
        )
        updated = Index(media.OCI_INDEX, (*existing.manifests, entry), existing.annotations)
        self.push_manifest(ref, updated.to_bytes(), media.OCI_INDEX, tag=tag)
        return digest

    def referrers_index_digest(self, ref: Reference, subject_digest: str) -> str | None:
        """The digest of the `sha256-<hex>` tag fallback index of
        `subject_digest` as the registry itself holds it; None if there is none."""
        try:
            return self.fetch_manifest(ref.with_tag(referrers_tag(subject_digest)), capability="push")[2]
        except NotFound:
            return None

    def remove_referrers(self, ref: Reference, subject_digest: str, digests: Collection[str]) -> str | None:
        """Drop `digests` from the `sha256-<hex>` tag fallback index of
        `subject_digest`, keeping every other entry (a registry with the
        referrers API drops a deleted manifest from its listing by itself).
        Returns the index's digest afterwards, None if there is no index.
        Like every tag update, a read-modify-write: the caller bounds who
        writes it at the same time."""
        tag = referrers_tag(subject_digest)
        try:
            data, index_type, current = self.fetch_manifest(ref.with_tag(tag), capability="push")
        except NotFound:
            return None
        existing = media.parse(data, index_type)
        if not isinstance(existing, Index):
            raise ServerError.at(ref, f"tag {tag} exists but is not an image index; it cannot hold referrers")
        kept = tuple(d for d in existing.manifests if d.digest not in digests)
        if len(kept) == len(existing.manifests):
            return current
        updated = Index(media.OCI_INDEX, kept, existing.annotations)
        return self.push_manifest(ref, updated.to_bytes(), media.OCI_INDEX, tag=tag)
