"""Answering registries' authentication challenges, for one client.

Which challenge each registry endpoint answered with last decides the
Authorization header: Basic credentials from the keychain, or a Bearer token
fetched from the challenge's realm and cached per (realm, service, scope).
Parsing, credentials and token records are in `auth`; this module owns the
token exchange, which needs a connection pool and the retry schedule.
"""

from __future__ import annotations

import math
import threading

import httpx

from snapshotter.registry.auth import (
    Challenge,
    Credentials,
    Keychain,
    Token,
    TokenCache,
    parse_challenges,
    parse_token_response,
    scope_for,
)
from snapshotter.registry.errors import ServerError, Unauthorized, Unreachable
from snapshotter.registry.hosts import Endpoint
from snapshotter.registry.pools import Pools
from snapshotter.registry.reference import Reference
from snapshotter.registry.retry import RETRY_STATUSES, Budget


def _token_key(challenge: Challenge, ref: Reference, actions: str) -> tuple[str, str, str]:
    return (challenge.realm, challenge.params.get("service", ""), scope_for(ref.repository, actions))


class Authenticator:
    def __init__(self, keychain: Keychain, pools: Pools) -> None:
        self.keychain = keychain
        self._pools = pools
        self._tokens = TokenCache()
        # netloc -> the challenge its registry answered with last.
        self._challenges: dict[str, Challenge] = {}
        self._lock = threading.Lock()

    def header(self, endpoint: Endpoint, ref: Reference, actions: str) -> str | None:
        """The Authorization value for a request to `endpoint`; None until a
        challenge said how, or when the token expired (the 401 renews it)."""
        with self._lock:
            challenge = self._challenges.get(endpoint.netloc)
            token = self._tokens.get(_token_key(challenge, ref, actions)) if challenge else None
        if challenge is None:
            return None
        if challenge.scheme == "basic":
            creds = self.keychain.get(ref.domain, ref.repository)
            return creds.basic_header() if creds and not creds.registry_token else None
        return f"Bearer {token.value}" if token else None

    def answer(
        self, endpoint: Endpoint, ref: Reference, actions: str, response: httpx.Response, budget: Budget
    ) -> None:
        """Learn how to authenticate from a 401; raise Unauthorized if we cannot.
        A token exchange spends the tries and time of the request's `budget`."""
        challenges = parse_challenges(response.headers.get("WWW-Authenticate", ""))
        chosen = next((c for c in challenges if c.scheme == "bearer"), None) or next(
            (c for c in challenges if c.scheme == "basic"), None
        )
        creds = self.keychain.get(ref.domain, ref.repository)
        if chosen is None:
            raise Unauthorized.at(ref, "registry answered 401 without a Basic or Bearer challenge")
        with self._lock:
            self._challenges[endpoint.netloc] = chosen
        if chosen.scheme == "bearer" and creds is not None and creds.registry_token:
            with self._lock:
                self._tokens.put(_token_key(chosen, ref, actions), Token(creds.registry_token, expires_at=math.inf))
            return
        if chosen.scheme == "basic":
            if creds is None or creds.registry_token:
                raise Unauthorized.at(
                    ref,
                    f"registry wants a login and {self.keychain.path} has none for {ref.domain}; "
                    f"add auths[{ref.domain!r}] to it (e.g. with `docker login {ref.domain}`)",
                )
            return
        self._fetch_token(chosen, ref, actions, creds, budget)

    def _fetch_token(
        self, challenge: Challenge, ref: Reference, actions: str, creds: Credentials | None, budget: Budget
    ) -> None:
        if not challenge.realm:
            raise Unauthorized.at(ref, "bearer challenge without a realm")
        # The challenge's own scope may be narrower or wider; ask for ours too.
        scopes = [scope_for(ref.repository, actions)]
        if challenge.params.get("scope") and challenge.params["scope"] not in scopes:
            scopes.append(challenge.params["scope"])
        params = [("scope", s) for s in scopes]
        if challenge.params.get("service"):
            params.append(("service", challenge.params["service"]))
        headers = {"Authorization": creds.basic_header()} if creds is not None else {}
        response = self._ask_token_server(challenge.realm, tuple(params), headers, ref, budget)
        if response.status_code in (401, 403):
            raise Unauthorized.at(
                ref,
                f"token server {challenge.realm} refused "
                + ("the credentials from " + str(self.keychain.path) if creds else "anonymous access; log in first"),
            )
        if response.status_code != 200:
            raise ServerError.at(ref, f"token server {challenge.realm} answered {response.status_code}")
        try:
            token = parse_token_response(response.content)
        except ValueError as exc:
            raise ServerError.at(ref, str(exc)) from None
        with self._lock:
            self._tokens.put(_token_key(challenge, ref, actions), token)

    def _ask_token_server(
        self, realm: str, params: tuple[tuple[str, str], ...], headers: dict[str, str], ref: Reference, budget: Budget
    ) -> httpx.Response:
        """GET the realm, retried on resets, timeouts and retryable statuses
        as long as `budget` allows; the last answer is returned whatever its
        status."""
        what = f"token request to {realm}"
        while True:
            timeout = budget.timeout(self._pools.timeout)
            if timeout is None:
                raise budget.overdue(ref, what, "no time left to send it")
            try:
                response = self._pools.get(None).get(realm, params=params, headers=headers, timeout=timeout)
            except httpx.TransportError as exc:
                delay = budget.delay()
                if delay is None:
                    raise budget.spent(
                        ref, what, str(exc), Unreachable.at(ref, f"token server {realm} unreachable: {exc}")
                    ) from None
            else:
                delay = budget.delay(response) if response.status_code in RETRY_STATUSES else None
                if delay is None:
                    return response
                response.close()
            budget.wait(delay)
