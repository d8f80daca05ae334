"""The transport under the OCI API: which endpoints a registry request may
go to, and how one gets there.

Each request goes to the endpoints that hosts.toml lists for the registry
(mirrors first, then the server; `over_endpoints`). Sending one is layered
as httpx layers its own loops, each a method below: `send` -> handling auth
(the registry's 401 challenge is answered once: basic auth, or a bearer
token fetched from the challenge's realm and cached per scope) -> handling
redirects -> handling retries (exponential backoff plus jitter on 5xx, 429,
resets and timeouts) -> a single request. Every request of one operation
on one endpoint spends from one `Budget`: its retries, redirects and auth
rounds, and a blob body's resumes around it, share `retries`, and a
caller's deadline caps each try's timeout and stops the tries. Credentials
go only to the registry endpoint they belong to: a redirect to another
origin (blob storage) is followed without them.

Mirrors fail fast (`health`): on a mirror a try waits at most the mirror
connect and response timeouts, a refused connection or a timeout is not
tried again there but hands over to the next host at once, and so does a
retryable status; the mirror is then skipped for its backoff period. The
server, the last resort, keeps the whole budget. hosts.toml is read again
whenever it changes (`hosts.HostsFiles`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Generic, TypeVar
from urllib.parse import urljoin, urlsplit

import httpx
import structlog

from snapshotter.registry.auth import Keychain
from snapshotter.registry.authenticator import Authenticator
from snapshotter.registry.errors import (
    DeadlineExceeded,
    DigestMismatch,
    NotFound,
    RegistryError,
    ServerError,
    Unauthorized,
    Unreachable,
)
from snapshotter.registry.health import Backoffs, MirrorPolicy
from snapshotter.registry.hosts import Endpoint, HostsFiles
from snapshotter.registry.metrics import (
    MIRROR_DOWN,
    MIRROR_MISMATCHES,
    MIRROR_SKIPPED,
    MULTIRANGE_FALLBACKS,
    RANGE_IGNORED,
    REQUESTS,
    RETRIES,
)
from snapshotter.registry.pools import Pools
from snapshotter.registry.reference import Reference
from snapshotter.registry.retry import RETRY_STATUSES, Backoff, Budget

log = structlog.get_logger("bootseer.registry")

T = TypeVar("T")

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


@dataclass(frozen=True)
class Request:
    """One registry API request as the API asks for it; the transport adds
    the endpoint's headers and query, credentials, redirects and retries."""

    endpoint: Endpoint
    ref: Reference
    method: str
    # A path under the endpoint's base URL, or an absolute URL (an upload's Location).
    target: str
    actions: str = "pull"
    headers: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    content: bytes | None = None

    @property
    def url(self) -> str:
        return self.target if "://" in self.target else self.endpoint.base_url + self.target

    @property
    def query(self) -> dict[str, str]:
        query = dict(self.params)
        if self.endpoint.mirror_of:
            query["ns"] = self.endpoint.mirror_of
        return query

    def on_registry(self, url: str) -> bool:
        """Whether `url` is on the endpoint's own origin, the one its
        credentials, headers and query are for."""
        return _origin(url) == _origin(self.endpoint.base_url)


@dataclass(frozen=True)
class _Answer(Generic[T]):
    value: T


class Transport:
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
        self.plain_http = plain_http
        self.certs_dir = certs_dir
        self.backoff = Backoff(retries, backoff)
        self.pools = Pools(timeout)
        # No keychain: the docker config's credentials only.
        self.auth = Authenticator(keychain or Keychain(), self.pools)
        self.hosts = HostsFiles(certs_dir, plain_http)
        self.mirrors = mirrors or MirrorPolicy()
        # Mirrors (by base URL) in a backoff period after failing.
        self.health = Backoffs(self.mirrors)
        # (mirror base URL, blob digest) pairs whose ranges go to the next host.
        self.ranges = Backoffs(self.mirrors)
        # Hosts (by base URL) asked range by range, not several ranges per request, for now.
        self.multiranges = Backoffs(self.mirrors)

    def close(self) -> None:
        self.pools.close()

    def budget(self, deadline: float | None = None) -> Budget:
        """A fresh budget for one operation on one endpoint."""
        return Budget(self.backoff, deadline)

    # -- endpoints ----------------------------------------------------------

    def endpoints(self, ref: Reference, capability: str) -> list[Endpoint]:
        every = self.hosts.endpoints(ref.domain)
        usable = [e for e in every if capability in e.capabilities]
        if not usable:
            raise RegistryError.at(
                ref, f"no endpoint in hosts.toml has the {capability!r} capability; add it to a [host] entry"
            )
        return usable

    def over_endpoints(
        self,
        ref: Reference,
        capability: str,
        call: Callable[[Endpoint], T],
        pinned: Callable[[], bool] | None = None,
        *,
        ranges_of: str | None = None,
    ) -> T:
        """`call` on each endpoint in order until one succeeds; a mirror that
        lacks the object or fails is skipped, the server's error is final, and
        so is any error once `pinned()` says the caller already holds bytes
        from that endpoint. A mirror that failed to answer at all (refused,
        timed out, kept breaking) is skipped for its backoff period, and with
        `ranges_of` (a blob digest: the call reads ranges of it) so is one
        that ignored Range for that blob."""
        *mirrors, server = self.endpoints(ref, capability)
        answer = self._on_mirrors(mirrors, call, pinned, ranges_of)
        return answer.value if answer is not None else call(server)

    def server_first(self, ref: Reference, capability: str, call: Callable[[Endpoint], T]) -> T:
        """`call` on the server, then on the mirrors (as `over_endpoints`)
        if it fails: for answers that change, such as a referrers listing,
        which a caching mirror may hold stale for as long as it likes
        (docker-registry 2.8 in proxy mode keeps serving its first copy of a
        `sha256-<hex>` tag: it cannot fetch OCI indexes from upstream).
        With mirrors behind it the server gets one try with a mirror's
        timeouts, so a registry that is down or rate-limiting costs what a
        dead mirror costs. Content named by digest never needs this."""
        *mirrors, server = self.endpoints(ref, capability)
        if not mirrors:
            return call(server)
        try:
            return call(replace(server, hurried=True))
        except (Unreachable, ServerError, DeadlineExceeded) as exc:
            log.warning("registry.server_failed", endpoint=server.base_url, reason=str(exc))
            answer = self._on_mirrors(mirrors, call)
            if answer is None:
                raise
            return answer.value

    def _on_mirrors(
        self,
        mirrors: list[Endpoint],
        call: Callable[[Endpoint], T],
        pinned: Callable[[], bool] | None = None,
        ranges_of: str | None = None,
    ) -> _Answer[T] | None:
        """The first mirror's answer to `call`; None if none gave one."""
        for endpoint in mirrors:
            if not self.health.usable(endpoint.base_url):
                MIRROR_SKIPPED.labels(endpoint.netloc, "down").inc()
                continue
            if ranges_of is not None and not self.ranges.usable((endpoint.base_url, ranges_of)):
                MIRROR_SKIPPED.labels(endpoint.netloc, "range").inc()
                continue
            try:
                result = call(endpoint)
            except Unreachable as exc:
                self._mirror_failed(endpoint, exc)
                if pinned is not None and pinned():
                    raise
                continue
            except (NotFound, ServerError) as exc:
                # It answered: up, even if it lacks this object or failed it.
                self._mirror_answered(endpoint)
                if pinned is not None and pinned():
                    raise
                log.info("registry.endpoint_skipped", endpoint=endpoint.base_url, reason=str(exc))
                continue
            except DigestMismatch as exc:
                # A pull-through cache can answer a tag with one version's
                # digest and another's body when the tag changes upstream
                # meanwhile (seen with docker-registry 2.8 as a recorder
                # rewrote a referrers tag). Nothing unverified is used, so
                # the next host is asked.
                self._mirror_answered(endpoint)
                MIRROR_MISMATCHES.labels(endpoint.netloc).inc()
                if pinned is not None and pinned():
                    raise
                log.warning("registry.mirror_mismatch", endpoint=endpoint.base_url, reason=str(exc))
                continue
            self._mirror_answered(endpoint)
            return _Answer(result)
        return None

    def _mirror_failed(self, endpoint: Endpoint, exc: Unreachable) -> None:
        period = self.health.failed(endpoint.base_url)
        MIRROR_DOWN.labels(endpoint.netloc).inc()
        log.warning("registry.mirror_down", endpoint=endpoint.base_url, skipped_for_s=period, reason=str(exc))

    def _mirror_answered(self, endpoint: Endpoint) -> None:
        if self.health.succeeded(endpoint.base_url):
            log.info("registry.mirror_up", endpoint=endpoint.base_url)

    def range_ignored(self, endpoint: Endpoint, digest: str) -> None:
        """`endpoint` answered a Range request for blob `digest` with the
        whole blob: counted, and a mirror is not asked for ranges of it
        again for a backoff period (a pull-through cache does this on a
        miss, and serves ranges once it has stored the blob)."""
        RANGE_IGNORED.labels(endpoint.netloc).inc()
        if endpoint.mirror_of:
            period = self.ranges.failed((endpoint.base_url, digest))
            log.info("registry.range_ignored", endpoint=endpoint.base_url, digest=digest, skipped_for_s=period)
        else:
            log.info("registry.range_ignored", endpoint=endpoint.base_url, digest=digest)

    def range_served(self, endpoint: Endpoint, digest: str) -> None:
        """`endpoint` answered a Range request for `digest` with 206."""
        if endpoint.mirror_of:
            self.ranges.succeeded((endpoint.base_url, digest))

    def multirange_usable(self, endpoint: Endpoint) -> bool:
        """Whether to ask `endpoint` for several ranges in one request now."""
        return self.multiranges.usable(endpoint.base_url)

    def multirange_failed(self, endpoint: Endpoint, digest: str, reason: str) -> None:
        """`endpoint` answered a multi-range request for `digest` with the
        whole blob ("whole_blob") or with a body that broke off or did not
        parse: counted, and asked range by range for a backoff period."""
        kind = "whole_blob" if reason == "whole_blob" else "broken"
        MULTIRANGE_FALLBACKS.labels(endpoint.netloc, kind).inc()
        period = self.multiranges.failed(endpoint.base_url)
        log.info("registry.multirange_fallback", endpoint=endpoint.base_url, digest=digest, reason=reason, for_s=period)

    def try_timeout(self, endpoint: Endpoint, budget: Budget) -> httpx.Timeout | None:
        """The timeouts of the next try on `endpoint`: the client's timeout,
        on a mirror its connect and response (headers, and each read of the
        body) timeouts, none past the budget's deadline; None when no time
        is left."""
        left = budget.timeout(self.pools.timeout)
        if left is None:
            return None
        if not endpoint.one_try:
            return httpx.Timeout(left)
        return httpx.Timeout(
            left,
            connect=min(left, self.mirrors.connect_timeout_s),
            read=min(left, self.mirrors.response_timeout_s),
        )

    def gives_up_at_once(self, endpoint: Endpoint, exc: httpx.TransportError) -> bool:
        """Whether `exc` on `endpoint` hands over to the next host without
        another try: on a mirror, a refused or failed connection and any
        timeout (a hung mirror costs one wait, not one per retry)."""
        return endpoint.one_try and isinstance(exc, httpx.ConnectError | httpx.TimeoutException)

    # -- sending, one layer per method ----------------------------------------

    def send(self, request: Request, budget: Budget | None = None) -> httpx.Response:
        """`request` with auth, redirects and retries, spending from `budget`
        (by default a fresh one). The response is returned open (streamed)
        for every status but the retried ones; the caller must close it."""
        return self._send_handling_auth(request, budget or self.budget())

    def _send_handling_auth(self, request: Request, budget: Budget) -> httpx.Response:
        """Send with what the registry's last challenge asked for; the first
        401 from the registry itself is answered and the request sent again,
        any other 401 is final."""
        answered = False
        while True:
            authorization = self.auth.header(request.endpoint, request.ref, request.actions)
            response = self._send_handling_redirects(request, authorization, budget)
            if response.status_code != 401:
                return response
            if answered or not request.on_registry(str(response.url)):
                response.close()
                raise Unauthorized.at(
                    request.ref,
                    f"registry refused the credentials for {request.ref.domain} from {self.auth.keychain.path}; "
                    "check them (docker login) and that the user may "
                    f"{request.actions.replace(',', ' and ')} this repository",
                )
            response.read()
            response.close()
            self.auth.answer(request.endpoint, request.ref, request.actions, response, budget)
            answered = True

    def _send_handling_redirects(self, request: Request, authorization: str | None, budget: Budget) -> httpx.Response:
        url = request.url
        redirects = 0
        while True:
            response = self._send_handling_retries(request, url, authorization, budget)
            if response.status_code not in REDIRECT_STATUSES or "Location" not in response.headers:
                return response
            response.close()
            redirects += 1
            if redirects > MAX_REDIRECTS:
                raise ServerError.at(
                    request.ref, f"more than {MAX_REDIRECTS} redirects for {request.method} {request.target}"
                )
            url = urljoin(str(response.url), response.headers["Location"])

    def _send_handling_retries(
        self, request: Request, url: str, authorization: str | None, budget: Budget
    ) -> httpx.Response:
        endpoint = request.endpoint
        while True:
            timeout = self.try_timeout(endpoint, budget)
            if timeout is None:
                raise budget.overdue(request.ref, f"{request.method} {request.target}", "no time left to send it")
            try:
                response = self._send_single_request(request, url, authorization, timeout)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if budget.expired():
                    raise budget.overdue(request.ref, f"{request.method} {request.target}", reason) from None
                if self.gives_up_at_once(endpoint, exc):
                    raise Unreachable.at(
                        request.ref,
                        f"{endpoint.netloc} gave no answer ({reason}; connect timeout "
                        f"{self.mirrors.connect_timeout_s:g} s, response timeout "
                        f"{self.mirrors.response_timeout_s:g} s); trying the next host",
                    ) from None
                self._retry(
                    request,
                    budget,
                    "transport",
                    reason,
                    None,
                    Unreachable.at(
                        request.ref,
                        f"no answer from {urlsplit(url).netloc} after {budget.tries} attempts ({reason}); "
                        "check that the registry is up and reachable, and its entry in hosts.toml",
                    ),
                )
                continue
            if response.status_code not in RETRY_STATUSES:
                return response
            response.close()
            reason = f"HTTP {response.status_code}"
            if endpoint.one_try:
                # The next host may well have it; containerd does not retry a mirror either.
                raise ServerError.at(request.ref, f"{endpoint.netloc} answered {reason}; trying the next host")
            self._retry(
                request,
                budget,
                str(response.status_code),
                reason,
                response,
                ServerError.at(
                    request.ref,
                    f"{request.method} {request.target} kept failing ({reason} after {budget.tries} attempts); "
                    "the registry is overloaded or broken, try again later",
                ),
            )

    def _retry(
        self,
        request: Request,
        budget: Budget,
        label: str,
        reason: str,
        response: httpx.Response | None,
        spent: RegistryError,
    ) -> None:
        """Wait before sending `request` again, or raise `spent` when the
        budget allows no more tries (DeadlineExceeded when time ran out)."""
        delay = budget.delay(response)
        if delay is None:
            raise budget.spent(request.ref, f"{request.method} {request.target}", reason, spent) from None
        RETRIES.labels(label).inc()
        log.info(
            "registry.retry",
            host=request.ref.domain,
            repository=request.ref.repository,
            attempt=budget.tries,
            reason=reason,
        )
        budget.wait(delay)

    def _send_single_request(
        self, request: Request, url: str, authorization: str | None, timeout: httpx.Timeout
    ) -> httpx.Response:
        """One HTTP exchange. Another origin than the endpoint's (blob storage
        a redirect points at) gets only the request's own headers, through a
        pool with no registry-specific trust."""
        own = request.on_registry(url)
        headers = {**request.endpoint.headers, **request.headers} if own else dict(request.headers)
        if own and authorization:
            headers["Authorization"] = authorization
        client = self.pools.get(request.endpoint if own else None)
        target = httpx.URL(url)
        query = request.query
        if own and query:
            # Merged into the URL: httpx's params= would replace a query already
            # there (an upload's _state, a presigned URL's signature).
            target = target.copy_merge_params(query)
        try:
            response = client.send(
                client.build_request(request.method, target, headers=headers, content=request.content, timeout=timeout),
                stream=True,
            )
        except httpx.TransportError:
            REQUESTS.labels(request.method, "error").inc()
            raise
        REQUESTS.labels(request.method, str(response.status_code)).inc()
        return response
