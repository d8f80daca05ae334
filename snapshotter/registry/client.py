"""`RegistryClient`: the one OCI distribution client every part uses.

Synchronous httpx over HTTP/1.1. Each request goes to the endpoints that
hosts.toml lists for the registry (mirrors first, then the server), with
retries and exponential backoff plus jitter on 5xx, 429, resets and
timeouts. Authentication follows the registry's challenge: basic auth, or
a bearer token fetched from the challenge's realm and cached per scope.
Credentials go only to the registry endpoint they belong to: a redirect to
another origin (blob storage) is followed without them.
"""

from __future__ import annotations

import hashlib
import io
import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

import httpx
import structlog

from snapshotter.registry import media
from snapshotter.registry.auth import (
    Challenge,
    Keychain,
    TokenCache,
    parse_challenges,
    parse_token_response,
    scope_for,
)
from snapshotter.registry.errors import (
    DigestMismatch,
    NotFound,
    RegistryError,
    ServerError,
    Unauthorized,
    Unreachable,
)
from snapshotter.registry.hosts import Endpoint, endpoints_for
from snapshotter.registry.media import Descriptor, Index, Manifest, Platform
from snapshotter.registry.metrics import BYTES, REQUESTS, RETRIES
from snapshotter.registry.reference import Reference

log = structlog.get_logger("bootseer.registry")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
# Manifests and configs are read whole into memory; bound that.
MAX_MANIFEST_BYTES = 4 << 20
BACKOFF_CAP = 10.0


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


@dataclass
class _Transfer:
    """Bytes already delivered by a streamed read, so a failed endpoint is
    only swapped for the next one while nothing has reached the caller."""

    delivered: int = 0


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _ssl_context(endpoint: Endpoint) -> ssl.SSLContext | bool:
    if endpoint.skip_verify:
        return False
    # The system trust store (not certifi's), plus the host's own CAs.
    context = ssl.create_default_context()
    for ca in endpoint.ca:
        context.load_verify_locations(cafile=str(ca))
    if endpoint.client_cert is not None:
        cert, key = endpoint.client_cert
        context.load_cert_chain(str(cert), str(key) if key else None)
    return context


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
        docker_config: Path | None = None,
        timeout: float = 30.0,
        retries: int = 4,
        backoff: float = 0.25,
    ) -> None:
        self.plain_http = plain_http
        self.certs_dir = certs_dir
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.keychain = Keychain(docker_config)
        self._tokens = TokenCache()
        # netloc -> the challenge its registry answered with last.
        self._challenges: dict[str, Challenge] = {}
        self._clients: dict[str, httpx.Client] = {}
        self._endpoints: dict[str, list[Endpoint]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------

    def endpoints(self, ref: Reference, capability: str) -> list[Endpoint]:
        with self._lock:
            if ref.domain not in self._endpoints:
                self._endpoints[ref.domain] = endpoints_for(ref.domain, self.certs_dir, self.plain_http)
            every = self._endpoints[ref.domain]
        usable = [e for e in every if capability in e.capabilities]
        if not usable:
            raise RegistryError(
                f"no endpoint in hosts.toml has the {capability!r} capability; add it to a [host] entry",
                host=ref.domain,
                repository=ref.repository,
            )
        return usable

    def _http(self, endpoint: Endpoint | None) -> httpx.Client:
        """One connection pool per TLS configuration; None is "plain system TLS"
        for redirect targets, which get no registry-specific trust."""
        key = endpoint.base_url if endpoint else ""
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                verify = _ssl_context(endpoint) if endpoint and endpoint.scheme == "https" else True
                if verify is True:
                    verify = ssl.create_default_context()
                client = httpx.Client(
                    verify=verify,
                    timeout=httpx.Timeout(self.timeout),
                    follow_redirects=False,
                    trust_env=False,
                    # Blob bytes must arrive as stored: digests and ranges are over them.
                    headers={"Accept-Encoding": "identity"},
                )
                self._clients[key] = client
            return client

    def _sleep_before_retry(self, attempt: int, response: httpx.Response | None) -> None:
        delay = min(BACKOFF_CAP, self.backoff * (2**attempt))
        delay = delay / 2 + random.uniform(0, delay / 2)
        if response is not None:
            retry_after = response.headers.get("Retry-After", "")
            if retry_after.isdigit():
                delay = min(BACKOFF_CAP, max(delay, float(retry_after)))
        time.sleep(delay)

    def _auth_header(self, endpoint: Endpoint, ref: Reference, actions: str) -> str | None:
        with self._lock:
            challenge = self._challenges.get(endpoint.netloc)
        if challenge is None:
            return None
        if challenge.scheme == "basic":
            creds = self.keychain.get(ref.domain)
            return creds.basic_header() if creds else None
        token = self._tokens.get(self._token_key(challenge, ref, actions))
        return f"Bearer {token.value}" if token else None

    @staticmethod
    def _token_key(challenge: Challenge, ref: Reference, actions: str) -> tuple[str, str, str]:
        return (challenge.realm, challenge.params.get("service", ""), scope_for(ref.repository, actions))

    def _answer_challenge(self, endpoint: Endpoint, ref: Reference, actions: str, response: httpx.Response) -> None:
        """Learn how to authenticate from a 401; raise Unauthorized if we cannot."""
        challenges = parse_challenges(response.headers.get("WWW-Authenticate", ""))
        chosen = next((c for c in challenges if c.scheme == "bearer"), None) or next(
            (c for c in challenges if c.scheme == "basic"), None
        )
        creds = self.keychain.get(ref.domain)
        if chosen is None:
            raise Unauthorized(
                "registry answered 401 without a Basic or Bearer challenge",
                host=ref.domain,
                repository=ref.repository,
            )
        with self._lock:
            self._challenges[endpoint.netloc] = chosen
        if chosen.scheme == "basic":
            if creds is None:
                raise Unauthorized(
                    f"registry wants a login and {self.keychain.path} has none for {ref.domain}; "
                    f"add auths[{ref.domain!r}] to it (e.g. with `docker login {ref.domain}`)",
                    host=ref.domain,
                    repository=ref.repository,
                )
            return
        self._fetch_token(chosen, ref, actions, creds)

    def _fetch_token(self, challenge: Challenge, ref: Reference, actions: str, creds: object) -> None:
        if not challenge.realm:
            raise Unauthorized("bearer challenge without a realm", host=ref.domain, repository=ref.repository)
        # The challenge's own scope may be narrower or wider; ask for ours too.
        scopes = [scope_for(ref.repository, actions)]
        if challenge.params.get("scope") and challenge.params["scope"] not in scopes:
            scopes.append(challenge.params["scope"])
        params: list[tuple[str, str]] = [("scope", s) for s in scopes]
        if challenge.params.get("service"):
            params.append(("service", challenge.params["service"]))
        headers = {"Authorization": creds.basic_header()} if creds is not None else {}  # type: ignore[attr-defined]
        for attempt in range(self.retries + 1):
            try:
                response = self._http(None).get(challenge.realm, params=params, headers=headers)
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise Unreachable(
                        f"token server {challenge.realm} unreachable: {exc}",
                        host=ref.domain,
                        repository=ref.repository,
                    ) from None
                self._sleep_before_retry(attempt, None)
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                self._sleep_before_retry(attempt, response)
                continue
            break
        if response.status_code in (401, 403):
            raise Unauthorized(
                f"token server {challenge.realm} refused "
                + ("the credentials from " + str(self.keychain.path) if creds else "anonymous access; log in first"),
                host=ref.domain,
                repository=ref.repository,
            )
        if response.status_code != 200:
            raise ServerError(
                f"token server {challenge.realm} answered {response.status_code}",
                host=ref.domain,
                repository=ref.repository,
            )
        try:
            token = parse_token_response(response.content)
        except ValueError as exc:
            raise ServerError(str(exc), host=ref.domain, repository=ref.repository) from None
        self._tokens.put(self._token_key(challenge, ref, actions), token)

    def _send(
        self,
        endpoint: Endpoint,
        ref: Reference,
        method: str,
        path_or_url: str,
        *,
        actions: str = "pull",
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        """One logical request with retries, auth and redirects. The response
        is returned open (streamed) for every status but the retried ones;
        the caller must close it."""
        url = path_or_url if "://" in path_or_url else endpoint.base_url + path_or_url
        query = dict(params or {})
        if endpoint.mirror_of:
            query["ns"] = endpoint.mirror_of
        registry_origin = _origin(endpoint.base_url)
        attempt = redirects = 0
        authenticated = False
        last_error = ""
        while True:
            foreign = _origin(url) != registry_origin
            request_headers = {} if foreign else {**endpoint.headers}
            request_headers.update(headers or {})
            if not foreign:
                auth = self._auth_header(endpoint, ref, actions)
                if auth:
                    request_headers["Authorization"] = auth
            client = self._http(None if foreign else endpoint)
            # Merged into the URL: httpx's params= would replace a query already
            # there (an upload's _state, a presigned URL's signature).
            target = httpx.URL(url).copy_merge_params(query) if query and not foreign else httpx.URL(url)
            request = client.build_request(method, target, headers=request_headers, content=content)
            try:
                response = client.send(request, stream=True)
            except httpx.TransportError as exc:
                REQUESTS.labels(method, "error").inc()
                last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if attempt >= self.retries:
                    raise Unreachable(
                        f"no answer from {urlsplit(url).netloc} after {attempt + 1} attempts ({last_error}); "
                        "check that the registry is up and reachable, and its entry in hosts.toml",
                        host=ref.domain,
                        repository=ref.repository,
                    ) from None
                RETRIES.labels("transport").inc()
                log.info(
                    "registry.retry", host=ref.domain, repository=ref.repository, attempt=attempt + 1, reason=last_error
                )
                self._sleep_before_retry(attempt, None)
                attempt += 1
                continue
            REQUESTS.labels(method, str(response.status_code)).inc()
            status = response.status_code
            if status in REDIRECT_STATUSES and "Location" in response.headers:
                response.close()
                redirects += 1
                if redirects > MAX_REDIRECTS:
                    raise ServerError(
                        f"more than {MAX_REDIRECTS} redirects for {method} {path_or_url}",
                        host=ref.domain,
                        repository=ref.repository,
                    )
                url = urljoin(str(response.url), response.headers["Location"])
                continue
            if status == 401 and not foreign and not authenticated:
                response.read()
                response.close()
                self._answer_challenge(endpoint, ref, actions, response)
                authenticated = True
                continue
            if status == 401:
                response.close()
                raise Unauthorized(
                    f"registry refused the credentials for {ref.domain} from {self.keychain.path}; "
                    "check them (docker login) and that the user may "
                    f"{actions.replace(',', ' and ')} this repository",
                    host=ref.domain,
                    repository=ref.repository,
                )
            if status in RETRY_STATUSES:
                response.close()
                last_error = f"HTTP {status}"
                if attempt >= self.retries:
                    raise ServerError(
                        f"{method} {path_or_url} kept failing ({last_error} after {attempt + 1} attempts); "
                        "the registry is overloaded or broken, try again later",
                        host=ref.domain,
                        repository=ref.repository,
                    )
                RETRIES.labels(str(status)).inc()
                log.info(
                    "registry.retry", host=ref.domain, repository=ref.repository, attempt=attempt + 1, reason=last_error
                )
                self._sleep_before_retry(attempt, response)
                attempt += 1
                continue
            return response

    def _read_small(self, response: httpx.Response, what: str, ref: Reference) -> bytes:
        """Read a manifest-sized body, refusing an unbounded one."""
        body = bytearray()
        try:
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_MANIFEST_BYTES:
                    raise ServerError(
                        f"{what} is larger than {MAX_MANIFEST_BYTES} bytes", host=ref.domain, repository=ref.repository
                    )
        finally:
            response.close()
        return bytes(body)

    def _over_endpoints(
        self, ref: Reference, capability: str, call: Callable[[Endpoint], object], transfer: _Transfer | None = None
    ) -> object:
        """`call` on each endpoint in order until one succeeds; a mirror that
        lacks the object or fails is skipped, the server's error is final."""
        endpoints = self.endpoints(ref, capability)
        for i, endpoint in enumerate(endpoints):
            try:
                return call(endpoint)
            except (NotFound, Unreachable, ServerError) as exc:
                last = i == len(endpoints) - 1
                if last or (transfer is not None and transfer.delivered):
                    raise
                log.info("registry.endpoint_skipped", endpoint=endpoint.base_url, reason=str(exc))
        raise AssertionError("unreachable: endpoints() never returns an empty list")

    def _unexpected(self, response: httpx.Response, what: str, ref: Reference) -> RegistryError:
        try:
            detail = response.read()[:300].decode(errors="replace").strip()
        except httpx.HTTPError:
            detail = ""
        finally:
            response.close()
        if response.status_code == 404:
            return NotFound(f"{what} not found", host=ref.domain, repository=ref.repository)
        if response.status_code == 403:
            return Unauthorized(
                f"{what}: access denied (403); check the account's permissions",
                host=ref.domain,
                repository=ref.repository,
            )
        return ServerError(
            f"{what}: unexpected HTTP {response.status_code} {detail}", host=ref.domain, repository=ref.repository
        )

    # -- manifests ----------------------------------------------------------

    def fetch_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of the manifest or index `ref` names.
        A digest in `ref` is verified; for a tag, the registry's
        Docker-Content-Digest (if any) must match what we received."""
        capability = "pull" if ref.digest else "resolve"

        def call(endpoint: Endpoint) -> tuple[bytes, str, str]:
            response = self._send(
                endpoint,
                ref,
                "GET",
                f"/{ref.repository}/manifests/{ref.object}",
                headers={"Accept": ", ".join(media.MANIFEST_ACCEPT)},
            )
            if response.status_code != 200:
                raise self._unexpected(response, f"manifest {ref.object}", ref)
            data = self._read_small(response, f"manifest {ref.object}", ref)
            algorithm = ref.digest.partition(":")[0] if ref.digest else "sha256"
            digest = media.digest_of(data, algorithm)
            expected = ref.digest or response.headers.get("Docker-Content-Digest", "")
            if expected and expected.partition(":")[0] == algorithm and expected != digest:
                raise DigestMismatch(
                    f"manifest {ref.object}: got {digest}, expected {expected}; a proxy or mirror altered it",
                    host=ref.domain,
                    repository=ref.repository,
                )
            try:
                media_type = media.detect_media_type(data, response.headers.get("Content-Type", ""))
            except media.InvalidManifest as exc:
                raise ServerError(f"manifest {ref.object}: {exc}", host=ref.domain, repository=ref.repository) from None
            return data, media_type, digest

        return self._over_endpoints(ref, capability, call)  # type: ignore[return-value]

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
                    raise NotFound(
                        f"{exc}; pick one with --platform", host=ref.domain, repository=ref.repository
                    ) from None
                data, media_type, digest = self.fetch_manifest(ref.with_digest(chosen.digest))
                parsed = media.parse(data, media_type)
        except media.InvalidManifest as exc:
            raise ServerError(f"{ref.object}: {exc}", host=ref.domain, repository=ref.repository) from None
        if not isinstance(parsed, Manifest) or media_type not in media.IMAGE_MANIFESTS:
            raise ServerError(
                f"{ref.object} is a {media_type}, not an image manifest", host=ref.domain, repository=ref.repository
            )
        return ResolvedImage(ref, digest, data, media_type, parsed, wanted, index_digest)

    def _put_manifest(self, ref: Reference, data: bytes, media_type: str, target: str) -> tuple[str, httpx.Headers]:
        digest = media.digest_of(data)

        def call(endpoint: Endpoint) -> tuple[str, httpx.Headers]:
            response = self._send(
                endpoint,
                ref,
                "PUT",
                f"/{ref.repository}/manifests/{target}",
                actions="pull,push",
                headers={"Content-Type": media_type},
                content=data,
            )
            if response.status_code not in (200, 201, 202):
                raise self._unexpected(response, f"pushing manifest {target}", ref)
            response.close()
            return digest, response.headers

        return self._over_endpoints(ref, "push", call)  # type: ignore[return-value]

    def push_manifest(self, ref: Reference, data: bytes, media_type: str, tag: str | None = None) -> str:
        """Push a manifest under `tag`, or by digest when `tag` is None; returns its digest."""
        return self._put_manifest(ref, data, media_type, tag or media.digest_of(data))[0]

    # -- blobs --------------------------------------------------------------

    def blob_exists(self, ref: Reference, digest: str) -> bool:
        def call(endpoint: Endpoint) -> bool:
            response = self._send(endpoint, ref, "HEAD", f"/{ref.repository}/blobs/{digest}")
            response.close()
            if response.status_code == 200:
                return True
            if response.status_code == 404:
                raise NotFound(f"blob {digest} not found", host=ref.domain, repository=ref.repository)
            raise self._unexpected(response, f"blob {digest}", ref)

        try:
            return bool(self._over_endpoints(ref, "pull", call))
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
        algorithm = digest.partition(":")[0]
        start = dest.tell() if dest.seekable() else None
        transfer = _Transfer()
        for attempt in range(self.retries + 1):
            hasher = hashlib.new(algorithm)
            transfer.delivered = 0
            self._over_endpoints(
                ref, "pull", lambda ep: self._stream_blob(ep, ref, digest, dest, hasher, transfer, progress), transfer
            )
            got = f"{algorithm}:{hasher.hexdigest()}"
            if got == digest:
                return
            RETRIES.labels("digest").inc()
            if start is None or attempt == self.retries:
                raise DigestMismatch(
                    f"blob {digest}: received bytes hash to {got}; the registry or a proxy corrupted it",
                    host=ref.domain,
                    repository=ref.repository,
                )
            log.warning("registry.digest_mismatch", host=ref.domain, repository=ref.repository, digest=digest)
            dest.seek(start)
            dest.truncate()
            if progress is not None:
                progress(-transfer.delivered)

    def _stream_blob(
        self,
        endpoint: Endpoint,
        ref: Reference,
        digest: str,
        dest: BinaryIO,
        hasher: hashlib._Hash,
        transfer: _Transfer,
        progress: Callable[[int], None] | None,
    ) -> None:
        failures = 0
        while True:
            headers = {"Range": f"bytes={transfer.delivered}-"} if transfer.delivered else {}
            response = self._send(endpoint, ref, "GET", f"/{ref.repository}/blobs/{digest}", headers=headers)
            if response.status_code not in (200, 206):
                raise self._unexpected(response, f"blob {digest}", ref)
            # A 200 to a resumed request is the whole blob again: skip what we have.
            skip = transfer.delivered if response.status_code == 200 else 0
            if response.status_code == 206 and _content_range_start(response) != transfer.delivered:
                response.close()
                raise ServerError(
                    f"blob {digest}: registry resumed at the wrong offset", host=ref.domain, repository=ref.repository
                )
            try:
                for chunk in response.iter_raw():
                    if skip:
                        dropped = min(skip, len(chunk))
                        chunk, skip = chunk[dropped:], skip - dropped
                        if not chunk:
                            continue
                    dest.write(chunk)
                    hasher.update(chunk)
                    transfer.delivered += len(chunk)
                    BYTES.labels("blob").inc(len(chunk))
                    if progress is not None:
                        progress(len(chunk))
                return
            except httpx.TransportError as exc:
                failures += 1
                if failures > self.retries:
                    raise Unreachable(
                        f"blob {digest}: transfer kept breaking ({type(exc).__name__}) after "
                        f"{transfer.delivered} bytes; check the network to the registry",
                        host=ref.domain,
                        repository=ref.repository,
                    ) from None
                RETRIES.labels("body").inc()
                log.info(
                    "registry.resume",
                    host=ref.domain,
                    repository=ref.repository,
                    digest=digest,
                    offset=transfer.delivered,
                    reason=type(exc).__name__,
                )
                self._sleep_before_retry(failures - 1, None)
            finally:
                response.close()

    def fetch_blob_bytes(self, ref: Reference, digest: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """A small blob (a config) in memory, verified."""
        buffer = io.BytesIO()
        self.fetch_blob(ref, digest, buffer)
        if buffer.tell() > limit:
            raise ServerError(f"blob {digest} is larger than {limit} bytes", host=ref.domain, repository=ref.repository)
        return buffer.getvalue()

    def fetch_range(self, ref: Reference, digest: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of blob `digest`: exactly end - start of them, or
        an exception. The caller verifies them (ranges carry no digest)."""
        media.check_digest(digest)
        if not 0 <= start < end:
            raise ValueError(f"bad range [{start}, {end})")
        buffer = bytearray()

        def call(endpoint: Endpoint) -> bytes:
            failures = 0
            while len(buffer) < end - start:
                offset = start + len(buffer)
                try:
                    self._read_range(endpoint, ref, digest, offset, end, buffer)
                    continue
                except (httpx.TransportError, _ShortRead) as exc:
                    failures += 1
                    if failures > self.retries:
                        raise Unreachable(
                            f"blob {digest} range [{offset}, {end}): transfer kept breaking "
                            f"({type(exc).__name__}); check the network to the registry",
                            host=ref.domain,
                            repository=ref.repository,
                        ) from None
                    RETRIES.labels("body").inc()
                    self._sleep_before_retry(failures - 1, None)
            return bytes(buffer)

        # A mirror that fails mid-range hands over to the next endpoint, which
        # continues from what `buffer` already holds.
        return self._over_endpoints(ref, "pull", call)  # type: ignore[return-value]

    def _read_range(
        self, endpoint: Endpoint, ref: Reference, digest: str, offset: int, end: int, buffer: bytearray
    ) -> None:
        response = self._send(
            endpoint, ref, "GET", f"/{ref.repository}/blobs/{digest}", headers={"Range": f"bytes={offset}-{end - 1}"}
        )
        try:
            if response.status_code == 416:
                raise RegistryError(
                    f"blob {digest}: range [{offset}, {end}) lies beyond its end",
                    host=ref.domain,
                    repository=ref.repository,
                )
            if response.status_code not in (200, 206):
                raise self._unexpected(response, f"blob {digest}", ref)
            # A server that ignores Range sends the whole blob: skip to `offset`.
            skip = offset if response.status_code == 200 else 0
            if response.status_code == 206 and _content_range_start(response) != offset:
                raise ServerError(
                    f"blob {digest}: registry answered a different range than asked",
                    host=ref.domain,
                    repository=ref.repository,
                )
            want = end - offset
            got = 0
            for chunk in response.iter_raw():
                if skip:
                    dropped = min(skip, len(chunk))
                    chunk, skip = chunk[dropped:], skip - dropped
                take = chunk[: want - got]
                buffer += take
                got += len(take)
                BYTES.labels("range").inc(len(take))
                if got == want:
                    return  # closing early drops the rest of a whole-body answer
            if got == 0:
                raise _ShortRead()
        finally:
            response.close()

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
            response = self._send(endpoint, ref, "POST", f"/{ref.repository}/blobs/uploads/", actions="pull,push")
            if response.status_code != 202 or "Location" not in response.headers:
                raise self._unexpected(response, "starting a blob upload", ref)
            response.close()
            location = httpx.URL(urljoin(str(response.url), response.headers["Location"]))
            upload = location.copy_merge_params({"digest": actual})
            put = self._send(
                endpoint,
                ref,
                "PUT",
                str(upload),
                actions="pull,push",
                headers={"Content-Type": "application/octet-stream"},
                content=data,
            )
            if put.status_code not in (201, 204):
                raise self._unexpected(put, f"uploading blob {actual}", ref)
            put.close()

        self._over_endpoints(ref, "push", call)
        return descriptor

    # -- referrers ----------------------------------------------------------

    def referrers(self, ref: Reference, subject_digest: str, artifact_type: str | None = None) -> list[Descriptor]:
        """Manifests whose `subject` is `subject_digest`: the referrers API, or
        (on a 404 from a registry without it) the `sha256-<hex>` tag's index."""
        media.check_digest(subject_digest)
        found = self._referrers_api(ref, subject_digest, artifact_type)
        if found is None:
            try:
                data, media_type, _ = self.fetch_manifest(ref.with_tag(referrers_tag(subject_digest)))
            except NotFound:
                return []
            parsed = media.parse(data, media_type)
            if not isinstance(parsed, Index):
                raise ServerError(
                    f"tag {referrers_tag(subject_digest)} is not an image index",
                    host=ref.domain,
                    repository=ref.repository,
                )
            found = list(parsed.manifests)
        if artifact_type:
            found = [d for d in found if d.artifact_type == artifact_type]
        return found

    def _referrers_api(self, ref: Reference, subject_digest: str, artifact_type: str | None) -> list[Descriptor] | None:
        """None when the registry has no referrers API."""

        def call(endpoint: Endpoint) -> list[Descriptor] | None:
            found: list[Descriptor] = []
            url = f"/{ref.repository}/referrers/{subject_digest}"
            params = {"artifactType": artifact_type} if artifact_type else None
            for _ in range(100):  # pages; bounded against a Link loop
                response = self._send(endpoint, ref, "GET", url, params=params, headers={"Accept": media.OCI_INDEX})
                if response.status_code == 404:
                    response.close()
                    return None
                if response.status_code != 200:
                    raise self._unexpected(response, f"referrers of {subject_digest}", ref)
                link = response.headers.get("Link", "")
                data = self._read_small(response, "referrers index", ref)
                try:
                    parsed = media.parse(data, media.OCI_INDEX)
                except media.InvalidManifest as exc:
                    raise ServerError(
                        f"referrers of {subject_digest}: {exc}", host=ref.domain, repository=ref.repository
                    ) from None
                assert isinstance(parsed, Index)
                found.extend(parsed.manifests)
                next_url = _next_link(link)
                if next_url is None:
                    return found
                url, params = urljoin(str(response.url), next_url), None
            return found

        try:
            return self._over_endpoints(ref, "pull", call)  # type: ignore[return-value]
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
            data, index_type, _ = self.fetch_manifest(ref.with_tag(tag))
            existing = media.parse(data, index_type)
            if not isinstance(existing, Index):
                raise ServerError(
                    f"tag {tag} exists but is not an image index; it cannot hold referrers",
                    host=ref.domain,
                    repository=ref.repository,
                )
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


class _ShortRead(Exception):
    """A body ended before the bytes asked for; retried like a reset."""


def _content_range_start(response: httpx.Response) -> int | None:
    value = response.headers.get("Content-Range", "")
    unit, _, rest = value.partition(" ")
    if unit != "bytes":
        return None
    first = rest.partition("-")[0]
    return int(first) if first.isdigit() else None


def _next_link(header: str) -> str | None:
    for part in header.split(","):
        if 'rel="next"' in part and "<" in part and ">" in part:
            return part[part.index("<") + 1 : part.index(">")]
    return None
