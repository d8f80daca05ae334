"""Several ranges of one blob in one GET (`Range: bytes=a-b,c-d,...`).

A prefetch asks for tens of runs of a layer at once, and a registry's cost
is mostly per request: docker-registry 2.8 spends about 7 ms of CPU on each
Range request and about 2 ms on each further range of a multi-range one,
whatever their sizes; each request also costs the client a round trip.

This is an optimisation only. What the one request does not bring, because
the host answered with the whole blob (S3 and most CDNs behind a registry's
redirect do), broke off, or sent a body this does not parse, the caller
fetches range by range with `resumable.read`. A host that answered with the
whole blob is not asked for several ranges again for a backoff period
(`Transport.multirange_failed`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import httpx

from snapshotter.registry.byteranges import ByteRangesParser, MalformedByteRanges, boundary_of
from snapshotter.registry.hosts import Endpoint
from snapshotter.registry.responses import content_range_start, unexpected
from snapshotter.registry.resumable import BlobBody
from snapshotter.registry.transport import Request, Transport


def read_many(transport: Transport, bodies: Sequence[BlobBody], endpoint: Endpoint) -> None:
    """Deliver what one request to `endpoint` brings of `bodies` (ranges of
    one blob, each with an end); a body that got all its bytes is `done`.
    Raises only for an answer that is an error (404, 401, ...)."""
    # In the order given: a server sends the parts in the order asked.
    wanted = [b for b in bodies if not b.done]
    if len(wanted) < 2 or not transport.multirange_usable(endpoint):
        return
    ref, digest = wanted[0].ref, wanted[0].digest
    budget = transport.budget(min((b.deadline for b in wanted if b.deadline is not None), default=None))
    header = "bytes=" + ",".join(f"{b.offset}-{_end(b) - 1}" for b in wanted)
    request = Request(endpoint, ref, "GET", f"/{ref.repository}/blobs/{digest}", headers={"Range": header})
    try:
        response = transport.send(request, budget)
    except httpx.TransportError as exc:
        transport.multirange_failed(endpoint, digest, f"{type(exc).__name__}: {exc}")
        return
    try:
        if response.status_code == 200:
            transport.multirange_failed(endpoint, digest, "whole_blob")
            return  # closing drops the whole blob it was about to send
        if response.status_code != 206:
            raise unexpected(response, f"blob {digest}", ref)
        # Read to the end, so that the connection goes back to its pool.
        first, last = min(b.offset for b in wanted), max(_end(b) for b in wanted)
        for offset, piece in _pieces(response, first, last):
            _deliver(wanted, offset, piece)
            if budget.expired():
                return
    except (httpx.TransportError, MalformedByteRanges) as exc:
        transport.multirange_failed(endpoint, digest, f"{type(exc).__name__}: {exc}")
    finally:
        response.close()


def _end(body: BlobBody) -> int:
    assert body.end is not None, "a multi-range read is of ranges with ends"
    return body.end


def _pieces(response: httpx.Response, first: int, last: int) -> Iterator[tuple[int, bytes]]:
    """(blob offset, bytes) of the answer as it arrives: its parts, or the
    one range it sent (a server may coalesce ranges into one, within
    [first, last) of those asked)."""
    boundary = boundary_of(response.headers.get("content-type", ""))
    if boundary is not None:
        parser = ByteRangesParser(boundary)
        for raw in response.iter_raw():
            yield from parser.feed(raw)
        if not parser.finished:
            raise MalformedByteRanges("the body ended before its closing delimiter")
        return
    offset = content_range_start(response)
    length = response.headers.get("content-length", "")
    if offset is None or offset > first or not length.isdigit() or offset + int(length) > last:
        raise MalformedByteRanges("a 206 answer with neither parts nor one range spanning those asked")
    for raw in response.iter_raw():
        yield offset, raw
        offset += len(raw)


def _deliver(bodies: list[BlobBody], offset: int, piece: bytes) -> None:
    """The bytes of `piece` (at `offset` in the blob) that continue a body
    where it stands; bytes it already has, or past a gap, are not taken."""
    end = offset + len(piece)
    for body in bodies:
        if body.done or not offset <= body.offset < end:
            continue
        take = min(end, _end(body)) - body.offset
        start = body.offset - offset
        body.deliver(piece if start == 0 and take == len(piece) else piece[start : start + take])
        if body.offset == body.end:
            body.done = True
