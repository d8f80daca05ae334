"""The node-local cache of snapshot images, shared by every container on the node.

One uncompressed erofs image per key, ready to mount. A per-key lock file
makes concurrent fetches of one key (threads of the daemon, or standalone
clients) download it once; the others wait and find it cached. Use is
recorded in the image's mtime, which is what least-recently-used eviction
sorts by: the state survives restarts with no database to keep consistent.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from depsnap.format import unpack
from depsnap.store import SnapshotStore


@dataclass(frozen=True)
class Fetched:
    path: Path
    source: str  # "cache" (already on the node) or "store" (downloaded now)
    size: int


@dataclass(frozen=True)
class Evicted:
    key: str
    size: int


class Cache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.images = root / "images"
        self.tmp = root / "tmp"
        self._locks = root / "locks"
        for directory in (self.images, self.tmp, self._locks):
            directory.mkdir(parents=True, exist_ok=True)

    def image_path(self, key: str) -> Path:
        return self.images / f"{key}.erofs"

    def lookup(self, key: str) -> Path | None:
        path = self.image_path(key)
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        return path

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        with open(self._locks / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def fetch(
        self, key: str, store: SnapshotStore | None, progress: Callable[[int], None] | None = None
    ) -> Fetched | None:
        """The image for `key`, downloading it from `store` if the node lacks it.

        Neither this nor `put` evicts: the caller does (`evict(keep=key)`),
        once, and can count what went.

        None when neither has it. Raises CorruptSnapshot (after deleting what
        it wrote) when the stored snapshot fails verification, and
        StoreUnavailable when the store cannot be read.
        """
        if (path := self.lookup(key)) is not None:
            return Fetched(path, "cache", path.stat().st_size)
        if store is None:
            return None
        with self._locked(key):
            if (path := self.lookup(key)) is not None:
                return Fetched(path, "cache", path.stat().st_size)
            stream = store.get(key)
            if stream is None:
                return None
            temp = self.tmp / f"{key}.{uuid.uuid4().hex}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with stream:
                    manifest = unpack(stream, fd, key, progress=progress)
                os.close(fd)
                fd = -1
                os.rename(temp, self.image_path(key))
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                temp.unlink(missing_ok=True)
                raise
        return Fetched(self.image_path(key), "store", manifest.image_size)

    def put(self, key: str, image: Path) -> Path:
        """Adopt a freshly captured `image` (moved when it can be, else copied)."""
        with self._locked(key):
            final = self.image_path(key)
            if not final.exists():
                temp = self.tmp / f"{key}.{uuid.uuid4().hex}"
                try:
                    os.link(image, temp)
                except OSError:
                    shutil.copyfile(image, temp)
                os.rename(temp, final)
        return final

    def discard(self, key: str) -> None:
        with self._locked(key):
            self.image_path(key).unlink(missing_ok=True)

    def entries(self) -> list[tuple[str, int, float]]:
        """(key, size, last use) for every cached image, least recently used first."""
        found = []
        for entry in os.scandir(self.images):
            if entry.name.endswith(".erofs"):
                st = entry.stat()
                found.append((entry.name.removesuffix(".erofs"), st.st_size, st.st_mtime))
        return sorted(found, key=lambda item: item[2])

    def size(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, keep: str | None = None) -> list[Evicted]:
        """Remove least recently used images until the cache fits its cap.

        An image mounted somewhere stays readable there after eviction (the
        mount holds the file); only its disk space returns later.
        """
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        evicted = []
        for key, size, _ in entries:
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            self.image_path(key).unlink(missing_ok=True)
            total -= size
            evicted.append(Evicted(key, size))
        return evicted

    def sweep_tmp(self, older_than_s: float = 3600.0) -> None:
        """Delete temporary files that a crashed fetch or capture left behind."""
        cutoff = time.time() - older_than_s
        for entry in os.scandir(self.tmp):
            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
