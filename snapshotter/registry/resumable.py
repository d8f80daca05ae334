"""Reading blob bytes that survive dropped connections.

A `BlobBody` is a blob's bytes from `start` to `end` (or to the blob's end)
on their way to a sink. When the connection breaks, `read` asks again with a
Range from where the bytes stopped, spending from the same budget as the
transport's own retries of those requests, and never past the body's
deadline. Whole blobs and ranges go through this same loop.

A host that ignores Range answers 200 with the whole blob. Reading that to
the offset asked for costs O(offset) per range, so a mirror's whole-body
answer to a range further in than `RANGE_SKIP_LIMIT` is dropped at once
and the range goes to the next host; either way the mirror is not asked
for ranges of that blob for a backoff period (`Transport.range_ignored`).
The server, the last resort, and whole-blob reads (a resumed blob is
skipped to its offset once) keep the slicing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx
import structlog

from snapshotter.registry.errors import RangeIgnored, RegistryError, ServerError, Unreachable
from snapshotter.registry.hosts import Endpoint
from snapshotter.registry.metrics import BYTES, RETRIES
from snapshotter.registry.reference import Reference
from snapshotter.registry.responses import content_range_start, unexpected
from snapshotter.registry.retry import Budget
from snapshotter.registry.transport import Request, Transport

log = structlog.get_logger("bootseer.registry")

# Bytes before a range's start read and dropped from a mirror's whole-body
# answer rather than asking the next host: about what one more round trip
# to a distant registry costs on a fast link, and at most once per blob and
# mirror per backoff period.
RANGE_SKIP_LIMIT = 1 << 20


class _ShortRead(Exception):
    """A range's body ended before any of the bytes asked for; retried like a reset."""


@dataclass
class BlobBody:
    """Bytes [start, end) of blob `digest` on their way to `sink`, across
    however many requests and endpoints that takes."""

    ref: Reference
    digest: str
    sink: Callable[[bytes], None]
    start: int = 0
    end: int | None = None  # exclusive; None: to the end of the blob
    # time.monotonic() by which every byte must be in, or DeadlineExceeded; None: no limit.
    deadline: float | None = None
    # Bytes handed to `sink` so far, whichever endpoints and requests they came from.
    delivered: int = 0
    done: bool = False

    @property
    def offset(self) -> int:
        return self.start + self.delivered

    @property
    def kind(self) -> str:
        """bootseer_registry_bytes_total's label."""
        return "blob" if self.end is None else "range"

    @property
    def what(self) -> str:
        if self.end is None:
            return f"blob {self.digest}"
        return f"blob {self.digest} range [{self.start}, {self.end})"

    def range_header(self) -> dict[str, str]:
        if self.end is not None:
            return {"Range": f"bytes={self.offset}-{self.end - 1}"}
        return {"Range": f"bytes={self.offset}-"} if self.offset else {}

    def started(self) -> bool:
        return self.delivered > 0

    def deliver(self, chunk: bytes) -> None:
        self.sink(chunk)
        self.delivered += len(chunk)
        BYTES.labels(self.kind).inc(len(chunk))


def read(transport: Transport, body: BlobBody, endpoint: Endpoint) -> None:
    """Deliver the rest of `body` from `endpoint`, asking again from where it
    stopped after each break."""
    budget = transport.budget(body.deadline)
    while not body.done:
        try:
            _read_once(transport, body, endpoint, budget)
        except (httpx.TransportError, _ShortRead) as exc:
            reason = type(exc).__name__
            if budget.expired():
                raise budget.overdue(body.ref, body.what, f"{reason}, {body.delivered} bytes in") from None
            if isinstance(exc, httpx.TransportError) and transport.gives_up_at_once(endpoint, exc):
                # A mirror whose body stalls is as good as hung: the next host
                # continues from `body.offset` (a range) or the caller gives up.
                raise Unreachable.at(
                    body.ref,
                    f"{body.what}: mirror {endpoint.netloc} stopped sending ({reason}) after "
                    f"{body.delivered} bytes; trying the next host",
                ) from None
            delay = budget.delay()
            if delay is None:
                raise budget.spent(
                    body.ref,
                    body.what,
                    reason,
                    Unreachable.at(
                        body.ref,
                        f"{body.what}: transfer kept breaking ({reason}) after {body.delivered} bytes; "
                        "check the network to the registry",
                    ),
                ) from None
            RETRIES.labels("body").inc()
            log.info(
                "registry.resume",
                host=body.ref.domain,
                repository=body.ref.repository,
                digest=body.digest,
                offset=body.offset,
                reason=reason,
            )
            budget.wait(delay)


def _drained(response: httpx.Response) -> bool:
    """Whether every byte of the body is in: the loop then ends without
    another read, and the connection goes back to its pool. A response
    closed before its end takes its connection with it, and every Range
    request would pay a new one (a TCP handshake, a TLS one, slow start)."""
    length = response.headers.get("content-length", "")
    return length.isdigit() and int(length) == response.num_bytes_downloaded


def _read_once(transport: Transport, body: BlobBody, endpoint: Endpoint, budget: Budget) -> None:
    """One GET from `body.offset`, delivering what it brings. A range that
    ends cleanly but short leaves `done` unset, so `read` asks again; that
    counts as a break only when it brought nothing."""
    ref, digest, offset = body.ref, body.digest, body.offset
    headers = body.range_header()
    response = transport.send(
        Request(endpoint, ref, "GET", f"/{ref.repository}/blobs/{digest}", headers=headers), budget
    )
    try:
        if response.status_code == 416 and body.end is not None:
            raise RegistryError.at(ref, f"blob {digest}: range [{offset}, {body.end}) lies beyond its end")
        if response.status_code not in (200, 206):
            raise unexpected(response, f"blob {digest}", ref)
        if response.status_code == 206 and content_range_start(response) != offset:
            raise ServerError.at(ref, f"blob {digest}: registry answered a different range than asked")
        if headers and response.status_code == 200:
            transport.range_ignored(endpoint, digest)
            if endpoint.mirror_of and body.end is not None and offset > RANGE_SKIP_LIMIT:
                raise RangeIgnored.at(
                    ref,
                    f"{body.what}: mirror {endpoint.netloc} answered the Range request with the whole blob; "
                    "its ranges go to the next host",
                )
        elif headers and body.end is not None:
            transport.range_served(endpoint, digest)
        skip = offset if response.status_code == 200 else 0
        got = 0
        for raw in response.iter_raw():
            chunk = raw[skip:]
            skip -= len(raw) - len(chunk)
            if body.end is not None:
                chunk = chunk[: body.end - body.offset]
            if chunk:
                body.deliver(chunk)
                got += len(chunk)
            if body.offset == body.end:
                body.done = True
                if not _drained(response):
                    return  # closing early drops the rest of a whole-body answer
            # Each socket read is bounded by the request's timeout, but a
            # body trickling in would go on past the deadline without this.
            if budget.expired():
                raise budget.overdue(ref, body.what, f"{body.delivered} bytes in")
        if body.end is None:
            body.done = True
        elif got == 0:
            raise _ShortRead()
    finally:
        response.close()
