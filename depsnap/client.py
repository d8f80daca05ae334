"""How the CLI reaches the node cache: through the daemon when it runs, on
its own when it does not.

Both give the same two operations. Through the daemon, images travel as file
descriptors over the unix socket, so a container needs the socket and
nothing else of the host's cache directory.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from depsnap.cache import Cache
from depsnap.format import CorruptSnapshot
from depsnap.store import StoreUnavailable, open_store
from depsnap.wire import daemon_answers, recv_message, send_message


class DaemonError(Exception):
    """The daemon answered with something other than a result."""


@dataclass
class Image:
    """A cached image, open: mount it through `path` while `fd` is open."""

    fd: int
    source: str  # "cache" or "store"
    size: int
    # The file's name when this process can see it, which reads better in
    # mountinfo than the descriptor path.
    name: Path | None = None

    @property
    def path(self) -> Path:
        return self.name or Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        os.close(self.fd)


class Node(Protocol):
    where: str

    def fetch(self, key: str, store_uri: str | None) -> Image | None: ...

    def put(self, key: str, image: Path) -> None: ...

    def discard(self, key: str) -> None: ...


class LocalNode:
    """The cache directory used directly, by this process."""

    where = "standalone"

    def __init__(self, cache: Cache, progress: Callable[[int], None] | None = None) -> None:
        self.cache = cache
        self.progress = progress

    def fetch(self, key: str, store_uri: str | None) -> Image | None:
        store = open_store(store_uri) if store_uri else None
        fetched = self.cache.fetch(key, store, progress=self.progress)
        if fetched is None:
            return None
        self.cache.evict(keep=key)
        fd = os.open(fetched.path, os.O_RDONLY)
        return Image(fd, fetched.source, fetched.size, fetched.path)

    def put(self, key: str, image: Path) -> None:
        self.cache.put(key, image)
        self.cache.evict(keep=key)

    def discard(self, key: str) -> None:
        self.cache.discard(key)


class DaemonNode:
    """The node daemon at `address`, one connection per call."""

    where = "daemon"

    def __init__(self, address: Path) -> None:
        self.address = address

    def _call(self, message: dict[str, Any], fds: Sequence[int] = ()) -> tuple[dict[str, Any], list[int]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.address))
            send_message(sock, message, fds)
            reply, got = recv_message(sock)
        if not reply.get("ok"):
            for fd in got:
                os.close(fd)
            error, text = reply.get("error"), reply.get("message", "")
            if error == "corrupt":
                raise CorruptSnapshot(text)
            if error == "unavailable":
                raise StoreUnavailable(text)
            raise DaemonError(f"depsnap daemon: {error}: {text}")
        return reply, got

    def fetch(self, key: str, store_uri: str | None) -> Image | None:
        reply, fds = self._call({"op": "fetch", "key": key, "store": store_uri})
        if not reply["found"]:
            return None
        if len(fds) != 1:
            raise DaemonError(f"depsnap daemon sent {len(fds)} descriptors, expected 1")
        return Image(fds[0], reply["source"], reply["size"])

    def put(self, key: str, image: Path) -> None:
        fd = os.open(image, os.O_RDONLY)
        try:
            self._call({"op": "put", "key": key}, [fd])
        finally:
            os.close(fd)

    def discard(self, key: str) -> None:
        self._call({"op": "discard", "key": key})

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})[0]


def connect(
    address: Path,
    cache_dir: Path,
    max_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> Node:
    """The daemon if it answers on `address`, else this process on `cache_dir`."""
    if daemon_answers(address):
        return DaemonNode(address)
    return LocalNode(Cache(cache_dir, max_bytes), progress)
