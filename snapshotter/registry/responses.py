"""Reading a registry's answers: a bounded manifest-sized body, the error an
unexpected status stands for, and the Content-Range and Link headers."""

from __future__ import annotations

import httpx

from snapshotter.registry.errors import NotFound, RegistryError, ServerError, Unauthorized
from snapshotter.registry.reference import Reference

# Manifests and configs are read whole into memory; bound that.
MAX_MANIFEST_BYTES = 4 << 20


def read_small(response: httpx.Response, what: str, ref: Reference) -> bytes:
    """Read a manifest-sized body, refusing an unbounded one."""
    body = bytearray()
    try:
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_MANIFEST_BYTES:
                raise ServerError.at(ref, f"{what} is larger than {MAX_MANIFEST_BYTES} bytes")
    finally:
        response.close()
    return bytes(body)


def unexpected(response: httpx.Response, what: str, ref: Reference) -> RegistryError:
    """The error for an answer the API did not expect; closes `response`."""
    try:
        detail = response.read()[:300].decode(errors="replace").strip()
    except httpx.HTTPError:
        detail = ""
    finally:
        response.close()
    if response.status_code == 404:
        return NotFound.at(ref, f"{what} not found")
    if response.status_code == 403:
        return Unauthorized.at(ref, f"{what}: access denied (403); check the account's permissions")
    return ServerError.at(ref, f"{what}: unexpected HTTP {response.status_code} {detail}")


def content_range_start(response: httpx.Response) -> int | None:
    value = response.headers.get("Content-Range", "")
    unit, _, rest = value.partition(" ")
    if unit != "bytes":
        return None
    first = rest.partition("-")[0]
    return int(first) if first.isdigit() else None


def next_link(header: str) -> str | None:
    """The `rel="next"` target of a Link header (a paginated listing)."""
    for part in header.split(","):
        if 'rel="next"' in part and "<" in part and ">" in part:
            return part[part.index("<") + 1 : part.index(">")]
    return None
