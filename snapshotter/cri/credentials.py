"""The registry credentials kubelet handed to PullImage, kept on disk.

One JSON file (`[registry] cri_credentials`, default
/var/lib/bootseer/cri/credentials.json), mode 0600 in a directory created
0700, replaced atomically (temporary file, fsync, rename) under an advisory
lock, so the layer server, a separate process, always reads a whole
document and both daemons find the credentials again after a restart:

    {"version": 1,
     "entries": {"registry.example.com/team/train": {
         "username": "...", "password": "...",
         "identity_token": "", "registry_token": "",
         "updated": "2026-12-01T10:00:00Z"}}}

Entries are keyed by registry host and repository of the pulled image.
Readers (`CriCredentialStore.lookup`, a `CredentialSource` of the registry
client's keychain) match the most specific key first (host/a/b, then
host/a, then host) and load the file again whenever it changed (inode,
size, mtime), so credentials captured after a reader started reach it at
its next request. Nothing here logs or formats a secret.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

from snapshotter.registry.auth import Credentials
from snapshotter.registry.reference import DOCKER_HUB, DOCKER_HUB_API

log = structlog.get_logger("bootseer.cri")

STORE_VERSION = 1
DEFAULT_PATH = Path("/var/lib/bootseer/cri/credentials.json")
_DOCKER_HUB_ALIASES = frozenset({DOCKER_HUB, DOCKER_HUB_API, "index.docker.io"})


class InvalidAuth(ValueError):
    """An AuthConfig that cannot be turned into credentials (the message holds no secret)."""


@dataclass(frozen=True)
class PullSecret:
    """What one AuthConfig authenticates with, normalised. Which field is
    used follows containerd's CRI plugin: username and password, else the
    identity token, else `auth` (base64 of user:password, decoded into
    username and password here), else a registry token: a bearer token
    for the registry, sent as it is (it cannot be renewed)."""

    username: str = ""
    password: str = field(default="", repr=False)
    identity_token: str = field(default="", repr=False)
    registry_token: str = field(default="", repr=False)

    def credentials(self) -> Credentials | None:
        if self.username:
            return Credentials(self.username, self.password)
        if self.identity_token:
            # docker's convention, as the docker config keychain has it.
            return Credentials("<token>", self.identity_token)
        if self.registry_token:
            return Credentials("", "", registry_token=self.registry_token)
        return None


def secret_from_auth(
    username: str = "",
    password: str = "",
    auth: str = "",
    identity_token: str = "",
    registry_token: str = "",
) -> PullSecret | None:
    """The PullSecret of an AuthConfig's fields; None if it carries nothing
    (an anonymous pull). Raises InvalidAuth for an `auth` that is not
    base64 of user:password."""
    if username:
        return PullSecret(username=username, password=password)
    if identity_token:
        return PullSecret(identity_token=identity_token)
    if auth:
        try:
            decoded = base64.b64decode(auth, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise InvalidAuth("AuthConfig.auth is not base64") from None
        user, sep, secret = decoded.partition(":")
        if not sep:
            raise InvalidAuth("AuthConfig.auth does not decode to user:password")
        return PullSecret(username=user, password=secret.strip("\x00"))
    if registry_token:
        return PullSecret(registry_token=registry_token)
    return None


def _normal_host(host: str) -> str:
    host = host.lower()
    return DOCKER_HUB if host in _DOCKER_HUB_ALIASES else host


def server_matches(server_address: str, host: str) -> bool:
    """Whether an AuthConfig's `server_address` names the registry `host`
    (empty names any: kubelet matched the secret to the image already).
    containerd's CRI plugin likewise ignores credentials for another server."""
    if not server_address:
        return True
    rest = server_address.split("://", 1)[-1]
    return _normal_host(rest.split("/", 1)[0]) == _normal_host(host)


def entry_key(host: str, repository: str) -> str:
    return f"{_normal_host(host)}/{repository}" if repository else _normal_host(host)


def _candidate_keys(host: str, repository: str) -> Iterator[str]:
    """host/a/b/c, host/a/b, host/a, host: most specific first."""
    parts = repository.split("/") if repository else []
    for end in range(len(parts), 0, -1):
        yield entry_key(host, "/".join(parts[:end]))
    yield entry_key(host, "")


@dataclass(frozen=True)
class _Entry:
    secret: PullSecret
    updated: str  # UTC, ISO 8601: when these credentials were last captured


_SECRET_FIELDS = ("username", "password", "identity_token", "registry_token")


def _parse_entries(doc: object) -> dict[str, _Entry]:
    if not isinstance(doc, dict) or doc.get("version") != STORE_VERSION or not isinstance(doc.get("entries"), dict):
        raise ValueError(f"not a version {STORE_VERSION} credentials document")
    entries: dict[str, _Entry] = {}
    for key, raw in doc["entries"].items():
        if not isinstance(raw, dict):
            raise ValueError(f"entry {key!r} is not an object")
        values = {name: raw.get(name, "") for name in (*_SECRET_FIELDS, "updated")}
        if not all(isinstance(v, str) for v in values.values()):
            raise ValueError(f"entry {key!r} has a field that is not a string")
        updated = values.pop("updated")
        entries[key] = _Entry(PullSecret(**values), updated)
    return entries


def _document(entries: dict[str, _Entry]) -> bytes:
    return json.dumps(
        {
            "version": STORE_VERSION,
            "entries": {key: {**asdict(e.secret), "updated": e.updated} for key, e in sorted(entries.items())},
        },
        indent=1,
    ).encode()


class CriCredentialStore:
    """The credentials file: `lookup` for the registry client's keychain
    (any process), `put` for the CRI proxy."""

    def __init__(self, path: Path = DEFAULT_PATH) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._warned: tuple[int, int, int] | str | None = None

    @property
    def path(self) -> Path:
        return self._path

    # -- reading ---------------------------------------------------------------

    def _current(self) -> dict[str, _Entry]:
        """The entries as the file holds them now; an unreadable or broken
        file counts as empty, with one warning per version of the file."""
        try:
            st = self._path.stat()
        except FileNotFoundError:
            self._entries, self._stamp = {}, None
            return self._entries
        except PermissionError:
            # Not this user's store (a non-root `bootseer index`): nothing to say.
            return {}
        except OSError as exc:
            self._warn_once(exc.strerror or str(exc), f"stat:{exc.errno}")
            return {}
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            try:
                self._entries = _parse_entries(json.loads(self._path.read_bytes()))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else str(exc).split(":")[0]
                self._warn_once(reason or type(exc).__name__, stamp)
                self._entries = {}
            self._stamp = stamp
        return self._entries

    def _warn_once(self, reason: str, what: tuple[int, int, int] | str) -> None:
        if self._warned != what:
            self._warned = what
            log.warning("CRI credentials file unusable; ignoring it", path=str(self._path), reason=reason)

    def lookup(self, host: str, repository: str) -> Credentials | None:
        """The credentials for `repository` on `host`, most specific entry first."""
        with self._lock:
            entries = self._current()
            for key in _candidate_keys(host, repository):
                entry = entries.get(key)
                if entry is not None and (creds := entry.secret.credentials()) is not None:
                    return creds
        return None

    def get(self, host: str, repository: str) -> PullSecret | None:
        """The secret stored for exactly this host and repository."""
        with self._lock:
            entry = self._current().get(entry_key(host, repository))
        return entry.secret if entry is not None else None

    # -- writing ---------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's lock and an flock on `<file>.lock`: one writer at a time."""
        with self._lock:
            self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self._path.with_name(self._path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def put(self, host: str, repository: str, secret: PullSecret) -> bool:
        """Store `secret` for `repository` on `host`; False if that is what
        the file already holds (nothing is written then)."""
        key = entry_key(host, repository)
        with self._locked():
            self._stamp = None  # read the file itself, not a cached copy
            entries = dict(self._current())
            if key in entries and entries[key].secret == secret:
                return False
            entries[key] = _Entry(secret, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self._write(_document(entries))
            return True

    def _write(self, data: bytes) -> None:
        # mkstemp creates the file 0600: the secret is never readable by others, not even briefly.
        fd, tmp = tempfile.mkstemp(prefix=f".{self._path.name}.", dir=self._path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self._path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        directory = os.open(self._path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._stamp = None
