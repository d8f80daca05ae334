"""Registry credentials and authentication.

Credentials come from credential sources consulted first, matched by
registry host and repository (the CRI proxy's store of kubelet's pull
secrets, `snapshotter.cri.credentials`), then from docker's config.json
(`auths.<host>.auth`, or `username`/`password`, or a credential helper).
Challenges (`WWW-Authenticate: Bearer realm=...,service=...,scope=...` or
`Basic`) are parsed here; the token exchange itself is done by
`authenticator`, which has the connection pools. Nothing in this module
logs or formats a secret.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class CredentialsError(ValueError):
    """A docker config.json that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    # A bearer token for the registry itself (CRI's AuthConfig.registry_token):
    # sent as it is, never exchanged, and not renewable.
    registry_token: str = field(default="", repr=False)

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "bearer" or "basic", lowercased
    params: dict[str, str]

    @property
    def realm(self) -> str:
        return self.params.get("realm", "")


_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))\s*,?')


def parse_challenges(header: str) -> list[Challenge]:
    """Parse one WWW-Authenticate header value (one or more challenges)."""
    challenges: list[Challenge] = []
    pos = 0
    text = header.strip()
    while pos < len(text):
        match = re.match(r"\s*,?\s*([A-Za-z][A-Za-z0-9-]*)\s*", text[pos:])
        if not match:
            break
        scheme = match.group(1).lower()
        pos += match.end()
        params: dict[str, str] = {}
        while pos < len(text):
            param = _PARAM.match(text, pos)
            # A bare word followed by a space starts the next challenge.
            if not param or param.end() == pos:
                break
            quoted, bare = param.group(2), param.group(3)
            params[param.group(1).lower()] = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare or ""
            pos = param.end()
        challenges.append(Challenge(scheme, params))
    return challenges


def scope_for(repository: str, actions: str) -> str:
    return f"repository:{repository}:{actions}"


def default_docker_config() -> Path:
    directory = os.environ.get("DOCKER_CONFIG")
    return Path(directory) / "config.json" if directory else Path.home() / ".docker" / "config.json"


def _auth_keys(host: str) -> list[str]:
    """The keys config.json may file `host` under, most specific first."""
    keys = [host, f"https://{host}", f"http://{host}"]
    if host in ("docker.io", "registry-1.docker.io", "index.docker.io"):
        keys += ["https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io"]
    return keys


def credentials_from_config(doc: dict[str, object], host: str, source: str = "config.json") -> Credentials | None:
    """Pure: the credentials `doc` (a parsed config.json) holds for `host`."""
    auths = doc.get("auths") or {}
    if not isinstance(auths, dict):
        raise CredentialsError(f"{source}: 'auths' must be an object")
    normalized = {_strip_url(k): v for k, v in auths.items()}
    for key in _auth_keys(host):
        entry = auths.get(key) or normalized.get(_strip_url(key))
        if not isinstance(entry, dict):
            continue
        creds = _entry_credentials(entry, key, source)
        if creds is not None:
            return creds
    return None


def _strip_url(key: str) -> str:
    key = re.sub(r"^https?://", "", key)
    return key.split("/", 1)[0]


def _entry_credentials(entry: dict[str, object], key: str, source: str) -> Credentials | None:
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            decoded = base64.b64decode(auth, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise CredentialsError(f"{source}: auths[{key!r}].auth is not base64 of user:password") from None
        username, sep, password = decoded.partition(":")
        if not sep:
            raise CredentialsError(f"{source}: auths[{key!r}].auth decodes without a ':' separator")
        return Credentials(username, password)
    user, secret = entry.get("username"), entry.get("password")
    if isinstance(user, str) and isinstance(secret, str) and user:
        return Credentials(user, secret)
    token = entry.get("identitytoken")
    if isinstance(token, str) and token:
        # docker's convention: an identity token is sent as the password of "<token>".
        return Credentials("<token>", token)
    return None


def _helper_credentials(helper: str, host: str) -> Credentials | None:
    """Ask `docker-credential-<helper>`; None when it has nothing for `host`."""
    try:
        result = subprocess.run(
            [f"docker-credential-{helper}", "get"],
            input=host,
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        raise CredentialsError(
            f"config.json names credential helper {helper!r} but docker-credential-{helper} is not on PATH"
        ) from None
    if result.returncode != 0:
        return None
    try:
        answer = json.loads(result.stdout)
        return Credentials(answer["Username"], answer["Secret"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CredentialsError(f"docker-credential-{helper} gave an answer that is not credentials JSON") from None


class CredentialSource(Protocol):
    """Credentials by registry host and repository, consulted before the
    docker config. `path` names the source in error messages."""

    @property
    def path(self) -> Path: ...

    def lookup(self, host: str, repository: str) -> Credentials | None: ...


class Keychain:
    """Credentials per registry host (and repository): the `sources` first,
    then a docker config.json, read again when it changes so a `docker
    login` reaches running daemons."""

    def __init__(self, config_path: Path | None = None, sources: Sequence[CredentialSource] = ()) -> None:
        self.docker_config = config_path if config_path is not None else default_docker_config()
        self.sources = tuple(sources)
        self._doc: dict[str, object] = {}
        self._stamp: tuple[int, int] | None = None
        # Where the credentials this thread was last given came from, for messages.
        self._last = threading.local()

    @property
    def path(self) -> Path:
        """Where the credentials last handed out in this thread came from
        (the docker config if none came from a source): what an error
        about refused credentials names."""
        last: Path | None = getattr(self._last, "path", None)
        return last if last is not None else self.docker_config

    def _load(self) -> dict[str, object]:
        try:
            st = self.docker_config.stat()
        except FileNotFoundError:
            self._doc, self._stamp = {}, None
            return self._doc
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                doc = json.loads(self.docker_config.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CredentialsError(f"{self.docker_config}: cannot read docker config: {exc}") from None
            if not isinstance(doc, dict):
                raise CredentialsError(f"{self.docker_config}: a docker config must be a JSON object")
            self._doc, self._stamp = doc, stamp
        return self._doc

    def get(self, host: str, repository: str) -> Credentials | None:
        """Credentials for `repository` on `host`: the first source that has
        some, else the docker config (which knows hosts only)."""
        for source in self.sources:
            creds = source.lookup(host, repository)
            if creds is not None:
                self._last.path = source.path
                return creds
        self._last.path = None
        return self._docker_config_get(host)

    def _docker_config_get(self, host: str) -> Credentials | None:
        doc = self._load()
        helpers = doc.get("credHelpers") or {}
        if isinstance(helpers, dict) and isinstance(helpers.get(host), str):
            return _helper_credentials(helpers[host], host)
        creds = credentials_from_config(doc, host, str(self.docker_config))
        if creds is None and isinstance(doc.get("credsStore"), str):
            return _helper_credentials(str(doc["credsStore"]), host)
        return creds


@dataclass
class Token:
    value: str = field(repr=False)
    expires_at: float

    def valid(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) < self.expires_at


# Registries that omit expires_in mean 60 s (docker token spec); renew a bit early.
DEFAULT_TOKEN_LIFETIME = 60.0
TOKEN_EARLY_RENEWAL = 10.0


def parse_token_response(body: bytes, now: float | None = None) -> Token:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("token server answered with something that is not JSON") from None
    value = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
    if not isinstance(value, str) or not value:
        raise ValueError("token server answer has no 'token' or 'access_token'")
    lifetime = doc.get("expires_in")
    if not isinstance(lifetime, (int, float)) or lifetime <= 0:
        lifetime = DEFAULT_TOKEN_LIFETIME
    start = now if now is not None else time.monotonic()
    return Token(value, start + max(float(lifetime) - TOKEN_EARLY_RENEWAL, 1.0))


@dataclass
class TokenCache:
    """Bearer tokens keyed by (realm, service, scope)."""

    tokens: dict[tuple[str, str, str], Token] = field(default_factory=dict)

    def get(self, key: tuple[str, str, str]) -> Token | None:
        """The cached token, or None once it expired (it is dropped, so the
        registry's next 401 fetches a new one)."""
        token = self.tokens.get(key)
        if token is not None and not token.valid():
            del self.tokens[key]
            return None
        return token

    def put(self, key: tuple[str, str, str], token: Token) -> None:
        self.tokens[key] = token
