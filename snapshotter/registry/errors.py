"""What can go wrong talking to a registry. Every message names the
registry host and repository and says what to try next."""

from __future__ import annotations

from typing import Self

from snapshotter.registry.reference import Reference


class RegistryError(Exception):
    def __init__(self, message: str, *, host: str = "", repository: str = "") -> None:
        self.host = host
        self.repository = repository
        where = f"{host}/{repository}" if repository else host
        super().__init__(f"{where}: {message}" if where else message)

    @classmethod
    def at(cls, ref: Reference, message: str) -> Self:
        """The error about the repository `ref` names."""
        return cls(message, host=ref.domain, repository=ref.repository)


class NotFound(RegistryError):
    """The manifest, tag or blob does not exist in that repository."""


class Unauthorized(RegistryError):
    """The registry refused our credentials (or wants some and we have none)."""


class Unreachable(RegistryError):
    """No answer after every retry: connection refused, reset or timed out."""


class ServerError(RegistryError):
    """The registry kept answering 5xx/429, or answered something unexpected."""


class DigestMismatch(RegistryError):
    """The bytes received do not hash to the digest asked for."""


class DeadlineExceeded(RegistryError):
    """The caller's deadline passed before the registry delivered what was asked."""


class RangeIgnored(ServerError):
    """A mirror answered a Range request with the whole blob; the next host serves the range."""
