"""`bootseer pull` served by the snapshotter daemon: the request, the events
that answer it, and the client's side of the socket.

Why a daemon pulls: a pull is on every lazy start's critical path, and a
fresh `bootseer pull` process spends 0.3-0.5 s importing gRPC, httpx and
the rest before its first request (more from a cold page cache), then
opens new connections to containerd and the registry. The snapshotter
daemon has all of that loaded and warm. The CLI sends one request line and
reads events until `done` or `error`; with no daemon on the socket it pulls
in its own process, exactly as before.

Wire: one JSON object a line over a unix stream socket. The client writes
one request; the daemon answers with `layer`, `fetched` and `layer_done`
events (for progress bars) and ends with one `done` (the result) or
`error` (a message for the user; `refused` when the daemon did not take
the request at all, e.g. a daemon older than the command that does not
know one of its fields: the command then pulls itself). Standard library
only: the CLI imports this and nothing heavier on its way to the daemon.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

# What a pull goes into unless told otherwise.
DEFAULT_CONTAINERD = Path("/run/containerd/containerd.sock")
DEFAULT_NAMESPACE = "default"
DEFAULT_SNAPSHOTTER = "bootseer"
# A request is a few hundred bytes; anything this long is not one.
MAX_LINE = 1 << 16
# Errors of connect() meaning no daemon serves the socket: pull in-process.
_ABSENT = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK, errno.ENOTDIR)


class RequestError(ValueError):
    """A request line the daemon cannot take; the message says why."""


class DaemonAbsent(Exception):
    """Nothing serves pulls on the socket: the command pulls itself."""


class RequestRefused(DaemonAbsent):
    """The daemon did not take the request at all (an older daemon than the
    command, say): the command pulls itself, and says why."""


@dataclass(frozen=True)
class PullRequest:
    image: str
    address: str  # containerd's socket
    namespace: str
    snapshotter: str
    platform: str | None = None
    plain_http: bool = False
    hosts_dir: str | None = None
    # The client's credentials file, resolved where the client runs ($DOCKER_CONFIG, ~).
    docker_config: str | None = None
    # When the user's command began (wall clock): the pull's record starts there.
    started: float | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> PullRequest:
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise RequestError(f"not a JSON request: {exc}") from None
        if not isinstance(doc, dict):
            raise RequestError("a request must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise RequestError(f"unknown request fields: {', '.join(unknown)}")
        for name in ("image", "address", "namespace", "snapshotter"):
            if not isinstance(doc.get(name), str) or not doc[name]:
                raise RequestError(f"{name} must be a non-empty string")
        for name in ("platform", "hosts_dir", "docker_config"):
            if doc.get(name) is not None and (not isinstance(doc[name], str) or not doc[name]):
                raise RequestError(f"{name} must be a non-empty string or null")
        if not isinstance(doc.get("plain_http", False), bool):
            raise RequestError("plain_http must be true or false")
        started = doc.get("started")
        if started is not None and (isinstance(started, bool) or not isinstance(started, int | float)):
            raise RequestError("started must be a number or null")
        return cls(**doc)


def encode_event(event: str, **payload: Any) -> bytes:
    return json.dumps({"event": event, **payload}, separators=(",", ":")).encode() + b"\n"


def read_line(stream: Any) -> bytes:
    """One line from a binary file object, at most MAX_LINE bytes ("" at the end)."""
    line: bytes = stream.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise RequestError(f"line longer than {MAX_LINE} bytes")
    return line


def request_pull(address: Path, request: PullRequest) -> Iterator[dict[str, Any]]:
    """Send `request` to the daemon on `address` and yield its events, the
    last one `done` or `error`. Raises DaemonAbsent if nothing serves the
    socket (before anything was sent), RequestRefused if the daemon did not
    take the request, ConnectionError if the daemon goes
    away mid-pull."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.connect(str(address))
        except OSError as exc:
            if exc.errno in _ABSENT:
                raise DaemonAbsent(f"{address}: {exc.strerror}") from None
            raise
        sock.sendall(request.encode())
        with sock.makefile("rb") as stream:
            while line := read_line(stream):
                try:
                    event = json.loads(line)
                except ValueError:
                    raise ConnectionError(f"the daemon on {address} sent a line that is not JSON") from None
                if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                    raise ConnectionError(f"the daemon on {address} sent an event without a name")
                if event["event"] == "error" and event.get("refused") is True:
                    raise RequestRefused(f"the snapshotter on {address} refused the pull: {event.get('message')}")
                yield event
                if event["event"] in ("done", "error"):
                    return
        raise ConnectionError(
            f"the snapshotter on {address} closed the connection before the pull ended "
            "(restarted or stopped?); see its log and pull again"
        )
    finally:
        sock.close()
